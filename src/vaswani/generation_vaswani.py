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
`Upstream`, the one place that reaches transformers' private generation methods (tests/test_decoding.py compares
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
   with `top_k`, a two-level search over blocks of the vocabulary that returns the same token as `torch.argmax`.
3. Beam search ranks tokens within each beam before it ranks beams. The best 2·beams continuations of a sentence
   are among the best 2·beams tokens of each of its beams, so `top_k` picks those from each beam's
   log-probabilities, and only beams × 2·beams candidates get the beam's running score added and compete;
   transformers adds the running score to every beam × vocabulary entry and ranks all of them (4 × 32,000 per
   sentence here).
4. Beam search keeps one copy of each source encoding, not one per beam (generate() repeats it): the model's
   cross-attention then attends with all of a sentence's beams at once (`VaswaniAttention`), and the
   cross-attention keys/values are projected and cached once per sentence instead of once per beam. The first step
   decodes one row per sentence too: a sentence's beams start as copies of one prompt, so their log-probabilities
   are one row's, repeated; the self-attention cache grows to a row per beam when it is first reordered.
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
   than max_length, eos_token_id and each sentence's own limit (`SentenceLimits`, kept in a buffer of the shape);
   others may read values on the host, and those calls decode as 1–5 describe. On
   other devices the same static steps run without graphs, which is how the CPU tests check them.
   Measured on a GPU by `benchmarks/gpu_plan.py translation-trained` (engine `vaswani-graphs`,
   benchmarks/results/translation-trained-cuda-h200.md).

Continuous batching (sentences in slots, each finished one replaced by the next source) is not a generate() call and
lives in the package, not in this file: `vaswani.slots`.

Anything else (sampling, `return_dict_in_generate`, a decoder-only or non-Vaswani model, a pre-filled or static
cache, an assistant model, a streamer, synced GPUs, the decoding methods that transformers moved to the Hub) goes
to transformers' own `generate()` unchanged.
"""

import functools
import inspect
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache, StaticCache, StaticLayer
from transformers.generation import GenerationConfig, GenerationMixin
from transformers.generation.utils import GENERATION_MODES_MAPPING
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, StoppingCriteria,
                                                       StoppingCriteriaList)
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.integrations.fsdp import is_fsdp_managed_module
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

# With VASWANI_REHEARSE_CUDA=1 in its environment, a process on the CPU takes every branch a process on a CUDA GPU
# takes wherever a CPU can run it (`runs_as`): so that a lent GPU never runs a line of Python for the first time.
# Read once, at import. What a CPU cannot run stays off under it: CUDA graph capture (the graphed steps run as they
# are), TF32, pinned memory, and the step's CUDA graphs in training (`mode="reduce-overhead"`).
REHEARSE_CUDA = "VASWANI_REHEARSE_CUDA"
rehearsing_cuda = os.environ.get(REHEARSE_CUDA, "") == "1"


def runs_as(device: torch.device | str) -> str:
    """The device type whose branches code on `device` takes: its own, or "cuda" for the CPU while rehearsing."""
    kind = torch.device(device).type
    return "cuda" if kind == "cpu" and rehearsing_cuda else kind


# The decoding cache's name in generate()'s model_kwargs: `cache` since transformers 5.24, `past_key_values` before
# (modeling_vaswani.CACHE_NAME; this file imports nothing of the package, so that it can ship on its own).
CACHE_NAME = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"


# transformers' private generation methods, in one place ---------------------------------------------------------------
#
# `custom_generate` hands a decoding method what generate() prepared, but beam search's bookkeeping, the preparation of
# a generation config outside generate(), its special-token tensors and transformers' own loops have no public API. The
# loops below reach them only through `Upstream`, which calls each by keyword (a reordered signature cannot swap two
# arguments unnoticed). UPSTREAM_CONTRACT lists each method called with the parameters passed (the caches' own methods
# too), UPSTREAM_CACHE_ATTRIBUTES the cache attributes read and written directly, and `check_upstream_contract` names
# any that an installed release has changed (tests/test_generation_internals.py runs it, with the signatures of the
# cache-layer methods that vaswani.slots overrides), so that an upgrade fails there, by name, instead of deep inside a
# decoding step.

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
    (DynamicLayer, "__init__"): (),  # the slots' cache layer (vaswani.slots) allocates its own buffers
    (DynamicLayer, "batch_select_indices"): ("indices",),
    (DynamicLayer, "lazy_initialization"): ("key_states", "value_states"),
    (Cache, "__init__"): ("layers",),
    (Cache, "get_seq_length"): (),
    (Cache, "reset"): (),
    (DynamicCache, "__init__"): ("config",),
    (StaticCache, "__init__"): ("config", "max_cache_len"),
    (EncoderDecoderCache, "__init__"): (),  # the self-attention and the cross-attention cache, by position
}

# The attributes of transformers' caches that the loops read or write themselves (the static steps fill the layers'
# `keys` and `values`; the slots make their own layers).
UPSTREAM_CACHE_ATTRIBUTES = {DynamicLayer: ("keys", "values", "is_initialized"), DynamicCache: ("layers",),
                             EncoderDecoderCache: ("self_attention_cache", "cross_attention_cache")}

# The tensors `_prepare_special_tokens` leaves on a generation config, which the loops read.
UPSTREAM_SPECIAL_TOKENS = ("_decoder_start_token_tensor", "_eos_token_tensor", "_pad_token_tensor")


def _signature_names(function) -> tuple[str, ...]:
    """A function's parameter names as written, the variable ones with their stars: ("self", "x", "*args", ...)."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(stars.get(p.kind, "") + name for name, p in inspect.signature(function).parameters.items())


