"""Stock transformers checkpoints as Vaswani checkpoints, and back: Marian / OPUS-MT for the translation model,
Llama for the decoder-only model.

transformers' `MarianMTModel` (the Hub's OPUS-MT translators, transformer-base and transformer-big) is this
architecture: post-LayerNorm encoder and decoder layers, sinusoidal positions, token embeddings scaled by √d_model.
What differs is expressed by config fields, so the converted model computes the same function:

    Marian                                   Vaswani
    activation_function swish / gelu / relu  ffn_activation silu / gelu / relu
    sinusoids: sines, then cosines           sinusoidal_layout="concatenated"
    scale_embedding                          scale_embedding
    final_logits_bias (buffer)               final_logits_bias=True (buffer of the same name)
    share_encoder_decoder_embeddings         share_embeddings
    decoder_vocab_size (separate vocab)      decoder_vocab_size
    tie_word_embeddings                      tie_word_embeddings
    max_position_embeddings                  max_position_embeddings (Marian's table size; ours extend past it)
    pad / eos / decoder_start_token_id       the same ids; bos_token_id as Marian's (usually None)
    generation_config.json                   copied (bad_words_ids=[[pad]], forced_eos_token_id, num_beams, …)

transformers' Marian has no pre-norm, no final stack norm and no embedding LayerNorm (its conversion script from
Marian's C++ checkpoints refuses those), so a converted model is post-norm. Its loss is the plain cross-entropy, so
`label_smoothing` is set to 0 and the converted model's loss equals Marian's too; set it for fine-tuning if wanted.
A config we cannot express (different encoder/decoder head counts or FFN widths, another activation, LayerDrop)
is refused with a `ValueError` naming the field.

Parameter names are nearly the same: Marian's `out_proj` is our `o_proj`, its `fc1`/`fc2` sit in our `mlp`, and its
position tables are not stored (both models compute them). `to_marian` maps the other way, for configs Marian can
express: those with Marian's sinusoid layout, or with the paper's interleaved one, whose residual channels are
then permuted so that Marian's layout computes the same model.

The tokenizer stays Marian's own (sentencepiece, `MarianTokenizer`); `scripts/convert_marian.py` copies it.

`LlamaForCausalLM` is the decoder-only model of the `modern` preset's recipe: pre-RMSNorm, rotary positions, a
gated FFN, grouped-query attention, a final norm. `to_llama` gives a `VaswaniForCausalLM` a stock exit (a checkpoint
that vLLM, TGI, llama.cpp's converter and every Llama user load without remote code), `from_llama` brings
any Llama checkpoint in; both compute the same logits, left padding and cached generation included:

    Vaswani (VaswaniForCausalLM)                   Llama
    norm_first=True, norm_type="rmsnorm"           (always), rms_norm_eps = layer_norm_eps
    position_embedding_type="rope", rope_theta     rope_parameters {"rope_type": "default", "rope_theta"}
    ffn_activation swiglu / geglu                  hidden_act silu / gelu (always gated)
    bias                                           attention_bias = mlp_bias
    scale_embedding (√d_model)                     folded into embed_tokens, untied from lm_head (to_llama)
    decoder_layers, d_model, d_ff, heads, kv heads num_hidden_layers, hidden_size, intermediate_size, …
    self_attn_layer_norm / final_layer_norm        input_layernorm / post_attention_layernorm
    model.layer_norm                               model.norm

What the other cannot express is refused with a `ValueError` naming the field: from Vaswani, post-norm, LayerNorm,
learned or sinusoidal positions, an ungated FFN (ReLU, GeLU), an output bias, or dropout (a training setting; set
it to 0 first); from Llama, RoPE scaling (`rope_type` other than "default", a partial rotary factor), a head_dim
other than hidden_size / num_attention_heads, biases on attention but not the MLP (or the reverse), or another
activation. A scaled embedding is folded into Llama's input table (which is then untied from the output
projection); biases in every linear layer are Llama's attention_bias and mlp_bias. The Llama model's loss is the
plain cross-entropy, so `from_llama` sets `label_smoothing` to 0. `scripts/convert_llama.py` converts whole
checkpoints either way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MarianConfig,
    MarianMTModel,
    TokenizersBackend,
)

from .checkpoints import check_output_dir
from .configuration_vaswani import VaswaniConfig, tokenizer_fingerprint
from .files import locking, staged_directory
from .hub import REPO_ID_PLACEHOLDER, attach_translation_pipeline, how_to_load
from .modeling_vaswani import (
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniSinusoidalPositionalEmbedding,
)

# Marian's activation_function → our ffn_activation (ACT2FN: "swish" and "silu" are both nn.SiLU).
MARIAN_ACTIVATIONS = {"swish": "silu", "silu": "silu", "gelu": "gelu", "relu": "relu"}
# The LayerNorm epsilon of every Marian norm: nn.LayerNorm's default, not configurable there.
MARIAN_LAYER_NORM_EPS = 1e-5


def vaswani_config_from_marian(marian: MarianConfig, share_embeddings: bool | None = None,
                               tie_word_embeddings: bool | None = None) -> VaswaniConfig:
    """The VaswaniConfig of the same model as `marian`; a ValueError names any field it cannot express.
    `share_embeddings` / `tie_word_embeddings` override what the config says (`from_marian` reads them off the
    model)."""
    for ours, theirs in (("encoder_attention_heads", "decoder_attention_heads"),
                         ("encoder_ffn_dim", "decoder_ffn_dim")):
        if getattr(marian, ours) != getattr(marian, theirs):
            raise ValueError(f"MarianConfig.{ours} ({getattr(marian, ours)}) differs from {theirs} "
                             f"({getattr(marian, theirs)}); a Vaswani model has one value for both stacks.")
    if marian.activation_function not in MARIAN_ACTIVATIONS:
        raise ValueError(f"MarianConfig.activation_function={marian.activation_function!r} has no Vaswani "
                         f"equivalent; supported: {', '.join(MARIAN_ACTIVATIONS)}.")
    for name in ("encoder_layerdrop", "decoder_layerdrop"):
        if getattr(marian, name):
            raise ValueError(f"MarianConfig.{name}={getattr(marian, name)}: Vaswani models have no LayerDrop; set "
                             f"model.config.{name} = 0.0 before converting (it only acts in training).")
    shared = marian.share_encoder_decoder_embeddings if share_embeddings is None else share_embeddings
    # With shared embeddings Marian's decoder and output layer use the shared table, of vocab_size rows, whatever
    # decoder_vocab_size says; separate ones have decoder_vocab_size rows.
    decoder_vocab_size = None if shared or marian.decoder_vocab_size == marian.vocab_size else marian.decoder_vocab_size
    return VaswaniConfig(
        vocab_size=marian.vocab_size,
        decoder_vocab_size=decoder_vocab_size,
        d_model=marian.d_model,
        encoder_layers=marian.encoder_layers,
        decoder_layers=marian.decoder_layers,
        num_attention_heads=marian.encoder_attention_heads,
        d_ff=marian.encoder_ffn_dim,
        ffn_activation=MARIAN_ACTIVATIONS[marian.activation_function],
        dropout=float(marian.dropout),
        attention_dropout=float(marian.attention_dropout),
        activation_dropout=float(marian.activation_dropout),
        norm_first=False,
        norm_type="layernorm",
        layer_norm_eps=MARIAN_LAYER_NORM_EPS,
        position_embedding_type="sinusoidal",
        sinusoidal_layout="concatenated",
        max_position_embeddings=marian.max_position_embeddings,
        scale_embedding=marian.scale_embedding,
        share_embeddings=shared,
        tie_word_embeddings=marian.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings,
        final_logits_bias=True,
        bias=True,
        label_smoothing=0.0,
        use_cache=marian.use_cache,
        pad_token_id=marian.pad_token_id,
        eos_token_id=marian.eos_token_id,
        bos_token_id=marian.bos_token_id,
        decoder_start_token_id=marian.decoder_start_token_id,
    )


def marian_config_from_vaswani(config: VaswaniConfig) -> MarianConfig:
    """The MarianConfig of the same model as `config`; a ValueError names any field Marian cannot express."""
    required = {
        "norm_first": False, "norm_type": "layernorm", "layer_norm_eps": MARIAN_LAYER_NORM_EPS,
        "position_embedding_type": "sinusoidal", "bias": True, "num_key_value_heads": config.num_attention_heads,
    }
    for name, value in required.items():
        if getattr(config, name) != value:
            raise ValueError(f"VaswaniConfig.{name}={getattr(config, name)!r}: Marian models need {value!r}.")
    activations = {ours: theirs for theirs, ours in MARIAN_ACTIVATIONS.items() if theirs != "silu"}
    if config.ffn_activation not in activations:
        raise ValueError(f"VaswaniConfig.ffn_activation={config.ffn_activation!r}: Marian models support "
                         f"{', '.join(activations)}.")
    if config.pad_token_id is None or config.decoder_start_token_id is None:
        raise ValueError("VaswaniConfig.pad_token_id and decoder_start_token_id must be set for a Marian model.")
    return MarianConfig(
        vocab_size=config.vocab_size,
        decoder_vocab_size=config.target_vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.num_attention_heads,
        decoder_attention_heads=config.num_attention_heads,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        activation_function=activations[config.ffn_activation],
        d_model=config.d_model,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.activation_dropout,
        scale_embedding=config.scale_embedding,
        share_encoder_decoder_embeddings=config.share_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        use_cache=config.use_cache,
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
        bos_token_id=config.bos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
        forced_eos_token_id=None,  # generation settings travel in the generation config
    )


def marian_name(name: str) -> str:
    """Our parameter or buffer name → Marian's."""
    name = re.sub(r"\.o_proj\.", ".out_proj.", name)
    return re.sub(r"\.mlp\.(fc[12])\.", r".\1.", name)


