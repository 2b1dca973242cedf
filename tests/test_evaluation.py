"""Scores must be sacreBLEU's, references must line up with their hypotheses, and batching must not reorder."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import sacrebleu
from conftest import fails_with_one_line, other_names, script_main, tiny_config
from tiny_translation_model import SOURCES
from transformers import AutoTokenizer, EvalPrediction

from vaswani import VaswaniForConditionalGeneration
from vaswani.evaluation import build_compute_metrics, evaluate_model, reference_streams, score_corpus, translate

HYPOTHESES = ["the cat sat on the mat .", "there is a dog in the garden", "he reads a book every evening"]
# Two references per hypothesis, as a list per hypothesis (our input format).
TWO_REFERENCES = [
    ["the cat sat on the mat .", "a cat was sitting on the mat ."],
    ["a dog is in the garden", "there's a dog in the yard"],
    ["every evening he reads a book", "he reads books in the evening"],
]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_models):
    return tiny_models()


def test_reference_streams_transpose_and_pad_ragged_lists_with_none():
    streams = reference_streams([["a", "b", "c"], "d", ["e", "f"]], num_hypotheses=3)
    assert streams == [["a", "d", "e"], ["b", None, "f"], ["c", None, None]]


@pytest.mark.parametrize(
    "references, message",
    [([["a"]], "2 hypotheses but 1"), ([["a"], []], "hypothesis 1 needs at least one"), ([["a"], [None]], "hypothesis 1")],
)
def test_reference_streams_reject_misaligned_or_empty_references(references, message):
    with pytest.raises(ValueError, match=message):
        reference_streams(references, num_hypotheses=2)


def test_multi_reference_scores_equal_sacrebleu_corpus_functions():
    scores = score_corpus(HYPOTHESES, TWO_REFERENCES)
    streams = [[refs[0] for refs in TWO_REFERENCES], [refs[1] for refs in TWO_REFERENCES]]
    assert scores["bleu"] == sacrebleu.corpus_bleu(HYPOTHESES, streams).score
    assert scores["chrf"] == sacrebleu.corpus_chrf(HYPOTHESES, streams).score
    assert scores["ter"] == sacrebleu.corpus_ter(HYPOTHESES, streams).score
    # A second reference must actually be used: it can only raise BLEU over the first reference alone.
    assert scores["bleu"] > sacrebleu.corpus_bleu(HYPOTHESES, streams[:1]).score
    assert scores["signatures"]["bleu"].startswith("nrefs:2|case:mixed|eff:no|tok:13a|smooth:exp")


def test_single_reference_strings_are_one_reference_each():
    references = [refs[0] for refs in TWO_REFERENCES]
    assert score_corpus(HYPOTHESES, references) == score_corpus(HYPOTHESES, [[ref] for ref in references])


def test_ragged_references_give_hand_computed_ter():
    # Sentence 1: 0 edits against its only reference (3 words). Sentence 2: 1 edit against its best reference,
    # average reference length (4 + 3) / 2. Corpus TER = total edits / total average reference length.
    scores = score_corpus(["the cat sat", "a dog ran"], [["the cat sat"], ["a dog ran fast", "the dog ran"]])
    assert scores["ter"] == pytest.approx(100 * 1 / (3 + 3.5))
    assert scores["signatures"]["ter"].startswith("nrefs:var")


def test_ragged_references_are_not_padded_with_empty_strings():
    # Repeating a sentence's own reference changes neither BLEU nor chrF; an empty padding reference would: for the
    # one-word hypothesis, length 0 is closer than 5 and would remove BLEU's brevity penalty.
    hypotheses = ["cat", "a dog ran in the park"]
    ragged = [["the cat sat on it"], ["a dog ran in the park", "the dog runs in a park"]]
    repeated = [["the cat sat on it", "the cat sat on it"], ragged[1]]
    for metric in ("bleu", "chrf"):
        assert score_corpus(hypotheses, ragged)[metric] == score_corpus(hypotheses, repeated)[metric]


def test_compute_metrics_decodes_generated_ids_and_labels(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    hypotheses = ["the cat sat on a mat", "a dog ran", "le chat"]
    labels_text = ["the cat sat on the mat", "a dog ran", "le chien"]
    # Generated ids start with the decoder start token (<s>) and are padded with pad (within a batch) and -100
    # (between batches); labels are padded with -100.
    generated = [[tokenizer.bos_token_id] + ids for ids in tokenizer(hypotheses)["input_ids"]]
    predictions = np.full((3, 9), -100)
    for row, ids in enumerate(generated):
        predictions[row, : len(ids)] = ids
    predictions[1, len(generated[1])] = tokenizer.pad_token_id
    label_ids = np.full((3, 8), -100)
    for row, ids in enumerate(tokenizer(labels_text)["input_ids"]):
        label_ids[row, : len(ids)] = ids
    eval_pred = EvalPrediction(predictions=predictions, label_ids=label_ids)

    metrics = build_compute_metrics(tokenizer)(eval_pred)
    assert metrics == {
        "bleu": sacrebleu.corpus_bleu(hypotheses, [labels_text]).score,
        "chrf": sacrebleu.corpus_chrf(hypotheses, [labels_text]).score,
        "ter": sacrebleu.corpus_ter(hypotheses, [labels_text]).score,
    }
    assert 0 < metrics["bleu"] < 100

    # Given references replace the labels; here they include each hypothesis, so the score is perfect.
    references = [["the cat sat on a mat"], ["a dog ran", "a dog was running"], ["le chien", "le chat"]]
    assert build_compute_metrics(tokenizer, references)(eval_pred) == pytest.approx({"bleu": 100, "chrf": 100, "ter": 0})


def test_translate_batches_by_length_and_restores_input_order(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    one_by_one = [translate(model, tokenizer, [sentence], num_beams=1, max_new_tokens=8)[0] for sentence in SOURCES]
    assert len(set(one_by_one)) > 2, "the tiny model must translate different inputs differently for this test"

    source_widths, limits = [], []
    generate = model.generate

    def recording_generate(**kwargs):
        source_widths.append(kwargs["input_ids"].shape[1])
        limits.append(kwargs["max_length"] - 1)  # the new tokens and the decoder's start token (length_options)
        return generate(**kwargs)

    monkeypatch.setattr(model, "generate", recording_generate)
    assert translate(model, tokenizer, SOURCES, batch_size=2, num_beams=1, max_new_tokens=8) == one_by_one
    assert source_widths == sorted(source_widths, reverse=True) and len(source_widths) == 3

    source_widths.clear(), limits.clear()
    translate(model, tokenizer, SOURCES, batch_size=2, num_beams=1)
    # The paper's "input length + 50" default, of the batch's longest source (the others stop at their own), within
    # the positions less the decoder start's.
    longest = model.config.max_position_embeddings - 1
    assert limits == [min(width + 50, longest) for width in source_widths]


def test_translate_handles_empty_input(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    assert translate(model, tokenizer, []) == []
    assert len(translate(model, tokenizer, ["", "cat"], num_beams=1, max_new_tokens=4)) == 2


def test_translate_disables_dropout_and_restores_training_mode(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    expected = translate(model, tokenizer, SOURCES, max_new_tokens=8)
    model.train()
    try:
        assert translate(model, tokenizer, SOURCES, max_new_tokens=8) == expected
        assert model.training
    finally:
        model.eval()


def test_evaluate_model_aligns_hypotheses_with_their_references(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    hypotheses = translate(model, tokenizer, SOURCES, num_beams=2, max_new_tokens=8)
    own = [[hypothesis, "an unrelated reference"] for hypothesis in hypotheses]
    result = evaluate_model(model, tokenizer, SOURCES, own, num_beams=2, max_new_tokens=8)
    assert result["hypotheses"] == hypotheses
    assert (result["bleu"], result["chrf"], result["ter"]) == pytest.approx((100, 100, 0))

    shifted = own[1:] + own[:1]  # every hypothesis now faces another sentence's references
    assert evaluate_model(model, tokenizer, SOURCES, shifted, num_beams=2, max_new_tokens=8)["bleu"] < 100


def test_evaluate_bleu_script_decodes_with_the_chosen_length_penalty(model_and_tokenizer, tmp_path, capsys):
    """--length_penalty reaches generate(): the script's translations are those of `translate` with that penalty
    (beam search; the main job's decoding is chosen on the validation split with it, issue 16)."""
    model, tokenizer = model_and_tokenizer
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "src.en").write_text("\n".join(SOURCES) + "\n")
    (tmp_path / "ref.fr").write_text("le chat\nun chien\nl'oiseau\nchat\nle chien\n")
    files = ["--source_file", str(tmp_path / "src.en"), "--reference_file", str(tmp_path / "ref.fr")]
    for penalty in (0.0, 2.0):
        script_main("evaluate_bleu")(["--model", str(tmp_path / "model"), "--device", "cpu", "--num_beams", "3",
                                      "--length_penalty", str(penalty), "--output_file",
                                      str(tmp_path / "report.json"), *files])
        assert json.loads(capsys.readouterr().out)["length_penalty"] == penalty
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["hypotheses"] == translate(model, tokenizer, SOURCES, num_beams=3, length_penalty=penalty)
    with pytest.raises(SystemExit):  # a CTranslate2 model takes --length_penalty too, not the PyTorch loops
        script_main("evaluate_bleu")(["--model", str(tmp_path / "model"), "--ctranslate2", "--length_penalty", "0.6",
                                      "--decoding", "lean", *files])
    assert "--decoding: the PyTorch engine's" in capsys.readouterr().err


