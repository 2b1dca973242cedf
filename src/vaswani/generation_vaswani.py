"""Greedy and beam search as transformers runs them, with less work per decoding step: the decoding loop of every
`VaswaniForConditionalGeneration.generate()` call that it covers.

    model.generate(**batch, num_beams=4)                         # on a CPU, this loop where it gives transformers'
                                                                 #   outputs; on other devices transformers' loop
    model.generate(**batch, num_beams=4, lean_decoding=True)     # this loop on any device
    model.generate(**batch, num_beams=4, lean_decoding=False)    # transformers' own loop
    model.generate(**batch, num_beams=4, cuda_graphs=True)       # on a GPU: steps replayed as CUDA graphs

This file imports only torch and transformers, so that it can ship on its own: with every checkpoint, next to
modeling_vaswani.py, whose `generate()` calls `generate` below; and with every translation checkpoint as
`custom_generate/generate.py`, transformers' own place for a repository's generation code, which
`from_pretrained(..., trust_remote_code=True)` loads in place of the model's `generate()`
(`GenerationMixin.load_custom_generate`), so that Hub users without this package decode with it too.

`decode` plugs into `generate()` through its own extension point (`custom_generate`, a decoding method): generate()
still validates the arguments, runs the encoder, expands the batch for the beams, makes the cache and builds the
logits processors and stopping criteria; `decode` replaces only the loop over decoding steps. The outputs are
transformers' own: the same tokens for greedy search, and the same hypotheses for beam search, whose bookkeeping
(finished hypotheses, length penalty, early stopping) is transformers' helper methods, called as they are, through
`_Upstream`, the one place that reaches transformers' private generation methods (tests/test_decoding.py compares
both with transformers' loop; benchmarks/results/decoding-loops-cpu-main-job-model.md counts identical translations on
a trained model). One caveat: one source row per sentence and finished sentences
leaving the batch (4 and 5 below) change the shapes of the matrix products, which may change the last bit of a
result. int8 (`vaswani.inference.quantize_for_cpu`) adds nothing to that: each activation
row has its own scale and integer products add up exactly, so a row's numbers do not depend on the rows beside it or
on which of them have left the batch.
What changes is the work around the model, which on a CPU is a large share of each step once the matrix
multiplications are int8 (benchmarks/README.md):

1. Each step calls the model with the source encoding and the cache directly, without generate()'s per-step
   re-preparation of its keyword arguments.
2. Greedy search takes the argmax of the raw logits (transformers first copies them to a new float32 tensor)
   with `_top_k`, a two-level search over blocks of the vocabulary that returns the same token as `torch.argmax`.
3. Beam search ranks tokens within each beam before it ranks beams. The best 2·beams continuations of a sentence
   are among the best 2·beams tokens of each of its beams, so `_top_k` picks those from each beam's
   log-probabilities, and only beams × 2·beams candidates get the beam's running score added and compete;
   transformers adds the running score to every beam × vocabulary entry and ranks all of them (4 × 32,000 per
   sentence here).
4. Beam search keeps one copy of each source encoding, not one per beam (generate() repeats it): the model's
   cross-attention then attends with all of a sentence's beams at once (`VaswaniAttention`), and the
   cross-attention keys/values are projected and cached once per sentence instead of once per beam.
5. Finished sentences leave the batch. transformers decodes every row until the whole batch stops; here a greedy
   row leaves once it has stopped (it gets padding from then on, as in transformers), and a beam-search sentence
   leaves once transformers' own early-stopping test says no later step can change its finished hypotheses (that
   test never turns back; benchmarks/README.md counts the sentence-steps this saves on a test set). Not done when
   logits processors are given: some of them (`prefix_allowed_tokens_fn`) address rows by their batch index.
6. With `cuda_graphs=True` (a generate() argument, opt-in), on a GPU each decoding step is recorded once as a CUDA
   graph and replayed from then on: one launch per step instead of hundreds of kernel launches from Python, which
   at batch 256 take several times longer than the kernels themselves (benchmarks/results/gpu-notes.md). A graph
   replays fixed work on fixed memory, so these steps have static shapes: the self-attention cache is
   pre-allocated for max_length positions (transformers' `StaticCache`), the source is padded with masked
   positions to a power of two of at least 32 tokens, and every row stays in the batch until the whole batch has
   stopped, as in transformers (unlike 5). Everything a step reads or writes lives in buffers kept per
   batch shape (`_StaticDecoding`), so later batches of the same shape replay the first one's graphs; the search's
   state stays on the device, and the host reads one flag per step, whether to go on. A batch's first step, which
   projects the source for cross-attention, runs as usual. Not with logits processors or stopping criteria other
   than max_length and eos_token_id (they may read values on the host); those calls decode as 1–5 describe. On
   other devices the same static steps run without graphs, which is how the CPU tests check them.
   Measured on a GPU by `benchmarks/gpu_session.sh translation-trained` (engine `vaswani-graphs`,
   benchmarks/results/translation-trained-cuda-h200.md).

7. `decode_in_slots` (not a generate() call: it takes a list of sources, of any length, and is what
   `vaswani.translation.TorchEngine(slots=...)` runs) keeps a fixed number of slots, each one sentence × its beams,
   busy with live rows: when a slot's sentence finishes, the next source takes its slot (the newcomers' encoder runs
   batched together), instead of the batch waiting for its longest sentence as in 6. The self-attention cache is
   pre-allocated for max_length positions, and each slot writes and attends at its own position (a per-row mask);
   the cross-attention keys/values and the source mask are kept per slot. Beam search's bookkeeping is `_advance`'s,
   with each sentence's own length (`_PerSentence`): transformers' helpers keep the hypotheses, and its length
   penalty is applied by the same float32 division. Each output is what generate() returns for that sentence alone
   with its own max_new_tokens (tests/test_decoding_static.py; the caveat of 4 and 5 holds: neighbours change the shapes
   of the matrix products). Finished slots are found on the device; the host reads which ones once every
   `SYNC_EVERY` steps, in one transfer with their outputs, and nothing else during the steps. On a GPU the step is
   replayed as a CUDA graph, recorded once per slot count: once no source is left to start, the slots are halved
   as their sentences finish, so a few graphs serve the tail. On a CPU the same loop runs without graphs, attending
   over the positions written so far; there it measured slower than the loop of 1–5 on the main job's model
   (`benchmarks/bench_translation.py --engines vaswani,vaswani-slots` compares them), which stays the CPU's default.

Anything else (sampling, `return_dict_in_generate`, a decoder-only or non-Vaswani model, a pre-filled or static
cache, an assistant model, a streamer, synced GPUs, the decoding methods that transformers moved to the Hub) goes
to transformers' own `generate()` unchanged.
"""

import copy
import functools
import inspect
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache, StaticCache, StaticLayer
from transformers.generation import GenerationConfig, GenerationMixin
from transformers.generation.utils import GENERATION_MODES_MAPPING
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.integrations.fsdp import is_fsdp_managed_module
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput


# The decoding cache's name in generate()'s model_kwargs: `cache` since transformers 5.24, `past_key_values` before
# (modeling_vaswani.CACHE_NAME; this file imports nothing of the package, so that it can ship on its own).
CACHE_NAME = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"


# transformers' private generation methods, in one place ---------------------------------------------------------------
#
# `custom_generate` hands a decoding method what generate() prepared, but beam search's bookkeeping, the preparation of
# a generation config outside generate(), its special-token tensors and transformers' own loops have no public API. The
# loops below reach them only through `_Upstream`, which calls each by keyword (a reordered signature cannot swap two
# arguments unnoticed). UPSTREAM_CONTRACT lists each method called with the parameters passed, UPSTREAM_OVERRIDES the
# cache-layer methods that `_SlotLayer` overrides with the signature transformers calls them with, and
# `check_upstream_contract` names any that an installed release has changed (tests/test_generation_internals.py runs
# it), so that an upgrade fails there, by name, instead of deep inside a decoding step.