@torch.no_grad()
def from_marian(marian: MarianMTModel) -> VaswaniForConditionalGeneration:
    """A VaswaniForConditionalGeneration computing exactly what `marian` computes (same weights, same generation
    config), in fp32 on the CPU, in eval mode."""
    # What is shared is read off the model rather than its config: with tie_word_embeddings=False, transformers 5
    # also leaves Marian's encoder and decoder tables untied from `shared`, so they are three tables.
    encoder, decoder = marian.model.encoder.embed_tokens.weight, marian.model.decoder.embed_tokens.weight
    config = vaswani_config_from_marian(marian.config, share_embeddings=encoder is decoder,
                                        tie_word_embeddings=marian.lm_head.weight is decoder)
    check_marian_positions(marian)
    model = VaswaniForConditionalGeneration(config)
    theirs = marian.state_dict()
    model.load_state_dict({name: theirs[marian_name(name)].float().cpu() for name in model.state_dict()})
    model.generation_config = GenerationConfig.from_dict(marian.generation_config.to_dict())
    return model.eval()


@torch.no_grad()
def to_marian(model: VaswaniForConditionalGeneration) -> MarianMTModel:
    """A MarianMTModel computing exactly what `model` computes, in fp32 on the CPU, in eval mode; a ValueError names
    any config field Marian cannot express. A model with the paper's interleaved sinusoids is converted with its
    residual channels permuted (sines first), which Marian's layout then matches: the same function."""
    config = marian_config_from_vaswani(model.config)
    marian = MarianMTModel(config)
    ours = model.state_dict()
    if model.config.sinusoidal_layout == "interleaved":
        ours = permute_residual_channels(ours, interleaved_to_concatenated(model.config.d_model))
    state = {}
    for name in marian.state_dict():
        if name.endswith("embed_positions.weight"):
            state[name] = marian.state_dict()[name]  # computed by Marian at init, the same sinusoids
        elif name == "model.shared.weight":
            state[name] = ours["model.encoder.embed_tokens.weight"]
        elif name == "final_logits_bias":
            bias = ours.get("final_logits_bias")
            state[name] = bias if bias is not None else torch.zeros(1, model.config.target_vocab_size)
        else:
            state[name] = ours[_vaswani_name(name)]
    marian.load_state_dict({name: tensor.float().cpu() for name, tensor in state.items()})
    marian.generation_config = GenerationConfig.from_dict(model.generation_config.to_dict())
    return marian.eval()


