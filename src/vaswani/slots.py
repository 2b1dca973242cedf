"""Continuous batching: sentences decoded side by side in a fixed number of slots, each finished one replaced at
once by the next source (`decode_in_slots`, what `vaswani.translation.TorchEngine(slots=...)` runs). Not a
`generate()` call: it takes a list of sources, of any length, so it lives in the package, not in the generation file
that ships with every checkpoint; it reuses that file's ranking, transformers' beam bookkeeping (through its
`Upstream` adapter) and its CUDA-graph runner.

Each slot is one sentence × its beams. The self-attention cache is pre-allocated for max_length positions, and each
slot writes and attends at its own position (a per-row mask); the cross-attention keys/values and the source mask are
kept per slot. Beam search's bookkeeping is `_advance_per_sentence`'s, with each sentence's own length
(`_PerSentence`): transformers' helpers keep the hypotheses, and its length penalty is applied by the same float32
division. Each output is what generate() returns for that sentence alone with its own max_new_tokens
(tests/test_decoding_static.py; neighbours change the shapes of the matrix products, which may change a last bit).
Finished slots are found on the device; the host reads which ones once every `SYNC_EVERY` steps, in one transfer with
their outputs, and nothing else during the steps. On a GPU the step is replayed as a CUDA graph, recorded once per
slot count: once no source is left to start, the slots are halved as their sentences finish, so a few graphs serve
the tail. On a CPU the same loop runs without graphs, attending over the positions written so far; there it measured
slower than the lean loop on the main job's model (`benchmarks/bench_translation.py --engines vaswani,vaswani-slots`
compares them), which stays the CPU's default.
"""

import copy
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import BaseModelOutput

from .generation_vaswani import (BeamSettings, Beams, StepGraphs, Upstream, rank_candidates, start_beams,
                                 runs_as, static_covers, top_k, update_beams)

# (owner, name) → its parameters, which `_SlotLayer`'s override must take ("*args", "**kwargs" for the variable
# ones), as transformers calls them; `generation_vaswani.check_upstream_contract` checks them.
SLOT_LAYER_OVERRIDES = {
    (DynamicLayer, "update"): ("self", "key_states", "value_states", "*args", "**kwargs"),
    (DynamicLayer, "get_mask_sizes"): ("self", "query_length"),
    (DynamicLayer, "get_seq_length"): ("self",),
    (DynamicLayer, "get_max_length"): ("self",),
    (DynamicLayer, "lazy_initialization"): ("self", "key_states", "value_states"),
}


class _PerSentence(NamedTuple):
    """Where each sentence of a beam search stands when sentences started at different steps (the slots of
    `decode_in_slots`), which `_advance_per_sentence` advances."""

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


def _advance_per_sentence(model, log_probs, beams: Beams, per_sentence: _PerSentence, settings: BeamSettings):
    """One step of beam search for sentences that started at different steps, each stopped at an end of sentence or
    at its own max_length (as transformers' `EosTokenCriteria` and `MaxLengthCriteria` decide): the new state, which
    candidates hit a stop (B, C), and the row each new beam continues (B·N,), for the cache."""
    prompt_len, beams_to_keep = settings.prompt_len, settings.beams_to_keep
    candidates = rank_candidates(model, log_probs, beams, settings)
    batch_size = candidates.tokens.shape[0]
    # Each sentence writes at its own length; a sentence whose slot is idle may run past the end of the buffers,
    # where it writes (harmlessly) at the last column.
    width = candidates.sequences.shape[-1]
    column = per_sentence.lengths.clamp(max=width - 1)[:, None, None].expand(batch_size, beams_to_keep, 1)
    candidates.sequences.scatter_(2, column, candidates.tokens[..., None])
    candidates.beam_indices.scatter_(2, (column - prompt_len).clamp(min=0),
                                     candidates.rows.to(candidates.beam_indices.dtype)[..., None])
    hits_stop = (per_sentence.lengths + 1 >= per_sentence.max_lengths)[:, None].expand(batch_size, beams_to_keep)
    if per_sentence.eos_token_id is not None:
        hits_stop = hits_stop | torch.isin(candidates.tokens, per_sentence.eos_token_id)
    # transformers divides by (generated length) ** length_penalty, a Python number per batch; here each sentence
    # has its own, so the division happens here (the same float32 division) and transformers' helpers are handed a
    # length of 1, whose penalty divides by exactly 1.
    last = per_sentence.penalties.shape[0] - 1
    generated = (per_sentence.lengths + 1 - prompt_len).clamp(max=last)
    finished_log_probs = candidates.log_probs / per_sentence.penalties[generated][:, None]
    if settings.early_stopping == "never" and settings.length_penalty > 0.0:
        generated = (per_sentence.max_lengths - prompt_len).clamp(max=last)
    beams = update_beams(model, beams, candidates, hits_stop, settings, finished_log_probs=finished_log_probs,
                         penalised_len=prompt_len, heuristic_len=prompt_len + 1, max_length=prompt_len + 1,
                         hypothetical_penalty=per_sentence.penalties[generated][:, None])
    column = (per_sentence.lengths - prompt_len).clamp(min=0, max=beams.running_beam_indices.shape[-1] - 1)
    parent_rows = beams.running_beam_indices.gather(2, column[:, None, None].expand(batch_size, settings.num_beams, 1))
    return beams, hits_stop, parent_rows.flatten()


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
        return 0  # positions differ per row: the caller passes them (decoder_position_ids) with a prepared mask

    def get_max_length(self) -> int:
        return self.keys.shape[2]


