"""The lean decoding loop (`vaswani.generation_vaswani`, behind every `generate()` call of a Vaswani translation
model): generate() returns what it returns with transformers' loop (`lean_decoding=False`: the outputs stay
identical to the reference path), for greedy and beam search with their options, across model variants, padded
batches and int8 weights; what it does not cover falls back to transformers' own loop."""

import copy
import functools

import pytest
import torch
from transformers import GenerationConfig

import vaswani.generation_vaswani as generation_vaswani
from vaswani.decoding import decode, use_lean_decoding
from vaswani.generation_vaswani import top_k
from vaswani.inference import quantize_for_cpu

from decoding_helpers import SEARCHES, SENTENCES, VARIANTS, generate_both
from tiny_translation_model import SOURCES


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_lean_decoding_returns_what_generate_returns(trained, search):
    model, tokenizer = trained
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    reference, lean = generate_both(model, batch, **search)
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
def test_lean_decoding_across_variants(tiny_models, variant):
    model, tokenizer = tiny_models(**VARIANTS[variant])
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    for search in (dict(num_beams=1), dict(num_beams=4)):
        reference, lean = generate_both(model, batch, **search)
        assert torch.equal(reference, lean), search


def test_lean_decoding_of_the_int8_model(trained):
    """Exact, as in fp32: int8 activations get one scale per row and integer products add up exactly, so a row's
    numbers do not depend on the rows beside it, and finished sentences leaving the batch change nothing."""
    model, tokenizer = trained
    quantized = quantize_for_cpu(copy.deepcopy(model))
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    for search in (dict(num_beams=1), dict(num_beams=4)):
        reference, lean = generate_both(quantized, batch, **search)
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
    values, indices = top_k(scores, k)
    expected_values, expected_indices = scores.topk(k, dim=-1)
    assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices)


def test_top_1_breaks_ties_like_argmax():
    scores = torch.zeros(3, 512)
    scores[0, [7, 300]] = 1.0  # two maxima in different blocks
    scores[1, [130, 131]] = 2.0  # two maxima in one block
    assert torch.equal(top_k(scores, 1)[1].squeeze(1), scores.argmax(dim=-1))  # row 2: all equal → index 0


def test_the_scripts_decode_with_it_on_a_cpu(trained, tmp_path):
    from vaswani.loading import decoding_loop, load_translator

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
    compiled, _ = load_translator(str(tmp_path), device="cpu", decoding="compiled")
    assert compiled.generate.keywords == {"lean_decoding": True}
    assert "forward" in vars(compiled)  # compile_decoding_steps' wrapper around torch.compile's
    with pytest.raises(ValueError, match="choose one of auto, lean, compiled, graphs, transformers"):
        load_translator(str(tmp_path), device="cpu", decoding="fast")
    # torch.compile cannot trace fbgemm's int8 weights
    with pytest.raises(ValueError, match=r"not int8 ones \(int8=True\)"):
        load_translator(str(tmp_path), device="cpu", decoding="compiled", int8=True)
    # On a CUDA GPU "auto" is the lean loop replayed as CUDA graphs, which translated fastest there; a loop asked for
    # is kept on any device.
    assert [decoding_loop("auto", torch.device(name)) for name in ("cuda", "cuda:1", "cpu")] == ["graphs", "graphs",
                                                                                                   "auto"]
    assert [decoding_loop(loop, torch.device("cuda")) for loop in ("lean", "graphs", "transformers")] == [
        "lean", "graphs", "transformers"]
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    loaded, _ = load_translator(str(tmp_path), device="cpu")
    assert torch.equal(loaded.generate(**batch, num_beams=4, max_new_tokens=20),
                       plain.generate(**batch, num_beams=4, max_new_tokens=20))


@pytest.mark.slow
@pytest.mark.parametrize("num_beams", [1, 4])
def test_compiled_decoding_steps_return_what_generate_returns(trained, tmp_path, num_beams, single_thread):
    """`decoding="compiled"`: the lean loop, its steps compiled with dynamic shapes, as sentences of uneven lengths
    finish at different steps and leave the batch; two batches of other shapes reuse or extend the graphs."""
    from torch._dynamo.utils import counters

    from vaswani.loading import load_translator

    model, tokenizer = trained
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    compiled, _ = load_translator(str(tmp_path), device="cpu", decoding="compiled", dtype="float32")
    torch._dynamo.reset()  # graphs of earlier tests could otherwise serve these calls
    counters.clear()
    for sentences in (SENTENCES, SENTENCES[::-1][:3], SENTENCES[1:]):
        batch = tokenizer(sentences, return_tensors="pt", padding=True)
        with torch.no_grad():
            reference = model.generate(**batch, num_beams=num_beams, max_new_tokens=20, lean_decoding=False)
            actual = compiled.generate(**batch, num_beams=num_beams, max_new_tokens=20)
        assert torch.equal(actual, reference)
        if num_beams == 1:  # sentences finished at different steps: rows left the batch
            lengths = (reference != tokenizer.pad_token_id).sum(dim=1)
            assert lengths.min() < lengths.max()
    assert counters["stats"]["unique_graphs"] > 0, "the decoding steps did not run compiled"
    assert not counters["graph_break"], "a decoding step left the graph: Python between its kernels again"


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
    reference, lean = generate_both(model, batch, num_beams=num_beams)
    assert torch.equal(reference, lean)
    assert kept and kept == sorted(kept, reverse=True) and kept[-1] < len(SENTENCES)


@pytest.mark.parametrize("search", [dict(num_beams=4), dict(num_beams=3, no_repeat_ngram_size=2)],
                         ids=["beams", "beams-with-a-logits-processor"])
def test_beam_searchs_first_step_decodes_one_row_per_sentence(trained, monkeypatch, search):
    """Item 4 of generation_vaswani: the beams start as copies of one prompt, so the first step decodes a row per
    sentence and every later step a row per beam; the outputs stay generate()'s."""
    model, tokenizer = trained
    batch = tokenizer(SENTENCES, return_tensors="pt", padding=True)
    rows = []
    original = generation_vaswani._next_token_logits
    monkeypatch.setattr(generation_vaswani, "_next_token_logits",
                        lambda model, tokens, *state: rows.append(len(tokens)) or original(model, tokens, *state))
    reference, lean = generate_both(model, batch, **search)
    assert torch.equal(reference, lean)
    assert rows[0] == len(SENTENCES) and rows[1] == len(SENTENCES) * search["num_beams"], rows