def _vaswani_name(name: str) -> str:
    name = re.sub(r"\.out_proj\.", ".o_proj.", name)
    return re.sub(r"(layers\.\d+)\.(fc[12])\.", r"\1.mlp.\2.", name)


def interleaved_to_concatenated(d_model: int) -> torch.Tensor:
    """The channel order that turns the paper's interleaved sinusoids (sin, cos, sin, cos, …) into Marian's
    concatenated ones (all sines, then all cosines): new channel j is old channel order[j]."""
    return torch.cat((torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)))


def permute_residual_channels(state: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same model with its d_model residual channels reordered. Every map into the residual stream
    (embeddings, attention and FFN outputs, norms) is reordered on its output side, every map out of it (q/k/v
    projections, fc1, the output projection) on its input side; LayerNorm treats channels alike, so the function
    is unchanged, with the positions now added in the new order."""
    permuted = {}
    for name, tensor in state.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensor = tensor[:, order]
        elif re.search(r"(q_proj|k_proj|v_proj|fc1|gate_proj|up_proj)\.weight$", name):
            tensor = tensor[:, order]
        elif re.search(r"(o_proj|fc2|down_proj)\.weight$", name):
            tensor = tensor[order]
        elif re.search(r"(o_proj|fc2|down_proj)\.bias$|layer_norm\.(weight|bias)$", name):
            tensor = tensor[order]
        permuted[name] = tensor
    return permuted


def check_marian_positions(marian: MarianMTModel) -> None:
    """Marian computes its position tables at initialisation; a model whose tables are anything else (edited, or
    from another implementation) would not convert exactly."""
    config = marian.config
    expected = VaswaniSinusoidalPositionalEmbedding(config.d_model, "concatenated")(
        torch.arange(config.max_position_embeddings))
    for stack in ("encoder", "decoder"):
        table = getattr(marian.model, stack).embed_positions.weight.float().cpu()
        if not torch.allclose(table, expected, atol=1e-4):
            raise ValueError(f"model.{stack}.embed_positions of this Marian model is not the sinusoid table that "
                             "MarianSinusoidalPositionalEmbedding computes; it cannot be converted exactly.")


@locking("output_dir")
def convert_marian_checkpoint(model_name_or_path: str, output_dir: str | Path, force: bool = False,
                              check: bool = True) -> VaswaniForConditionalGeneration:
    """Load a MarianMTModel and its tokenizer (a Hub id or a local directory), convert the model, and save a
    Vaswani checkpoint to `output_dir`: weights (safetensors), config, generation config, module files, the
    translation pipeline, Marian's own tokenizer files, and a model card naming the source model and its licence.
    With `check`, both models first translate a short input and must agree (logits within 1e-4, same greedy
    output), or nothing is written. `output_dir` is checked first (`checkpoints.check_output_dir`: never the
    source, nor a training run's; a non-empty one only with `force`) and is replaced whole."""
    check_output_dir(output_dir, [model_name_or_path], force)
    try:
        marian = MarianMTModel.from_pretrained(model_name_or_path, dtype=torch.float32).eval()
    except OSError as error:
        raise FileNotFoundError(f"Cannot load a Marian model from {model_name_or_path}: "
                                f"{str(error).splitlines()[0]}") from error
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    model = from_marian(marian)
    model.config.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
    if check:
        check_same_translations(marian, model, tokenizer)
    with staged_directory(output_dir, f"-{os.getpid()}") as staging:
        attach_translation_pipeline(model, staging)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_converted_model_card(staging, str(model_name_or_path), *source_card_data(model_name_or_path))
    return model


@torch.no_grad()
def check_same_translations(marian: MarianMTModel, model: VaswaniForConditionalGeneration, tokenizer,
                            sentences=("Hello, how are you?", "The cat sat on the mat.")) -> None:
    inputs = tokenizer(list(sentences), padding=True, return_tensors="pt")
    start = torch.full((len(sentences), 1), marian.config.decoder_start_token_id)
    # Source ids as target ids: any ids of the target vocabulary will do for comparing the two models.
    target_ids = inputs["input_ids"][:, :4].clamp(max=marian.lm_head.out_features - 1)
    decoder_input_ids = torch.cat([start, target_ids], 1)
    expected = marian(**inputs, decoder_input_ids=decoder_input_ids).logits
    got = model(**inputs, decoder_input_ids=decoder_input_ids).logits
    difference = (expected - got).abs().max().item()
    if difference > 1e-4:
        raise ValueError(f"The converted model's logits differ from Marian's by {difference:.2e}; not saved.")
    settings = {"num_beams": 1, "do_sample": False, "max_new_tokens": 16}
    if not torch.equal(marian.generate(**inputs, **settings), model.generate(**inputs, **settings)):
        raise ValueError("The converted model's greedy translations differ from Marian's; not saved.")


def source_card_data(model_name_or_path: str) -> tuple[str | None, list[str] | None]:
    """The `license` and `language` of the source model's card (README.md front matter), if it can be read."""
    from huggingface_hub import ModelCard

    path = Path(model_name_or_path)
    try:
        card = ModelCard.load(path / "README.md" if path.is_dir() else model_name_or_path)
    except Exception:  # no card, no network: the new card then says the licence is unknown
        return None, None
    language = card.data.language
    return card.data.license, [language] if isinstance(language, str) else language


def write_converted_model_card(output_dir: Path, source: str, license: str | None,
                               languages: list[str] | None = None) -> Path:
    from huggingface_hub import ModelCard, ModelCardData

    stated = f"`{license}`, as stated by the source model's card" if license else (
        "not stated in a card that could be read at conversion time; check the source model's card")
    card_data = ModelCardData(
        license=license, language=languages, library_name="transformers", pipeline_tag="translation", base_model=source
        if "/" in source and not Path(source).exists() else None,
        tags=["translation", "transformer", "vaswani", "marian", "opus-mt", "encoder-decoder"],
    )
    text = f"""# {Path(source).name} (Vaswani)

`{source}` (a `MarianMTModel`), converted to a Vaswani Transformer checkpoint with
`scripts/convert_marian.py` of the `vaswani` package: the same weights, the same translations (logits and greedy
output checked against the Marian model at conversion time), with vaswani's decoding paths and tools.

## Source and licence

Source model: `{source}`. Its weights, and so these, are licensed {stated}. The tokenizer is the source
model's own (`MarianTokenizer`, sentencepiece; needs `pip install sentencepiece`).

{how_to_load(REPO_ID_PLACEHOLDER)}"""
    path = output_dir / "README.md"
    ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n{text}").save(path)
    return path


# Llama ---------------------------------------------------------------------------------------------------------------

# Our gated ffn_activation → Llama's hidden_act (Llama's MLP is always gated: down(act(gate(x)) * up(x))).
LLAMA_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu"}
# Our parameter names → Llama's, where they differ.
LLAMA_NAMES = {".self_attn_layer_norm.": ".input_layernorm.", ".final_layer_norm.": ".post_attention_layernorm.",
               "model.layer_norm.": "model.norm."}


def llama_config_from_vaswani(config: VaswaniConfig) -> LlamaConfig:
    """The LlamaConfig of the same decoder-only model as `config`; a ValueError names any field Llama cannot
    express."""
    required = {"norm_first": True, "norm_type": "rmsnorm", "position_embedding_type": "rope",
                "final_logits_bias": False}
    for name, value in required.items():
        if getattr(config, name) != value:
            raise ValueError(f"VaswaniConfig.{name}={getattr(config, name)!r}: Llama models need {value!r}.")
    if config.ffn_activation not in LLAMA_ACTIVATIONS:
        raise ValueError(f"VaswaniConfig.ffn_activation={config.ffn_activation!r}: Llama's MLP is gated; it "
                         f"expresses {' and '.join(LLAMA_ACTIVATIONS)}.")
    for name in ("dropout", "activation_dropout"):
        if getattr(config, name):
            raise ValueError(f"VaswaniConfig.{name}={getattr(config, name)}: Llama models have no such dropout; set "
                             f"model.config.{name} = 0.0 before converting (it only acts in training).")
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.decoder_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=LLAMA_ACTIVATIONS[config.ffn_activation],
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.layer_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        attention_bias=config.bias,
        mlp_bias=config.bias,
        attention_dropout=config.attention_dropout,
        # A scaled embedding is folded into Llama's input table, which then differs from the output projection.
        tie_word_embeddings=config.tie_word_embeddings and not config.scale_embedding,
        use_cache=config.use_cache,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )


def vaswani_config_from_llama(llama: LlamaConfig, tie_word_embeddings: bool | None = None) -> VaswaniConfig:
    """The VaswaniConfig of the same decoder-only model as `llama`; a ValueError names any field it cannot
    express. `tie_word_embeddings` overrides what the config says (`from_llama` reads it off the model)."""
    rope = dict(llama.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"LlamaConfig.rope_parameters['rope_type']={rope['rope_type']!r}: Vaswani models have only "
                         "the default (unscaled) rotary embedding.")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"LlamaConfig.rope_parameters['partial_rotary_factor']={rope['partial_rotary_factor']}: "
                         "Vaswani models rotate every channel of a head.")
    unknown = sorted(set(rope) - {"rope_type", "rope_theta", "partial_rotary_factor"})
    if unknown:
        raise ValueError(f"LlamaConfig.rope_parameters has {', '.join(unknown)}, which Vaswani models cannot express.")
    if llama.head_dim * llama.num_attention_heads != llama.hidden_size:
        raise ValueError(f"LlamaConfig.head_dim={llama.head_dim}: Vaswani models have head_dim = hidden_size / "
                         f"num_attention_heads = {llama.hidden_size / llama.num_attention_heads:g}.")
    activations = {theirs: ours for ours, theirs in LLAMA_ACTIVATIONS.items()}
    if llama.hidden_act not in activations:
        raise ValueError(f"LlamaConfig.hidden_act={llama.hidden_act!r} has no Vaswani equivalent; supported: "
                         f"{', '.join(activations)}.")
    if llama.attention_bias != llama.mlp_bias:
        raise ValueError(f"LlamaConfig.attention_bias={llama.attention_bias} and mlp_bias={llama.mlp_bias}: a "
                         "Vaswani model has biases in every linear layer or in none (one field, bias).")
    return VaswaniConfig(
        vocab_size=llama.vocab_size,
        d_model=llama.hidden_size,
        encoder_layers=0,
        decoder_layers=llama.num_hidden_layers,
        num_attention_heads=llama.num_attention_heads,
        num_key_value_heads=llama.num_key_value_heads,
        d_ff=llama.intermediate_size,
        ffn_activation=activations[llama.hidden_act],
        dropout=0.0,
        attention_dropout=float(llama.attention_dropout),
        activation_dropout=0.0,
        norm_first=True,
        norm_type="rmsnorm",
        layer_norm_eps=llama.rms_norm_eps,
        position_embedding_type="rope",
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=llama.max_position_embeddings,
        scale_embedding=False,
        tie_word_embeddings=llama.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings,
        final_logits_bias=False,
        bias=llama.attention_bias,
        label_smoothing=0.0,
        use_cache=llama.use_cache,
        is_encoder_decoder=False,
        pad_token_id=llama.pad_token_id,
        bos_token_id=llama.bos_token_id,
        eos_token_id=llama.eos_token_id,
        decoder_start_token_id=llama.bos_token_id,
    )


