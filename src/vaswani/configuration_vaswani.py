"""Configuration of the Vaswani Transformer.

The defaults *are* the base model of "Attention Is All You Need" (Vaswani et al., 2017, Table 3, row "base"):
post-LayerNorm ("Add & Norm" = LayerNorm(x + Sublayer(x)), §3.1), sinusoidal positions (§3.5), a ReLU
feed-forward network (§3.3), 6 + 6 layers, d_model 512, 8 heads, d_ff 2048, dropout 0.1 (§5.4), token
embeddings shared between encoder, decoder and the output projection and scaled by √d_model (§3.4), and
label smoothing 0.1 while training (§5.4).

Every modern variant is one plain field: pre-norm (`norm_first`), RMSNorm (`norm_type`), rotary or learned
positions (`position_embedding_type`), grouped-query / multi-query attention (`num_key_value_heads`) and gated
feed-forward networks (`ffn_activation="swiglu"`). Named presets (`base`, `big`, `modern`, `tiny`) are
classmethods, in the manner of fairseq's `transformer_vaswani_wmt_en_de_big`.

Post-norm vs pre-norm: the paper normalises *after* each residual addition. Placing the norm *before* each
sublayer (Xiong et al., 2020, "On Layer Normalization in the Transformer Architecture") keeps an identity path
from input to output, trains stably without a long warm-up and is what modern decoders use; it needs one extra
norm at the end of each stack, which `norm_first=True` adds.
"""

import hashlib
import json

from transformers import PreTrainedConfig

NORM_TYPES = ("layernorm", "rmsnorm")
POSITION_EMBEDDING_TYPES = ("sinusoidal", "learned", "rope")
SINUSOIDAL_LAYOUTS = ("interleaved", "concatenated")
FFN_ACTIVATIONS = ("relu", "gelu", "silu", "swiglu", "geglu")
# How many tokens an output may run past its source when no length is given (§6.1: "input length + 50").
OUTPUT_SLACK = 50


