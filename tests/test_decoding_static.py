"""The lean loop's fixed-shape steps (`vaswani.generation_vaswani`): static shapes replayed as CUDA graphs by
generate(), and sentences decoded side by side in slots (`decode_in_slots`). Each returns what generate() returns
with transformers' loop; on a CPU the same steps run without graphs, checked for what a graph could not replay."""

import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import StoppingCriteriaList

import vaswani.generation_vaswani as generation_vaswani
import vaswani.slots as slot_decoding
from vaswani.decoding import use_lean_decoding
from vaswani.generation_vaswani import SentenceLimits

from decoding_helpers import LOGITS_PROCESSORS, SEARCHES, SENTENCES, VARIANTS, generate_both
from host_reads import PythonReads


# Static shapes and CUDA graphs (6 in generation_vaswani's docstring) --------------------------------------------------

# What a recorded CUDA graph cannot contain: reading a device value on the host (`.item()`, `bool(tensor)`, the
# data-dependent shapes of nonzero/masked_select/unique) and tensors made from host data (a host-to-device copy).
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_consecutive", "_unique2", "unique_dim",
              "lift_fresh", "lift_fresh_copy"}
# Batches with the same number of sentences and sources under 32 tokens: one static shape, whose steps are reused.
SAME_SHAPE_BATCHES = [SENTENCES[:4], SENTENCES[3:], ["cat", "a dog ran", "the cat", "the dog sat on a mat"]]


class _StepCheck(TorchDispatchMode):
    """What a step does that a CUDA graph could not replay: the host reads it makes (`found`), and the memory it reads
    that it did not write itself (`external`: storage addresses), which a replay reads at the recorded addresses."""

    def __init__(self):
        super().__init__()
        self.found, self.external, self.written = [], set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean_index = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            index is not None and index.dtype == torch.bool for index in args[1]
        )  # x[mask]: the selected positions are found on the host
        if name in HOST_READS or boolean_index:
            self.found.append(name)
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.external |= {_address(t) for t in inputs} - self.written
        result = func(*args, **(kwargs or {}))
        self.written |= {_address(t) for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)}
        return result


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@pytest.fixture
def replayed_steps(monkeypatch):
    """On the CPU, make the static path behave as recorded graphs do: each step position runs the step function of
    the first batch that reached it (its Python objects, not the current call's). The first run is checked for host
    reads (by the ops dispatched and the Tensor methods Python calls), and every later run must read the same memory as the first (a graph reads the recorded addresses, so a
    buffer replaced between batches would go unseen). The model's token-id check is left out: `check_ids` skips
    it while a CUDA graph is being recorded, and only on the CPU is it a host read."""
    import vaswani.modeling_vaswani as modeling

    counts = {"recorded": 0, "replayed": 0, "check": True}  # torch.compile refuses dispatch modes: check=False
    host_reads = []

    def run(graphs, position, step):
        recorded = graphs.__dict__.setdefault("recorded", {})
        check = _StepCheck() if counts["check"] else contextlib.nullcontext(_StepCheck())
        python = PythonReads() if counts["check"] else contextlib.nullcontext(PythonReads())
        with check as seen, python as read:
            (recorded[position][0] if position in recorded else step)()
        if position in recorded:
            counts["replayed"] += 1
            assert seen.external == recorded[position][1], f"step {position} reads other memory than when recorded"
        else:
            host_reads.extend(seen.found + list(read.reads))
            recorded[position] = (step, seen.external)
            counts["recorded"] += 1

    monkeypatch.setattr(generation_vaswani.StepGraphs, "run", run)
    monkeypatch.setattr(modeling, "check_ids", lambda ids, invalid, message: None)
    generation_vaswani._static_states.clear()
    yield counts, host_reads
    generation_vaswani._static_states.clear()


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_static_decoding_returns_what_generate_returns(trained, replayed_steps, search):
    """cuda_graphs=True: the same outputs as generate() without it, for batches that reuse the first batch's steps;
    no step reads a device value on the host, and every replay reads the recorded memory (the `replayed_steps`
    checks). With a logits processor it takes the lean loop instead."""
    model, tokenizer = trained
    counts, host_reads = replayed_steps
    for sentences in SAME_SHAPE_BATCHES:
        reference, static = generate_both(model, tokenizer(sentences, return_tensors="pt", padding=True),
                                           cuda_graphs=True, **search)
        assert torch.equal(reference, static)
    assert host_reads == []
    if LOGITS_PROCESSORS & set(search):
        assert counts["recorded"] == counts["replayed"] == 0
    else:
        assert counts["recorded"] > 0 and counts["replayed"] > 0