def llama_name(name: str) -> str:
    """Our parameter name → Llama's."""
    for ours, theirs in LLAMA_NAMES.items():
        name = name.replace(ours, theirs)
    return name


@torch.no_grad()
def to_llama(model: VaswaniForCausalLM) -> LlamaForCausalLM:
    """A LlamaForCausalLM computing exactly what the decoder-only `model` computes (same weights, same generation
    config), in fp32 on the CPU, in eval mode; a ValueError names any config field Llama cannot express. A scaled
    embedding (`scale_embedding`, the presets' default) is folded into Llama's input table, so a model whose output
    projection is tied to it becomes an untied Llama model: the same function, the table stored twice."""
    if not isinstance(model, VaswaniForCausalLM):
        raise ValueError(f"to_llama converts a VaswaniForCausalLM (the decoder-only model), not a "
                         f"{type(model).__name__}.")
    llama = LlamaForCausalLM(llama_config_from_vaswani(model.config))
    ours = {llama_name(name): tensor for name, tensor in model.state_dict().items()}
    # The embedding scale (√d_model, §3.4) becomes part of the input table: the same product, computed once.
    ours["model.embed_tokens.weight"] = ours["model.embed_tokens.weight"] * model.model.embed_scale
    llama.load_state_dict({name: ours[name].float().cpu() for name in llama.state_dict()})
    settings = model.generation_config.to_dict()
    settings.pop("decoder_start_token_id", None)  # an encoder-decoder setting, which a decoder-only model never reads
    llama.generation_config = GenerationConfig.from_dict(settings)
    return llama.eval()


