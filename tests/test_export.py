"""The CTranslate2 exporter (`vaswani.export`, `scripts/export_ctranslate2.py`): the exported model must score and
translate exactly like the PyTorch model, for every architecture variant CTranslate2 can express."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import fails_with_one_line, greedy_checkpoint, other_names, script_main, snapshot
from tiny_translation_model import SOURCES, TARGETS, build_tokenizer

from vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani.evaluation import translate
import vaswani.export
import vaswani.generation_vaswani
from vaswani.engine_choice import load_default_engine
from vaswani.export import cached_export, export_to_ctranslate2
from vaswani.loading import load_engine
from vaswani.translation import translate as translate_with

ctranslate2 = pytest.importorskip("ctranslate2")


def tokens(tokenizer, texts, target=False):
    """What a CTranslate2 user passes: the tokenizer's tokens, the source with its </s>; a target without it (the
    translator appends </s> when scoring)."""
    if target:
        return [tokenizer.convert_ids_to_tokens(tokenizer(text_target=t)["input_ids"])[:-1] for t in texts]
    return [tokenizer.convert_ids_to_tokens(tokenizer(s)["input_ids"]) for s in texts]


def torch_log_probs(model, tokenizer, sources, targets) -> list[torch.Tensor]:
    """Each target token's log-probability under teacher forcing, </s> included."""
    batch = tokenizer(sources, text_target=targets, return_tensors="pt", padding=True)
    with torch.inference_mode():
        log_probs = model(**batch).logits.float().log_softmax(-1)
    labels = batch["labels"]
    picked = log_probs.gather(-1, labels[..., None])[..., 0]
    return [row[label != tokenizer.pad_token_id] for row, label in zip(picked, labels)]


VARIANTS = {
    "paper": {},
    "pre-norm": {"norm_first": True},
    "rmsnorm-swiglu-no-bias": {"norm_first": True, "norm_type": "rmsnorm", "ffn_activation": "swiglu", "bias": False},
    "gelu-learned-positions": {"ffn_activation": "gelu", "position_embedding_type": "learned"},
    "geglu-mqa-unscaled": {"ffn_activation": "geglu", "num_key_value_heads": 1, "scale_embedding": False},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_exported_model_scores_every_token_like_pytorch(variant, tmp_path):
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=len(tokenizer), **VARIANTS[variant])).eval()
    translator = ctranslate2.Translator(export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer))

    scored = translator.score_batch(tokens(tokenizer, SOURCES), tokens(tokenizer, TARGETS, target=True))

    for expected, result in zip(torch_log_probs(model, tokenizer, SOURCES, TARGETS), scored):
        assert len(result.log_probs) == len(expected)
        torch.testing.assert_close(torch.tensor(result.log_probs), expected, atol=1e-4, rtol=1e-4)


def test_exported_model_translates_like_generate(trained, tmp_path):
    """Greedy decoding gives the same translations, </s> included. Beam search is compared through its scores
    (`test_exported_model_scores_every_token_like_pytorch`), not its outputs: the two libraries end a search by
    different rules (CTranslate2 once `beam_size` hypotheses have finished; transformers, with its default
    early_stopping=False, once no running beam can beat the finished ones), so either may return a hypothesis the
    other never finished. Seen on this toy model: "un chien a cou" against "un chien a couru"."""
    model, tokenizer = trained
    translator = ctranslate2.Translator(export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer))
    batch = tokenizer(SOURCES, return_tensors="pt", padding=True)
    with torch.inference_mode():
        expected = tokenizer.batch_decode(model.generate(**batch, num_beams=1, max_new_tokens=16),
                                          skip_special_tokens=True)

    results = translator.translate_batch(tokens(tokenizer, SOURCES), beam_size=1, max_decoding_length=16)

    hypotheses = [tokenizer.convert_tokens_to_string(r.hypotheses[0]) for r in results]
    assert hypotheses == expected
    assert len(set(hypotheses)) > 1  # the model's translations depend on the input