def check_upstream_contract(contract: dict = UPSTREAM_CONTRACT, overrides: dict | None = None,
                            special_tokens: tuple = UPSTREAM_SPECIAL_TOKENS,
                            cache_attributes: dict = UPSTREAM_CACHE_ATTRIBUTES) -> list[str]:
    """What an installed transformers no longer offers, one line per change (empty where all holds): a method that
    is gone; of `contract`'s, a parameter passed that it no longer takes or one it now requires that is not passed;
    of `overrides`' (a subclass's overrides: (owner, name) → the parameters they take), another signature; a
    special-token tensor that `_prepare_special_tokens` no longer sets; of `cache_attributes`, one that a cache (a
    layer that has stored a key and a value) no longer has."""
    overrides = overrides or {}
    problems = []
    checks = [(key, expected, False) for key, expected in contract.items()]
    checks += [(key, expected, True) for key, expected in overrides.items()]
    for (owner, name), expected, overridden in checks:
        where = f"{owner.__module__}.{owner.__name__}.{name}"
        member = inspect.getattr_static(owner, name, None)
        if member is None:
            problems.append(f"{where} no longer exists")
            continue
        if not callable(getattr(owner, name)):
            problems.append(f"{where} is no longer a method")
            continue
        if overridden:
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
    problems += _missing_cache_attributes(cache_attributes)
    return problems


def _missing_cache_attributes(cache_attributes: dict) -> list[str]:
    """`check_upstream_contract`'s lines for the attributes of `cache_attributes` that the caches no longer have."""
    problems = []
    for owner, names in cache_attributes.items():
        try:
            if issubclass(owner, EncoderDecoderCache):
                instance = owner(DynamicCache(), DynamicCache())
            else:
                instance = owner()
                if isinstance(instance, DynamicLayer):
                    states = torch.zeros(1, 1, 1, 2)
                    instance.update(states, states)
        except Exception as error:  # noqa: BLE001 - reported, with what it was
            problems.append(f"{owner.__module__}.{owner.__name__} could not be made as the loops make it: {error!r}")
            continue
        problems += [f"{owner.__module__}.{owner.__name__}.{name} no longer exists" for name in names
                     if getattr(instance, name, None) is None]
    return problems


class _SpecialTokens(NamedTuple):
    """A prepared generation config's special tokens, as tensors on the model's device (eos: 1-D, or None)."""

    decoder_start: torch.Tensor
    eos: torch.Tensor | None
    pad: torch.Tensor | None


class Upstream:
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


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    static = cuda_graphs and static_covers(logits_processor, stopping_criteria)
    mode = _lean_mode(model, generation_config, model_kwargs, static)
    if mode is None:
        return Upstream.own_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
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
    state = (encoder_outputs, _source_mask(model, encoder_outputs.last_hidden_state, attention_mask), cache)
    if mode == GenerationMode.GREEDY_SEARCH:
        return _greedy(model, input_ids, state, logits_processor, stopping_criteria, generation_config)
    return _beam(model, input_ids, state, logits_processor, stopping_criteria, generation_config)


