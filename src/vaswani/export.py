"""Export a Vaswani translation model to CTranslate2, the C++ inference engine people deploy seq2seq models with on
CPUs (`pip install "vaswani[ct2]"` or `ctranslate2`; not a dependency of the model itself).

    export_to_ctranslate2("path/or/repo", "model-ct2", quantization="int8")   # or scripts/export_ctranslate2.py
    engine = vaswani.loading.load_engine("model-ct2", compute_type="int8")    # as for a checkpoint
    vaswani.translation.translate(engine, ["I'm calm."]).texts

CTranslate2's own `TransformerSpec` describes the architecture: encoder and decoder layers of self-attention,
cross-attention and FFN, post- or pre-norm, shared embeddings scaled by √d_model. What CTranslate2 does not derive
from a config, the exporter passes as weights: our interleaved sinusoid table of §3.5 (CTranslate2's built-in one
puts all sines before all cosines), or the learned position table. The result translates exactly like the PyTorch
model in fp32 (tests/test_export.py compares log-probabilities, and greedy and beam-search outputs token for token)
at CTranslate2's speed, with its int8/int16/bf16 weight formats and its batching and beam search in C++
(benchmarks/README.md).

Supported: every seq2seq variant that CTranslate2's encoder-decoder spec can express, that is post-norm and
pre-norm, LayerNorm and RMSNorm, ReLU/GELU/SiLU and the gated SwiGLU/GEGLU FFNs, sinusoidal and learned positions,
multi-head and multi-query attention, and models converted from Marian / OPUS-MT (`vaswani.convert`) with one
shared vocabulary: their sinusoid layout, output bias (`final_logits_bias`, the projection's bias), their tokenizer,
and the tokens their generation config never generates (Marian's `bad_words_ids=[[pad]]`), which get a bias of
-10⁴ so that their probability is exactly 0. Not supported (a clear error): RoPE and grouped-query attention with
more than one key/value head, which CTranslate2 offers only for decoder-only models; separate source and target
vocabularies; banned sequences of several tokens.
"""

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from .checkpoints import check_output_dir
from .configuration_vaswani import OUTPUT_SLACK, VaswaniConfig
from .decoding_settings import model_decoding
from .files import exclusive, locking, staged_directory, write_atomically
from .loading import engine_for_model, load_engine, load_translator
from .machine import cache_dir as machine_cache_dir
from .modeling_vaswani import VaswaniForConditionalGeneration, VaswaniSinusoidalPositionalEmbedding
from .translation import translate

# Our activation names → CTranslate2's, and whether the FFN is gated (two input projections).
FFN_ACTIVATIONS = {"relu": ("RELU", False), "gelu": ("GELU", False), "silu": ("SWISH", False),
                   "swiglu": ("SWISH", True), "geglu": ("GELU", True)}