# (owner, name) → the parameters passed to it (besides self), "**" where other keywords are passed too.
UPSTREAM_CONTRACT = {
    (GenerationMixin, "_prepare_generation_config"): ("generation_config", "**"),
    (GenerationMixin, "_prepare_special_tokens"): ("generation_config", "kwargs_has_attention_mask", "device"),
    (GenerationMixin, "_get_logits_processor"): ("generation_config", "input_ids_seq_length", "encoder_input_ids",
                                                 "device"),
    (GenerationMixin, "_get_stopping_criteria"): ("generation_config", "stopping_criteria"),
    (GenerationMixin, "_sample"): ("input_ids", "logits_processor", "stopping_criteria", "generation_config", "**"),
    (GenerationMixin, "_beam_search"): ("input_ids", "logits_processor", "stopping_criteria", "generation_config",
                                        "**"),
    (GenerationMixin, "_gather_beams"): ("tensor", "beam_indices"),
    (GenerationMixin, "_get_running_beams_for_next_iteration"): (
        "topk_log_probs", "topk_running_sequences", "topk_running_beam_indices", "next_token_hits_stopping_criteria",
        "num_beams"),
    (GenerationMixin, "_update_finished_beams"): (
        "sequences", "topk_running_sequences", "beam_scores", "topk_log_probs", "beam_indices",
        "topk_running_beam_indices", "is_early_stop_heuristic_unsatisfied", "is_sent_finished",
        "next_token_hits_stopping_criteria", "top_num_beam_mask", "num_beams", "cur_len", "decoder_prompt_len",
        "length_penalty", "early_stopping"),
    (GenerationMixin, "_check_early_stop_heuristic"): (
        "is_early_stop_heuristic_unsatisfied", "running_beam_scores", "beam_scores", "is_sent_finished", "cur_len",
        "max_length", "decoder_prompt_len", "early_stopping", "length_penalty"),
    (GenerationMixin, "_beam_search_has_unfinished_sequences"): (
        "is_early_stop_heuristic_unsatisfied", "is_sent_finished", "next_token_hits_stopping_criteria",
        "early_stopping"),
    (DynamicLayer, "__init__"): (),  # `_SlotLayer` allocates its own buffers
}

# (owner, name) → its parameters, which an override must take ("*args", "**kwargs" for the variable ones).
UPSTREAM_OVERRIDES = {
    (DynamicLayer, "update"): ("self", "key_states", "value_states", "*args", "**kwargs"),
    (DynamicLayer, "get_mask_sizes"): ("self", "query_length"),
    (DynamicLayer, "get_seq_length"): ("self",),
    (DynamicLayer, "get_max_length"): ("self",),
    (DynamicLayer, "lazy_initialization"): ("self", "key_states", "value_states"),
}

# The tensors `_prepare_special_tokens` leaves on a generation config, which the loops read.
UPSTREAM_SPECIAL_TOKENS = ("_decoder_start_token_tensor", "_eos_token_tensor", "_pad_token_tensor")


def _signature_names(function) -> tuple[str, ...]:
    """A function's parameter names as written, the variable ones with their stars: ("self", "x", "*args", ...)."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(stars.get(p.kind, "") + name for name, p in inspect.signature(function).parameters.items())


def check_upstream_contract(contract: dict = UPSTREAM_CONTRACT, overrides: dict = UPSTREAM_OVERRIDES,
                            special_tokens: tuple = UPSTREAM_SPECIAL_TOKENS) -> list[str]:
    """What an installed transformers no longer offers, one line per change (empty where all holds): a method that
    is gone; of `contract`'s, a parameter passed that it no longer takes or one it now requires that is not passed;
    of `overrides`', another signature; a special-token tensor that `_prepare_special_tokens` no longer sets."""
    problems = []
    for (owner, name), expected in [*contract.items(), *overrides.items()]:
        where = f"{owner.__module__}.{owner.__name__}.{name}"
        member = inspect.getattr_static(owner, name, None)
        if member is None:
            problems.append(f"{where} no longer exists")
            continue
        if not callable(getattr(owner, name)):
            problems.append(f"{where} is no longer a method")
            continue
        if (owner, name) in overrides:
            if _signature_names(getattr(owner, name)) != expected:
                problems.append(f"{where} now takes {_signature_names(getattr(owner, name))}, not {expected}")
            continue
        parameters = dict(inspect.signature(getattr(owner, name)).parameters)
        if not isinstance(member, (staticmethod, classmethod)):
            parameters.pop(next(iter(parameters), None), None)  # self
        variable = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        named = {name for name, parameter in parameters.items() if parameter.kind not in variable}
        for gone in [name for name in expected if name != "**" and name not in named]:
            problems.append(f"{where} no longer takes {gone!r}")
        if "**" in expected and inspect.Parameter.VAR_KEYWORD not in {p.kind for p in parameters.values()}:
            problems.append(f"{where} no longer takes other keyword arguments")
        for required in [name for name in named - set(expected) if parameters[name].default is inspect.Parameter.empty]:
            problems.append(f"{where} now requires {required!r}, which is not passed")
    if special_tokens:
        # `_prepare_special_tokens` reads only the model's config and device.
        stand_in = type("StandIn", (), {"config": GenerationConfig(), "device": torch.device("cpu")})()
        stand_in.config.is_encoder_decoder = True
        generation_config = GenerationConfig(decoder_start_token_id=1, eos_token_id=2, pad_token_id=0)
        try:
            GenerationMixin._prepare_special_tokens(stand_in, generation_config, True, device="cpu")
        except Exception as error:  # noqa: BLE001 - reported, with what it was
            problems.append(f"GenerationMixin._prepare_special_tokens failed on a plain generation config: {error!r}")
        else:
            for name in special_tokens:
                if not isinstance(getattr(generation_config, name, None), torch.Tensor):
                    problems.append(f"GenerationMixin._prepare_special_tokens no longer sets GenerationConfig.{name}")
    return problems


class _SpecialTokens(NamedTuple):
    """A prepared generation config's special tokens, as tensors on the model's device (eos: 1-D, or None)."""

    decoder_start: torch.Tensor
    eos: torch.Tensor | None
    pad: torch.Tensor | None


class _Upstream:
    """Every call of transformers' private generation methods, and every read of what they leave (see
    UPSTREAM_CONTRACT above). The loops call these, never the private names."""

    @staticmethod
    def generation_config(model, generation_config=None, **options):
        """The generation config that generate() decodes with: a copy of `generation_config` (or the model's), with
        `options` (generate()'s keyword arguments that are generation settings) over it."""
        prepared, _ = model._prepare_generation_config(generation_config=generation_config, **options)
        return prepared

    @staticmethod
    def prepare_special_tokens(model, generation_config, device) -> None:
        """Put the special tokens on `generation_config` as tensors on `device`, as generate() does before decoding."""
        model._prepare_special_tokens(generation_config=generation_config, kwargs_has_attention_mask=True,
                                      device=device)

    @staticmethod
    def special_tokens(generation_config) -> _SpecialTokens:
        """The special tokens of a prepared generation config (one that generate() hands a decoding method, or one
        given to `prepare_special_tokens`)."""
        return _SpecialTokens(generation_config._decoder_start_token_tensor, generation_config._eos_token_tensor,
                              generation_config._pad_token_tensor)

    @staticmethod
    def processors_and_criteria(model, generation_config, device):
        """The logits processors and stopping criteria that generate() builds from `generation_config` alone (a
        prepared one), for a one-token source."""
        source = torch.zeros(1, 1, dtype=torch.long, device=device)
        processors = model._get_logits_processor(generation_config=generation_config, input_ids_seq_length=1,
                                                 encoder_input_ids=source, device=device)
        criteria = model._get_stopping_criteria(generation_config=generation_config,
                                                stopping_criteria=StoppingCriteriaList())
        return processors, criteria

    @staticmethod
    def own_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        """transformers' own loop for the generation mode, taken from its own table as generate() takes it; of
        those, only its sampling and beam-search loops run on what generate() hands a decoding method (assisted
        decoding needs its assistant, the rest are Hub repositories)."""
        mode = generation_config.get_generation_mode()
        name = GENERATION_MODES_MAPPING.get(mode)
        if name not in ("_sample", "_beam_search"):
            raise ValueError(f"decode runs greedy search, sampling and beam search, not {mode.value}; call "
                             "generate() without it.")
        method = getattr(type(model), name)  # as generate() picks it
        return method(model, input_ids=input_ids, logits_processor=logits_processor,
                      stopping_criteria=stopping_criteria, generation_config=generation_config, **model_kwargs)

    @staticmethod
    def gather_beams(model, tensor, beam_indices):
        return model._gather_beams(tensor=tensor, beam_indices=beam_indices)

    @staticmethod
    def running_beams_for_next_iteration(model, **arguments):
        return model._get_running_beams_for_next_iteration(**arguments)

    @staticmethod
    def update_finished_beams(model, **arguments):
        return model._update_finished_beams(**arguments)

    @staticmethod
    def check_early_stop_heuristic(model, **arguments):
        return model._check_early_stop_heuristic(**arguments)

    @staticmethod
    def has_unfinished_sentences(model, improvable, is_sent_finished, hits_stop, early_stopping):
        """transformers' test of whether beam search goes on."""
        return model._beam_search_has_unfinished_sequences(
            is_early_stop_heuristic_unsatisfied=improvable, is_sent_finished=is_sent_finished,
            next_token_hits_stopping_criteria=hits_stop, early_stopping=early_stopping)