def _source_mask(model, encoder_states, attention_mask):
    """The cross-attention mask that the model builds from the sources' padding mask at every step (the same
    function, for one query per row), built once per batch instead: on a CPU, building it is a measurable share of a
    step (benchmarks/results/profile-decoding-cpu.md). None where nothing is masked."""
    if attention_mask is None or attention_mask.dim() == 4:
        return attention_mask
    return create_bidirectional_mask(config=model.config, inputs_embeds=encoder_states[:, :1],
                                     attention_mask=attention_mask, encoder_hidden_states=encoder_states,
                                     allow_is_bidirectional_skip=not model.training)


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


class SentenceLimits(StoppingCriteria):
    """Each sentence of a batch stops at its own length: `max_lengths[i]` tokens (the decoder prompt included, as
    `MaxLengthCriteria` counts them) for the i-th sentence, so that its output does not depend on the sources beside
    it. Both loops call stopping criteria with the rows of each sentence together (greedy search: one row per
    sentence; beam search: its C candidates), and the lean loop hands on `keep`'s criterion for the sentences that
    stay in its batch. A `generate()` argument: `stopping_criteria=StoppingCriteriaList([SentenceLimits(...)])`, with
    `max_length` the longest of them."""

    def __init__(self, max_lengths: torch.Tensor):
        self.max_lengths = max_lengths  # (sentences,) on the model's device

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        rows_per_sentence = input_ids.shape[0] // self.max_lengths.shape[0]
        return (input_ids.shape[-1] >= self.max_lengths).repeat_interleave(rows_per_sentence)

    def keep(self, sentences: torch.Tensor) -> "SentenceLimits":
        """The limits of `sentences` (indices into this batch's sentences), in that order."""
        return SentenceLimits(self.max_lengths[sentences])


def _stops_at_eos(stopping_criteria) -> bool:
    """Whether a sequence can stop before max_length, so that stopped rows must be padded (transformers' rule)."""
    return any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)


def _greedy(model, input_ids, state, logits_processor, stopping_criteria, generation_config) -> torch.Tensor:
    """transformers' `_sample` without sampling: the argmax token, padding after a sequence has stopped; stopped
    sequences leave the batch (5 in the module docstring)."""
    pad_token_id = Upstream.special_tokens(generation_config).pad
    stops_at_eos = _stops_at_eos(stopping_criteria)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    live = torch.arange(input_ids.shape[0], device=input_ids.device)  # the rows still decoded
    new_tokens = input_ids  # the first step reads the whole decoder prompt, later steps the last token
    while True:
        logits = _next_token_logits(model, new_tokens, *state)
        if logits_processor:
            next_tokens = logits_processor(input_ids, logits.float()).argmax(dim=-1)
        else:
            next_tokens = top_k(logits, 1)[1].squeeze(1)
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


class Beams(NamedTuple):
    """transformers' beam-search state, per sentence: B sentences × N beams, sequences of up to max_length tokens."""

    running_sequences: torch.Tensor  # (B, N, max_length) the live beams
    running_scores: torch.Tensor  # (B, N) their summed log-probabilities
    running_beam_indices: torch.Tensor  # (B, N, max_length - prompt) the row each step continued
    sequences: torch.Tensor  # (B, N, max_length) the finished hypotheses, best first
    beam_scores: torch.Tensor  # (B, N) their length-penalised scores
    beam_indices: torch.Tensor  # (B, N, max_length - prompt)
    is_sent_finished: torch.Tensor  # (B, N) which of the N finished slots hold a hypothesis
    improvable: torch.Tensor  # (B, 1) whether a later step can still change the finished hypotheses


class BeamSettings(NamedTuple):
    num_beams: int
    beams_to_keep: int  # C, the candidates kept per sentence: 2N, more with several EOS tokens
    prompt_len: int
    max_length: int
    early_stopping: bool | str
    length_penalty: float