@pytest.mark.parametrize("num_beams", [1, 4])
def test_static_decoding_stops_each_sentence_at_its_own_limit(trained, replayed_steps, num_beams):
    """Each sentence's own limit (`SentenceLimits`) is followed by the recorded steps too: batches of one shape with
    other limits replay the first one's steps and stop where transformers' loop stops."""
    model, tokenizer = trained
    counts, host_reads = replayed_steps
    for offset, sentences in enumerate(SAME_SHAPE_BATCHES):
        batch = tokenizer(sentences, return_tensors="pt", padding=True)
        lengths = torch.tensor([2 + (offset + i) % 5 for i in range(len(sentences))]) + 1  # and the decoder start
        limits = StoppingCriteriaList([SentenceLimits(lengths)])
        reference, static = generate_both(model, batch, cuda_graphs=True, num_beams=num_beams,
                                          max_length=int(lengths.max()), stopping_criteria=limits)
        assert torch.equal(reference, static)
    assert host_reads == [] and counts["replayed"] > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_static_decoding_across_variants(replayed_steps, tiny_models, variant):
    model, tokenizer = tiny_models(**VARIANTS[variant])
    counts, host_reads = replayed_steps
    for sentences in SAME_SHAPE_BATCHES[:2]:
        batch = tokenizer(sentences, return_tensors="pt", padding=True)
        for search in (dict(num_beams=1), dict(num_beams=4)):
            reference, static = generate_both(model, batch, **search, cuda_graphs=True)
            assert torch.equal(reference, static), search
    assert host_reads == [] and counts["replayed"] > 0


def test_static_decoding_keeps_one_state_per_shape(trained, replayed_steps):
    """Batches of one shape share buffers and steps; another batch size or a longer source gets its own."""
    model, tokenizer = trained
    model = use_lean_decoding(copy.deepcopy(model), cuda_graphs=True)
    long_sentence = " ".join(["the cat sat on the mat"] * 8)  # over 32 tokens: the next source length, 64
    for sentences in [*SAME_SHAPE_BATCHES, SENTENCES[:2], [long_sentence, *SENTENCES[:3]]]:
        with torch.no_grad():
            model.generate(**tokenizer(sentences, return_tensors="pt", padding=True), num_beams=2, max_new_tokens=8)
    shapes = [(state.tokens.shape[0], state.source_len) for state in generation_vaswani._static_states[model].values()]
    assert shapes == [(8, 32), (4, 32), (8, 64)]


def test_static_states_do_not_keep_their_model_alive(trained, replayed_steps):
    import gc
    import weakref

    model, tokenizer = trained
    model = copy.deepcopy(model)
    for num_beams in (1, 4):
        generate_both(model, tokenizer(SENTENCES[:2], return_tensors="pt", padding=True), cuda_graphs=True,
                       num_beams=num_beams)
    assert len(generation_vaswani._static_states[model]) == 2
    dropped = weakref.ref(model)
    del model
    gc.collect()
    assert dropped() is None and len(generation_vaswani._static_states) == 0


@pytest.mark.slow
def test_static_decoding_with_a_compiled_forward(trained, replayed_steps):
    """compile_for_generation + cuda_graphs: the static steps run the compiled forward (one graph, no breaks), which
    is what the CUDA graphs then record; the same outputs."""
    import torch._dynamo

    from vaswani.inference import compile_for_generation

    model, tokenizer = trained
    compiled = use_lean_decoding(compile_for_generation(copy.deepcopy(model)), cuda_graphs=True)
    counts, host_reads = replayed_steps
    counts["check"] = False  # checked without compilation above; the compiled graph has no breaks
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for sentences in SAME_SHAPE_BATCHES[:2]:
        batch = tokenizer(sentences, return_tensors="pt", padding=True)
        with torch.no_grad():
            assert torch.equal(model.generate(**batch, num_beams=4, max_new_tokens=20, lean_decoding=False),
                               compiled.generate(**batch, num_beams=4, max_new_tokens=20))
    assert counts["replayed"] > 0
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("num_beams", [1, 4])
def test_cuda_graphs_return_what_generate_returns(trained, num_beams, compiled):
    """The recorded and replayed CUDA graphs on a GPU, of the eager or the compiled forward: the outputs of
    generate() without them, batch after batch."""
    from vaswani.inference import compile_for_generation

    reference_model, tokenizer = trained
    reference_model = copy.deepcopy(reference_model).cuda()
    model = copy.deepcopy(reference_model)
    if compiled:
        model = compile_for_generation(model)
    for sentences in SAME_SHAPE_BATCHES:
        batch = tokenizer(sentences, return_tensors="pt", padding=True).to("cuda")
        with torch.no_grad():
            reference = reference_model.generate(**batch, num_beams=num_beams, max_new_tokens=20, lean_decoding=False)
            graphed = model.generate(**batch, num_beams=num_beams, max_new_tokens=20, cuda_graphs=True)
        assert torch.equal(reference, graphed)
    (state,) = generation_vaswani._static_states[model].values()
    assert state.graphs.graphs  # recorded, and replayed by the later batches


