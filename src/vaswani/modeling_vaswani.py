"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), box for box of its Figure 1.

Read top to bottom: positions (sinusoidal §3.5, rotary), the feed-forward network (§3.3), attention (§3.2) with
its free math function, the encoder and decoder layers ("Add & Norm" around each sublayer, §3.1), the stacks,
and the models with their heads. One attention class plays the paper's three roles (§3.2.3):

* encoder self-attention: queries, keys and values from the source; only source padding is masked;
* decoder masked self-attention: from the target; causal + padding mask; keys/values cached while generating;
* encoder-decoder (cross) attention: queries from the decoder, keys/values from the encoder output, computed once
  per source and cached; the source padding is masked, and nothing is causal.

Shapes: batch B, source length S, target length T, heads H, key/value heads K, head dim D, width d_model.
"""

import copy
import inspect
import math
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache, StaticLayer
from transformers.dynamic_module_utils import custom_object_save
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithPast,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    SequenceClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_vaswani import VaswaniConfig
from .generation_vaswani import generate as lean_generate, runs_as


# transformers 5.24 renamed the decoding cache from `past_key_values` to `cache` wherever generate() and the mask
# functions pass it: forward arguments, output fields, `create_causal_mask`'s argument (the old name is deprecated
# there, its removal announced for 5.40). Our forwards take `cache` and also accept the old name, which earlier
# releases' generate() passes; outputs and mask calls use the installed release's own name, so that no deprecation
# warning is raised on either side of the rename.
CACHE_NAME = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"


def cache_argument(cache: Cache | None, kwargs: dict) -> Cache | None:
    """The decoding cache under either name (see CACHE_NAME); the old one is taken out of `kwargs`."""
    old = kwargs.pop("past_key_values", None)
    if cache is not None and old is not None:
        raise ValueError("Pass the decoding cache once, as `cache` (or `past_key_values` before transformers 5.24).")
    if old is not None and CACHE_NAME == "cache" and not torch.compiler.is_compiling():
        # As the installed release's own models say it (its `deprecate_kwarg`); its generate() passes the new name.
        warnings.warn("`past_key_values` is deprecated for `forward`. Use `cache` instead.", FutureWarning)
    return cache if cache is not None else old


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Teacher forcing: the decoder reads <start> y_1 … y_{T-1} and is trained to predict y_1 … y_T (§3, "shifted
    right"). Ignored label positions (-100) become padding. With `position_ids` of packed rows (several targets a
    row, `sequence_starts`), each target is shifted within itself: its first position reads <start>, not the end of
    the target before it."""
    # Built without assigning a Python number into a tensor, which older torch lifts to a tensor of its own (a copy
    # from the host at every step where the model shifts the labels itself, as it does for packed rows).
    start = labels.new_full((labels.shape[0], 1), decoder_start_token_id)
    shifted = torch.cat((start, labels[:, :-1]), dim=1)
    if position_ids is not None:
        shifted = torch.where(sequence_starts(position_ids), start, shifted)
    return shifted.masked_fill_(shifted == -100, pad_token_id)


# Packed sequences: several sequences a row, each with positions of its own -----------------------------------------


def sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where a new sequence starts in rows of packed sequences: wherever a position does not follow the one before
    it, as transformers finds packed sequences from `position_ids` (`masking_utils.find_packed_sequence_indices`,
    what `DataCollatorWithFlattening` gives Llama). Computed on the device, with nothing read back to the host."""
    follows = position_ids[..., 1:] == position_ids[..., :-1] + 1
    return torch.cat((torch.ones_like(follows[..., :1]), ~follows), dim=-1)


def packed_attention_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                          key_padding_mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """The boolean (B, 1, q_len, kv_len) mask, True where attention is allowed, of rows of packed sequences: a query
    sees the keys of its own sequence (the sequences counted along each row, `sequence_starts`, so that the k-th
    target of a row attends to the k-th source of that row), not padding (`key_padding_mask` 0), and with `causal`
    none after it. A query that would see nothing (padding, or a target without a source) sees every key instead:
    an entirely masked row gives NaN under some sdpa kernels, and a NaN reaches the gradients even where no loss
    counts it (NaN × 0 is NaN); padding's outputs are never read by a real position or the loss."""
    query_sequences = sequence_starts(query_positions).cumsum(-1)
    key_sequences = sequence_starts(key_positions).cumsum(-1)
    allowed = query_sequences[:, :, None] == key_sequences[:, None, :]  # (B, q_len, kv_len)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :].bool()
    if causal:
        allowed = allowed & torch.ones(allowed.shape[-2:], dtype=torch.bool, device=allowed.device).tril()
    return (allowed | ~allowed.any(-1, keepdim=True))[:, None]


# The attention functions that take `packed_attention_mask`'s boolean mask as it is.
PACKED_ATTENTION = ("sdpa", "eager")


def check_packed_attention(config) -> None:
    if config._attn_implementation not in PACKED_ATTENTION:
        raise ValueError(f"Packed sequences (position_ids restarting within a row) need sdpa or eager attention; "
                         f"this model uses {config._attn_implementation}. Load it with attn_implementation='sdpa'.")


# Positions ---------------------------------------------------------------------------------------------------------


def _inverse_frequencies(dim: int, base: float, device: torch.device) -> torch.Tensor:
    """1 / base^(2i/dim) for i = 0 … dim/2 - 1: the wavelengths of both the sinusoids and the rotations."""
    return 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


