"""The lean decoding loop (`vaswani.generation_vaswani`, behind every `generate()` call of a Vaswani translation
model): generate() returns what it returns with transformers' loop (`lean_decoding=False`; issue 4: "outputs stay
identical to the reference path"), for greedy and beam search with their options, across model variants, padded
batches and int8 weights; what it does not cover falls back to transformers' own loop."""

import contextlib
import copy
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationConfig

import vaswani.generation_vaswani as generation_vaswani
from vaswani.decoding import decode, use_lean_decoding
from vaswani.generation_vaswani import _top_k
from vaswani.inference import quantize_for_cpu

from tiny_translation_model import SOURCES, build_model_and_tokenizer

# Uneven lengths, so that the batch is padded and sentences finish at different steps.
SENTENCES = SOURCES + ["the cat", "a tree under the bird"]
# Tokens that the tiny model writes often, so that banning them changes its translations.
BAD_WORDS = [[40], [62, 55]]
# The options among SEARCHES that generate() turns into logits processors.
LOGITS_PROCESSORS = {"no_repeat_ngram_size", "bad_words_ids", "forced_eos_token_id"}
# Every option of greedy and beam search that changes which hypotheses are kept or when decoding stops.
SEARCHES = [
    dict(num_beams=1),
    dict(num_beams=1, max_new_tokens=5),
    dict(num_beams=1, max_length=7),
    dict(num_beams=1, no_repeat_ngram_size=2),  # a logits processor
    dict(num_beams=1, bad_words_ids=BAD_WORDS),
    dict(num_beams=1, forced_eos_token_id=1, max_new_tokens=6),
    dict(num_beams=1, eos_token_id=None, max_new_tokens=12),
    dict(num_beams=4),
    dict(num_beams=5),
    dict(num_beams=3, length_penalty=0.6),
    dict(num_beams=4, early_stopping=True),
    dict(num_beams=4, early_stopping=False, length_penalty=2.0),
    dict(num_beams=4, early_stopping="never", length_penalty=1.5),
    dict(num_beams=5, early_stopping=True, length_penalty=0.0),
    dict(num_beams=4, num_return_sequences=3),
    dict(num_beams=5, num_return_sequences=5, early_stopping="never"),
    dict(num_beams=4, max_new_tokens=5),
    dict(num_beams=4, max_length=7),
    dict(num_beams=4, no_repeat_ngram_size=2),
    dict(num_beams=4, bad_words_ids=BAD_WORDS),
    dict(num_beams=5, forced_eos_token_id=1, max_new_tokens=6),
    dict(num_beams=2, eos_token_id=None, max_new_tokens=12),
]
VARIANTS = {
    "paper": {},
    "modern": dict(norm_first=True, norm_type="rmsnorm", position_embedding_type="rope", ffn_activation="swiglu",
                   num_key_value_heads=2),
    "mqa-learned": dict(num_key_value_heads=1, position_embedding_type="learned"),
}


@pytest.fixture(scope="module")
def trained():
    return build_model_and_tokenizer()


def _generate_both(model, batch, cuda_graphs=False, **search):
    """generate() with transformers' loop and with the lean one (checked to have run: not a silent fallback)."""
    if "max_length" not in search:
        search = {"max_new_tokens": 20, **search}
    loops = ("_greedy", "_beam", "_greedy_static", "_beam_static")
    originals = {name: getattr(generation_vaswani, name) for name in loops}
    ran = []
    try:
        for name, original in originals.items():
            setattr(generation_vaswani, name, lambda *a, _f=original, _n=name, **k: ran.append(_n) or _f(*a, **k))
        with torch.no_grad():  # as generate() itself (under inference_mode, host reads escape the HOST_READS check)
            reference = model.generate(**batch, **search, lean_decoding=False)
            assert ran == []
            lean = model.generate(**batch, **search, cuda_graphs=cuda_graphs)
    finally:
        for name, original in originals.items():
            setattr(generation_vaswani, name, original)
    assert len(ran) == 1, ran
    return reference, lean


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_lean_decoding_returns_what_generate_returns(trained, search):
    model, tokenizer = trained
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    reference, lean = _generate_both(model, batch, **search)
    assert torch.equal(reference, lean)