@contextlib.contextmanager
def one_torch_thread():
    """torch's CPU work on the calling thread alone for the span of the block (as a decorator: of the call).

    CTranslate2 float32 decoded at about half its speed for the rest of a process that had made its export at two
    threads (benchmarks/results/README.md, "CTranslate2 in a process that used torch's threads"). What was measured:
    not when ctranslate2 is imported before torch, or when torch never ran on several threads; as slow when
    CTranslate2's OpenMP threads are made to sleep between its many small parallel steps (`OMP_WAIT_POLICY=PASSIVE`).
    So, it appears, CTranslate2 runs on torch's OpenMP runtime where torch was imported first, and torch's idle
    threads there stop CTranslate2's from spinning. An export, made once, costs little more on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@locking("output_dir")
@one_torch_thread()
def export_to_ctranslate2(model, output_dir: str, tokenizer=None, quantization: str | None = None,
                          max_positions: int | None = None, force: bool = False,
                          measure_on: Sequence[str] | None = None) -> str:
    """Write `model` (a VaswaniForConditionalGeneration, or a path or Hub id to load one from) as a CTranslate2
    model directory; return its path.

    `tokenizer` (or the one saved with the model) gives the shared vocabulary, in id order, and the special tokens.
    `quantization` is CTranslate2's weight format on disk (int8, int8_float32, int16, float16, bfloat16, float32;
    None keeps fp32); `ctranslate2.Translator(compute_type=...)` can convert again at load time. `max_positions` is
    how many positions the sinusoid table covers (default: the config's `max_position_embeddings`); CTranslate2
    cannot compute them on the fly, so longer inputs must be truncated to it. An `output_dir` that is the model's
    own directory, holds it, or is a training run's is refused, as is any other non-empty one without `force`
    (`checkpoints.check_output_dir`); the directory is replaced whole.

    The directory's README.md (its model card) says how the export decodes and what CTranslate2 cannot follow of
    the checkpoint's settings (`model_card`); with `measure_on` (source sentences), the share of them that the
    export, in float32, translates differently from the PyTorch model.
    """
    from ctranslate2.converters import Converter

    check_output_dir(output_dir, [model] if isinstance(model, (str, os.PathLike)) else [], force)
    if isinstance(model, (str, os.PathLike)):
        model, saved_tokenizer = load_translator(str(model), device="cpu", dtype="float32")
        tokenizer = tokenizer or saved_tokenizer
    if not isinstance(model, VaswaniForConditionalGeneration):
        raise ValueError(f"Expected a VaswaniForConditionalGeneration, got {type(model).__name__}.")
    if tokenizer is None:
        raise ValueError("Pass the tokenizer: CTranslate2 stores the vocabulary with the model.")

    class VaswaniConverter(Converter):
        def _load(self):
            return model_spec(model, tokenizer, max_positions)

    with staged_directory(output_dir, f"-{os.getpid()}") as staging:
        VaswaniConverter().convert(str(staging), quantization=quantization, force=True)  # (into the empty staging)
        tokenizer.save_pretrained(staging)  # the directory is then all a deployment needs (`loading.load_engine`),
        model.generation_config.save_pretrained(staging)  # with the decoding settings the model was evaluated with
        differing = None if measure_on is None else count_differences(model, tokenizer, str(staging), measure_on)
        (staging / "README.md").write_text(model_card(model, differing, len(measure_on or ())), encoding="utf-8")
    return str(output_dir)


# What an export is made from: when any of these files of the checkpoint changes, its cached export is made again.
EXPORT_SOURCES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "model.safetensors", "model.safetensors.index.json")
CACHE_KEY_FILE = "vaswani_export_source.json"


def export_source(model_dir: str) -> dict:
    """What identifies the checkpoint in `model_dir` for its cached export: its real path, and the size and
    modification time of each file an export is made from (`EXPORT_SOURCES`, the weights' shards too)."""
    names = [name for name in sorted(os.listdir(model_dir))
             if name in EXPORT_SOURCES or (name.startswith("model-") and name.endswith(".safetensors"))]
    files = {}
    for name in names:
        status = os.stat(os.path.join(model_dir, name))
        files[name] = [status.st_size, status.st_mtime_ns]
    return {"checkpoint": os.path.realpath(model_dir), "files": files}


def export_path(model_dir: str, cache_dir: str | None = None) -> str:
    """Where `cached_export` keeps the export of the checkpoint in `model_dir`: in `cache_dir` (default:
    `vaswani.machine.cache_dir("ctranslate2")`), under a name made from the checkpoint's real path."""
    name = hashlib.sha256(os.path.realpath(model_dir).encode()).hexdigest()[:16]
    return os.path.join(cache_dir or machine_cache_dir("ctranslate2"), name)


def cached_export(model_dir: str, cache_dir: str | None = None) -> tuple[str, bool]:
    """The float32 CTranslate2 export of the checkpoint directory `model_dir`, kept in `cache_dir` (`export_path`);
    made on first use, and made again when the checkpoint's files have changed since (`export_source`: the weights'
    and configs' sizes and modification times, recorded in the export as `CACHE_KEY_FILE`). Returns its path and
    whether it was made now. Processes asking at once wait for the one that exports (`files.exclusive`), then reuse
    its export."""
    source = export_source(model_dir)
    output_dir = export_path(model_dir, cache_dir)
    key_file = os.path.join(output_dir, CACHE_KEY_FILE)
    with exclusive(output_dir, wait=True):
        try:
            with open(key_file, encoding="utf-8") as file:
                if json.load(file) == source:
                    return output_dir, False
        except (OSError, ValueError):  # not made yet, or made by a run that stopped before recording its source
            pass
        export_to_ctranslate2(model_dir, output_dir, force=True)
        write_atomically(key_file, json.dumps(source, indent=1))
    return output_dir, True


def count_differences(model, tokenizer, export_dir: str, sources: Sequence[str]) -> int:
    """How many of `sources` the CTranslate2 model in `export_dir`, computing in float32, translates otherwise than
    `model` does, each with the checkpoint's own decoding settings."""
    pytorch = translate(engine_for_model(model, tokenizer, slots=0), sources, warn=False).texts
    exported = translate(load_engine(export_dir, device="cpu", compute_type="float32"), sources, warn=False).texts
    return sum(a != b for a, b in zip(pytorch, exported))


def model_card(model, differing: int | None, measured: int) -> str:
    """The export's README.md: how `vaswani.loading.load_engine` decodes with it (the checkpoint's settings, told to
    CTranslate2 as transformers applies them) and the one rule of those settings CTranslate2 cannot follow, with its
    measured share (`differing` of `measured` sentences) where one was measured."""
    decoding = model_decoding(model)
    lines = ["# A Vaswani translation model for CTranslate2", "",
             "Exported by `vaswani.export` with the tokenizer and `generation_config.json` of its checkpoint. "
             "`vaswani.loading.load_engine(this_directory)` translates with it as the PyTorch checkpoint does.", "",
             "## Decoding", "",
             f"The checkpoint's settings: {decoding.num_beams} beam(s), length penalty {decoding.length_penalty}, "
             f"early_stopping={decoding.early_stopping}; each output at most "
             + (f"{decoding.max_new_tokens} tokens" if decoding.max_new_tokens is not None else
                f"its source's length plus {OUTPUT_SLACK} tokens")
             + f", within the {decoding.longest_output + 1} exported positions, which also cut a source.", "",
             "What `load_engine` tells `Translator.translate_batch`: `length_penalty` with `return_end_token=True` "
             "(transformers counts the end of sentence in the length it divides by; CTranslate2 only when it returns "
             "it; a penalty of 0 is told as 1e-12, which divides no score, because at exactly 0 CTranslate2 ends a "
             "sentence at its best beam's end instead of once as many hypotheses as beams have ended), "
             "`max_decoding_length`, each sentence's own (one per call: the batch's longest, then, at its own, each "
             "sentence whose beam search reached a shorter limit of its own), "
             "`max_input_length`, `patience=1`, `min_decoding_length` from `min_new_tokens`.", ""]
    if decoding.num_beams > 1 and decoding.early_stopping is not True:
        lines += ["## What CTranslate2 cannot follow", "",
                  "CTranslate2 ends a sentence's beam search once as many hypotheses as beams have finished, which "
                  "is transformers' `early_stopping=True`. This checkpoint decodes with "
                  f"`early_stopping={decoding.early_stopping}`, under which transformers goes on while a live beam "
                  "could still beat a finished one, so some sentences get another translation here.",
                  ""]
        if measured:
            lines.append(f"Measured at export, in float32: {differing} of {measured} sentences "
                         f"({100 * differing / measured:.1f}%) translate differently.")
        else:
            lines.append("Not measured for this export: `export_to_ctranslate2(..., measure_on=sentences)` "
                         "(`scripts/export_ctranslate2.py --measure_on FILE`) measures it.")
    else:
        lines += ["Every setting is one CTranslate2 follows: in float32 its translations are the PyTorch model's, "
                  "but for the last bit of a kernel's sum (tests/test_decoding_contract.py)."]
    return "\n".join(lines) + "\n"


def model_spec(model: VaswaniForConditionalGeneration, tokenizer, max_positions: int | None = None):
    """The `ctranslate2.specs.TransformerSpec` of `model`, weights and vocabulary filled in."""
    from ctranslate2.specs import common_spec, transformer_spec

    config: VaswaniConfig = model.config
    check_exportable(config)
    activation, gated = FFN_ACTIVATIONS[config.ffn_activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (config.encoder_layers, config.decoder_layers),
        config.num_attention_heads,
        pre_norm=config.norm_first,
        activation=getattr(common_spec.Activation, activation),
        ffn_glu=gated,
        rms_norm=config.norm_type == "rmsnorm",
        multi_query_attention=config.num_key_value_heads == 1 < config.num_attention_heads,
    )
    spec.config.layer_norm_epsilon = config.layer_norm_eps
    max_positions = max_positions or config.max_position_embeddings
    spec.config.add_attribute("max_positions", max_positions)  # read back by loading.load_ctranslate2
    base = model.model
    for stack_spec, stack in ((spec.encoder, base.encoder), (spec.decoder, base.decoder)):
        set_stack(stack_spec, stack, position_table(stack, max_positions), config)
    for layer_spec, layer in zip(spec.encoder.layer, base.encoder.layers):
        set_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_layer_norm, fused_qkv=True)
        set_ffn(layer_spec.ffn, layer.mlp, layer.final_layer_norm)
    for layer_spec, layer in zip(spec.decoder.layer, base.decoder.layers):
        set_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_layer_norm, fused_qkv=True)
        set_attention(layer_spec.attention, layer.encoder_attn, layer.encoder_attn_layer_norm, fused_qkv=False)
        set_ffn(layer_spec.ffn, layer.mlp, layer.final_layer_norm)
    set_linear(spec.decoder.projection, model.lm_head)
    bias = output_bias(model)
    if bias is not None:
        spec.decoder.projection.bias = to_numpy(bias)

    tokens = tokenizer.convert_ids_to_tokens(list(range(config.vocab_size)))
    if len(tokens) != config.vocab_size or None in tokens:
        raise ValueError(f"The tokenizer has {len(tokenizer)} tokens but the model {config.vocab_size}: export the "
                         "tokenizer the model was trained with.")
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    # Sources are passed as the tokenizer makes them (with </s>); decoding starts from decoder_start_token_id.
    # A Marian model has no bos token; CTranslate2 needs one, but starts decoding from decoder_start_token.
    bos_token_id = config.bos_token_id if config.bos_token_id is not None else config.decoder_start_token_id
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = (
        tokens[bos_token_id], tokens[config.eos_token_id], tokenizer.unk_token)
    spec.config.decoder_start_token = tokens[config.decoder_start_token_id]
    return spec