def start_beams(input_ids, generation_config) -> tuple[Beams, BeamSettings]:
    """The state before the first step, as transformers' `_beam_search` sets it up."""
    _, eos_token_id, pad_token_id = Upstream.special_tokens(generation_config)
    max_length, num_beams = generation_config.max_length, generation_config.num_beams
    rows, prompt_len = input_ids.shape
    batch_size, device = rows // num_beams, input_ids.device
    n_eos_tokens = eos_token_id.shape[0] if eos_token_id is not None else 0
    settings = BeamSettings(num_beams, max(2, 1 + n_eos_tokens) * num_beams, prompt_len, max_length,
                             generation_config.early_stopping, generation_config.length_penalty)
    fill = pad_token_id or eos_token_id[0] if eos_token_id is not None else -1  # transformers' filler, as written there
    running_sequences = torch.full((batch_size, num_beams, max_length), fill, dtype=torch.long, device=device)
    running_sequences[:, :, :prompt_len] = input_ids.view(batch_size, num_beams, prompt_len)
    running_scores = torch.zeros((batch_size, num_beams), device=device)
    running_scores[:, 1:] = -1e9  # the beams start identical: only the first may expand at the first step
    running_beam_indices = torch.full((batch_size, num_beams, max_length - prompt_len), -1, dtype=torch.int32,
                                      device=device)
    beams = Beams(
        running_sequences, running_scores, running_beam_indices,
        sequences=running_sequences.clone(),
        beam_scores=torch.full((batch_size, num_beams), -1e9, device=device),
        beam_indices=running_beam_indices.clone(),
        is_sent_finished=torch.zeros((batch_size, num_beams), dtype=torch.bool, device=device),
        improvable=torch.ones((batch_size, 1), dtype=torch.bool, device=device),
    )
    return beams, settings


class Candidates(NamedTuple):
    """A beam-search step's best C continuations of each sentence (B sentences), as transformers'
    `_get_top_k_continuations` leaves them, the new token not yet written into the sequences."""

    log_probs: torch.Tensor  # (B, C) their running scores
    beams: torch.Tensor  # (B, C) the beam each continues
    tokens: torch.Tensor  # (B, C) the token each adds
    sequences: torch.Tensor  # (B, C, max_length) the sequences they continue
    beam_indices: torch.Tensor  # (B, C, max_length - prompt)
    rows: torch.Tensor  # (B, C) the batch row of the beam each continues


def rank_candidates(model, log_probs, beams: Beams, settings: BeamSettings) -> Candidates:
    """The best C (beam, token) pairs of each sentence from the (B·N, vocab) log-probabilities of the next token,
    ranked as 3 in the module docstring says."""
    num_beams, beams_to_keep = settings.num_beams, settings.beams_to_keep
    batch_size = beams.running_scores.shape[0]
    rows = batch_size * num_beams
    # The best C tokens of every beam, then the best C (beam, token) pairs of every sentence.
    token_scores, tokens = top_k(log_probs, beams_to_keep)  # (B·N, C)
    scores = (token_scores + beams.running_scores.view(rows, 1)).view(batch_size, num_beams * beams_to_keep)
    topk_log_probs, choice = scores.topk(beams_to_keep, dim=-1)  # (B, C)
    topk_beams = choice // beams_to_keep
    batch_offset = torch.arange(batch_size, device=log_probs.device).view(-1, 1) * num_beams
    return Candidates(topk_log_probs, topk_beams, tokens.view(batch_size, -1).gather(1, choice),
                      Upstream.gather_beams(model, beams.running_sequences, topk_beams),
                      Upstream.gather_beams(model, beams.running_beam_indices, topk_beams), topk_beams + batch_offset)


def update_beams(model, beams: Beams, candidates: Candidates, hits_stop, settings: BeamSettings, *,
                 finished_log_probs, penalised_len: int, heuristic_len: int, max_length: int,
                 hypothetical_penalty=None) -> Beams:
    """transformers' bookkeeping of a beam-search step, its helper methods called as `_beam_search` calls them: the
    next running beams, the finished hypotheses (`finished_log_probs`, divided there by
    `(penalised_len + 1 - prompt) ** length_penalty`) and whether a later step can still change them
    (`_check_early_stop_heuristic` at `heuristic_len` and `max_length`, on running scores divided by
    `hypothetical_penalty` first where one is given)."""
    num_beams, prompt_len = settings.num_beams, settings.prompt_len
    running_sequences, running_scores, running_beam_indices = Upstream.running_beams_for_next_iteration(
        model,
        topk_log_probs=candidates.log_probs,
        topk_running_sequences=candidates.sequences,
        topk_running_beam_indices=candidates.beam_indices,
        next_token_hits_stopping_criteria=hits_stop,
        num_beams=num_beams,
    )
    sequences, beam_scores, beam_indices, is_sent_finished = Upstream.update_finished_beams(
        model,
        sequences=beams.sequences,
        topk_running_sequences=candidates.sequences,
        beam_scores=beams.beam_scores,
        topk_log_probs=finished_log_probs,
        beam_indices=beams.beam_indices,
        topk_running_beam_indices=candidates.beam_indices,
        is_early_stop_heuristic_unsatisfied=beams.improvable,
        is_sent_finished=beams.is_sent_finished,
        next_token_hits_stopping_criteria=hits_stop,
        top_num_beam_mask=torch.arange(settings.beams_to_keep, device=hits_stop.device) < num_beams,
        num_beams=num_beams,
        cur_len=penalised_len,
        decoder_prompt_len=prompt_len,
        length_penalty=settings.length_penalty,
        early_stopping=settings.early_stopping,
    )
    improvable = Upstream.check_early_stop_heuristic(
        model,
        is_early_stop_heuristic_unsatisfied=beams.improvable,
        running_beam_scores=running_scores if hypothetical_penalty is None else running_scores / hypothetical_penalty,
        beam_scores=beam_scores,
        is_sent_finished=is_sent_finished,
        cur_len=heuristic_len,
        max_length=max_length,
        decoder_prompt_len=prompt_len,
        early_stopping=settings.early_stopping,
        length_penalty=settings.length_penalty,
    )
    return Beams(running_sequences, running_scores, running_beam_indices, sequences, beam_scores, beam_indices,
                 is_sent_finished, improvable)


