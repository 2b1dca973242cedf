"""Scores must be sacreBLEU's, references must line up with their hypotheses, and batching must not reorder."""

import json

import numpy as np
import pytest
import sacrebleu
from conftest import script_main
from tiny_translation_model import SOURCES, build_model_and_tokenizer
from transformers import EvalPrediction

from vaswani.evaluation import build_compute_metrics, evaluate_model, reference_streams, score_corpus, translate

HYPOTHESES = ["the cat sat on the mat .", "there is a dog in the garden", "he reads a book every evening"]
# Two references per hypothesis, as a list per hypothesis (our input format).
TWO_REFERENCES = [
    ["the cat sat on the mat .", "a cat was sitting on the mat ."],
    ["a dog is in the garden", "there's a dog in the yard"],
    ["every evening he reads a book", "he reads books in the evening"],
]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return build_model_and_tokenizer()


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
        limits.append(kwargs["max_new_tokens"])
        return generate(**kwargs)

    monkeypatch.setattr(model, "generate", recording_generate)
    assert translate(model, tokenizer, SOURCES, batch_size=2, num_beams=1, max_new_tokens=8) == one_by_one
    assert source_widths == sorted(source_widths, reverse=True) and len(source_widths) == 3

    source_widths.clear(), limits.clear()
    translate(model, tokenizer, SOURCES, batch_size=2, num_beams=1)
    assert limits == [width + 50 for width in source_widths]  # the paper's "input length + 50" default


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
    with pytest.raises(SystemExit):
        script_main("evaluate_bleu")(["--model", str(tmp_path / "model"), "--ctranslate2", "--length_penalty", "0.6",
                                      *files])
    assert "--length_penalty is generate()'s" in capsys.readouterr().err