def test_evaluate_bleu_under_two_processes_scores_what_one_process_scores(good_checkpoint, tmp_path, capsys):
    """torchrun with 2 processes: each translates every other source (5 sources: shares of 3 and 2), process 0
    gathers them in order, scores and writes the report, and the launch ends with status 0 (a process that is done
    waits at the group's barrier rather than being taken for a lost one). About 20 s: one launch of two processes."""
    (tmp_path / "src.en").write_text("\n".join(SOURCES) + "\n")
    (tmp_path / "ref.fr").write_text("le chat\nun chien\nl'oiseau\nchat\nle chien\n")
    arguments = ["--model", str(good_checkpoint), "--device", "cpu", "--num_beams", "1", "--source_file",
                 str(tmp_path / "src.en"), "--reference_file", str(tmp_path / "ref.fr"), "--output_file"]
    script_main("evaluate_bleu")([*arguments, str(tmp_path / "one.json")])
    capsys.readouterr()
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "evaluate_bleu.py")
    launch = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             script, *arguments, str(tmp_path / "two.json")], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert launch.returncode == 0, launch.stderr[-3000:]
    assert launch.stdout.count('"sentences"') == 1  # process 0 alone prints the scores
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert two["hypotheses"] == one["hypotheses"] and len(set(one["hypotheses"])) > 1
    assert (two["bleu"], two["sentences"]) == (one["bleu"], 5)