def test_int8_export_from_a_checkpoint_directory(trained, checkpoint, tmp_path):
    model, tokenizer = trained
    output = export_to_ctranslate2(checkpoint, tmp_path / "ct2", quantization="int8")

    fp32_bytes = sum(p.numel() * 4 for p in model.parameters() if p is not model.lm_head.weight)
    assert (Path(output) / "model.bin").stat().st_size < 0.6 * fp32_bytes  # int8 matrices, fp32 norms and biases
    translator = ctranslate2.Translator(output, compute_type="int8")
    # Greedy on both sides: CTranslate2's default is beam_size=2, whose outputs differ from greedy search's even in fp32.
    results = translator.translate_batch(tokens(tokenizer, SOURCES), max_decoding_length=16, beam_size=1)
    with torch.inference_mode():
        fp32 = model.generate(**tokenizer(SOURCES, return_tensors="pt", padding=True), max_new_tokens=16, num_beams=1)
    expected = tokenizer.batch_decode(fp32, skip_special_tokens=True)
    agree = sum(tokenizer.convert_tokens_to_string(r.hypotheses[0]) == e for r, e in zip(results, expected))
    assert agree >= 4  # int8 rounding may flip a near-tie in one of five sentences


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"position_embedding_type": "rope"}, "no rotary positions"),
        ({"num_attention_heads": 4, "num_key_value_heads": 2}, "2 key/value heads for 4 query heads"),
    ],
)
def test_refuses_what_ctranslate2_cannot_express(tmp_path, overrides, message):
    tokenizer = build_tokenizer()
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=len(tokenizer), **overrides))
    with pytest.raises(ValueError, match=message):
        export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    assert not (tmp_path / "ct2").exists()


def test_refuses_a_tokenizer_of_another_size(tmp_path):
    tokenizer = build_tokenizer()
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=len(tokenizer) + 5))
    with pytest.raises(ValueError, match="export the tokenizer the model was trained with"):
        export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)


def test_export_script(checkpoint, tmp_path, capsys):
    export = script_main("export_ctranslate2")

    export(["--model", str(checkpoint), "--output_dir", str(tmp_path / "ct2"),
                 "--quantization", "int8"])

    assert (tmp_path / "ct2" / "model.bin").is_file() and (tmp_path / "ct2" / "shared_vocabulary.json").is_file()
    assert str(tmp_path / "ct2") in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # an existing directory is a user error without --force
        export(["--model", str(checkpoint), "--output_dir", str(tmp_path / "ct2")])
    assert exit_info.value.code == 2


def test_the_exported_directory_translates_like_evaluation_translate(trained, tmp_path):
    model, tokenizer = trained
    export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    engine = load_engine(str(tmp_path / "ct2"))  # the tokenizer travels with the export, found by its model.bin
    assert engine.settings["engine"] == "ctranslate2"

    # Greedy, where the two libraries' outputs are equal (beam search may stop differently: see above).
    got = translate_with(engine, SOURCES, max_sentences=2, warn=False).texts

    assert got == translate(model, tokenizer, SOURCES, batch_size=2, num_beams=1)


def test_evaluate_bleu_script_with_ctranslate2(trained, checkpoint, tmp_path, capsys):
    model, tokenizer = trained
    export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    (tmp_path / "src.en").write_text("\n".join(SOURCES) + "\n")
    (tmp_path / "ref.fr").write_text("\n".join(TARGETS) + "\n")
    files = ["--source_file", str(tmp_path / "src.en"), "--reference_file", str(tmp_path / "ref.fr"), "--device", "cpu",
             "--num_beams", "1"]  # greedy: equal outputs, hence equal scores (beam search may stop differently)
    evaluate = script_main("evaluate_bleu")

    evaluate(["--model", str(checkpoint), "--no-ctranslate2", *files])
    pytorch = json.loads(capsys.readouterr().out)
    evaluate(["--model", str(tmp_path / "ct2"), "--ctranslate2", *files])
    exported = json.loads(capsys.readouterr().out)

    assert exported["engine"] == "ctranslate2 float32" and pytorch["engine"] == "pytorch float32"
    # The report says why each engine decoded.
    assert pytorch["engine_choice"] == {"engine": "pytorch", "reason": "--no-ctranslate2", "seconds": None,
                                        "sample": None}
    assert exported["engine_choice"]["reason"] == "--ctranslate2"
    assert exported["bleu"] == pytorch["bleu"] and exported["chrf"] == pytorch["chrf"]
    evaluate(["--model", str(checkpoint), "--ctranslate2", *files])  # a checkpoint: through its cached export
    cached = json.loads(capsys.readouterr().out)
    assert cached["engine"] == "ctranslate2 float32" and cached["bleu"] == pytorch["bleu"]