def check_exportable(config: VaswaniConfig) -> None:
    if config.position_embedding_type == "rope":
        raise ValueError("CTranslate2's encoder-decoder models have no rotary positions; export a model with "
                         "position_embedding_type='sinusoidal' or 'learned'.")
    if config.num_key_value_heads not in (1, config.num_attention_heads):
        raise ValueError(f"CTranslate2's encoder-decoder models support multi-head or multi-query attention, not "
                         f"{config.num_key_value_heads} key/value heads for {config.num_attention_heads} query heads.")
    if not config.share_embeddings or not config.tie_word_embeddings:
        raise ValueError("The exporter writes one shared vocabulary; export a model with share_embeddings=True and "
                         "tie_word_embeddings=True.")


def output_bias(model) -> torch.Tensor | None:
    """The projection's bias: `final_logits_bias`, and -10⁴ on every token that the generation config bans
    (`bad_words_ids` of one token each), which CTranslate2 would otherwise generate. exp(-10⁴) is 0 in fp32 and
    fp16, so the other tokens' log-probabilities are unchanged."""
    bias = model.final_logits_bias
    banned = model.generation_config.bad_words_ids or []
    if any(len(sequence) != 1 for sequence in banned):
        raise ValueError(f"The generation config bans sequences of several tokens (bad_words_ids={banned}); the "
                         "exported model can only leave out single tokens.")
    if not banned:
        return bias[0] if bias is not None else None
    bias = bias[0].clone() if bias is not None else torch.zeros(model.config.target_vocab_size)
    bias[[sequence[0] for sequence in banned]] = -1e4
    return bias