def test_the_default_loop_follows_the_device_and_the_call_overrides_it(trained, monkeypatch):
    """The lean loop by default on the CPU, transformers' loop on other devices (where it measured faster);
    `lean_decoding=True`/`False` and `cuda_graphs=True` choose on any device."""
    model, tokenizer = trained
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    assert generation_vaswani._lean_by_default(model)
    ran = []
    original = generation_vaswani.decode
    # functools.wraps: generate() reads the decoding method's signature for the arguments it accepts.
    monkeypatch.setattr(generation_vaswani, "decode",
                        functools.wraps(original)(lambda *a, **k: ran.append(1) or original(*a, **k)))
    search = dict(num_beams=4, max_new_tokens=10)
    with torch.no_grad():
        reference = model.generate(**batch, **search, lean_decoding=False)
        assert ran == []
        assert torch.equal(model.generate(**batch, **search), reference) and ran == [1]
        monkeypatch.setattr(generation_vaswani, "_lean_by_default", lambda model: False)  # as on a GPU
        assert torch.equal(model.generate(**batch, **search), reference) and ran == [1]
        assert torch.equal(model.generate(**batch, **search, lean_decoding=True), reference) and ran == [1, 1]
        assert torch.equal(model.generate(**batch, **search, cuda_graphs=True), reference) and ran == [1, 1, 1]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lean_decoding_across_variants(variant):
    model, tokenizer = build_model_and_tokenizer(**VARIANTS[variant])
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    for search in (dict(num_beams=1), dict(num_beams=4)):
        reference, lean = _generate_both(model, batch, **search)
        assert torch.equal(reference, lean), search


def test_lean_decoding_of_the_int8_model(trained):
    """Exact, as in fp32: int8 activations get one scale per row and integer products add up exactly, so a row's
    numbers do not depend on the rows beside it, and finished sentences leaving the batch change nothing."""
    model, tokenizer = trained
    quantized = quantize_for_cpu(copy.deepcopy(model))
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    for search in (dict(num_beams=1), dict(num_beams=4)):
        reference, lean = _generate_both(quantized, batch, **search)
        assert torch.equal(reference, lean), search


PRECISIONS = {
    "fp32": lambda model: model,
    "bf16": lambda model: copy.deepcopy(model).to(torch.bfloat16),
    "int8": lambda model: quantize_for_cpu(copy.deepcopy(model)),
}


@pytest.mark.parametrize("num_beams", [1, 4])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_sentence_translates_alike_alone_and_in_a_padded_batch(trained, precision, num_beams):
    """A sentence's translation does not depend on the sentences beside it, with either loop. Only the padding
    differs: it lengthens the source (masked positions, which may change the last bit of the attention's sums). The
    rest of a row's numbers are its own: int8 quantizes each row with its own scale and adds its products exactly."""
    model, tokenizer = trained
    model = PRECISIONS[precision](model)
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 2  # padded, to several lengths
    for lean_decoding in (True, False):
        search = dict(num_beams=num_beams, max_new_tokens=20, lean_decoding=lean_decoding)
        with torch.no_grad():
            together = model.generate(**batch, **search)
            alone = [model.generate(**tokenizer([s], return_tensors="pt"), **search)[0] for s in SENTENCES]
        eos = model.config.eos_token_id
        assert [_until(row, eos) for row in together] == [_until(row, eos) for row in alone], lean_decoding