def test_an_export_does_torchs_work_on_one_thread_and_gives_the_count_back(checkpoint, tmp_path, monkeypatch):
    """An export starts no team of torch threads: in the process that then decodes with CTranslate2 (on torch's
    OpenMP runtime), such a team halved CTranslate2's speed (`vaswani.export.one_torch_thread`)."""
    import vaswani.export

    seen, model_spec = [], vaswani.export.model_spec
    monkeypatch.setattr(vaswani.export, "model_spec", lambda *args: seen.append(torch.get_num_threads())
                        or model_spec(*args))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        export_to_ctranslate2(str(checkpoint), str(tmp_path / "ct2"), measure_on=SOURCES[:2])
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_cached_export_is_reused_and_made_again_when_the_weights_change(checkpoint, tmp_path):
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    cache = tmp_path / "cache"

    first, made = cached_export(str(path), str(cache))
    again, made_again = cached_export(str(path), str(cache))
    assert made and not made_again and again == first
    weights = (Path(first) / "model.bin").stat().st_mtime_ns

    model = VaswaniForConditionalGeneration.from_pretrained(path)  # other weights, saved in place
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    model.save_pretrained(path)
    rebuilt, made = cached_export(str(path), str(cache))

    assert made and rebuilt == first and (Path(first) / "model.bin").stat().st_mtime_ns != weights
    exported = translate_with(load_default_engine(str(path), device="cpu", cache_dir=str(cache), ctranslate2=True),
                              SOURCES).texts
    pytorch = translate_with(load_engine(str(path), device="cpu", ctranslate2=False), SOURCES).texts
    assert exported == pytorch


def test_sources_and_outputs_stay_inside_the_exported_position_table(trained, tmp_path):
    model, tokenizer = trained
    export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer, max_positions=24)
    engine = load_engine(str(tmp_path / "ct2"), num_beams=2, max_new_tokens=100)
    translator, calls = engine.translator, []

    class Recording:  # CTranslate2 fails past the table ("No position encodings are defined for positions >= 24")
        def translate_batch(self, sources, **options):
            calls.append(([len(s) for s in sources], options["max_decoding_length"]))
            return translator.translate_batch(sources, **options)

    long_source = " ".join(SOURCES * 4)  # about 90 tokens
    engine.translator = Recording()
    got = translate_with(engine, [long_source, SOURCES[0]], warn=False).texts

    assert len(got) == 2 and all(got)
    assert calls == [([24, 7], 23)]  # the PyTorch engine's limit: the table less the decoder start's position


def test_the_export_never_writes_over_its_model_and_replaces_any_other_directory_whole(checkpoint, tmp_path,
                                                                                       capsys):
    model = tmp_path / "run" / "model"
    shutil.copytree(checkpoint, model)
    before = snapshot(tmp_path / "run")
    export = script_main("export_ctranslate2")
    for kind, output in {**other_names(model, tmp_path), "holding it": tmp_path / "run"}.items():
        error = fails_with_one_line(export, ["--model", str(model), "--output_dir", str(output), "--force"], capsys,
                                    "the input")
        assert "--force" not in error, kind
    assert snapshot(tmp_path / "run") == before
    old = tmp_path / "ct2"
    old.mkdir()
    (old / "stale.bin").write_bytes(b"of an earlier export")
    export(["--model", str(model), "--output_dir", str(old), "--force"])
    assert not (old / "stale.bin").exists() and (old / "model.bin").is_file()


def test_a_ctranslate2_engine_gets_the_cpu_threads_torch_has(trained, tmp_path, monkeypatch):
    """CTranslate2's own default is a fixed thread count; an engine from the factory uses the cores torch uses, so
    both engines of a comparison (and a user's --threads) get the same."""
    model, tokenizer = trained
    export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    options, real = [], ctranslate2.Translator
    monkeypatch.setattr(ctranslate2, "Translator",
                        lambda *args, **kwargs: options.append(kwargs) or real(*args, **kwargs))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = load_engine(str(tmp_path / "ct2"), device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert [option["intra_threads"] for option in options] == [1]
    assert translate_with(engine, SOURCES[:2]).texts  # the engine translates