# Continuous batching in slots (7 in generation_vaswani's docstring) --------------------------------------------------

# Sentences of uneven lengths, more of them than slots, so that slots are refilled while others decode.
SLOT_SENTENCES = SENTENCES + ["dog", "the mat sat on the cat under a bird", "a cat ran under the tree"]
SLOT_SEARCHES = [
    dict(num_beams=1),
    dict(num_beams=1, eos_token_id=None),
    dict(num_beams=4),
    dict(num_beams=3, length_penalty=0.6),
    dict(num_beams=4, early_stopping=True),
    dict(num_beams=4, early_stopping=False, length_penalty=2.0),
    dict(num_beams=4, early_stopping="never", length_penalty=1.5),
    dict(num_beams=5, early_stopping=True, length_penalty=0.0),
    dict(num_beams=2, eos_token_id=None),
]


def _alone(model, tokenizer, sentences, max_new_tokens, **search) -> list[list[int]]:
    """Each sentence's output from transformers' own loop on that sentence alone (not the lean loop, whose beam
    bookkeeping the slots share)."""
    with torch.no_grad():
        return [model.generate(**tokenizer([sentence], return_tensors="pt"), max_new_tokens=limit, lean_decoding=False,
                               **search)[0].tolist()
                for sentence, limit in zip(sentences, max_new_tokens)]


def _first_token(model, tokenizer, sentence) -> int:
    with torch.no_grad():
        return model.generate(**tokenizer([sentence], return_tensors="pt"), num_beams=1, max_new_tokens=1)[0, 1].item()