def _until(ids: torch.Tensor, eos: int) -> list[int]:
    """A translation's tokens up to its first end of sentence (a batch fills the rest with padding or more eos)."""
    ids = ids.tolist()
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_uncovered_calls_fall_back_to_transformers(trained):
    model, tokenizer = trained
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    for search in (dict(do_sample=True, top_k=5), dict(do_sample=True, num_beams=2)):
        torch.manual_seed(3)
        reference = model.generate(**batch, **search, lean_decoding=False)
        torch.manual_seed(3)
        assert torch.equal(reference, model.generate(**batch, **search, custom_generate=decode)), search
    # Scores go to transformers' loop too, and come back as it shapes them: one (beams·batch, vocabulary) tensor per
    # step, for as many steps as the beams ran, which may outlast the best beam (how many, the CPU's rounding decides).
    scoring = dict(num_beams=2, output_scores=True, return_dict_in_generate=True)
    reference = model.generate(**batch, **scoring, lean_decoding=False)
    scored = model.generate(**batch, **scoring, custom_generate=decode)
    assert torch.equal(scored.sequences, reference.sequences)
    assert torch.equal(scored.sequences_scores, reference.sequences_scores)
    assert len(scored.scores) == len(reference.scores) >= scored.sequences.shape[1] - 1
    assert all(torch.equal(a, b) and a.shape == (2 * len(SENTENCES), model.config.vocab_size)
               for a, b in zip(scored.scores, reference.scores))


def test_use_lean_decoding_binds_every_call_and_keeps_per_call_overrides(trained):
    model, tokenizer = trained
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    lean = use_lean_decoding(copy.deepcopy(model))
    assert torch.equal(lean.generate(**batch, num_beams=4), model.generate(**batch, num_beams=4, lean_decoding=False))
    config = GenerationConfig(num_beams=2, max_new_tokens=6, decoder_start_token_id=model.config.decoder_start_token_id,
                              eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id)
    assert torch.equal(lean.generate(**batch, generation_config=config),
                       model.generate(**batch, generation_config=config, lean_decoding=False))


def test_other_generation_modes_are_refused_in_one_sentence(trained):
    model, tokenizer = trained
    batch = tokenizer(SENTENCES[:2], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="call generate\\(\\) without it"):
        model.generate(**batch, num_beams=4, num_beam_groups=2, diversity_penalty=1.0, custom_generate=decode)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_cross_attention_with_one_source_row_per_sentence_matches_repeated_sources(trained, attention):
    """The model side of beam search's shared source: beams·B decoder rows over B encoder rows."""
    model, tokenizer = trained
    model = copy.deepcopy(model)
    model.set_attn_implementation(attention)
    batch = tokenizer(SENTENCES[:3], return_tensors="pt", padding=True)
    beams = 4
    with torch.inference_mode():
        encoded = model.get_encoder()(**batch).last_hidden_state
        targets = torch.randint(4, model.config.vocab_size, (3 * beams, 5), generator=torch.Generator().manual_seed(0))
        repeated = model(encoder_outputs=(encoded.repeat_interleave(beams, 0),),
                         attention_mask=batch["attention_mask"].repeat_interleave(beams, 0), decoder_input_ids=targets)
        shared = model(encoder_outputs=(encoded,), attention_mask=batch["attention_mask"], decoder_input_ids=targets)
    torch.testing.assert_close(shared.logits, repeated.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab_size", [32000, 320, 37])  # blocks of 128, of 32, and no blocks (plain topk)
@pytest.mark.parametrize("k", [1, 2, 8])
def test_top_k_is_torch_topk(vocab_size, k):
    scores = torch.randn(16, vocab_size, generator=torch.Generator().manual_seed(k))
    values, indices = _top_k(scores, k)
    expected_values, expected_indices = scores.topk(k, dim=-1)
    assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices)


def test_top_1_breaks_ties_like_argmax():
    scores = torch.zeros(3, 512)
    scores[0, [7, 300]] = 1.0  # two maxima in different blocks
    scores[1, [130, 131]] = 2.0  # two maxima in one block
    assert torch.equal(_top_k(scores, 1)[1].squeeze(1), scores.argmax(dim=-1))  # row 2: all equal → index 0