@torch.no_grad()
def from_llama(llama: LlamaForCausalLM) -> VaswaniForCausalLM:
    """A VaswaniForCausalLM computing exactly what `llama` computes (same weights, same generation config), in fp32
    on the CPU, in eval mode; a ValueError names any config field it cannot express."""
    tied = llama.lm_head.weight is llama.model.embed_tokens.weight
    model = VaswaniForCausalLM(vaswani_config_from_llama(llama.config, tie_word_embeddings=tied))
    theirs = llama.state_dict()
    model.load_state_dict({name: theirs[llama_name(name)].float().cpu() for name in model.state_dict()})
    model.generation_config = GenerationConfig.from_dict(llama.generation_config.to_dict())
    return model.eval()


def stock_tokenizer(tokenizer):
    """The tokenizer as a class of transformers itself, so that its checkpoint loads without remote code: a custom
    class over a `tokenizers` pipeline (VaswaniTokenizer) becomes a `TokenizersBackend` over the same pipeline and
    special tokens, which encodes and decodes alike."""
    if type(tokenizer).__module__.startswith("transformers."):
        return tokenizer
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"The tokenizer ({type(tokenizer).__name__}) is neither a transformers class nor built on "
                         "a `tokenizers` pipeline; a Llama checkpoint could not load it without remote code.")
    special = {name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")
               if getattr(tokenizer, name, None) is not None}
    return TokenizersBackend(tokenizer_object=tokenizer.backend_tokenizer, model_max_length=tokenizer.model_max_length,
                             padding_side=tokenizer.padding_side,
                             clean_up_tokenization_spaces=tokenizer.clean_up_tokenization_spaces, **special)