def positions_after(past_length: int | torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
    """Position ids past_length … past_length + length - 1, shape (1, length). Written as arange + offset, not
    arange(past, past + length): a static cache reports past_length as a tensor, and under torch.compile only the
    former keeps the length static."""
    return (torch.arange(length, device=device) + past_length)[None]


class VaswaniSinusoidalPositionalEmbedding(nn.Module):
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    Computed from the positions on every call rather than stored: it costs one outer product, has no buffer that a
    checkpoint would have to restore, and extends to any length ("may allow the model to extrapolate", §3.5).
    `layout="concatenated"` puts the same sines in the first half of the channels and the cosines in the second
    (tensor2tensor, Marian / OPUS-MT).
    """

    def __init__(self, d_model: int, layout: str = "interleaved"):
        super().__init__()
        self.d_model = d_model
        self.layout = layout

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.layout == "concatenated":
            # Marian computes this table in float64 and rounds it to float32; so do we, or the angles' float32
            # rounding (about position × 1e-7) would show in the logits far along a sentence. MPS has no float64.
            dtype = torch.float32 if position_ids.device.type == "mps" else torch.float64
            frequencies = 1.0 / 10000.0 ** (torch.arange(0, self.d_model, 2, device=position_ids.device,
                                                         dtype=dtype) / self.d_model)
            angles = position_ids.to(dtype)[..., None] * frequencies
            return torch.cat((angles.sin(), angles.cos()), dim=-1).float()  # (..., seq, d_model)
        angles = position_ids.float()[..., None] * _inverse_frequencies(self.d_model, 10000.0, position_ids.device)
        # stack + flatten interleaves: sin on even channels, cos on odd ones, exactly as the paper writes it.
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (..., seq, d_model)


class VaswaniRotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., 2021, RoFormer): rotates query/key channel pairs by position-dependent
    angles so that q·k depends only on the relative offset. Like the sinusoids, computed on the fly."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * _inverse_frequencies(self.head_dim, self.theta, position_ids.device)
        angles = torch.cat((freqs, freqs), dim=-1)  # (batch, seq, head_dim)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads: (batch, 1, seq, head_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# Feed-forward network ----------------------------------------------------------------------------------------------


class VaswaniMLP(nn.Module):
    """§3.3: FFN(x) = max(0, x W1 + b1) W2 + b2, applied to each position separately (ReLU, or GELU/SiLU)."""

    def __init__(self, config: VaswaniConfig, activation: str):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.fc2 = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.act = ACT2FN[activation]
        self.activation_dropout = config.activation_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(self.act(self.fc1(x)), p=self.activation_dropout, training=self.training)
        return self.fc2(x)


class VaswaniGatedMLP(nn.Module):
    """Gated linear unit FFN (Shazeer, 2020, "GLU Variants Improve Transformer"): down(act(gate(x)) * up(x))."""

    def __init__(self, config: VaswaniConfig, activation: str):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.act = ACT2FN[activation]
        self.activation_dropout = config.activation_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(F.dropout(x, p=self.activation_dropout, training=self.training))


# The variant tables: each config string resolves to a class once, in __init__.
MLP_CLASSES = {
    "relu": (VaswaniMLP, "relu"),
    "gelu": (VaswaniMLP, "gelu"),
    "silu": (VaswaniMLP, "silu"),
    "swiglu": (VaswaniGatedMLP, "silu"),
    "geglu": (VaswaniGatedMLP, "gelu"),
}


def make_mlp(config: VaswaniConfig) -> nn.Module:
    mlp_class, activation = MLP_CLASSES[config.ffn_activation]
    return mlp_class(config, activation)


def make_norm(config: VaswaniConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)


# Attention ---------------------------------------------------------------------------------------------------------


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, K, L, D) → (B, K·n_rep, L, D): each key/value head serves n_rep query heads (GQA/MQA)."""
    batch, kv_heads, length, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None].expand(batch, kv_heads, n_rep, length, head_dim)
    return hidden_states.reshape(batch, kv_heads * n_rep, length, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """§3.2.1, Scaled Dot-Product Attention: softmax(Q Kᵀ / √d_k) V. The reference path; it returns the weights."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, q_len, kv_len)
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # sdpa's mask: True where allowed
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores + attention_mask  # additive: 0 where allowed, the dtype's minimum where masked
    # Softmax in float32: in bf16 the sum over long rows loses the small probabilities.
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, q_len, H, D)
    return output, weights


class VaswaniAttention(nn.Module):
    """Multi-head attention (§3.2.2) with optional grouped key/value heads, in one of the three roles above.

    It only projects, applies rotary positions, caches and dispatches; the math lives in the attention function
    chosen by `config._attn_implementation` (eager, sdpa, flash_attention_2, flex_attention).
    """

    def __init__(self, config: VaswaniConfig, layer_idx: int, is_causal: bool = False, is_cross_attention: bool = False):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        # Read by the sdpa/flash/flex functions: only decoder self-attention is causal, never cross-attention.
        self.is_causal = is_causal
        self.is_cross_attention = is_cross_attention
        self.q_proj = nn.Linear(config.d_model, config.num_attention_heads * self.head_dim, bias=config.bias)
        self.k_proj = nn.Linear(config.d_model, config.num_key_value_heads * self.head_dim, bias=config.bias)
        self.v_proj = nn.Linear(config.d_model, config.num_key_value_heads * self.head_dim, bias=config.bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.d_model, bias=config.bias)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], -1, self.head_dim).transpose(1, 2)  # (B, L, heads·D) → (B, heads, L, D)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query = self._split_heads(self.q_proj(hidden_states))  # (B, H, q_len, D)

        if self.is_cross_attention:
            cross_cache = cache.cross_attention_cache if cache is not None else None
            if cross_cache is not None and cache.is_updated.get(self.layer_idx):
                # The source does not change while decoding: its keys/values were projected on the first step.
                key, value = cross_cache.layers[self.layer_idx].keys, cross_cache.layers[self.layer_idx].values
            else:
                key = self._split_heads(self.k_proj(key_value_states))  # (B, K, S, D)
                value = self._split_heads(self.v_proj(key_value_states))
                if cross_cache is not None:
                    key, value = cross_cache.update(key, value, self.layer_idx)
                    cache.is_updated[self.layer_idx] = True
        else:
            key = self._split_heads(self.k_proj(hidden_states))
            value = self._split_heads(self.v_proj(hidden_states))
            if position_embeddings is not None:
                query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
            if cache is not None:
                self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
                key, value = self_cache.update(key, value, self.layer_idx)  # (B, K, past + q_len, D)

        beams = query.shape[0] // key.shape[0]
        if beams > 1:
            # Beam search with one source row per sentence (`generation_vaswani`): the consecutive query rows of a
            # sentence's beams attend to its keys/values together, as beams·q_len queries, instead of against a copy
            # per beam. Same result; the output reshape below splits the queries back into rows.
            query = query.unflatten(0, (key.shape[0], beams)).transpose(1, 2).flatten(2, 3)  # (B/beams, H, beams·q_len, D)
            if torch.is_tensor(attention_mask) and attention_mask.shape[-2] > 1:  # one mask row per query position
                attention_mask = attention_mask.repeat(1, 1, beams, 1)
        implementation = self.config._attn_implementation
        if (implementation == "sdpa" and hidden_states.shape[1] == 1 and runs_as(query.device) == "cpu"
                and not self.training):
            # A decoding step on a CPU: for one query per row (or a sentence's few beams, above) over a few dozen
            # keys, torch's SDPA kernel costs about twice the plain matmul-softmax-matmul below (benchmarks/README.md,
            # "Profile"). Same result.
            implementation = "eager"
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        output, weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        output = output.reshape(*hidden_states.shape[:-1], -1)  # (B, q_len, H·D)
        return self.o_proj(output), weights


# Layers ------------------------------------------------------------------------------------------------------------


class VaswaniEncoderLayer(GradientCheckpointingLayer):
    """One encoder block (§3.1): self-attention, then the FFN, each wrapped in residual + norm."""

    def __init__(self, config: VaswaniConfig, layer_idx: int):
        super().__init__()
        self.norm_first = config.norm_first
        self.dropout = config.dropout
        self.self_attn = VaswaniAttention(config, layer_idx)
        self.self_attn_layer_norm = make_norm(config)
        self.mlp = make_mlp(config)
        self.final_layer_norm = make_norm(config)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs) -> torch.Tensor:
        x = hidden_states
        if self.norm_first:  # pre-norm: x + Sublayer(Norm(x))
            x = x + self._sa_block(self.self_attn_layer_norm(x), attention_mask, position_embeddings, **kwargs)
            x = x + self._ff_block(self.final_layer_norm(x))
        else:  # the paper's post-norm: Norm(x + Sublayer(x))
            x = self.self_attn_layer_norm(x + self._sa_block(x, attention_mask, position_embeddings, **kwargs))
            x = self.final_layer_norm(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attention_mask, position_embeddings, **kwargs):
        x, _ = self.self_attn(x, attention_mask=attention_mask, position_embeddings=position_embeddings, **kwargs)
        return F.dropout(x, p=self.dropout, training=self.training)  # residual dropout (§5.4)

    def _ff_block(self, x):
        return F.dropout(self.mlp(x), p=self.dropout, training=self.training)


class VaswaniDecoderLayer(GradientCheckpointingLayer):
    """One decoder block (§3.1): masked self-attention, cross-attention over the encoder output, then the FFN.
    Without cross-attention (`VaswaniForCausalLM`) it is the GPT-style decoder-only block."""

    def __init__(self, config: VaswaniConfig, layer_idx: int, cross_attention: bool = True):
        super().__init__()
        self.norm_first = config.norm_first
        self.dropout = config.dropout
        self.self_attn = VaswaniAttention(config, layer_idx, is_causal=True)
        self.self_attn_layer_norm = make_norm(config)
        if cross_attention:
            self.encoder_attn = VaswaniAttention(config, layer_idx, is_cross_attention=True)
            self.encoder_attn_layer_norm = make_norm(config)
        else:
            self.encoder_attn = self.encoder_attn_layer_norm = None
        self.mlp = make_mlp(config)
        self.final_layer_norm = make_norm(config)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        position_embeddings=None,
        cache=None,
        **kwargs,
    ) -> torch.Tensor:
        cache = cache_argument(cache, kwargs)
        x = hidden_states
        cross = self.encoder_attn is not None
        if self.norm_first:
            x = x + self._sa_block(self.self_attn_layer_norm(x), attention_mask, position_embeddings, cache, **kwargs)
            if cross:
                x = x + self._ca_block(
                    self.encoder_attn_layer_norm(x), encoder_hidden_states, encoder_attention_mask, cache, **kwargs
                )
            x = x + self._ff_block(self.final_layer_norm(x))
        else:
            x = self.self_attn_layer_norm(
                x + self._sa_block(x, attention_mask, position_embeddings, cache, **kwargs)
            )
            if cross:
                x = self.encoder_attn_layer_norm(
                    x + self._ca_block(x, encoder_hidden_states, encoder_attention_mask, cache, **kwargs)
                )
            x = self.final_layer_norm(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attention_mask, position_embeddings, cache, **kwargs):
        x, _ = self.self_attn(
            x,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            cache=cache,
            **kwargs,
        )
        return F.dropout(x, p=self.dropout, training=self.training)

    def _ca_block(self, x, encoder_hidden_states, encoder_attention_mask, cache, **kwargs):
        x, _ = self.encoder_attn(
            x,
            attention_mask=encoder_attention_mask,
            key_value_states=encoder_hidden_states,
            cache=cache,
            **kwargs,
        )
        return F.dropout(x, p=self.dropout, training=self.training)

    def _ff_block(self, x):
        return F.dropout(self.mlp(x), p=self.dropout, training=self.training)


# Pre-trained model base --------------------------------------------------------------------------------------------


def _unsharded_class(cls: type) -> type:
    """The model class behind FSDP2: `fully_shard` shards a module in place and swaps its class for a subclass
    `FSDP<name>` of both `FSDPModule` and the class, which torch defines in its own module."""
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule

        if issubclass(cls, FSDPModule):
            return next(base for base in cls.__mro__ if not issubclass(base, FSDPModule))
    return cls


class VaswaniPreTrainedModel(PreTrainedModel):
    config: VaswaniConfig
    config_class = VaswaniConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # FSDP auto-wrap and `device_map` keep each block whole. Each model names only the blocks it has: accelerate's
    # FSDP wrapping refuses a name that the model does not contain.
    _no_split_modules = ["VaswaniEncoderLayer", "VaswaniDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # Every Auto class a Vaswani checkpoint opens with (the table `__init__.py` registers). transformers' own
    # `save_pretrained` writes only the saved class into `auto_map`, so a translation checkpoint loaded through
    # `trust_remote_code` would open with AutoModelForSeq2SeqLM but not with AutoModel; `save_pretrained` below
    # writes them all.
    _auto_map = {
        "AutoModel": "VaswaniModel",
        "AutoModelForSeq2SeqLM": "VaswaniForConditionalGeneration",
        "AutoModelForCausalLM": "VaswaniForCausalLM",
        "AutoModelForSequenceClassification": "VaswaniForSequenceClassification",
    }

    def save_pretrained(self, save_directory, *args, **kwargs):
        auto_class, model_class = self._auto_class, _unsharded_class(type(self))
        if auto_class is not None:  # registered for the Auto classes, so the module files are shipped too
            module = model_class.__module__.rsplit(".", 1)[-1]  # "modeling_vaswani", also when loaded as remote code
            auto_map = {name: f"{module}.{class_name}" for name, class_name in self._auto_map.items()}
            self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **auto_map}
        if auto_class is None or model_class is type(self):
            saved = super().save_pretrained(save_directory, *args, **kwargs)
        else:
            # transformers would ship the module of the FSDP subclass (torch's) as the model code and name that
            # subclass in auto_map; it ships this module instead, below.
            type(self)._auto_class = None
            try:
                saved = super().save_pretrained(save_directory, *args, **kwargs)
            finally:
                del type(self)._auto_class
            if kwargs.get("is_main_process", True):
                custom_object_save(model_class, save_directory)
        if auto_class is not None and kwargs.get("is_main_process", True):
            self._save_generation_and_pipeline_code(Path(save_directory))
        return saved

    def _save_generation_and_pipeline_code(self, save_directory: Path) -> None:
        """What transformers' own save (this module's file and its relative imports) leaves out, so that a checkpoint
        stays whole through any save, the stock `Trainer.save_model` of a model loaded as remote code included:
        `custom_generate/generate.py`, the lean decoding loop that `from_pretrained(..., trust_remote_code=True)`
        makes the model's generate(), and the translation pipeline file that config.json names."""
        if self.can_generate() and self.config.is_encoder_decoder:
            (save_directory / "custom_generate").mkdir(exist_ok=True)
            shutil.copyfile(inspect.getfile(lean_generate), save_directory / "custom_generate" / "generate.py")
        pipelines = getattr(self.config, "custom_pipelines", None) or {}
        if any(entry.get("impl", "").startswith("pipeline_vaswani.") for entry in pipelines.values()):
            # A relative import, so that transformers fetches this file with the remote modeling code, and the
            # copy below finds it next to this module wherever it was loaded from.
            from .pipeline_vaswani import VaswaniTranslationPipeline

            pipeline_file = Path(inspect.getfile(VaswaniTranslationPipeline))
            shutil.copyfile(pipeline_file, save_directory / pipeline_file.name)

    def _reorder_cache(self, cache: Cache, beam_idx: torch.LongTensor) -> Cache:
        return reorder_self_attention_cache(cache, beam_idx)  # called by generate()'s beam search

    def mark_tied_weights_as_initialized(self, loading_info):
        """Called by `from_pretrained` before it initialises what the checkpoint lacks. transformers flags every tied
        target as initialised (the tie will overwrite it), and in custom code then drops every flagged parameter from the
        missing keys. With `share_embeddings` our encoder, decoder and `shared` hold one embedding *module*, so the
        targets' parameter is the source's own: a checkpoint without the table would leave it unreported on the meta
        device. A source missing together with all its targets is missing; it goes back into the report and is
        initialised."""
        missing = set(loading_info.missing_keys)
        super().mark_tied_weights_as_initialized(loading_info)
        tied = self.all_tied_weights_keys
        for source in set(tied.values()) & missing:
            if {target for target, origin in tied.items() if origin == source} <= missing:
                loading_info.missing_keys.add(source)

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """The vocabulary is joint, but with `share_embeddings=False` the decoder has its own table, which the generic
        implementation (it knows one input embedding: the encoder's) would leave at the old size."""
        if self.config.decoder_vocab_size is not None:
            raise ValueError(
                "This model has separate source and target vocabularies (decoder_vocab_size), and "
                "resize_token_embeddings resizes a joint one; resize model.model.encoder.embed_tokens and "
                "model.model.decoder.embed_tokens (with the output projection) to their own tokenizers' sizes."
            )
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        bias = getattr(self, "final_logits_bias", None)
        if bias is not None and bias.shape[-1] != embeddings.num_embeddings:  # new tokens get no bias
            self.final_logits_bias = nn.Buffer(F.pad(bias[:, : embeddings.num_embeddings],
                                                     (0, max(0, embeddings.num_embeddings - bias.shape[-1]))))
        decoder = getattr(self.base_model, "decoder", None)  # present in VaswaniModel and the translation model
        if decoder is not None and decoder.embed_tokens is not embeddings:
            decoder.embed_tokens = self._get_resized_embeddings(
                decoder.embed_tokens, embeddings.num_embeddings, mean_resizing=mean_resizing
            )
            self.tie_weights()  # the output projection follows the (new) decoder table
        return embeddings

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """All initialisation, in one place. The paper does not state its scheme; we follow its reference code
        (tensor2tensor) and fairseq: Xavier-uniform linear layers with zero biases, and token embeddings drawn from
        N(0, d_model^-1/2), so that after the √d_model scaling (§3.4) they have unit variance, like the positions.
        The padding row starts at zero. Norms start as the identity."""
        if isinstance(module, nn.Linear):
            init.xavier_uniform_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=self.config.d_model**-0.5)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            if module.weight is not None:
                init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif getattr(module, "final_logits_bias", None) is not None:
            init.zeros_(module.final_logits_bias)