def test_the_scripts_decode_with_it_on_a_cpu(trained, tmp_path):
    from vaswani.loading import load_translator

    model, tokenizer = trained
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for int8 in (False, True):
        loaded, _ = load_translator(str(tmp_path), device="cpu", int8=int8)
        assert "generate" not in vars(loaded)  # the class's own method, which decodes with the lean loop on a CPU
    plain, _ = load_translator(str(tmp_path), device="cpu", decoding="transformers")
    assert plain.generate.keywords == {"lean_decoding": False}
    lean, _ = load_translator(str(tmp_path), device="cpu", decoding="lean")
    assert lean.generate.keywords == {"lean_decoding": True}
    graphs, _ = load_translator(str(tmp_path), device="cpu", decoding="graphs")
    assert graphs.generate.keywords == {"model": graphs, "cuda_graphs": True}
    with pytest.raises(ValueError, match="choose one of auto, lean, graphs, transformers"):
        load_translator(str(tmp_path), device="cpu", decoding="fast")
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    loaded, _ = load_translator(str(tmp_path), device="cpu")
    assert torch.equal(loaded.generate(**batch, num_beams=4, max_new_tokens=20),
                       plain.generate(**batch, num_beams=4, max_new_tokens=20))


def test_translate_script_with_either_loop(trained, tmp_path, capsys):
    from conftest import script_main

    model, tokenizer = trained
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    outputs = []
    for loop in ("auto", "lean", "graphs", "transformers"):
        script_main("translate")(["--model", str(tmp_path), "--device", "cpu", "--decoding", loop, *SOURCES[:3]])
        outputs.append(capsys.readouterr().out.splitlines())
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3] and len(outputs[0]) == 3