def position_table(stack, length: int) -> torch.Tensor:
    """(length, d_model): the position encodings the encoder or decoder adds to its scaled token embeddings (the
    sinusoids, or its own learned table)."""
    positions = stack.embed_positions
    if isinstance(positions, VaswaniSinusoidalPositionalEmbedding):
        return positions(torch.arange(length))
    return positions.weight[:length]


def set_stack(spec, stack, positions: torch.Tensor, config: VaswaniConfig) -> None:
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    embeddings.weight = to_numpy(stack.embed_tokens.weight)
    spec.scale_embeddings = math.sqrt(config.d_model) if config.scale_embedding else False
    spec.position_encodings.encodings = to_numpy(positions)
    if stack.layer_norm is not None:  # pre-norm stacks end with a norm
        set_norm(spec.layer_norm, stack.layer_norm)


def set_attention(spec, attention, norm, fused_qkv: bool) -> None:
    """CTranslate2 fuses the projections: self-attention's q, k, v into one matrix; cross-attention's k, v."""
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    groups = [projections] if fused_qkv else [projections[:1], projections[1:]]
    for linear_spec, group in zip(spec.linear, groups):
        linear_spec.weight = to_numpy(torch.cat([p.weight for p in group]))
        if group[0].bias is not None:
            linear_spec.bias = to_numpy(torch.cat([p.bias for p in group]))
    set_linear(spec.linear[-1], attention.o_proj)
    set_norm(spec.layer_norm, norm)


def set_ffn(spec, mlp, norm) -> None:
    if hasattr(mlp, "gate_proj"):  # CTranslate2's gated FFN: linear_1(act(linear_0(x)) * linear_0_noact(x))
        set_linear(spec.linear_0, mlp.gate_proj)
        set_linear(spec.linear_0_noact, mlp.up_proj)
        set_linear(spec.linear_1, mlp.down_proj)
    else:
        set_linear(spec.linear_0, mlp.fc1)
        set_linear(spec.linear_1, mlp.fc2)
    set_norm(spec.layer_norm, norm)


def set_linear(spec, linear) -> None:
    spec.weight = to_numpy(linear.weight)
    if linear.bias is not None:
        spec.bias = to_numpy(linear.bias)


def set_norm(spec, norm) -> None:
    spec.gamma = to_numpy(norm.weight)
    if hasattr(spec, "beta"):  # LayerNorm; a bias-free one (bias=False) is a zero beta
        spec.beta = to_numpy(norm.bias) if norm.bias is not None else np.zeros_like(spec.gamma)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float32).cpu().numpy()