def _block_size(vocab_size: int, k: int) -> int | None:
    """The largest power-of-two block (8 … 128 entries) that tiles the vocabulary into at least k blocks."""
    for block in (128, 64, 32, 16, 8):
        if vocab_size % block == 0 and vocab_size // block >= k:
            return block
    return None


def _top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores.topk(k, dim=-1)` over rows of vocabulary size, in two levels: the k best entries of a row lie in the
    k blocks with the highest maxima (a block holding one of them has a maximum at least as high as the k-th best,
    and at most k blocks do), so only those k blocks are searched, which on a CPU is faster than `topk` and than
    `argmax` over vocabulary-sized rows (benchmarks/README.md, "Changes toward the CPU targets"). It matches `argmax`
    exactly for k = 1 (the first maximal block, then the first maximum in it). For k > 1, equal scores may be ordered
    differently."""
    rows, vocab_size = scores.shape
    block = _block_size(vocab_size, k)
    if block is None:
        return scores.topk(k, dim=-1)
    blocks = scores.view(rows, vocab_size // block, block)  # (rows, blocks, block)
    if k == 1:
        best_block = blocks.amax(dim=-1).argmax(dim=-1, keepdim=True)  # (rows, 1)
    else:
        best_block = blocks.amax(dim=-1).topk(k, dim=-1).indices  # (rows, k)
    candidates = blocks.gather(1, best_block[..., None].expand(-1, -1, block)).flatten(1)  # (rows, k·block)
    values, position = candidates.topk(k, dim=-1) if k > 1 else candidates.max(dim=-1, keepdim=True)
    return values, best_block.gather(1, position // block) * block + position % block


def _lean_mode(model, generation_config, model_kwargs, static: bool = False) -> GenerationMode | None:
    """The mode when `decode` covers this call (greedy or beam search); None sends it to transformers' own method.
    The `static` steps (CUDA graphs, 6 in the module docstring) make their own cache, so generate()'s may be a static
    one too, if still empty."""
    mode = generation_config.get_generation_mode()
    cache = model_kwargs.get(CACHE_NAME)
    layer_types = (DynamicLayer, StaticLayer) if static else (DynamicLayer,)
    covered = (
        mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.BEAM_SEARCH)
        and model.config.model_type == "vaswani"  # its cross-attention takes one source row per sentence
        and model.config.is_encoder_decoder
        and not generation_config.return_dict_in_generate
        and model_kwargs.get("encoder_outputs") is not None
        and model_kwargs.get("decoder_attention_mask") is None
        and model_kwargs.get("use_cache", True)
        and isinstance(cache, EncoderDecoderCache)
        and cache.get_seq_length() == 0
        and all(type(layer) in layer_types for layer in cache.self_attention_cache.layers)
    )
    return mode if covered else None


def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, cuda_graphs: bool = False,
           **model_kwargs):
    """A `custom_generate` decoding method for `generate()`: greedy or beam search (see the module docstring).
    `cuda_graphs=True` (a `generate()` argument) decodes with static shapes and replays each step as a CUDA graph
    (6 in the module docstring)."""
    static = cuda_graphs and _static_covers(logits_processor, stopping_criteria)
    mode = _lean_mode(model, generation_config, model_kwargs, static)
    if mode is None:
        return _Upstream.own_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  **model_kwargs)
    cache = model_kwargs[CACHE_NAME]
    encoder_outputs, attention_mask = model_kwargs["encoder_outputs"], model_kwargs.get("attention_mask")
    if mode == GenerationMode.BEAM_SEARCH:  # one source row per sentence (4 in the module docstring)
        beams = generation_config.num_beams
        encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs.last_hidden_state[::beams])
        attention_mask = attention_mask[::beams] if attention_mask is not None else None
    if static:
        decode_static = _greedy_static if mode == GenerationMode.GREEDY_SEARCH else _beam_static
        return decode_static(model, input_ids, encoder_outputs.last_hidden_state, attention_mask, stopping_criteria,
                             generation_config)
    state = (encoder_outputs, attention_mask, cache)
    if mode == GenerationMode.GREEDY_SEARCH:
        return _greedy(model, input_ids, state, logits_processor, stopping_criteria, generation_config)
    return _beam(model, input_ids, state, logits_processor, stopping_criteria, generation_config)


def _next_token_logits(model, decoder_input_ids, encoder_outputs, attention_mask, cache) -> torch.Tensor:
    """One decoding step: the logits of the next token after `decoder_input_ids` (B, new) given the cache."""
    outputs = model(
        decoder_input_ids=decoder_input_ids,
        encoder_outputs=encoder_outputs,
        attention_mask=attention_mask,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return outputs.logits[:, -1]  # (B, vocab)


def _stops_at_eos(stopping_criteria) -> bool:
    """Whether a sequence can stop before max_length, so that stopped rows must be padded (transformers' rule)."""
    return any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)


def _greedy(model, input_ids, state, logits_processor, stopping_criteria, generation_config) -> torch.Tensor:
    """transformers' `_sample` without sampling: the argmax token, padding after a sequence has stopped; stopped
    sequences leave the batch (5 in the module docstring)."""
    pad_token_id = _Upstream.special_tokens(generation_config).pad
    stops_at_eos = _stops_at_eos(stopping_criteria)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    live = torch.arange(input_ids.shape[0], device=input_ids.device)  # the rows still decoded
    new_tokens = input_ids  # the first step reads the whole decoder prompt, later steps the last token
    while True:
        logits = _next_token_logits(model, new_tokens, *state)
        if logits_processor:
            next_tokens = logits_processor(input_ids, logits.float()).argmax(dim=-1)
        else:
            next_tokens = _top_k(logits, 1)[1].squeeze(1)
        if stops_at_eos:  # stopped rows get padding (those that left the batch, and those that just stopped)
            tokens = pad_token_id.expand(input_ids.shape[0]).clone()
            tokens[live] = next_tokens * unfinished[live] + pad_token_id * (1 - unfinished[live])
            next_tokens = tokens
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~stopping_criteria(input_ids, None)
        if unfinished.max() == 0:
            return input_ids
        if stops_at_eos and not logits_processor:
            stopped = unfinished[live] == 0
            if stopped.any():
                keep = (~stopped).nonzero().squeeze(1)
                live = live[keep]
                state = _keep_rows(state, keep, keep)
        new_tokens = input_ids[live, -1:]


class _Beams(NamedTuple):
    """transformers' beam-search state, per sentence: B sentences × N beams, sequences of up to max_length tokens."""

    running_sequences: torch.Tensor  # (B, N, max_length) the live beams
    running_scores: torch.Tensor  # (B, N) their summed log-probabilities
    running_beam_indices: torch.Tensor  # (B, N, max_length - prompt) the row each step continued
    sequences: torch.Tensor  # (B, N, max_length) the finished hypotheses, best first
    beam_scores: torch.Tensor  # (B, N) their length-penalised scores
    beam_indices: torch.Tensor  # (B, N, max_length - prompt)
    is_sent_finished: torch.Tensor  # (B, N) which of the N finished slots hold a hypothesis
    improvable: torch.Tensor  # (B, 1) whether a later step can still change the finished hypotheses


class _BeamSettings(NamedTuple):
    num_beams: int
    beams_to_keep: int  # C, the candidates kept per sentence: 2N, more with several EOS tokens
    prompt_len: int
    max_length: int
    early_stopping: bool | str
    length_penalty: float


def _start_beams(input_ids, generation_config) -> tuple[_Beams, _BeamSettings]:
    """The state before the first step, as transformers' `_beam_search` sets it up."""
    _, eos_token_id, pad_token_id = _Upstream.special_tokens(generation_config)
    max_length, num_beams = generation_config.max_length, generation_config.num_beams
    rows, prompt_len = input_ids.shape
    batch_size, device = rows // num_beams, input_ids.device
    n_eos_tokens = eos_token_id.shape[0] if eos_token_id is not None else 0
    settings = _BeamSettings(num_beams, max(2, 1 + n_eos_tokens) * num_beams, prompt_len, max_length,
                             generation_config.early_stopping, generation_config.length_penalty)
    fill = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1  # transformers' filler, as written there
    running_sequences = torch.full((batch_size, num_beams, max_length), fill, dtype=torch.long, device=device)
    running_sequences[:, :, :prompt_len] = input_ids.view(batch_size, num_beams, prompt_len)
    running_scores = torch.zeros((batch_size, num_beams), device=device)
    running_scores[:, 1:] = -1e9  # the beams start identical: only the first may expand at the first step
    running_beam_indices = torch.full((batch_size, num_beams, max_length - prompt_len), -1, dtype=torch.int32,
                                      device=device)
    beams = _Beams(
        running_sequences, running_scores, running_beam_indices,
        sequences=running_sequences.clone(),
        beam_scores=torch.full((batch_size, num_beams), -1e9, device=device),
        beam_indices=running_beam_indices.clone(),
        is_sent_finished=torch.zeros((batch_size, num_beams), dtype=torch.bool, device=device),
        improvable=torch.ones((batch_size, 1), dtype=torch.bool, device=device),
    )
    return beams, settings


class _PerSentence(NamedTuple):
    """Where each sentence of a beam search stands when sentences started at different steps (the slots of
    `decode_in_slots`): `_advance` then takes one of these in place of the batch's one current length."""

    lengths: torch.Tensor  # (B,) the current length of each sentence's sequences (transformers' cur_len)
    max_lengths: torch.Tensor  # (B,) each sentence's max_length
    eos_token_id: torch.Tensor | None  # (E,) the end-of-sentence ids, or None: only max_length stops
    penalties: torch.Tensor  # (max_length + 1,) n ** length_penalty for n generated tokens, in float32


def _length_penalties(max_length: int, length_penalty: float, device) -> torch.Tensor:
    """`n ** length_penalty` for n = 0 … max_length, each computed by Python as transformers computes it (a Python
    number, which divides a float32 tensor as its float32 rounding), so that dividing by an entry of this float32
    table gives transformers' scores to the bit."""
    return torch.tensor([n ** length_penalty if n else 1.0 for n in range(max_length + 1)], dtype=torch.float32,
                        device=device)


def _advance(model, log_probs, beams: _Beams, cur_len: int | _PerSentence, stopping_criteria,
             settings: _BeamSettings):
    """One step of beam search from the (B·N, vocab) log-probabilities of the next token: the new state, which
    candidates hit a stopping criterion (B, C), and the row each new beam continues (B·N,), for the cache.

    `cur_len` is the batch's current length, or each sentence's (`_PerSentence`, for sentences that started at
    different steps; `stopping_criteria` is then unused: each sentence stops at an end of sentence or at its own
    max_length, as transformers' `EosTokenCriteria` and `MaxLengthCriteria` decide). The candidates are ranked as 3 in
    the module docstring says; the rest is transformers' helper methods."""
    num_beams, beams_to_keep, prompt_len = settings.num_beams, settings.beams_to_keep, settings.prompt_len
    batch_size = beams.running_scores.shape[0]
    rows, device = batch_size * num_beams, log_probs.device
    # The best C tokens of every beam, then the best C (beam, token) pairs of every sentence.
    token_scores, tokens = _top_k(log_probs, beams_to_keep)  # (B·N, C)
    scores = (token_scores + beams.running_scores.view(rows, 1)).view(batch_size, num_beams * beams_to_keep)
    topk_log_probs, choice = scores.topk(beams_to_keep, dim=-1)  # (B, C)
    topk_beams = choice // beams_to_keep
    topk_tokens = tokens.view(batch_size, -1).gather(1, choice)

    # What transformers' `_get_top_k_continuations` makes of its top-k over beams × vocabulary.
    topk_running_sequences = _Upstream.gather_beams(model, beams.running_sequences, topk_beams)
    topk_running_beam_indices = _Upstream.gather_beams(model, beams.running_beam_indices, topk_beams)
    batch_offset = torch.arange(batch_size, device=device).view(-1, 1) * num_beams
    per_sentence = isinstance(cur_len, _PerSentence)
    if per_sentence:
        # Each sentence writes at its own length; a sentence whose slot is idle may run past the end of the buffers,
        # where it writes (harmlessly) at the last column.
        width = topk_running_sequences.shape[-1]
        column = cur_len.lengths.clamp(max=width - 1)[:, None, None].expand(batch_size, beams_to_keep, 1)
        topk_running_sequences.scatter_(2, column, topk_tokens[..., None])
        topk_running_beam_indices.scatter_(2, (column - prompt_len).clamp(min=0),
                                           (topk_beams + batch_offset).to(topk_running_beam_indices.dtype)[..., None])
        hits_stop = (cur_len.lengths + 1 >= cur_len.max_lengths)[:, None].expand(batch_size, beams_to_keep)
        if cur_len.eos_token_id is not None:
            hits_stop = hits_stop | torch.isin(topk_tokens, cur_len.eos_token_id)
        # transformers divides by (generated length) ** length_penalty, a Python number per batch; here each sentence
        # has its own, so the division happens here (the same float32 division) and transformers' helpers are handed
        # a length of 1, whose penalty divides by exactly 1.
        generated = (cur_len.lengths + 1 - prompt_len).clamp(max=cur_len.penalties.shape[0] - 1)
        finished_log_probs = topk_log_probs / cur_len.penalties[generated][:, None]
        if settings.early_stopping == "never" and settings.length_penalty > 0.0:
            generated = (cur_len.max_lengths - prompt_len).clamp(max=cur_len.penalties.shape[0] - 1)
        hypothetical_penalty = cur_len.penalties[generated][:, None]
        penalised_len, heuristic_len = prompt_len, prompt_len + 1
    else:
        topk_running_sequences[:, :, cur_len] = topk_tokens
        topk_running_beam_indices[:, :, cur_len - prompt_len] = topk_beams + batch_offset
        hits_stop = stopping_criteria(topk_running_sequences[:, :, : cur_len + 1].flatten(0, 1), None)
        hits_stop = hits_stop.view(batch_size, beams_to_keep)
        finished_log_probs, hypothetical_penalty = topk_log_probs, None
        penalised_len, heuristic_len = cur_len, cur_len + 1

    running_sequences, running_scores, running_beam_indices = _Upstream.running_beams_for_next_iteration(
        model,
        topk_log_probs=topk_log_probs,
        topk_running_sequences=topk_running_sequences,
        topk_running_beam_indices=topk_running_beam_indices,
        next_token_hits_stopping_criteria=hits_stop,
        num_beams=num_beams,
    )
    sequences, beam_scores, beam_indices, is_sent_finished = _Upstream.update_finished_beams(
        model,
        sequences=beams.sequences,
        topk_running_sequences=topk_running_sequences,
        beam_scores=beams.beam_scores,
        topk_log_probs=finished_log_probs,
        beam_indices=beams.beam_indices,
        topk_running_beam_indices=topk_running_beam_indices,
        is_early_stop_heuristic_unsatisfied=beams.improvable,
        is_sent_finished=beams.is_sent_finished,
        next_token_hits_stopping_criteria=hits_stop,
        top_num_beam_mask=torch.arange(beams_to_keep, device=device) < num_beams,
        num_beams=num_beams,
        cur_len=penalised_len,
        decoder_prompt_len=prompt_len,
        length_penalty=settings.length_penalty,
        early_stopping=settings.early_stopping,
    )
    improvable = _Upstream.check_early_stop_heuristic(
        model,
        is_early_stop_heuristic_unsatisfied=beams.improvable,
        running_beam_scores=running_scores if hypothetical_penalty is None else running_scores / hypothetical_penalty,
        beam_scores=beam_scores,
        is_sent_finished=is_sent_finished,
        cur_len=heuristic_len,
        max_length=settings.max_length if hypothetical_penalty is None else heuristic_len,
        decoder_prompt_len=prompt_len,
        early_stopping=settings.early_stopping,
        length_penalty=settings.length_penalty,
    )
    beams = _Beams(running_sequences, running_scores, running_beam_indices, sequences, beam_scores, beam_indices,
                   is_sent_finished, improvable)
    if per_sentence:
        column = (cur_len.lengths - prompt_len).clamp(min=0, max=running_beam_indices.shape[-1] - 1)
        parent_rows = running_beam_indices.gather(2, column[:, None, None].expand(batch_size, num_beams, 1))
        return beams, hits_stop, parent_rows.flatten()
    return beams, hits_stop, running_beam_indices[..., cur_len - prompt_len].flatten()


def _beam(model, input_ids, state, logits_processor, stopping_criteria, generation_config) -> torch.Tensor:
    """transformers' `_beam_search` (deterministic, sequences only), with the candidate ranking of the module
    docstring; its helper methods keep the hypotheses. Sentences whose hypotheses can no longer change leave the
    batch (5 in the module docstring)."""
    beams, settings = _start_beams(input_ids, generation_config)
    num_beams, cur_len = settings.num_beams, settings.prompt_len
    # The results of sentences that left the batch, and the original index of each sentence still in it.
    final_sequences, final_beam_indices = beams.sequences.clone(), beams.beam_indices.clone()
    live = torch.arange(beams.sequences.shape[0], device=input_ids.device)

    new_tokens = input_ids
    while True:
        log_probs = torch.log_softmax(_next_token_logits(model, new_tokens, *state).float(), dim=-1)  # (B·N, vocab)
        if logits_processor:
            rows = log_probs.shape[0]
            log_probs = logits_processor(beams.running_sequences[:, :, :cur_len].reshape(rows, cur_len), log_probs)
        beams, hits_stop, parent_rows = _advance(model, log_probs, beams, cur_len, stopping_criteria, settings)
        model._reorder_cache(state[2], parent_rows)
        cur_len += 1
        if not _Upstream.has_unfinished_sentences(model, beams.improvable, beams.is_sent_finished, hits_stop,
                                                  settings.early_stopping):
            break
        done = ~beams.improvable[:, 0]  # no later step can change these sentences' finished hypotheses
        if done.any() and not logits_processor:
            final_sequences[live[done]], final_beam_indices[live[done]] = beams.sequences[done], beams.beam_indices[done]
            keep = (~done).nonzero().squeeze(1)
            keep_rows = (keep[:, None] * num_beams + torch.arange(num_beams, device=keep.device)).flatten()
            live = live[keep]
            beams = _Beams(*(tensor[keep] for tensor in beams))
            state = _keep_rows(state, keep, keep_rows)
        new_tokens = beams.running_sequences[:, :, cur_len - 1].reshape(-1, 1)
    final_sequences[live], final_beam_indices[live] = beams.sequences, beams.beam_indices
    return _best_hypotheses(final_sequences, final_beam_indices, settings.prompt_len, generation_config)


def _best_hypotheses(sequences, beam_indices, prompt_len: int, generation_config) -> torch.Tensor:
    """The best `num_return_sequences` hypotheses of each sentence, cut to the longest one returned."""
    count = generation_config.num_return_sequences
    sequences, beam_indices = sequences[:, :count].flatten(0, 1), beam_indices[:, :count].flatten(0, 1)
    generated = (beam_indices + 1).bool().sum(dim=1).max()
    return sequences[:, : prompt_len + generated]


def _keep_rows(state, sources, rows):
    """The decoding state of the sentences that stay in the batch: their source rows (`sources`) of the encoder
    output, its mask and the cross-attention cache, and their decoder rows (`rows`) of the self-attention cache."""
    encoder_outputs, attention_mask, cache = state
    for layer in cache.self_attention_cache.layers:
        layer.batch_select_indices(rows)
    for layer in cache.cross_attention_cache.layers:
        layer.batch_select_indices(sources)
    encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs.last_hidden_state[sources])
    return encoder_outputs, attention_mask[sources] if attention_mask is not None else None, cache


def generate(*args, model, lean_decoding: bool | None = None, cuda_graphs: bool = False, **kwargs):
    """`model.generate(*args, **kwargs)`, decoded by `decode` where it returns what transformers' loop returns
    (greedy and beam search of a Vaswani encoder-decoder, see `_decodes`), by transformers' loop otherwise.

    The entry point of `custom_generate/generate.py`: transformers calls it with `model` as a keyword
    (`functools.partial(generate, model=model)` replaces the loaded model's `generate`), and the model's own
    `generate()` does the same. `lean_decoding` chooses the loop: by default (None) the lean one for a model on
    the CPU and transformers' own on any other device, where the lean loop's per-step work (sentences leaving the
    batch, a host read for each) measured slower than the steps it saves
    (benchmarks/results/translation-trained-cuda-h200.md); True or False forces one. `cuda_graphs=True` replays the
    lean loop's steps as CUDA graphs (6 in the module docstring), whatever `lean_decoding` says; a
    `custom_generate` of the caller's own is used as given."""
    arguments = inspect.signature(GenerationMixin.generate).bind(model, *args, **kwargs).arguments
    arguments.pop("self")
    arguments.update(arguments.pop("kwargs", {}))
    if lean_decoding is None:
        lean_decoding = _lean_by_default(model)
    if (lean_decoding or cuda_graphs) and _decodes(model, arguments):
        arguments["custom_generate"] = decode
        if cuda_graphs:
            arguments["cuda_graphs"] = True
    return GenerationMixin.generate(model, **arguments)


def _lean_by_default(model) -> bool:
    """Whether `generate()` decodes with the lean loop when the call does not say: on the CPU only."""
    return model.device.type == "cpu"


def _decodes(model, arguments: dict) -> bool:
    """Whether `decode` runs this `generate()` call itself. A decoding method passed as `custom_generate` gets none
    of generate()'s assistant model, streamer, tokenizers or GPU synchronisation, so calls that have them (given,
    or `synced_gpus` as generate() would default it under DeepSpeed ZeRO-3 or FSDP) keep transformers' loop, as do
    the generation modes that `decode` does not run."""
    config = model.config
    if config.model_type != "vaswani" or not config.is_encoder_decoder:
        return False
    handed_over = ("custom_generate", "assistant_model", "streamer", "tokenizer", "assistant_tokenizer")
    if any(arguments.get(name) is not None for name in handed_over):
        return False
    synced_gpus = arguments.get("synced_gpus")
    if synced_gpus is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        synced_gpus = (distributed and torch.distributed.get_world_size() > 1
                       and (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)))
    if synced_gpus:
        return False
    # The generation config that generate() will use (a copy: the call's options over the model's defaults).
    options = {name: value for name, value in arguments.items() if name not in _GENERATE_PARAMETERS}
    generation_config = _Upstream.generation_config(model, arguments.get("generation_config"), **options)
    return generation_config.get_generation_mode() in (GenerationMode.GREEDY_SEARCH, GenerationMode.BEAM_SEARCH)


_GENERATE_PARAMETERS = set(inspect.signature(GenerationMixin.generate).parameters)


# Static shapes and CUDA graphs (6 in the module docstring) ------------------------------------------------------------

_STATIC_SHAPES_KEPT = 8  # per model: batch shapes whose buffers and graphs are kept, the least recently used dropped
_static_states: "weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict]" = weakref.WeakKeyDictionary()


def _static_covers(logits_processor, stopping_criteria) -> bool:
    """Whether a decoding step can be captured: no logits processors (some read their arguments on the host), and
    only the stopping criteria generate() makes from max_length and eos_token_id (pure tensor operations)."""
    return not logits_processor and all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria)


def _static_source_length(length: int) -> int:
    """The source length that a batch's source is padded to: the next power of two, at least 32, so that the batches
    of a corpus share a few shapes, and with them their buffers and graphs."""
    return max(32, 1 << (length - 1).bit_length())


class _StepGraphs:
    """The CUDA graph of each decoding step position (the step's Python integers, such as the current length, are
    constants in the recording), replayed by every later batch of the same shape. Elsewhere, steps run as they are."""

    def __init__(self, device: torch.device):
        self.record = device.type == "cuda"
        # position → (graph, the step it records): the step function is kept for what it refers to, such as the
        # stopping criteria's EOS ids, whose memory the graph reads
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Callable]] = {}
        self.pool = None  # the memory pool that the graphs of a shape share

    def run(self, position: int, step) -> None:
        if not self.record:
            step()
        elif position in self.graphs:
            self.graphs[position][0].replay()
        else:
            # First time at this position: run the step (which also warms up its kernels), then record it. Recording
            # does not execute anything, so the step runs exactly once either way.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                step()
            self.graphs[position] = (graph, step)


class _StaticDecoding:
    """What the decoding steps of one batch shape read and write, at addresses that stay the same from batch to
    batch, so that a step recorded as a CUDA graph can be replayed for any of them:

    * the decoder's self-attention keys/values, pre-allocated for max_length positions (transformers' StaticCache,
      written and beam-reordered in place),
    * the source's cross-attention keys/values and its mask, padded with masked positions to a fixed length,
    * the last tokens (the next step's input), and the search's own state (`search`, set by the decoding method).
    """

    def __init__(self, model, rows: int, sources: int, source_len: int, max_length: int):
        # A weak reference, as in the steps' code: these states are kept per model, which must stay collectable.
        self.model, self.source_len = weakref.proxy(model), source_len
        self.self_attention_cache = StaticCache(config=model.config, max_cache_len=max_length)
        self.cache = None  # self + cross-attention, made by the first batch's first step
        self.encoder_states = None
        device = model.device
        self.source_mask = torch.zeros(sources, 1, 1, source_len, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.graphs = _StepGraphs(device)
        self.search = None

    def start(self, input_ids, encoder_states, attention_mask) -> torch.Tensor:
        """A batch's first step, eagerly: the decoder prompt goes into the self-attention cache and the source's
        keys/values into the fixed buffers. Returns the logits of the next token (rows, vocab)."""
        self.self_attention_cache.reset()
        cross_attention_cache = DynamicCache(config=self.model.config)
        logits = _next_token_logits(self.model, input_ids, BaseModelOutput(last_hidden_state=encoder_states),
                                    attention_mask, EncoderDecoderCache(self.self_attention_cache, cross_attention_cache))
        length = encoder_states.shape[1]
        if self.cache is None:
            fixed = DynamicCache(config=self.model.config)
            for layer, computed in zip(fixed.layers, cross_attention_cache.layers):
                padded = (*computed.keys.shape[:2], self.source_len, computed.keys.shape[-1])
                layer.lazy_initialization(computed.keys, computed.values)
                layer.keys, layer.values = computed.keys.new_zeros(padded), computed.values.new_zeros(padded)
            self.cache = EncoderDecoderCache(self.self_attention_cache, fixed)  # marked as computed: non-empty
            self.encoder_states = encoder_states.new_zeros(encoder_states.shape[0], self.source_len,
                                                           encoder_states.shape[2])
        pairs = [(self.encoder_states, encoder_states)]  # each (..., source position, width)
        for layer, computed in zip(self.cache.cross_attention_cache.layers, cross_attention_cache.layers):
            pairs += [(layer.keys, computed.keys), (layer.values, computed.values)]
        for fixed, new in pairs:
            fixed[..., :length, :] = new
            fixed[..., length:, :] = 0
        self.source_mask.fill_(False)
        self.source_mask[:, 0, 0, :length] = attention_mask.bool() if attention_mask is not None else True
        return logits

    def decode(self, input_ids, encoder_states, attention_mask, advance, unfinished) -> int:
        """Decode one batch: its first step eagerly (`start`), then one recorded or replayed step per position while
        `unfinished()`. `advance(logits, cur_len)` updates the search state in place. Returns the final length."""
        advance(self.start(input_ids, encoder_states, attention_mask), input_ids.shape[1])
        cur_len = input_ids.shape[1] + 1
        while unfinished():
            self.graphs.run(cur_len, functools.partial(self._step, advance, cur_len))
            cur_len += 1
        return cur_len

    def _step(self, advance, cur_len: int) -> None:
        advance(self.next_token_logits(), cur_len)

    def next_token_logits(self) -> torch.Tensor:
        """A later step: the logits after `tokens`, from the fixed buffers only. The source mask is passed as the
        prepared 4-D mask, which the model uses as it is (building one from a padding mask reads it on the host)."""
        encoder_outputs = BaseModelOutput(last_hidden_state=self.encoder_states)
        return _next_token_logits(self.model, self.tokens, encoder_outputs, self.source_mask, self.cache)


def _static_state(model, key: tuple, rows: int, encoder_states: torch.Tensor, max_length: int) -> _StaticDecoding:
    """The static state of this model for this batch shape, made on first use."""
    states = _static_states.setdefault(model, OrderedDict())
    sources, source_len = encoder_states.shape[0], _static_source_length(encoder_states.shape[1])
    key = (*key, rows, sources, source_len, max_length, model.dtype, torch.is_inference_mode_enabled())
    if key not in states:
        positions = model.config.max_position_embeddings
        if model.config.position_embedding_type == "learned" and max_length > positions:
            raise ValueError(f"max_length {max_length} is longer than the {positions} learned positions of this "
                             "model; lower max_new_tokens or max_length.")
        states[key] = _StaticDecoding(model, rows, sources, source_len, max_length)
        while len(states) > _STATIC_SHAPES_KEPT:
            states.popitem(last=False)
    states.move_to_end(key)
    return states[key]


def _criteria_key(stopping_criteria, generation_config) -> tuple:
    """What the recorded steps take from the stopping criteria and the generation config, as plain values."""
    _, eos, pad = _Upstream.special_tokens(generation_config)
    return (tuple(type(c).__name__ for c in stopping_criteria), generation_config.max_length,
            tuple(eos.tolist()) if eos is not None else None, int(pad) if pad is not None else None)


def _greedy_static(model, input_ids, encoder_states, attention_mask, stopping_criteria, generation_config):
    """`_greedy` with static shapes: every row is decoded until the whole batch has stopped, as in transformers."""
    rows, prompt_len = input_ids.shape
    max_length = generation_config.max_length
    static = _static_state(model, ("greedy", prompt_len, *_criteria_key(stopping_criteria, generation_config)),
                           rows, encoder_states, max_length)
    pad_token_id = _Upstream.special_tokens(generation_config).pad
    stops_at_eos = _stops_at_eos(stopping_criteria)
    if static.search is None:
        static.search = (torch.empty(rows, max_length, dtype=torch.long, device=input_ids.device),
                         torch.empty(rows, dtype=torch.long, device=input_ids.device))
    sequences, unfinished = static.search
    sequences[:, :prompt_len] = input_ids
    unfinished.fill_(1)

    def advance(logits, cur_len):
        next_tokens = _top_k(logits, 1)[1].squeeze(1)
        if stops_at_eos:  # stopped rows get padding
            next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
        sequences[:, cur_len] = next_tokens
        unfinished.copy_(unfinished & ~stopping_criteria(sequences[:, : cur_len + 1], None))
        static.tokens.copy_(next_tokens[:, None])

    cur_len = static.decode(input_ids, encoder_states, attention_mask, advance, lambda: unfinished.max() != 0)
    return sequences[:, :cur_len].clone()


def _beam_static(model, input_ids, encoder_states, attention_mask, stopping_criteria, generation_config):
    """`_beam` with static shapes: every sentence stays in the batch until the whole batch has stopped, as in
    transformers."""
    start, settings = _start_beams(input_ids, generation_config)
    rows, prompt_len = input_ids.shape
    static = _static_state(model, ("beam", *settings, *_criteria_key(stopping_criteria, generation_config)),
                           rows, encoder_states, settings.max_length)
    if static.search is None:
        static.search = (start, torch.zeros(start.running_scores.shape[0], settings.beams_to_keep, dtype=torch.bool,
                                            device=input_ids.device))
    else:
        for fixed, new in zip(static.search[0], start):
            fixed.copy_(new)
    beams, hits_stop = static.search

    def advance(logits, cur_len):
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        new_beams, new_hits_stop, parent_rows = _advance(static.model, log_probs, beams, cur_len, stopping_criteria,
                                                         settings)
        for fixed, new in zip((*beams, hits_stop), (*new_beams, new_hits_stop)):
            fixed.copy_(new)
        for layer in static.self_attention_cache.layers:  # reordered in place, only the cur_len positions written
            for cache in (layer.keys, layer.values):
                written = cache[:, :, :cur_len]
                written.copy_(written.index_select(0, parent_rows))
        static.tokens.copy_(beams.running_sequences[:, :, cur_len].reshape(rows, 1))

    def unfinished():
        return _Upstream.has_unfinished_sentences(model, beams.improvable, beams.is_sent_finished, hits_stop,
                                                  settings.early_stopping)

    static.decode(input_ids, encoder_states, attention_mask, advance, unfinished)
    return _best_hypotheses(beams.sequences, beams.beam_indices, prompt_len, generation_config).clone()


# Continuous batching: sentences in slots (7 in the module docstring) ------------------------------------------------

class _SlotLayer(DynamicLayer):  # a concrete layer class in every supported transformers release
    """One decoder layer's self-attention keys/values for every row of the slots, pre-allocated for max_length
    positions: each row writes its new key/value at its own position (`positions`, set before each step), and the
    attention reads the first `read_length` positions, masked per row beyond the row's own position.

    With `spare` buffers (where the memory need not stay put, as it must for a CUDA graph), beam search's reordering
    selects the rows into them and swaps: one pass over the cache instead of a selection and a copy back. Every
    buffer starts as zeros, never uninitialised: a masked position's value still meets its zero attention weight,
    and 0 × NaN is NaN."""

    def __init__(self, rows: int, kv_heads: int, max_length: int, head_dim: int, dtype, device, spare: bool):
        super().__init__()
        self.keys = torch.zeros(rows, kv_heads, max_length, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.spare = (torch.zeros_like(self.keys), torch.zeros_like(self.keys)) if spare else None
        self.is_initialized = True
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.read_length = max_length

    def attend(self, length: int, max_length: int) -> None:
        """Attend over the first `length` positions from now on, growing the buffers (by doubling, up to
        `max_length`) when they are shorter: without graphs the buffers need only hold the positions written so far,
        and shorter rows are closer together in memory."""
        self.read_length = length
        if length > self.keys.shape[2]:
            width = min(max_length, max(2 * self.keys.shape[2], length))
            grow = lambda cache: torch.nn.functional.pad(cache, (0, 0, 0, width - cache.shape[2]))  # noqa: E731
            self.keys, self.values = grow(self.keys), grow(self.values)
            if self.spare is not None:
                self.spare = (torch.zeros_like(self.keys), torch.zeros_like(self.values))

    def reorder(self, parent_rows: torch.Tensor) -> None:
        """Each row continues the cache of row `parent_rows[row]` (the positions written so far)."""
        written = slice(0, self.read_length)
        if self.spare is None:
            for cache in (self.keys, self.values):
                cache[:, :, written].copy_(cache[:, :, written].index_select(0, parent_rows))
            return
        for cache, spare in zip((self.keys, self.values), self.spare):
            torch.index_select(cache[:, :, written], 0, parent_rows, out=spare[:, :, written])
        self.spare, (self.keys, self.values) = (self.keys, self.values), self.spare

    def keep(self, rows: torch.Tensor) -> None:
        self.keys, self.values, self.positions = self.keys[rows], self.values[rows], self.positions[rows]
        if self.spare is not None:
            self.spare = (torch.zeros_like(self.keys), torch.zeros_like(self.values))

    def lazy_initialization(self, key_states, value_states) -> None:
        raise RuntimeError("slot caches are allocated when made")

    def update(self, key_states, value_states, *args, **kwargs):
        rows = torch.arange(self.keys.shape[0], device=self.keys.device)
        self.keys[rows, :, self.positions] = key_states[:, :, 0]  # (rows, heads, head_dim) at each row's position
        self.values[rows, :, self.positions] = value_states[:, :, 0]
        return self.keys[:, :, : self.read_length], self.values[:, :, : self.read_length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.read_length, 0

    def get_seq_length(self) -> int:
        return 0  # positions differ per row: the caller passes them (position_ids) with a prepared mask

    def get_max_length(self) -> int:
        return self.keys.shape[2]


def slots_cover(model, **generate_options) -> bool:
    """Whether `decode_in_slots` decodes what `model.generate(**generate_options)` would: greedy or beam search of a
    Vaswani encoder-decoder, one output per sentence, with no logits processors and no stopping criteria other than
    max_length and end of sentence (those may read values on the host, or address rows by batch index)."""
    config = model.config
    if config.model_type != "vaswani" or not config.is_encoder_decoder:
        return False
    generation_config = _Upstream.generation_config(model, **generate_options)
    if generation_config.get_generation_mode() not in (GenerationMode.GREEDY_SEARCH, GenerationMode.BEAM_SEARCH):
        return False
    if generation_config.num_return_sequences != 1 or generation_config.return_dict_in_generate:
        return False
    _Upstream.prepare_special_tokens(model, generation_config, model.device)
    processors, criteria = _Upstream.processors_and_criteria(model, generation_config, model.device)
    return not processors and _static_covers(processors, criteria)


def _read_back(tensor: torch.Tensor) -> list:
    """The loop's one way to read values on the host (the only point where the host waits for the device)."""
    return tensor.cpu().tolist()


# How many decoding steps the host lets pass between two looks at which slots finished, on a CPU and on a GPU: a
# finished slot idles for half of that on average, and on a GPU each look makes the host wait for the device and
# drains its queue of launched steps. On a CPU nothing waits, and 1, 2 and 4 measured alike.
SYNC_EVERY = {False: 2, True: 8}


class _Slots:
    """The state of `decode_in_slots`: `slots` sentences × `num_beams` rows, every buffer with the slot (or row) as
    its first dimension, so that a slot can be refilled, or the slots compacted, by indexing that dimension."""

    def __init__(self, model, generation_config, slots: int, source_len: int, max_length: int, graphs: bool):
        config, device, dtype = model.config, model.device, model.dtype
        self.model, self.generation_config, self.max_length = model, generation_config, max_length
        self.beam = generation_config.get_generation_mode() == GenerationMode.BEAM_SEARCH
        self.num_beams = generation_config.num_beams if self.beam else 1
        rows = slots * self.num_beams
        # With graphs every buffer has its final size from the start; without, the caches grow as needed.
        self.layers = [_SlotLayer(rows, config.num_key_value_heads, max_length if graphs else min(max_length, 32),
                                  config.head_dim, dtype, device, spare=self.beam and not graphs)
                       for _ in range(config.decoder_layers)]
        cross = DynamicCache(config=config)
        zeros = torch.zeros(slots, config.num_key_value_heads, source_len, config.head_dim, dtype=dtype, device=device)
        for layer in cross.layers:
            layer.lazy_initialization(zeros, zeros)
            layer.keys, layer.values = zeros.clone(), zeros.clone()
        self.cross = cross
        self.source_mask = torch.zeros(slots, 1, 1, source_len, dtype=torch.bool, device=device)
        # The decoder needs encoder states; with the cross-attention cache filled, it reads only their shape.
        self.encoder_states = torch.zeros(slots, 1, config.d_model, dtype=dtype, device=device)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.lengths = torch.ones(slots, dtype=torch.long, device=device)
        self.max_lengths = torch.ones(slots, dtype=torch.long, device=device)
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)
        self.final = torch.zeros(slots, max_length, dtype=torch.long, device=device)  # each finished output
        self.final_len = torch.zeros(slots, dtype=torch.long, device=device)
        tokens = _Upstream.special_tokens(generation_config)
        self.eos = tokens.eos.to(device) if tokens.eos is not None else None
        self.decoder_start = tokens.decoder_start
        if self.beam:
            start = tokens.decoder_start.view(1, 1).expand(slots * self.num_beams, 1)
            self.beams, self.settings = _start_beams(start, _with_max_length(generation_config, max_length))
            self.penalties = _length_penalties(max_length, generation_config.length_penalty, device)
        else:
            self.sequences = torch.zeros(slots, max_length, dtype=torch.long, device=device)
            self.sequences[:, 0] = tokens.decoder_start
        # A slot's search state before its first step, copied into a slot when it is refilled.
        self.fresh = [tensor.clone() for tensor in self._state()]

    def _state(self) -> list[torch.Tensor]:
        """The search's tensors, slot first."""
        return list(self.beams) if self.beam else [self.sequences]

    @property
    def slots(self) -> int:
        return self.lengths.shape[0]

    def fill(self, slots: list[int], encoder_states, attention_mask, max_lengths: list[int]) -> None:
        """Start new sentences in `slots`: their source's cross-attention keys/values (projected by each decoder
        layer's own cross-attention, as on a first decoding step) and mask, the decoder start token, a fresh search."""
        device, length = self.lengths.device, encoder_states.shape[1]
        index = torch.tensor(slots, dtype=torch.long, device=device)
        rows = (index[:, None] * self.num_beams + torch.arange(self.num_beams, device=device)).flatten()
        computed = EncoderDecoderCache(DynamicCache(config=self.model.config), DynamicCache(config=self.model.config))
        for layer in self.model.get_decoder().layers:
            layer.encoder_attn(encoder_states[:, :1], key_value_states=encoder_states, cache=computed)
        padding = self.source_mask.shape[-1] - length  # masked source positions, zero keys/values
        for layer, new in zip(self.cross.layers, computed.cross_attention_cache.layers):
            for fixed, projected in ((layer.keys, new.keys), (layer.values, new.values)):
                fixed.index_copy_(0, index, torch.nn.functional.pad(projected, (0, 0, 0, padding)))
        mask = torch.nn.functional.pad(attention_mask.bool(), (0, padding))
        self.source_mask.index_copy_(0, index, mask[:, None, None, :])
        self.tokens[rows] = self.decoder_start
        self.lengths[index] = 1
        self.max_lengths[index] = torch.tensor(max_lengths, dtype=torch.long, device=device)
        self.active[index] = True
        for state, fresh in zip(self._state(), self.fresh):  # every slot's fresh state is the same
            state.index_copy_(0, index, fresh[: len(slots)])

    def keep(self, slots: list[int]) -> None:
        """Keep only `slots`, in this order (fewer slots once no sentence is left to start)."""
        device = self.lengths.device
        index = torch.tensor(slots, dtype=torch.long, device=device)
        rows = (index[:, None] * self.num_beams + torch.arange(self.num_beams, device=device)).flatten()
        for layer in self.layers:
            layer.keep(rows)
        self.tokens = self.tokens[rows]
        self.source_mask, self.encoder_states, self.lengths, self.max_lengths, self.active, self.final = (
            t[index] for t in (self.source_mask, self.encoder_states, self.lengths, self.max_lengths, self.active,
                               self.final))
        self.final_len = self.final_len[index]
        for layer in self.cross.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        if self.beam:
            self.beams = _Beams(*(t[index] for t in self.beams))
        else:
            self.sequences = self.sequences[index]
        self.fresh = [t[index] for t in self.fresh]

    def step(self) -> None:
        """One decoding step of every slot, on the device only: the model, the search, and which slots finished."""
        beams = self.num_beams
        slots = self.slots
        positions = (self.lengths - 1).clamp(max=self.max_length - 1)  # the position of each slot's last token
        row_positions = positions[:, None].expand(slots, beams).reshape(-1)  # (rows,)
        read_length = self.layers[0].read_length
        mask = torch.arange(read_length, device=positions.device) <= row_positions[:, None]  # (rows, read_length)
        for layer in self.layers:
            layer.positions = row_positions
        # The tokens are the model's own predictions, so the decoder's range check of token ids (a host read on a
        # CPU) is skipped by passing their embeddings.
        embeddings = self.model.get_decoder().get_input_embeddings()(self.tokens)
        logits = self.model(
            decoder_inputs_embeds=embeddings,
            decoder_attention_mask=mask[:, None, None, :],
            position_ids=row_positions[:, None],
            encoder_outputs=BaseModelOutput(last_hidden_state=self.encoder_states),
            attention_mask=self.source_mask,
            cache=EncoderDecoderCache(Cache(layers=self.layers), self.cross),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]  # (rows, vocab)
        if self.beam:
            done = self._beam_step(logits)
        else:
            done = self._greedy_step(logits)
        self.active &= ~done
        self.lengths += 1

    def _greedy_step(self, logits) -> torch.Tensor:
        next_tokens = _top_k(logits, 1)[1]  # (slots, 1)
        column = self.lengths.clamp(max=self.max_length - 1)[:, None]
        self.sequences.scatter_(1, column, next_tokens)
        self.tokens.copy_(next_tokens)
        done = self.lengths + 1 >= self.max_lengths
        if self.eos is not None:
            done |= torch.isin(next_tokens[:, 0], self.eos)
        done &= self.active
        self.final.copy_(torch.where(done[:, None], self.sequences, self.final))
        self.final_len.copy_(torch.where(done, self.lengths + 1, self.final_len))
        return done

    def _beam_step(self, logits) -> torch.Tensor:
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        per_sentence = _PerSentence(self.lengths, self.max_lengths, self.eos, self.penalties)
        new_beams, hits_stop, parent_rows = _advance(self.model, log_probs, self.beams, per_sentence, None,
                                                     self.settings)
        for fixed, new in zip(self.beams, new_beams):
            fixed.copy_(new)
        for layer in self.layers:  # each row continues its parent's cache
            layer.reorder(parent_rows)
        beams = self.beams
        rows = beams.running_sequences.shape[0] * self.num_beams
        column = self.lengths.clamp(max=self.max_length - 1)[:, None, None].expand(-1, self.num_beams, 1)
        self.tokens.copy_(beams.running_sequences.gather(2, column).reshape(rows, 1))
        # transformers' test for stopping (`_beam_search_has_unfinished_sequences`), per sentence.
        done = ~beams.improvable[:, 0] | hits_stop.all(dim=1)
        if self.settings.early_stopping is True:
            done |= beams.is_sent_finished.all(dim=1)
        done &= self.active
        generated = (beams.beam_indices[:, 0] >= 0).sum(dim=1)  # the best hypothesis's length, as _best_hypotheses
        self.final.copy_(torch.where(done[:, None], beams.sequences[:, 0], self.final))
        self.final_len.copy_(torch.where(done, self.settings.prompt_len + generated, self.final_len))
        return done


def _with_max_length(generation_config, max_length: int):
    """A shallow copy of `generation_config` (its prepared special-token tensors included) with this max_length."""
    config = copy.copy(generation_config)
    config.max_length = max_length
    return config


def decode_in_slots(model, sources, max_new_tokens, *, slots: int = 64, sync_every: int | None = None,
                    cuda_graphs: bool | None = None, **generate_options) -> list[list[int]]:
    """Greedy or beam search of every source in `sources` (lists of token ids), each output what
    `model.generate(input_ids=[source], max_new_tokens=its max_new_tokens, **generate_options)[0]` returns (the
    decoder start token first), in the order of `sources` (7 in the module docstring).

    `slots` sentences decode side by side; when one finishes, the next source takes its slot. `max_new_tokens` is
    one number or one per source. The host looks at which slots finished once every `sync_every` steps (default
    `SYNC_EVERY` for the model's device), the only time it waits for the device; a slot that finished in between idles
    until then. With `cuda_graphs` (default: on a GPU) each step is replayed as a CUDA graph, recorded once per slot
    count. Calls that `slots_cover` does not cover are refused."""
    if not slots_cover(model, **generate_options):
        raise ValueError("decode_in_slots runs greedy and beam search with one output per sentence, without logits "
                         "processors or stopping criteria other than max_length and eos_token_id.")
    device = model.device
    sync_every = SYNC_EVERY[device.type == "cuda"] if sync_every is None else sync_every
    # On other devices the fixed-shape steps run as they are (how the CPU tests check them).
    graphs = _StepGraphs(device) if (device.type == "cuda" if cuda_graphs is None else cuda_graphs) else None
    if slots < 1 or sync_every < 1:
        raise ValueError(f"slots and sync_every must be at least 1, got {slots} and {sync_every}.")
    sources = [list(source) for source in sources]
    if not sources:
        return []
    limits = [max_new_tokens] * len(sources) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(sources):
        raise ValueError(f"{len(limits)} max_new_tokens for {len(sources)} sources.")
    generation_config = _Upstream.generation_config(model, **generate_options)
    _Upstream.prepare_special_tokens(model, generation_config, device)
    prompt_len = 1  # the decoder start token
    max_length = prompt_len + max(limits)
    positions = model.config.max_position_embeddings
    if model.config.position_embedding_type == "learned" and max_length > positions:
        raise ValueError(f"max_length {max_length} is longer than the {positions} learned positions of this model; "
                         "lower max_new_tokens.")
    pad = _Upstream.special_tokens(generation_config).pad
    pad_id = int(pad) if pad is not None else 0
    state = _Slots(model, generation_config, min(slots, len(sources)), max(map(len, sources)), max_length,
                   graphs is not None)
    outputs: list[list[int] | None] = [None] * len(sources)
    pending = iter(range(len(sources)))
    held: list[int | None] = [None] * state.slots  # the source each slot decodes
    steps_taken = [0] * state.slots  # the host's count of each slot's steps (its length − 1, known without a read)
    encoder = model.get_encoder()

    def start(free: list[int]) -> None:
        newcomers = [(slot, index) for slot, index in zip(free, pending)]
        if not newcomers:
            return
        batch = [sources[index] for _, index in newcomers]
        longest = max(map(len, batch))
        input_ids = torch.tensor([ids + [pad_id] * (longest - len(ids)) for ids in batch], device=device)
        attention_mask = torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for ids in batch], device=device)
        encoder_states = encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state
        state.fill([slot for slot, _ in newcomers], encoder_states, attention_mask,
                   [prompt_len + limits[index] for _, index in newcomers])
        for slot, index in newcomers:
            held[slot], steps_taken[slot] = index, 0

    start(list(range(state.slots)))
    while True:
        for _ in range(sync_every):
            if graphs is None:  # attend over the positions that some slot has written so far
                for layer in state.layers:
                    layer.attend(min(max_length, 1 + max(steps_taken)), max_length)
                state.step()
            else:  # a graph replays fixed shapes: every position, masked per row
                graphs.run(state.slots, state.step)
            steps_taken = [taken + 1 for taken in steps_taken]
        # One read: which slots are still decoding, and every slot's finished output with its length.
        report = _read_back(torch.cat([state.active[:, None].long(), state.final_len[:, None], state.final], dim=1))
        for slot, (live, length, *row) in enumerate(report):
            if not live and held[slot] is not None:
                outputs[held[slot]], held[slot] = row[:length], None
        start([slot for slot, index in enumerate(held) if index is None])
        live = [slot for slot, index in enumerate(held) if index is not None]
        if not live:
            return outputs
        if len(live) <= (state.slots // 2 if graphs is not None else state.slots - 1):
            # No source left to start: decode only the live slots. With graphs, in halves, so that a few slot counts
            # (each one recorded graph) serve the whole tail; the idle slots that fill a half just idle.
            if graphs is not None:
                size = state.slots // 2
                while size // 2 >= len(live):
                    size //= 2
                live += [slot for slot, index in enumerate(held) if index is None][: size - len(live)]
            state.keep(live)
            held = [held[slot] for slot in live]
            steps_taken = [steps_taken[slot] for slot in live]