def test_evaluate_bleu_never_writes_its_report_over_an_input(tmp_path, capsys):
    """Refused before the model is read: --model names nothing here."""
    source, reference = tmp_path / "src.en", tmp_path / "ref.fr"
    source.write_text("the cat\n")
    reference.write_text("le chat\n")
    for path in (source, reference):
        for name in other_names(path, tmp_path).values():
            fails_with_one_line(script_main("evaluate_bleu"), ["--model", str(tmp_path / "no-model"), "--source_file",
                                                               str(source), "--reference_file", str(reference),
                                                               "--output_file", str(name)],
                                capsys, f"{name} is the input {path}")
    assert (source.read_text(), reference.read_text()) == ("the cat\n", "le chat\n")


def test_evaluate_bleu_names_each_file_of_another_length_and_its_count(tmp_path, capsys):
    source, same, short = tmp_path / "src.en", tmp_path / "ref1.fr", tmp_path / "ref2.fr"
    source.write_text("the cat\na dog\n")
    same.write_text("le chat\nun chien\n")
    short.write_text("le chat\n")
    fails_with_one_line(script_main("evaluate_bleu"), ["--model", str(tmp_path / "no-model"), "--source_file",
                                                       str(source), "--reference_file", str(same), "--reference_file",
                                                       str(short)],
                        capsys, f"--source_file {source} (2): {short} has 1")


def test_the_shipped_evaluate_module_gives_score_corpus_numbers(tmp_path):
    from vaswani.evaluator import METRIC_PATH, load_metric

    metric = load_metric(cache_dir=str(tmp_path))
    assert metric.name == "sacrebleu_multiref"
    ragged = [TWO_REFERENCES[0], TWO_REFERENCES[1][:1], TWO_REFERENCES[2]]
    expected = score_corpus(HYPOTHESES, ragged)
    assert metric.compute(predictions=HYPOTHESES, references=ragged) == {k: expected[k] for k in ("bleu", "chrf", "ter")}
    single = [refs[0] for refs in TWO_REFERENCES]
    expected = score_corpus(HYPOTHESES, single)
    assert metric.compute(predictions=HYPOTHESES, references=single) == {k: expected[k] for k in ("bleu", "chrf", "ter")}
    assert METRIC_PATH.parent.name == "vaswani"  # shipped inside the package, beside the code it calls


def test_translation_evaluator_keeps_generation_options_to_itself():
    import evaluate

    from vaswani.evaluator import TranslationEvaluator

    # evaluate's compute(generation_kwargs=...) updates PIPELINE_KWARGS in place; the class's dict is shared.
    evaluator = TranslationEvaluator()
    evaluator.PIPELINE_KWARGS.update(num_beams=4)
    assert "num_beams" not in evaluate.TranslationEvaluator.PIPELINE_KWARGS
    assert "num_beams" not in TranslationEvaluator().PIPELINE_KWARGS