class VaswaniConfig(PreTrainedConfig):
    r"""
    Args:
        vocab_size: size of the (shared) source/target vocabulary. The paper's En-Fr model used 32k word pieces.
        decoder_vocab_size: size of a separate target vocabulary (the decoder's embedding and the output projection),
            as in Marian's `decoder_vocab_size`; needs `share_embeddings=False`. `None` (paper): `vocab_size`.
        d_model: width of every residual stream, embedding and attention output.
        encoder_layers / decoder_layers: number of blocks in each stack (N in the paper).
        num_attention_heads: query heads per attention layer (h).
        num_key_value_heads: key/value heads; `None` means `num_attention_heads` (multi-head attention),
            a divisor of it gives grouped-query attention (Ainslie et al., 2023), 1 gives multi-query attention
            (Shazeer, 2019).
        d_ff: inner width of the position-wise feed-forward network.
        ffn_activation: `relu` (paper), `gelu`, `silu`, or the gated `swiglu` / `geglu` (Shazeer, 2020), which use
            `gate_proj`/`up_proj`/`down_proj` instead of `fc1`/`fc2`.
        dropout: residual and embedding dropout (P_drop).
        attention_dropout: dropout on attention probabilities.
        activation_dropout: dropout after the feed-forward activation.
        norm_first: `False` is the paper's post-norm; `True` is pre-norm with a final norm on each stack.
        norm_type: `layernorm` (paper) or `rmsnorm` (Zhang & Sennrich, 2019).
        layer_norm_eps: epsilon of every norm; 1e-5 is PyTorch's `nn.Transformer` default.
        position_embedding_type: `sinusoidal` (paper, works at any length), `learned` (up to
            `max_position_embeddings`) or `rope` (Su et al., 2021; applied to self-attention queries and keys).
        sinusoidal_layout: where the sinusoids' channels go. `interleaved` (paper, §3.5): sin on even channels, cos
            on odd ones; `concatenated`: all sines, then all cosines, with the same frequencies (tensor2tensor's
            `get_timing_signal_1d` and Marian, hence every OPUS-MT model).
        rope_theta: base of the rotary frequencies.
        max_position_embeddings: table size for learned positions, and the cache size default for static caches.
        scale_embedding: multiply token embeddings by √d_model (§3.4).
        share_embeddings: one token embedding for encoder and decoder (needs a joint vocabulary).
        tie_word_embeddings: the output projection reuses the decoder's token embedding (§3.4).
        final_logits_bias: add a fixed bias to the output logits, a (1, target vocabulary) buffer that is stored in
            checkpoints but not trained: Marian's output-layer bias (`final_logits_bias` in transformers' Marian and
            BART). `False` (paper): no bias.
        bias: bias terms in every linear layer (and LayerNorm).
        label_smoothing: ε_ls used by the loss in training mode (§5.4); evaluation reports the plain likelihood.
        classifier_dropout: dropout before the sequence-classification head (`None`: use `dropout`).
        tokenizer_fingerprint: `tokenizer_fingerprint()` of the tokenizer the model was trained with, written by the
            training script and the Marian converter; `check_tokenizer_fits` then refuses any other tokenizer, even
            one of the same size. `None` (older checkpoints): not checked.
    """

    model_type = "vaswani"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the name before and after transformers 5.24
    # Names that generic transformers code (caches, generation, Trainer) looks up.
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "decoder_layers", "intermediate_size": "d_ff"}

    vocab_size: int = 37000
    decoder_vocab_size: int | None = None
    d_model: int = 512
    encoder_layers: int = 6
    decoder_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    d_ff: int = 2048
    ffn_activation: str = "relu"
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    norm_first: bool = False
    norm_type: str = "layernorm"
    layer_norm_eps: float = 1e-5
    position_embedding_type: str = "sinusoidal"
    sinusoidal_layout: str = "interleaved"
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    scale_embedding: bool = True
    share_embeddings: bool = True
    tie_word_embeddings: bool = True
    final_logits_bias: bool = False
    bias: bool = True
    label_smoothing: float = 0.1
    classifier_dropout: float | None = None
    use_cache: bool = True
    is_encoder_decoder: bool = True
    # Special tokens: the layout written by `VaswaniTokenizer` (the decoder starts at its <s>, as
    # `decoder_start_token_id` rules).
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 3
    decoder_start_token_id: int | None = 3
    tokenizer_fingerprint: str | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)
        self._check()

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        # transformers only warns about another model_type and would then build a randomly initialised Vaswani model.
        model_type = config_dict.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(
                f"This is a `{model_type}` checkpoint, not a `{cls.model_type}` one (config.json's model_type); load it "
                "with its own model class."
            )
        return super().from_dict(config_dict, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_attention_heads

    @property
    def target_vocab_size(self) -> int:
        """The decoder's vocabulary: its embedding rows and the output projection's."""
        return self.decoder_vocab_size if self.decoder_vocab_size is not None else self.vocab_size

    def get_text_config(self, decoder=None, encoder=None):
        """transformers' view of one side of this flat encoder-decoder config (generate() and the common tests read
        `get_text_config(decoder=True).vocab_size`). Its generic version copies every `decoder_*` field onto the
        unprefixed name, which would make the decoder's vocabulary our `decoder_vocab_size=None` ("the same as
        vocab_size"); the decoder side gets its real size instead."""
        text_config = super().get_text_config(decoder=decoder, encoder=encoder)
        if text_config is not self and text_config.vocab_size is None:
            text_config.vocab_size = self.target_vocab_size
        return text_config

    def _check(self) -> None:
        """Fail early, naming the field and the fix, instead of deep inside a matmul."""
        for name in ("vocab_size", "d_model", "num_attention_heads", "num_key_value_heads", "d_ff",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"VaswaniConfig.{name} must be a positive integer, got {value!r}.")
        if self.decoder_vocab_size is not None:
            if isinstance(self.decoder_vocab_size, bool) or not isinstance(self.decoder_vocab_size, int) \
                    or self.decoder_vocab_size < 1:
                raise ValueError(f"VaswaniConfig.decoder_vocab_size must be a positive integer or None, got "
                                 f"{self.decoder_vocab_size!r}.")
            if self.share_embeddings and self.decoder_vocab_size != self.vocab_size:
                raise ValueError(
                    f"VaswaniConfig.decoder_vocab_size ({self.decoder_vocab_size}) differs from vocab_size "
                    f"({self.vocab_size}), so the encoder and decoder cannot share one embedding: set "
                    "share_embeddings=False, or decoder_vocab_size=None for a joint vocabulary."
                )
        for name in ("encoder_layers", "decoder_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"VaswaniConfig.{name} must be a non-negative integer, got {value!r}.")
        if self.d_model % self.num_attention_heads:
            raise ValueError(
                f"VaswaniConfig.d_model ({self.d_model}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}); pick a head count that divides d_model, e.g. "
                f"{_divisor_near(self.d_model, self.num_attention_heads)}."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"VaswaniConfig.num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads}): each key/value head serves a whole group of query heads."
            )
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(
                f"VaswaniConfig.position_embedding_type='rope' rotates pairs of channels, so the head dimension "
                f"d_model / num_attention_heads must be even, got {self.head_dim}."
            )
        if self.position_embedding_type == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"VaswaniConfig.d_model must be even for sinusoidal positions, got {self.d_model}.")
        for name, allowed in (("norm_type", NORM_TYPES), ("position_embedding_type", POSITION_EMBEDDING_TYPES),
                              ("sinusoidal_layout", SINUSOIDAL_LAYOUTS), ("ffn_activation", FFN_ACTIVATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"VaswaniConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        for name in ("dropout", "attention_dropout", "activation_dropout", "label_smoothing", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"VaswaniConfig.{name} must be in [0, 1), got {value!r}.")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"VaswaniConfig.layer_norm_eps must be positive, got {self.layer_norm_eps!r}.")
        if not self.rope_theta > 0:
            raise ValueError(f"VaswaniConfig.rope_theta must be positive, got {self.rope_theta!r}.")

    # Presets. Keyword arguments override any field, e.g. `VaswaniConfig.base(vocab_size=16000)`.

    @classmethod
    def base(cls, **overrides) -> "VaswaniConfig":
        """The paper's base model (65M parameters with a 37k vocabulary): exactly the defaults."""
        return cls(**overrides)

    @classmethod
    def big(cls, **overrides) -> "VaswaniConfig":
        """The paper's big model (Table 3): d_model 1024, d_ff 4096, 16 heads, dropout 0.3 (0.1 for En-Fr)."""
        return cls(**{"d_model": 1024, "d_ff": 4096, "num_attention_heads": 16, "dropout": 0.3, **overrides})

    @classmethod
    def modern(cls, **overrides) -> "VaswaniConfig":
        """Today's decoder recipe on the same skeleton: pre-RMSNorm, RoPE, SwiGLU, GQA (2 query heads per K/V
        head) and no biases. d_ff is 2/3 of 4·d_model, as in LLaMA, so the gated
        FFN costs about what the ReLU one does."""
        defaults = {
            "norm_first": True, "norm_type": "rmsnorm", "layer_norm_eps": 1e-6, "position_embedding_type": "rope",
            "ffn_activation": "swiglu", "num_key_value_heads": 4, "bias": False, "d_ff": 1376, "dropout": 0.0,
        }
        return cls(**{**defaults, **overrides})

    @classmethod
    def small(cls, **overrides) -> "VaswaniConfig":
        """A CPU-trainable translation model (about 10M parameters with a 8k vocabulary)."""
        defaults = {"vocab_size": 8000, "d_model": 256, "encoder_layers": 3, "decoder_layers": 3,
                    "num_attention_heads": 4, "d_ff": 1024}
        return cls(**{**defaults, **overrides})

    @classmethod
    def tiny(cls, **overrides) -> "VaswaniConfig":
        """For tests: two layers of width 32."""
        defaults = {"vocab_size": 99, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
                    "num_attention_heads": 4, "d_ff": 64, "max_position_embeddings": 64}
        return cls(**{**defaults, **overrides})

    PRESETS = ("tiny", "small", "base", "big", "modern")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "VaswaniConfig":
        if name not in cls.PRESETS:
            raise ValueError(f"Unknown preset {name!r}; choose one of {', '.join(cls.PRESETS)}.")
        return getattr(cls, name)(**overrides)


def check_tokenizer_fits(model, tokenizer) -> None:
    """Refuse a tokenizer that does not belong to `model`: a token id beyond the model's vocabulary, a vocabulary
    other than the one config.json's `tokenizer_fingerprint` records, or a pad, eos or decoder-start id other than
    the one its config.json (and generation_config.json) gives, is a `ValueError` naming both values. Each would
    translate without complaint and give wrong text.

    Every loader of a model together with its tokenizer calls this (the command-line tools, the translation
    pipeline, `vaswani.evaluation.translate`, fine-tuning). It lives in this file because this file ships with
    every checkpoint, so the pipeline can import it as remote code. The decoder must start where
    `decoder_start_token_id` says.
    """
    fix = ("the tokenizer and the model come from different checkpoints; load both from the same directory (a "
           "checkpoint holds tokenizer.json and tokenizer_config.json beside config.json)")
    config = model.config
    vocab = tokenizer.get_vocab()
    largest = max(vocab.values(), default=-1)
    if largest >= config.vocab_size:
        raise ValueError(f"The tokenizer has token ids up to {largest}, but the model's vocabulary holds "
                         f"vocab_size={config.vocab_size} tokens (config.json); {fix}.")
    recorded = getattr(config, "tokenizer_fingerprint", None)
    if recorded is not None and recorded != _fingerprint(vocab):
        raise ValueError(f"The tokenizer's vocabulary (fingerprint {_fingerprint(vocab)}) is not the one the model was "
                         f"trained with (config.json has tokenizer_fingerprint={recorded}); {fix}.")
    expected = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
                "decoder_start_token_id": decoder_start_token_id(tokenizer)}
    for settings, file in ((config, "config.json"), (getattr(model, "generation_config", None),
                                                     "generation_config.json")):
        for name, tokenizer_id in expected.items():
            model_id = getattr(settings, name, None)
            if model_id is None or tokenizer_id is None:
                continue
            if tokenizer_id not in (model_id if isinstance(model_id, list) else [model_id]):
                raise ValueError(f"The tokenizer's {name.removesuffix('_token_id').replace('_', '-')} id is "
                                 f"{tokenizer_id}, but the model's {file} has {name}={model_id}; {fix}.")


def longest_output(config) -> int | None:
    """How many tokens the package lets a decoder with `config`'s positions generate: its `max_position_embeddings`
    less the decoder start token's position. A learned table ends there; sinusoidal and rotary positions would go
    on, but outputs stop at the same bound, the one a CTranslate2 export's position table has (`vaswani.export`), so
    that both engines stop a runaway output alike. None for models of other types, which the translation pipeline
    may run."""
    if getattr(config, "model_type", None) != "vaswani":
        return None
    return config.max_position_embeddings - 1


def output_limit(source_length: int, max_new_tokens: int | None = None, longest: int | None = None) -> int:
    """The one output-length rule of every decoder the package runs (its engines, the pipeline, the heatmaps):
    `max_new_tokens` where one is given, else the source's length plus `OUTPUT_SLACK`; never past `longest`, where
    the positions end (`longest_output`; None: no end)."""
    limit = max_new_tokens if max_new_tokens is not None else source_length + OUTPUT_SLACK
    return limit if longest is None else min(limit, longest)


def length_options(limit: int) -> dict:
    """`generate()`'s length argument for at most `limit` new tokens: `max_length`, which counts the decoder's start
    token too, with the generation config's own `max_new_tokens` set aside. It stops where `max_new_tokens=limit`
    stops; `max_new_tokens` would make transformers warn on every call that `max_length` is set as well, which a
    checkpoint's generation config does for stock `generate()`."""
    return {"max_length": limit + 1, "max_new_tokens": None}


def decoder_start_token_id(tokenizer) -> int | None:
    """The one rule for the token a decoder starts from: the tokenizer's `<s>`, or its pad token where it has no
    `<s>` (Marian's tokenizers, whose converted checkpoints start there). A new model takes it into its config
    (`VaswaniConfig`'s default is `VaswaniTokenizer`'s `<s>`), and `check_tokenizer_fits` holds every loaded one
    to it."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.pad_token_id


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary (every token and its id, added tokens included): equal for the
    same tokenizer saved and reloaded, different for one trained on other text, even with the same size."""
    return _fingerprint(tokenizer.get_vocab())


def _fingerprint(vocab: dict[str, int]) -> str:
    return hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def _divisor_near(n: int, k: int) -> int:
    """The divisor of n closest to k (for a helpful error message)."""
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))


__all__ = ["OUTPUT_SLACK", "VaswaniConfig", "check_tokenizer_fits", "decoder_start_token_id", "longest_output",
           "length_options", "output_limit", "tokenizer_fingerprint"]