# Stacks ------------------------------------------------------------------------------------------------------------


class VaswaniStack(VaswaniPreTrainedModel):
    """What the encoder and decoder stacks share: token embedding × √d_model plus positions (§3.4, §3.5), dropout,
    N layers, and under pre-norm a final norm."""

    def __init__(self, config: VaswaniConfig, num_layers: int, vocab_size: int | None = None):
        super().__init__(config)
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        vocab_size = vocab_size or config.vocab_size  # a translation decoder's may differ (decoder_vocab_size)
        self.embed_tokens = nn.Embedding(vocab_size, config.d_model, config.pad_token_id)
        self.embed_positions = None
        self.rotary_emb = None
        if config.position_embedding_type == "sinusoidal":
            self.embed_positions = VaswaniSinusoidalPositionalEmbedding(config.d_model, config.sinusoidal_layout)
        elif config.position_embedding_type == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.d_model)
        else:
            self.rotary_emb = VaswaniRotaryEmbedding(config.head_dim, config.rope_theta)
        self.num_layers = num_layers
        self.layer_norm = make_norm(config) if config.norm_first else None

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def embed(self, input_ids, inputs_embeds, position_ids, past_length: int = 0):
        """Returns the first layer's input and the rotary (cos, sin) — None unless RoPE."""
        batch_size, seq_length = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if batch_size == 0 or seq_length == 0:  # would fail later in a reshape that does not say why
            raise ValueError(f"Got an empty batch of shape ({batch_size}, {seq_length}): pass at least one token.")
        if inputs_embeds is None:
            self._check_token_ids(input_ids)
            inputs_embeds = self.embed_tokens(input_ids)
        seq_length = inputs_embeds.shape[1]
        # Skipped for a static cache, whose past_length is a tensor: reading it would make the host wait for the device
        # at every step, and be a data-dependent branch under torch.compile or in a CUDA graph. Positions given by the
        # caller (packed rows) are checked by the table's lookup, whatever the row's length.
        if (
            self.config.position_embedding_type == "learned"
            and position_ids is None
            and not torch.is_tensor(past_length)
            and past_length + seq_length > self.config.max_position_embeddings
        ):
            raise ValueError(
                f"Sequence of {past_length + seq_length} positions is longer than the {self.config.max_position_embeddings} "
                "learned positions of this model; truncate the input (tokenizer(..., truncation=True, max_length=...)) "
                "or use sinusoidal/rope positions, which extend to any length."
            )
        if position_ids is None:
            position_ids = positions_after(past_length, seq_length, inputs_embeds.device)
        hidden_states = inputs_embeds * self.embed_scale
        position_embeddings = None
        if self.rotary_emb is not None:
            position_embeddings = self.rotary_emb(position_ids, hidden_states.dtype)
        else:
            hidden_states = hidden_states + self.embed_positions(position_ids).to(hidden_states.dtype)
        hidden_states = F.dropout(hidden_states, p=self.config.dropout, training=self.training)
        return hidden_states, position_embeddings

    def _check_token_ids(self, input_ids: torch.Tensor) -> None:
        # An out-of-range id would otherwise surface as an opaque index error (or a device-side assert on CUDA).
        vocab_size = self.embed_tokens.num_embeddings
        check_ids(
            input_ids,
            (input_ids < 0) | (input_ids >= vocab_size),
            lambda bad: f"Token id {bad} is outside the vocabulary [0, {vocab_size}); the tokenizer and the model's "
            "vocab_size disagree (after adding tokens, call model.resize_token_embeddings(len(tokenizer))).",
        )

    def finish(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(hidden_states) if self.layer_norm is not None else hidden_states


class VaswaniEncoder(VaswaniStack):
    """The left half of Figure 1: N encoder layers over the embedded source."""

    _no_split_modules = ["VaswaniEncoderLayer"]
    _can_record_outputs = {"hidden_states": VaswaniEncoderLayer, "attentions": VaswaniAttention}

    def __init__(self, config: VaswaniConfig):
        super().__init__(config, config.encoder_layers)
        self.layers = nn.ModuleList([VaswaniEncoderLayer(config, i) for i in range(config.encoder_layers)])
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, position_ids=None,
                **kwargs) -> BaseModelOutput:
        r"""`position_ids` (B, S): each token's position; where they restart within a row, the row holds several
        sources (packed), and each token attends only to its own source (`packed_attention_mask`)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds to the encoder.")
        hidden_states, position_embeddings = self.embed(input_ids, inputs_embeds, position_ids=position_ids)
        if position_ids is not None:
            check_packed_attention(self.config)
            attention_mask = packed_attention_mask(position_ids, position_ids, attention_mask, causal=False)
        else:
            # While training the mask is always built: deciding to leave it out (a batch without padding) reads it
            # back from the device at every step. Inference keeps that choice, which lets sdpa take its fastest
            # kernel.
            attention_mask = create_bidirectional_mask(
                config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask,
                allow_is_bidirectional_skip=not self.training,
            )
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, position_embeddings, **kwargs)
        return BaseModelOutput(last_hidden_state=self.finish(hidden_states))


class VaswaniDecoder(VaswaniStack):
    """The right half of Figure 1 (without the output projection): N decoder layers over the shifted target,
    attending to the encoder output. With `cross_attention=False` it is a decoder-only (GPT-style) stack."""

    _no_split_modules = ["VaswaniDecoderLayer"]
    _can_record_outputs = {
        "hidden_states": VaswaniDecoderLayer,
        "attentions": OutputRecorder(VaswaniAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(VaswaniAttention, index=1, layer_name="encoder_attn"),
    }

    def __init__(self, config: VaswaniConfig, cross_attention: bool = True):
        # A decoder-only model has one vocabulary; a translation decoder reads and writes the target one.
        super().__init__(config, config.decoder_layers, config.target_vocab_size if cross_attention else None)
        self.cross_attention = cross_attention
        self.layers = nn.ModuleList(
            [VaswaniDecoderLayer(config, i, cross_attention) for i in range(config.decoder_layers)]
        )
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        cache: Cache | None = None,
        inputs_embeds=None,
        position_ids=None,
        use_cache: bool | None = None,
        encoder_position_ids=None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        r"""`position_ids` (B, T) restarting within a row, without a cache (training, scoring): the row holds several
        targets (packed), each attending causally to itself only and, with cross-attention, to the source of the
        same rank in its row, whose `encoder_position_ids` (B, S) say where the sources start
        (`packed_attention_mask`); with cross-attention but without `encoder_position_ids`, rows are not packed."""
        cache = cache_argument(cache, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds to the decoder.")
        if self.cross_attention and encoder_hidden_states is None:
            raise ValueError("The decoder of an encoder-decoder model needs encoder_hidden_states.")
        if use_cache and cache is None:
            cache = (
                EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
                if self.cross_attention
                else DynamicCache(config=self.config)
            )
        self_attention_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        # Generation feeds one new token per step: its position continues after the cached ones.
        past_length = self_attention_cache.get_seq_length() if self_attention_cache is not None else 0
        hidden_states, position_embeddings = self.embed(input_ids, inputs_embeds, position_ids, past_length)

        # Only positions given by the caller can describe packed sequences (the ones `embed` makes never do).
        # transformers' own masks find packed sequences in decoder-only rows too (sdpa, eager), but first decide
        # whether there are any by reading the positions back from the device, at every step; this mask needs no
        # such decision. Other attention functions keep transformers' masks, which they take in their own form.
        # With cross-attention, rows are packed only when the sources' positions come too (each target's
        # cross-attention must stay on its own source); positions alone are just the targets' positions.
        packed = position_ids is not None and cache is None and (
            encoder_position_ids is not None if self.cross_attention
            else self.config._attn_implementation in PACKED_ATTENTION)
        if packed:
            check_packed_attention(self.config)
            causal_mask = packed_attention_mask(position_ids, position_ids, attention_mask, causal=True)
            cross_mask = None
            if self.cross_attention:
                cross_mask = packed_attention_mask(position_ids, encoder_position_ids, encoder_attention_mask,
                                                   causal=False)
        else:
            causal_mask = None if self._sees_whole_cache(hidden_states, attention_mask, position_ids,
                                                         self_attention_cache) else create_causal_mask(
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **{CACHE_NAME: self_attention_cache},
            )
            cross_mask = None
            if self.cross_attention and torch.is_tensor(encoder_attention_mask) and encoder_attention_mask.dim() == 4:
                cross_mask = encoder_attention_mask  # prepared once per batch by the decoding loop
            elif self.cross_attention:
                cross_mask = create_bidirectional_mask(
                    config=self.config,
                    inputs_embeds=hidden_states,
                    attention_mask=encoder_attention_mask,
                    encoder_hidden_states=encoder_hidden_states,
                    allow_is_bidirectional_skip=not self.training,
                )
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                causal_mask,
                encoder_hidden_states,
                encoder_attention_mask=cross_mask,
                position_embeddings=position_embeddings,
                # Under the release's own name: under gradient checkpointing, GradientCheckpointingLayer drops the
                # cache by that name, so that the backward's recompute does not write it a second time.
                **{CACHE_NAME: cache},
                **kwargs,
            )
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=self.finish(hidden_states), **{CACHE_NAME: cache})

    def _sees_whole_cache(self, hidden_states, attention_mask, position_ids, self_attention_cache) -> bool:
        """Whether the causal mask can be left out: a decoding step of one token on a growing cache without padding
        may attend to every position the cache holds, so eager's mask would add zeros and sdpa's is None. Building it
        anyway is a large share of a CPU decoding step's Python (benchmarks/results/profile-decoding-cpu.md). A
        static cache holds unwritten positions, which stay masked."""
        return (hidden_states.shape[1] == 1 and attention_mask is None and position_ids is None
                and self_attention_cache is not None and self.config._attn_implementation in ("eager", "sdpa")
                and all(type(layer) is DynamicLayer for layer in self_attention_cache.layers))


# Models ------------------------------------------------------------------------------------------------------------


def check_ids(ids: torch.Tensor, invalid: torch.Tensor, message: Callable[[int], str]) -> None:
    """Raise ValueError(message(first bad id)) where `invalid` holds. Reading the answer back on an accelerator would
    make the host wait for the device once per forward (each training step, each decoding step), so the check is an
    asynchronous device-side assertion, with the same message. On the CPU the assertion fails at once, and the
    ValueError then names the bad id; a valid batch reads nothing back anywhere (the training step's host-sync count
    is the same on every device). Under torch.compile, and while a CUDA graph is being recorded (decoding steps,
    whose ids are the model's own predictions), it is left out."""
    if torch.compiler.is_compiling() or not ids.numel() or (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if runs_as(ids.device) != "cpu":
        torch._assert_async(~invalid.any(), message("out of range"))
        return
    try:
        torch._assert_async(~invalid.any(), message("out of range"))
    except RuntimeError:
        raise ValueError(message(int(ids[invalid][0]))) from None


class SmoothedCrossEntropy(torch.autograd.Function):
    """The summed, label-smoothed cross-entropy of `F.cross_entropy(..., ignore_index=-100, reduction="sum",
    label_smoothing=ε)`, with its gradient written out: softmax(z) − q per kept row, where q puts 1 − ε + ε/V on
    the label and ε/V on every other token (Szegedy et al., 2016, §7; the paper's §5.4).

    The same numbers; the point is the backward pass over the (tokens × vocabulary) logits. Autograd's takes four
    passes, each into a fresh vocabulary-sized tensor: zeros for the label term, its scatter, the sum with the
    smoothing term's gradient, the log-softmax backward. This one takes one softmax and three in-place passes, and
    keeps the logits (which the model returns anyway) rather than their log-softmax, which speeds up training on a
    CPU (benchmarks/results/training-cpu-default-malloc.md against training-cpu-autograd-loss.md)."""

    @staticmethod
    def forward(ctx, logits, labels, smoothing: float):  # logits (N, V) float, labels (N,) with -100 = ignored
        kept = labels != -100
        target = labels.masked_fill(~kept, 0).unsqueeze(-1)
        log_probs = logits.log_softmax(-1)
        per_token = -(1 - smoothing) * log_probs.gather(-1, target).squeeze(-1) - smoothing * log_probs.mean(-1)
        ctx.save_for_backward(logits, target, kept)
        ctx.smoothing = smoothing
        return per_token.masked_fill(~kept, 0).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable  # a first-order gradient, computed in place
    def backward(ctx, grad_loss):
        logits, target, kept = ctx.saved_tensors
        grad = logits.softmax(-1)
        if ctx.smoothing:
            grad.sub_(ctx.smoothing / logits.shape[-1])
        grad.scatter_add_(-1, target, grad.new_full(target.shape, ctx.smoothing - 1))
        grad.mul_((kept * grad_loss).unsqueeze(-1))
        return grad, None, None


def _token_loss(logits, labels, label_smoothing: float, num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy over non-ignored (-100) label positions, optionally label-smoothed (§5.4).

    Summed, then divided by `num_items_in_batch` when the Trainer passes it: with gradient accumulation each
    micro-batch is then weighted by its share of the tokens, so 1×N and N×1 batches give the same update.
    """
    # Otherwise torch's "Target … is out of bounds" (or a device-side assert on CUDA) names neither cause.
    vocab_size = logits.shape[-1]
    check_ids(
        labels,
        (labels != -100) & ((labels < 0) | (labels >= vocab_size)),
        lambda bad: f"Label id {bad} is outside the vocabulary [0, {vocab_size}); only -100 may mark ignored "
        "positions, and the tokenizer and the model's vocab_size must agree.",
    )
    loss = SmoothedCrossEntropy.apply(
        logits.float().flatten(0, -2), labels.to(logits.device).flatten(), label_smoothing
    )
    if num_items_in_batch is None:
        num_items_in_batch = (labels != -100).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def reorder_self_attention_cache(cache: Cache, beam_idx: torch.LongTensor) -> Cache:
    """Beam search: after each step, row i of the cache must hold the history of the beam that row i now continues.

    Only the decoder's self-attention cache is reordered. The cross-attention keys/values are the same for every beam
    of a sentence (the encoder output is repeated per beam, and beams never move across sentences), so reordering them,
    as the generic `Cache.reorder_cache` does, copies every layer's source projections once per step for nothing.
    A static cache is reordered in place, so its tensors keep the addresses that a compiled decoding step was traced
    with; a dynamic one is replaced, as it is anyway at every step.
    """
    self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    for layer in self_cache.layers:
        if isinstance(layer, StaticLayer) and layer.is_initialized:  # fixed storage
            index = beam_idx.to(layer.keys.device)
            layer.keys.copy_(layer.keys.index_select(0, index))
            layer.values.copy_(layer.values.index_select(0, index))
        else:
            layer.reorder_cache(beam_idx)
    return cache


def _logits_and_loss(model, hidden_states, labels, logits_to_keep: int, num_items_in_batch):
    """The output "Linear" of Figure 1 (its softmax lives in the loss and in generation), and the loss of a language
    model head. `labels` are already aligned with the positions; smoothing applies in training mode only."""
    if logits_to_keep:  # generation only needs the last position's distribution
        hidden_states = hidden_states[:, -logits_to_keep:]
    logits = model.lm_head(hidden_states)
    if getattr(model, "final_logits_bias", None) is not None:  # config.final_logits_bias (Marian's output bias)
        logits = logits + model.final_logits_bias
    if labels is None:
        return logits, None
    smoothing = model.config.label_smoothing if model.training else 0.0
    return logits, _token_loss(logits, labels, smoothing, num_items_in_batch)


class VaswaniModel(VaswaniPreTrainedModel):
    """The encoder-decoder Transformer without an output head: returns the decoder's last hidden states."""

    def __init__(self, config: VaswaniConfig):
        super().__init__(config)
        self.encoder = VaswaniEncoder(config)
        self.decoder = VaswaniDecoder(config)
        if config.share_embeddings:
            # §3.4: one embedding matrix for source and target tokens (a joint subword vocabulary).
            self.shared = self.encoder.embed_tokens
            self.decoder.embed_tokens = self.shared
            # The encoder's table is the one stored in checkpoints (`model.encoder.embed_tokens.weight`), so that
            # VaswaniEncoderModel and the classifier, which have no `shared`, load a translator's embeddings too.
            self._tied_weights_keys = {
                "shared.weight": "encoder.embed_tokens.weight",
                "decoder.embed_tokens.weight": "encoder.embed_tokens.weight",
            }
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embed_tokens = value
        if self.config.share_embeddings:
            self.shared = self.decoder.embed_tokens = value

    def decoder_inputs_from_source(self, input_ids: torch.Tensor | None) -> torch.Tensor:
        """The decoder's inputs when a caller gives neither them nor labels: the source shifted right, as transformers'
        encoder-decoders (BART, T5) make them and its common tests expect. Source ids are target ids only when both
        sides read one vocabulary."""
        if input_ids is None:
            raise ValueError("Pass decoder_input_ids, decoder_inputs_embeds or labels, or input_ids for the decoder to "
                             "read shifted right.")
        if self.config.decoder_vocab_size is not None:
            raise ValueError("This model has a target vocabulary of its own (decoder_vocab_size), so source ids cannot "
                             "stand in for the decoder's inputs: pass decoder_input_ids or labels.")
        return shift_tokens_right(input_ids, self.config.pad_token_id, self.config.decoder_start_token_id)

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        encoder_outputs=None,
        cache: Cache | None = None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        use_cache: bool | None = None,
        position_ids=None,
        decoder_position_ids=None,
        **kwargs,
    ) -> Seq2SeqModelOutput:
        r"""Packing is asked for by giving both `position_ids` (B, S) and `decoder_position_ids` (B, T), restarting at
        each pair: rows of several sentence pairs (as `packing.PackedSeq2SeqCollator` makes them), the k-th target of
        a row translating its k-th source; attention stays within each pair (`packed_attention_mask`). Given alone,
        `position_ids` are the positions of the decoder's tokens, whose outputs come out, as for a decoder-only model
        and as a stock caller (transformers' common tests) means them; `decoder_position_ids` alone are the same.
        Without decoder inputs, the decoder reads `input_ids` shifted right (`decoder_inputs_from_source`)."""
        cache = cache_argument(cache, kwargs)
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self.decoder_inputs_from_source(input_ids)
        packed = position_ids is not None and decoder_position_ids is not None
        if not packed:  # at most one of them is given: the decoder's positions
            decoder_position_ids = position_ids if decoder_position_ids is None else decoder_position_ids
            position_ids = None
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                position_ids=position_ids, return_dict=True, **kwargs,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            position_ids=decoder_position_ids,
            encoder_position_ids=position_ids,
            return_dict=True,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **{CACHE_NAME: getattr(decoder_outputs, CACHE_NAME)},
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


class VaswaniForConditionalGeneration(VaswaniPreTrainedModel, GenerationMixin):
    """Figure 1 whole: the encoder-decoder plus the output "Linear + Softmax", for translation and `generate()`."""

    def __init__(self, config: VaswaniConfig):
        super().__init__(config)
        self.model = VaswaniModel(config)
        self.lm_head = nn.Linear(config.d_model, config.target_vocab_size, bias=False)
        # A buffer, as in Marian: it is saved and loaded with the weights, but not trained.
        self.final_logits_bias = (
            nn.Buffer(torch.zeros(1, config.target_vocab_size)) if config.final_logits_bias else None
        )
        # §3.4: the pre-softmax projection shares the decoder's embedding matrix; with shared embeddings that is the
        # encoder's, the copy stored in checkpoints.
        side = "encoder" if config.share_embeddings else "decoder"
        self._tied_weights_keys = {"lm_head.weight": f"model.{side}.embed_tokens.weight"}
        self.post_init()

    def get_encoder(self):
        return self.model.encoder

    def get_decoder(self):
        return self.model.decoder

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor,
                                              decoder_position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id,
                                  decoder_position_ids)

    def generate(self, *args, **kwargs):
        """transformers' `generate()`, decoded by the lean loop of `generation_vaswani` wherever that returns the same
        outputs (greedy and beam search) on a CPU, by transformers' own loop otherwise; `lean_decoding=True` or
        `False` chooses the loop on any device (`generation_vaswani.generate`)."""
        return lean_generate(*args, model=self, **kwargs)

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        decoder_input_ids=None,
        decoder_attention_mask=None,
        encoder_outputs=None,
        cache: Cache | None = None,
        inputs_embeds=None,
        decoder_inputs_embeds=None,
        labels=None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        position_ids=None,
        decoder_position_ids=None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        r"""`labels` (B, T) are the target ids, not shifted: the model shifts them to make `decoder_input_ids` and
        predicts `labels` position by position. -100 marks positions to ignore. `position_ids` and
        `decoder_position_ids` restarting at each pair describe packed rows (`VaswaniModel.forward`); each target is
        then shifted within itself, and the loss counts every label once, as without packing."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        cache = cache_argument(cache, kwargs)
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                packed = position_ids is not None and decoder_position_ids is not None
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(
                    labels, decoder_position_ids if packed else None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=cache,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            position_ids=position_ids,
            decoder_position_ids=decoder_position_ids,
            return_dict=True,
            **kwargs,
        )
        logits, loss = _logits_and_loss(self, outputs.last_hidden_state, labels, logits_to_keep, num_items_in_batch)
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )


class VaswaniForCausalLM(VaswaniPreTrainedModel, GenerationMixin):
    """Decoder-only language model (the GPT family): decoder blocks without cross-attention, `decoder_layers`
    deep. `labels` are the input ids; the model shifts them so position t predicts token t+1."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _no_split_modules = ["VaswaniDecoderLayer"]

    def __init__(self, config: VaswaniConfig):
        # generate() reads is_encoder_decoder, which must be False here. Flip it on a copy: the caller's config may
        # also serve a translation model, whose generate() would otherwise stop running the encoder.
        config = copy.deepcopy(config)
        config.is_encoder_decoder = False
        super().__init__(config)
        self.model = VaswaniDecoder(config, cross_attention=False)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_decoder(self):
        return self.model

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache: Cache | None = None,
        inputs_embeds=None,
        labels=None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        # Targets already aligned with the positions. Under context/sequence parallelism the Trainer shifts `labels`
        # on the whole sequence before sharding it and passes the result here: shifting a shard again would pair its
        # positions with the wrong tokens, and leave its last one without a target.
        shift_labels = kwargs.pop("shift_labels", None)
        cache = cache_argument(cache, kwargs)
        if labels is not None or shift_labels is not None:
            # Training or scoring: a cache would only be filled to be dropped, and without one `position_ids` that
            # restart describe packed sequences (`DataCollatorWithFlattening`'s rows).
            use_cache = False
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        if shift_labels is None and labels is not None:
            # position t predicts token t+1; the last has no target
            shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        logits, loss = _logits_and_loss(
            self, outputs.last_hidden_state, shift_labels, logits_to_keep, num_items_in_batch
        )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class VaswaniEncoderModel(VaswaniPreTrainedModel):
    """Encoder-only model (the BERT family). It keeps the encoder under `encoder.`, as in the translation model,
    so the encoder of a trained translator loads into it (and into the classifier below) unchanged."""

    _no_split_modules = ["VaswaniEncoderLayer"]

    def __init__(self, config: VaswaniConfig):
        super().__init__(config)
        self.encoder = VaswaniEncoder(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs) -> BaseModelOutput:
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs)


class VaswaniForSequenceClassification(VaswaniPreTrainedModel):
    """Encoder + mean pooling over non-padding positions + a linear classifier (`config.num_labels`)."""

    _no_split_modules = ["VaswaniEncoderLayer"]

    def __init__(self, config: VaswaniConfig):
        super().__init__(config)
        self.model = VaswaniEncoderModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.dropout
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.set_input_embeddings(value)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, **kwargs):
        kwargs.pop("num_items_in_batch", None)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, return_dict=True, **kwargs
        )
        hidden_states = outputs.last_hidden_state  # (B, S, d_model)
        if attention_mask is None:
            pooled = hidden_states.mean(dim=1)
        else:
            weights = attention_mask.to(hidden_states.dtype)[..., None]
            pooled = (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


__all__ = [
    "VaswaniPreTrainedModel",
    "VaswaniModel",
    "VaswaniForConditionalGeneration",
    "VaswaniForCausalLM",
    "VaswaniEncoderModel",
    "VaswaniForSequenceClassification",
]