def test_evaluate_evaluator_over_the_shipped_pipeline_gives_evaluate_bleu_numbers(tiny_models, tmp_path, capsys):
    """`evaluate`'s translation evaluator, over `pipeline("translation", <checkpoint>, trust_remote_code=True)` and
    the package's metric module, in a fresh process that is offline with an empty Hugging Face cache (so nothing
    can come from the Hub), scores exactly what scripts/evaluate_bleu.py scores: the same translations (one
    sentence per batch on both sides, and learned positions, so that both decode with the same length limit) and
    the same multi-reference BLEU, chrF and TER."""
    from vaswani.hub import attach_translation_pipeline

    model, tokenizer = tiny_models(position_embedding_type="learned", max_position_embeddings=32)
    checkpoint = tmp_path / "checkpoint"
    attach_translation_pipeline(model, checkpoint)
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    # References other than the training targets, which the tiny model reproduces: the score is then neither
    # perfect nor zero. An empty line in the second file means no second reference for that sentence.
    first = ["le chat est assis sur le tapis", "un chien courait", "un oiseau a volé sous l'arbre", "le chat",
             "un chien était assis sur le tapis"]
    second = ["le chat s'est assis sur le tapis", "", "l'oiseau vola sous un arbre", "chat", ""]
    references = [[ref, *([extra] if extra else [])] for ref, extra in zip(first, second)]
    (tmp_path / "src.en").write_text("\n".join(SOURCES) + "\n")
    (tmp_path / "ref1.fr").write_text("\n".join(first) + "\n")
    (tmp_path / "ref2.fr").write_text("\n".join(second) + "\n")
    script_main("evaluate_bleu")(["--model", str(checkpoint), "--device", "cpu", "--num_beams", "4", "--batch_size",
                                  "1", "--source_file", str(tmp_path / "src.en"), "--reference_file",
                                  str(tmp_path / "ref1.fr"), "--reference_file", str(tmp_path / "ref2.fr")])
    expected = json.loads(capsys.readouterr().out)

    script = f"""
import json
from datasets import Dataset
from transformers import pipeline
from vaswani.evaluator import TranslationEvaluator, load_metric

translator = pipeline("translation", model={str(checkpoint)!r}, trust_remote_code=True, device="cpu", num_beams=4,
                      max_new_tokens=31)  # evaluate_bleu.py's limit for 32 learned positions
data = Dataset.from_dict({{"text": {SOURCES!r}, "label": {references!r}}})
scores = TranslationEvaluator().compute(model_or_pipeline=translator, data=data, metric=load_metric())
print(json.dumps({{"module": type(translator).__module__, **scores}}))
"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_EVALUATE_OFFLINE": "1"}
    completed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    scores = json.loads(completed.stdout.strip().splitlines()[-1])
    assert scores["module"].startswith("transformers_modules.")  # the checkpoint's copy of pipeline_vaswani.py
    assert expected["signatures"]["bleu"].startswith("nrefs:var")
    assert {k: scores[k] for k in ("bleu", "chrf", "ter")} == {k: expected[k] for k in ("bleu", "chrf", "ter")}
    assert 0 < scores["bleu"] < 100  # neither trivially perfect nor empty: equality says something


# Failure modes ------------------------------------------------------------------------------------------------------


def test_translating_no_sentences_gives_no_translations(good_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(good_checkpoint)
    model = VaswaniForConditionalGeneration(tiny_config(vocab_size=len(tokenizer)))
    assert translate(model, tokenizer, []) == []


def test_evaluate_bleu_refuses_an_empty_source_and_writes_its_report_atomically(good_checkpoint, tmp_path, capsys):
    evaluate_main = script_main("evaluate_bleu")
    (tmp_path / "empty.en").write_text("")
    (tmp_path / "empty.fr").write_text("")
    fails_with_one_line(evaluate_main, ["--model", str(good_checkpoint), "--source_file", str(tmp_path / "empty.en"),
                                        "--reference_file", str(tmp_path / "empty.fr")], capsys, "nothing to evaluate")
    (tmp_path / "src.en").write_text("the cat\na dog ran\n")
    (tmp_path / "ref.fr").write_text("le chat\nun chien a couru\n")
    report = tmp_path / "report.json"
    evaluate_main(["--model", str(good_checkpoint), "--source_file", str(tmp_path / "src.en"), "--reference_file",
                   str(tmp_path / "ref.fr"), "--num_beams", "1", "--output_file", str(report)])
    assert len(json.loads(report.read_text())["hypotheses"]) == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("report")] == ["report.json"]