def slots_cover(model, **generate_options) -> bool:
    """Whether `decode_in_slots` decodes what `model.generate(**generate_options)` would: greedy or beam search of a
    Vaswani encoder-decoder, one output per sentence, with no logits processors and no stopping criteria other than
    max_length and end of sentence (those may read values on the host, or address rows by batch index)."""
    config = model.config
    if config.model_type != "vaswani" or not config.is_encoder_decoder:
        return False
    generation_config = Upstream.generation_config(model, **generate_options)
    if generation_config.get_generation_mode() not in (GenerationMode.GREEDY_SEARCH, GenerationMode.BEAM_SEARCH):
        return False
    if generation_config.num_return_sequences != 1 or generation_config.return_dict_in_generate:
        return False
    Upstream.prepare_special_tokens(model, generation_config, model.device)
    processors, criteria = Upstream.processors_and_criteria(model, generation_config, model.device)
    return not processors and static_covers(processors, criteria)


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
        tokens = Upstream.special_tokens(generation_config)
        self.eos = tokens.eos.to(device) if tokens.eos is not None else None
        self.decoder_start = tokens.decoder_start
        if self.beam:
            start = tokens.decoder_start.view(1, 1).expand(slots * self.num_beams, 1)
            self.beams, self.settings = start_beams(start, _with_max_length(generation_config, max_length))
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
            self.beams = Beams(*(t[index] for t in self.beams))
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
            decoder_position_ids=row_positions[:, None],
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
        next_tokens = top_k(logits, 1)[1]  # (slots, 1)
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
        new_beams, hits_stop, parent_rows = _advance_per_sentence(self.model, log_probs, self.beams, per_sentence,
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
    sync_every = SYNC_EVERY[runs_as(device) == "cuda"] if sync_every is None else sync_every
    # On other devices the fixed-shape steps run as they are (how the CPU tests check them).
    graphs = StepGraphs(device) if (runs_as(device) == "cuda" if cuda_graphs is None else cuda_graphs) else None
    if slots < 1 or sync_every < 1:
        raise ValueError(f"slots and sync_every must be at least 1, got {slots} and {sync_every}.")
    sources = [list(source) for source in sources]
    if not sources:
        return []
    limits = [max_new_tokens] * len(sources) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(sources):
        raise ValueError(f"{len(limits)} max_new_tokens for {len(sources)} sources.")
    generation_config = Upstream.generation_config(model, **generate_options)
    Upstream.prepare_special_tokens(model, generation_config, device)
    prompt_len = 1  # the decoder start token
    max_length = prompt_len + max(limits)
    positions = model.config.max_position_embeddings
    if model.config.position_embedding_type == "learned" and max_length > positions:
        raise ValueError(f"max_length {max_length} is longer than the {positions} learned positions of this model; "
                         "lower max_new_tokens.")
    pad = Upstream.special_tokens(generation_config).pad
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