@pytest.mark.parametrize("search", SLOT_SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_slots_return_what_generate_returns_for_each_sentence(trained, search):
    """Each sentence's output equals generate()'s for it alone, with its own max_new_tokens, whatever the slot count
    and the order of arrival; among them sentences that stop at the first step (by their length limit of one token,
    and by an end of sentence: the token one sentence starts with is made an end of sentence) and sentences that
    reach their length limit."""
    model, tokenizer = trained
    if "eos_token_id" not in search:
        search = dict(search, eos_token_id=[tokenizer.eos_token_id, _first_token(model, tokenizer, SLOT_SENTENCES[0])])
    limits = [1 if i == 3 else 4 if i % 3 == 1 else 16 for i in range(len(SLOT_SENTENCES))]
    reference = _alone(model, tokenizer, SLOT_SENTENCES, limits, **search)
    assert len(reference[3]) == 2  # the limit of one token
    if search["eos_token_id"] is None or search["num_beams"] == 1:
        assert any(len(output) == 5 for output in reference)  # a limit of four tokens
    if search["eos_token_id"] is not None and search["num_beams"] == 1:
        assert len(reference[0]) == 2  # an end of sentence at the first step (for beam search, a finished candidate)
    sources = tokenizer(SLOT_SENTENCES)["input_ids"]
    orders = [list(range(len(sources))), list(reversed(range(len(sources)))), [5, 0, 9, 2, 7, 1, 8, 3, 6, 4]]
    for slots in (1, 3, 16):
        for order, sync_every in zip(orders, (1, 2, 3)):
            with torch.no_grad():
                outputs = slot_decoding.decode_in_slots(model, [sources[i] for i in order],
                                                             [limits[i] for i in order], slots=slots,
                                                             sync_every=sync_every, **search)
            assert [outputs[order.index(i)] for i in range(len(sources))] == reference, (slots, order)


@pytest.mark.parametrize("variant", [name for name in VARIANTS if name != "paper"])
def test_slots_across_variants(tiny_models, variant):
    """Rotary and learned positions, grouped and single key/value heads: the positions and cache rows of each slot."""
    model, tokenizer = tiny_models(**VARIANTS[variant])
    sources = tokenizer(SLOT_SENTENCES)["input_ids"]
    for search in (dict(num_beams=1), dict(num_beams=4)):
        reference = _alone(model, tokenizer, SLOT_SENTENCES, [12] * len(sources), **search)
        with torch.no_grad():
            assert slot_decoding.decode_in_slots(model, sources, 12, slots=4, **search) == reference, search


def test_slots_read_the_device_once_every_k_steps(trained, monkeypatch):
    """No decoding step reads a device value on the host (a dispatch mode counts the reading ops, a function mode
    the Tensor methods that hand a value to Python); the loop reads once every `sync_every` steps, which finished
    slots to refill, through `_read_back`."""
    model, tokenizer = trained
    sources = tokenizer(SLOT_SENTENCES)["input_ids"]
    counts = {"steps": 0, "step_reads": [], "read_backs": 0}
    step, read_back = slot_decoding._Slots.step, slot_decoding._read_back

    def counted_step(self):
        counts["steps"] += 1
        with _StepCheck() as seen, PythonReads() as read:
            step(self)
        counts["step_reads"] += seen.found + list(read.reads)

    def counted_read_back(tensor):
        counts["read_backs"] += 1
        return read_back(tensor)

    monkeypatch.setattr(slot_decoding._Slots, "step", counted_step)
    monkeypatch.setattr(slot_decoding, "_read_back", counted_read_back)
    for sync_every in (1, 4):
        counts.update(steps=0, read_backs=0)
        with torch.no_grad():  # under inference_mode, host reads escape the dispatch mode
            slot_decoding.decode_in_slots(model, sources, 16, slots=3, sync_every=sync_every, num_beams=4)
        assert counts["step_reads"] == []
        assert counts["steps"] == counts["read_backs"] * sync_every and counts["read_backs"] > 1


def test_slot_steps_replay_as_graphs(trained, replayed_steps):
    """cuda_graphs=True (here on the CPU): fixed shapes, one recorded step per slot count, replayed for every later
    step with the same memory and no host reads (the `replayed_steps` fixture), halving the slots once no sentence
    is left to start; the outputs are generate()'s."""
    (counts, host_reads), (model, tokenizer) = replayed_steps, trained
    sources = tokenizer(SLOT_SENTENCES)["input_ids"]
    for search in (dict(num_beams=1), dict(num_beams=4)):
        reference = _alone(model, tokenizer, SLOT_SENTENCES, [16] * len(sources), **search)
        counts.update(recorded=0, replayed=0)
        with torch.no_grad():
            outputs = slot_decoding.decode_in_slots(model, sources, 16, slots=4, sync_every=2, cuda_graphs=True,
                                                         **search)
        assert outputs == reference and host_reads == []
        assert 1 <= counts["recorded"] <= 3 and counts["replayed"] > 5 * counts["recorded"]  # slot counts 4, 2, 1


def test_slots_refuse_what_they_do_not_cover(trained):
    model, tokenizer = trained
    assert slot_decoding.slots_cover(model, num_beams=4)
    for search in (dict(num_beams=4, no_repeat_ngram_size=2), dict(num_beams=4, num_return_sequences=2),
                   dict(do_sample=True)):
        assert not slot_decoding.slots_cover(model, **search)
        with pytest.raises(ValueError, match="decode_in_slots runs greedy and beam search"):
            slot_decoding.decode_in_slots(model, [[5, 6, 1]], 4, **search)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_beams", [1, 4])
def test_slots_as_cuda_graphs_return_what_they_return_without(trained, num_beams):
    """On a GPU: the slots replayed as CUDA graphs (the default there) give the outputs of the same loop run
    step by step, one graph per slot count."""
    model, tokenizer = trained
    model = copy.deepcopy(model).cuda()
    sources = tokenizer(SLOT_SENTENCES)["input_ids"]
    recorded = []
    original = generation_vaswani.StepGraphs.run
    with torch.no_grad():
        plain = slot_decoding.decode_in_slots(model, sources, 16, slots=4, num_beams=num_beams, cuda_graphs=False)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(generation_vaswani.StepGraphs, "run",
                          lambda self, key, step: original(self, key, step) or recorded.append(sorted(self.graphs)))
            graphed = slot_decoding.decode_in_slots(model, sources, 16, slots=4, num_beams=num_beams)
    assert graphed == plain
    assert recorded[-1] == sorted(set(recorded[-1])) and len(recorded[-1]) <= 3