def _advance(model, log_probs, beams: Beams, cur_len: int, stopping_criteria, settings: BeamSettings):
    """One step of beam search for sentences that all stand at `cur_len`, stopped by `stopping_criteria` (as
    transformers' `_beam_search` stops them): the new state, which candidates hit a stopping criterion (B, C), and
    the row each new beam continues (B·N,), for the cache."""
    prompt_len = settings.prompt_len
    candidates = rank_candidates(model, log_probs, beams, settings)
    candidates.sequences[:, :, cur_len] = candidates.tokens
    candidates.beam_indices[:, :, cur_len - prompt_len] = candidates.rows
    hits_stop = stopping_criteria(candidates.sequences[:, :, : cur_len + 1].flatten(0, 1), None)
    hits_stop = hits_stop.view(candidates.tokens.shape)
    beams = update_beams(model, beams, candidates, hits_stop, settings, finished_log_probs=candidates.log_probs,
                         penalised_len=cur_len, heuristic_len=cur_len + 1, max_length=settings.max_length)
    return beams, hits_stop, beams.running_beam_indices[..., cur_len - prompt_len].flatten()


def _beam(model, input_ids, state, logits_processor, stopping_criteria, generation_config) -> torch.Tensor:
    """transformers' `_beam_search` (deterministic, sequences only), with the candidate ranking of the module
    docstring; its helper methods keep the hypotheses. Sentences whose hypotheses can no longer change leave the
    batch (5 in the module docstring)."""
    beams, settings = start_beams(input_ids, generation_config)
    num_beams, cur_len = settings.num_beams, settings.prompt_len
    # The results of sentences that left the batch, and the original index of each sentence still in it.
    final_sequences, final_beam_indices = beams.sequences.clone(), beams.beam_indices.clone()
    live = torch.arange(beams.sequences.shape[0], device=input_ids.device)

    new_tokens, first_step = input_ids[::num_beams], True  # the beams' prompts are copies (4 in the module docstring)
    while True:
        log_probs = torch.log_softmax(_next_token_logits(model, new_tokens, *state).float(), dim=-1)  # (B·N, vocab)
        if first_step:  # (B, vocab) → (B·N, vocab)
            log_probs = log_probs.repeat_interleave(num_beams, dim=0)
        if logits_processor:
            rows = log_probs.shape[0]
            log_probs = logits_processor(beams.running_sequences[:, :, :cur_len].reshape(rows, cur_len), log_probs)
        beams, hits_stop, parent_rows = _advance(model, log_probs, beams, cur_len, stopping_criteria, settings)
        model._reorder_cache(state[2], parent_rows // num_beams if first_step else parent_rows)
        cur_len, first_step = cur_len + 1, False
        if not Upstream.has_unfinished_sentences(model, beams.improvable, beams.is_sent_finished, hits_stop,
                                                  settings.early_stopping):
            break
        done = ~beams.improvable[:, 0]  # no later step can change these sentences' finished hypotheses
        if done.any() and not logits_processor:
            final_sequences[live[done]], final_beam_indices[live[done]] = beams.sequences[done], beams.beam_indices[done]
            keep = (~done).nonzero().squeeze(1)
            keep_rows = (keep[:, None] * num_beams + torch.arange(num_beams, device=keep.device)).flatten()
            live = live[keep]
            beams = Beams(*(tensor[keep] for tensor in beams))
            state = _keep_rows(state, keep, keep_rows)
            stopping_criteria = StoppingCriteriaList([criterion.keep(keep) if isinstance(criterion, SentenceLimits)
                                                      else criterion for criterion in stopping_criteria])
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
        layer.batch_select_indices(indices=rows)
    for layer in cache.cross_attention_cache.layers:
        layer.batch_select_indices(indices=sources)
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
    return runs_as(model.device) == "cpu"


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
    generation_config = Upstream.generation_config(model, arguments.get("generation_config"), **options)
    return generation_config.get_generation_mode() in (GenerationMode.GREEDY_SEARCH, GenerationMode.BEAM_SEARCH)


_GENERATE_PARAMETERS = set(inspect.signature(GenerationMixin.generate).parameters)


# Static shapes and CUDA graphs (6 in the module docstring) ------------------------------------------------------------

_STATIC_SHAPES_KEPT = 8  # per model: batch shapes whose buffers and graphs are kept, the least recently used dropped
_static_states: "weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict]" = weakref.WeakKeyDictionary()


def static_covers(logits_processor, stopping_criteria) -> bool:
    """Whether a decoding step can be captured: no logits processors (some read their arguments on the host), and
    only the stopping criteria generate() makes from max_length and eos_token_id, and each sentence's own limit
    (`SentenceLimits`): pure tensor operations."""
    covered = (MaxLengthCriteria, EosTokenCriteria, SentenceLimits)
    return not logits_processor and all(type(c) in covered for c in stopping_criteria)


def _static_source_length(length: int) -> int:
    """The source length that a batch's source is padded to: the next power of two, at least 32, so that the batches
    of a corpus share a few shapes, and with them their buffers and graphs."""
    return max(32, 1 << (length - 1).bit_length())


class StepGraphs:
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
        self.graphs = StepGraphs(device)
        self.search = None
        self.limits = None  # each sentence's max_length (`SentenceLimits`), where the batch gives them

    def own_limits(self, stopping_criteria) -> StoppingCriteriaList:
        """`stopping_criteria` with each sentence's limits (`SentenceLimits`) read from this shape's own buffer, into
        which this batch's are copied: a recorded step reads the addresses it was recorded with."""
        given = next((c for c in stopping_criteria if isinstance(c, SentenceLimits)), None)
        if given is None:
            return stopping_criteria
        if self.limits is None:
            self.limits = given.max_lengths.clone()
        else:
            self.limits.copy_(given.max_lengths)
        return StoppingCriteriaList([SentenceLimits(self.limits) if c is given else c for c in stopping_criteria])

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
    _, eos, pad = Upstream.special_tokens(generation_config)
    return (tuple(type(c).__name__ for c in stopping_criteria), generation_config.max_length,
            tuple(eos.tolist()) if eos is not None else None, int(pad) if pad is not None else None)


def _greedy_static(model, input_ids, encoder_states, attention_mask, stopping_criteria, generation_config):
    """`_greedy` with static shapes: every row is decoded until the whole batch has stopped, as in transformers."""
    rows, prompt_len = input_ids.shape
    max_length = generation_config.max_length
    static = _static_state(model, ("greedy", prompt_len, *_criteria_key(stopping_criteria, generation_config)),
                           rows, encoder_states, max_length)
    stopping_criteria = static.own_limits(stopping_criteria)
    pad_token_id = Upstream.special_tokens(generation_config).pad
    stops_at_eos = _stops_at_eos(stopping_criteria)
    if static.search is None:
        static.search = (torch.empty(rows, max_length, dtype=torch.long, device=input_ids.device),
                         torch.empty(rows, dtype=torch.long, device=input_ids.device))
    sequences, unfinished = static.search
    sequences[:, :prompt_len] = input_ids
    unfinished.fill_(1)

    def advance(logits, cur_len):
        next_tokens = top_k(logits, 1)[1].squeeze(1)
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
    start, settings = start_beams(input_ids, generation_config)
    rows, prompt_len = input_ids.shape
    static = _static_state(model, ("beam", *settings, *_criteria_key(stopping_criteria, generation_config)),
                           rows, encoder_states, settings.max_length)
    stopping_criteria = static.own_limits(stopping_criteria)
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
        return Upstream.has_unfinished_sentences(model, beams.improvable, beams.is_sent_finished, hits_stop,
                                                  settings.early_stopping)

    static.decode(input_ids, encoder_states, attention_mask, advance, unfinished)
    return _best_hypotheses(beams.sequences, beams.beam_indices, prompt_len, generation_config).clone()