@torch.no_grad()
def check_same_logits(expected_model, model, vocab_size: int, pad_token_id: int | None) -> None:
    """Both decoder-only models must give the same logits on a left-padded batch and the same greedy continuation
    (cached), or the conversion is refused before anything is written."""
    generator = torch.Generator().manual_seed(0)
    low = min(4, vocab_size - 1)
    input_ids = torch.randint(low, vocab_size, (2, 6), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    if pad_token_id is not None:
        input_ids = input_ids.masked_fill(attention_mask == 0, pad_token_id)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    expected, got = expected_model(**inputs).logits, model(**inputs).logits
    difference = (expected - got)[attention_mask.bool()].abs().max().item()
    if difference > 1e-4:
        raise ValueError(f"The converted model's logits differ by {difference:.2e}; not saved.")
    settings = {"do_sample": False, "num_beams": 1, "max_new_tokens": 8, "min_new_tokens": 8,
                "pad_token_id": pad_token_id if pad_token_id is not None else 0}
    if not torch.equal(expected_model.generate(**inputs, **settings), model.generate(**inputs, **settings)):
        raise ValueError("The converted model's greedy continuations differ; not saved.")


@locking("output_dir")
def convert_llama_checkpoint(model_name_or_path: str, output_dir: str | Path, force: bool = False,
                             check: bool = True):
    """Convert a checkpoint either way, by its config.json: a Vaswani decoder-only checkpoint becomes a stock Llama
    one (weights, config, generation config, tokenizer as a transformers class, no module files), a Llama
    checkpoint a Vaswani one (with its module files and the Llama tokenizer). The weights keep the dtype the source
    stored. With `check`, both models first compare logits (in float32) on a left-padded batch and greedy
    continuations, or nothing is written. `output_dir` is checked first and replaced whole, as in
    `convert_marian_checkpoint`. Returns the new model."""
    from transformers import AutoConfig

    check_output_dir(output_dir, [model_name_or_path], force)
    try:
        config = AutoConfig.from_pretrained(model_name_or_path)
    except OSError as error:
        raise FileNotFoundError(f"Cannot load a model config from {model_name_or_path}: "
                                f"{str(error).splitlines()[0]}") from error
    model_type = config.model_type
    if model_type == VaswaniConfig.model_type and VaswaniForCausalLM.__name__ not in (config.architectures or []):
        raise ValueError(f"{model_name_or_path} holds a {', '.join(config.architectures or ['Vaswani model'])}; only "
                         "the decoder-only VaswaniForCausalLM has a Llama equivalent.")
    if model_type == LlamaConfig.model_type:
        source = LlamaForCausalLM.from_pretrained(model_name_or_path, dtype=torch.float32).eval()
        converted = from_llama(source)
    elif model_type == VaswaniConfig.model_type:
        source = VaswaniForCausalLM.from_pretrained(model_name_or_path, dtype=torch.float32).eval()
        converted = to_llama(source)
    else:
        raise ValueError(f"{model_name_or_path} holds a {model_type!r} model; this converts Llama and Vaswani "
                         "decoder-only checkpoints.")
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    except (OSError, ValueError):
        pass  # a checkpoint without a tokenizer converts to one without
    if check:
        check_same_logits(source, converted, source.config.vocab_size, source.config.pad_token_id)
    if isinstance(config.dtype, torch.dtype) and config.dtype.is_floating_point:
        converted.to(config.dtype)  # compared in float32, stored as the source was (a bf16 Llama stays bf16)
    if isinstance(converted, VaswaniForCausalLM):
        if tokenizer is not None:
            converted.config.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
    else:
        tokenizer = stock_tokenizer(tokenizer) if tokenizer is not None else None
    with staged_directory(output_dir, f"-{os.getpid()}") as staging:
        converted.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return converted


__all__ = ["from_marian", "to_marian", "convert_marian_checkpoint", "vaswani_config_from_marian",
           "marian_config_from_vaswani", "from_llama", "to_llama", "convert_llama_checkpoint",
           "llama_config_from_vaswani", "vaswani_config_from_llama"]