@pytest.mark.parametrize("num_beams", [1, 4])
def test_finished_sentences_leave_the_batch(trained, monkeypatch, num_beams):
    """Item 5 of generation_vaswani: the batch shrinks as sentences finish, and the outputs stay generate()'s."""
    model, tokenizer = trained
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    kept = []
    original = generation_vaswani._keep_rows
    monkeypatch.setattr(generation_vaswani, "_keep_rows", lambda state, sources, rows: kept.append(len(sources)) or original(state, sources, rows))
    reference, lean = _generate_both(model, batch, num_beams=num_beams)
    assert torch.equal(reference, lean)
    assert kept and kept == sorted(kept, reverse=True) and kept[-1] < len(SENTENCES)


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
    reads, and every later run must read the same memory as the first (a graph reads the recorded addresses, so a
    buffer replaced between batches would go unseen). The model's token-id check is left out: `check_ids` skips
    it while a CUDA graph is being recorded, and only on the CPU is it a host read."""
    import vaswani.modeling_vaswani as modeling

    counts = {"recorded": 0, "replayed": 0, "check": True}  # torch.compile refuses dispatch modes: check=False
    host_reads = []

    def run(graphs, position, step):
        recorded = graphs.__dict__.setdefault("recorded", {})
        check = _StepCheck() if counts["check"] else contextlib.nullcontext(_StepCheck())
        with check as seen:
            (recorded[position][0] if position in recorded else step)()
        if position in recorded:
            counts["replayed"] += 1
            assert seen.external == recorded[position][1], f"step {position} reads other memory than when recorded"
        else:
            host_reads.extend(seen.found)
            recorded[position] = (step, seen.external)
            counts["recorded"] += 1

    monkeypatch.setattr(generation_vaswani._StepGraphs, "run", run)
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
        reference, static = _generate_both(model, tokenizer(sentences, return_tensors="pt", padding=True),
                                           cuda_graphs=True, **search)
        assert torch.equal(reference, static)
    assert host_reads == []
    if LOGITS_PROCESSORS & set(search):
        assert counts["recorded"] == counts["replayed"] == 0
    else:
        assert counts["recorded"] > 0 and counts["replayed"] > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_static_decoding_across_variants(replayed_steps, variant):
    model, tokenizer = build_model_and_tokenizer(**VARIANTS[variant])
    counts, host_reads = replayed_steps
    for sentences in SAME_SHAPE_BATCHES[:2]:
        batch = tokenizer(sentences, return_tensors="pt", padding=True)
        for search in (dict(num_beams=1), dict(num_beams=4)):
            reference, static = _generate_both(model, batch, **search, cuda_graphs=True)
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
        _generate_both(model, tokenizer(SENTENCES[:2], return_tensors="pt", padding=True), cuda_graphs=True,
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
    """Each sentence's output from generate() on that sentence alone."""
    with torch.no_grad():
        return [model.generate(**tokenizer([sentence], return_tensors="pt"), max_new_tokens=limit, **search)[0].tolist()
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
                outputs = generation_vaswani.decode_in_slots(model, [sources[i] for i in order],
                                                             [limits[i] for i in order], slots=slots,
                                                             sync_every=sync_every, **search)
            assert [outputs[order.index(i)] for i in range(len(sources))] == reference, (slots, order)


@pytest.mark.parametrize("variant", [name for name in VARIANTS if name != "paper"])
def test_slots_across_variants(variant):
    """Rotary and learned positions, grouped and single key/value heads: the positions and cache rows of each slot."""
    model, tokenizer = build_model_and_tokenizer(**VARIANTS[variant])
    sources = tokenizer(SLOT_SENTENCES)["input_ids"]
    for search in (dict(num_beams=1), dict(num_beams=4)):
        reference = _alone(model, tokenizer, SLOT_SENTENCES, [12] * len(sources), **search)
        with torch.no_grad():
            assert generation_vaswani.decode_in_slots(model, sources, 12, slots=4, **search) == reference, search


def test_slots_read_the_device_once_every_k_steps(trained, monkeypatch):
    """No decoding step reads a device value on the host (a dispatch mode counts the reading ops); the loop reads
    once every `sync_every` steps, which finished slots to refill, through `_read_back`."""
    model, tokenizer = trained
    sources = tokenizer(SLOT_SENTENCES)["input_ids"]
    counts = {"steps": 0, "step_reads": [], "read_backs": 0}
    step, read_back = generation_vaswani._Slots.step, generation_vaswani._read_back

    def counted_step(self):
        counts["steps"] += 1
        with _StepCheck() as seen:
            step(self)
        counts["step_reads"] += seen.found

    def counted_read_back(tensor):
        counts["read_backs"] += 1
        return read_back(tensor)

    monkeypatch.setattr(generation_vaswani._Slots, "step", counted_step)
    monkeypatch.setattr(generation_vaswani, "_read_back", counted_read_back)
    for sync_every in (1, 4):
        counts.update(steps=0, read_backs=0)
        with torch.no_grad():  # under inference_mode, host reads escape the dispatch mode
            generation_vaswani.decode_in_slots(model, sources, 16, slots=3, sync_every=sync_every, num_beams=4)
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
            outputs = generation_vaswani.decode_in_slots(model, sources, 16, slots=4, sync_every=2, cuda_graphs=True,
                                                         **search)
        assert outputs == reference and host_reads == []
        assert 1 <= counts["recorded"] <= 3 and counts["replayed"] > 5 * counts["recorded"]  # slot counts 4, 2, 1


def test_slots_refuse_what_they_do_not_cover(trained):
    model, tokenizer = trained
    assert generation_vaswani.slots_cover(model, num_beams=4)
    for search in (dict(num_beams=4, no_repeat_ngram_size=2), dict(num_beams=4, num_return_sequences=2),
                   dict(do_sample=True)):
        assert not generation_vaswani.slots_cover(model, **search)
        with pytest.raises(ValueError, match="decode_in_slots runs greedy and beam search"):
            generation_vaswani.decode_in_slots(model, [[5, 6, 1]], 4, **search)


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
    original = generation_vaswani._StepGraphs.run
    with torch.no_grad():
        plain = generation_vaswani.decode_in_slots(model, sources, 16, slots=4, num_beams=num_beams, cuda_graphs=False)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(generation_vaswani._StepGraphs, "run",
                          lambda self, key, step: original(self, key, step) or recorded.append(sorted(self.graphs)))
            graphed = generation_vaswani.decode_in_slots(model, sources, 16, slots=4, num_beams=num_beams)
    assert graphed == plain
    assert recorded[-1] == sorted(set(recorded[-1])) and len(recorded[-1]) <= 3

