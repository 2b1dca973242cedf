"""One decoding contract (`vaswani.decoding_settings.DecodingSettings`): a sentence gets the same translation whichever
engine, batch or caller decodes it, within its own output limit; the exported CTranslate2 model follows the same
settings; settings that generate() cannot honour are refused before anything is loaded; sources are bounded for
every kind of positions; validation decodes the weights the test score decodes."""

import json
import random
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, GenerationConfig, pipeline

import vaswani.configuration_vaswani as configuration_vaswani
import vaswani.trainer
import vaswani.training
from conftest import fails_with_one_line, script_main
from tiny_translation_model import SOURCES, build_tokenizer
from training_script import distinct_corpus, train_args
from vaswani import VaswaniConfig, VaswaniForConditionalGeneration, loading
from vaswani.evaluation import translate as evaluate_translate
from vaswani.pipeline_vaswani import register_pipeline
from vaswani.translation import NO_LENGTH_PENALTY, translate

# Few tokens past each source, so that the toy model's outputs reach their own limit in some sentences and end
# before it in others (the rule, not its number, is what every caller must share).
SLACK = 2
# A length penalty of 2 favours long hypotheses, so that a sentence's beam search would take a longer one where a
# neighbour's limit let it grow.
SEARCHES = {"greedy": {"num_beams": 1}, "beam": {"num_beams": 4, "length_penalty": 2.0}}


@pytest.fixture
def short_limits(monkeypatch):
    monkeypatch.setattr(configuration_vaswani, "OUTPUT_SLACK", SLACK)


def sentences(count: int = 40, seed: int = 0) -> list[str]:
    words = " ".join(SOURCES).split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(count)] + SOURCES


def alone(model, tokenizer, texts, **search) -> tuple[list[str], int]:
    """Each sentence through transformers' own loop by itself, with its own limit: what every path must give; and
    how many outputs ran to their limit."""
    outputs, at_limit = [], 0
    for text in texts:
        input_ids = torch.tensor([tokenizer(text)["input_ids"]])
        limit = input_ids.shape[1] + SLACK
        with torch.inference_mode():
            output = model.generate(input_ids=input_ids, max_new_tokens=limit, lean_decoding=False, **search)[0, 1:]
        at_limit += tokenizer.eos_token_id not in output.tolist()
        outputs.append(tokenizer.decode(output, skip_special_tokens=True).strip())
    return outputs, at_limit


@pytest.fixture(scope="module")
def saved(trained, tmp_path_factory):
    """`trained` saved with each search as its checkpoint's generation config."""
    model, tokenizer = trained
    paths = {}
    for name, search in SEARCHES.items():
        path = tmp_path_factory.mktemp(name) / "checkpoint"
        model.generation_config = GenerationConfig(**{**model.generation_config.to_diff_dict(), **search})
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = path
    model.generation_config = GenerationConfig.from_pretrained(paths["greedy"])
    return paths


@pytest.mark.parametrize("name", SEARCHES)
def test_a_sentence_gets_one_translation_from_every_batch_engine_and_caller(trained, saved, name, short_limits,
                                                                          tmp_path, capsys, monkeypatch,
                                                                          single_thread):
    model, tokenizer = trained
    search, texts = SEARCHES[name], sentences()
    monkeypatch.setattr(model, "generation_config", GenerationConfig.from_pretrained(saved[name]))  # the checkpoint's
    expected, at_limit = alone(model, tokenizer, texts, **search)
    assert 0 < at_limit < len(texts)  # some outputs reach their limit, others end before it

    engines = {"lean": loading.load_engine(str(saved[name]), device="cpu", slots=0),
               "transformers": loading.load_engine(str(saved[name]), device="cpu", decoding="transformers", slots=0),
               "slots": loading.load_engine(str(saved[name]), device="cpu", slots=3)}
    for engine_name, engine in engines.items():
        for budget in ({}, {"max_tokens": 40}, {"max_sentences": 3}, {"max_sentences": 1}):
            assert translate(engine, texts, **budget).texts == expected, (engine_name, budget)
    # Validation and the test score, the pipeline, and the scripts.
    assert evaluate_translate(model, tokenizer, texts, batch_size=7) == expected
    split = {"source": texts, "target": expected}
    assert vaswani.trainer.score_split(model, tokenizer, _Split(split), batch_size=5)["hypotheses"] == expected
    register_pipeline()
    translator = pipeline("translation", model=model, tokenizer=tokenizer, device="cpu", **search)
    assert [row["translation_text"] for row in translator(texts, batch_size=8)] == expected
    source_file = tmp_path / "source.txt"
    source_file.write_text("\n".join(texts) + "\n", encoding="utf-8")
    script_main("translate")(["--model", str(saved[name]), "--device", "cpu", "--input_file", str(source_file),
                              "--output_file", str(tmp_path / "out.txt"), "--max_tokens_per_batch", "50"])
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines() == expected
    (tmp_path / "ref.txt").write_text("\n".join(expected) + "\n", encoding="utf-8")
    script_main("evaluate_bleu")(["--model", str(saved[name]), "--device", "cpu", "--source_file", str(source_file),
                                  "--reference_file", str(tmp_path / "ref.txt")])
    assert json.loads(capsys.readouterr().out)["bleu"] == pytest.approx(100)


class _Split(dict):
    """A stand-in for a datasets split: its columns by name."""

    column_names = ["source", "target"]


def test_the_ctranslate2_export_translates_as_the_pytorch_engine_in_float32(trained, short_limits, tmp_path):
    """Told the length penalty (counting the end of sentence as transformers does), each sentence's own limit and
    the source limit, CTranslate2 gives every sentence the PyTorch engine's translation where the two stop a beam
    search by the same rule (`early_stopping=True`, which CTranslate2's rule is); greedy search alike."""
    pytest.importorskip("ctranslate2")
    from vaswani.export import export_to_ctranslate2

    model, tokenizer = trained
    export = export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    # At a length penalty of 0, CTranslate2 would end a sentence at its best beam's end, transformers once num_beams
    # hypotheses have ended: two beams over 300 sentences tell the rules apart (2 of them differ on the CPUs tried).
    for texts, searches in ((sentences(80, seed=1), ({"num_beams": 1},
                                                     {"num_beams": 4, "length_penalty": 0.6, "early_stopping": True},
                                                     {"num_beams": 3, "length_penalty": 2.0, "early_stopping": True},
                                                     {"num_beams": 4, "length_penalty": 0.0, "early_stopping": True})),
                            (sentences(300, seed=2), ({"num_beams": 2, "length_penalty": 0.0, "early_stopping": True},))):
        for search in searches:
            exported = loading.load_engine(export, **search)
            pytorch = loading.engine_for_model(model, tokenizer, slots=0, **search)
            assert exported.decoding.record() | {"precision": None} == pytorch.decoding.record() | {"precision": None}
            expected = translate(pytorch, texts).texts
            assert translate(exported, texts, max_sentences=16).texts == expected, search
            assert translate(exported, texts, max_sentences=1).texts == expected, search
    # What CTranslate2 is told: transformers' length penalty, counting the end of sentence in the length (which
    # CTranslate2 counts only when it returns it), and at 0 one that divides no score (length ** 1e-12 is 1.0 in
    # float32), so that its stopping rule is transformers'; the source limit; the output limit, one per call.
    texts = sentences(80, seed=1)
    calls = []

    class Recording:
        def __init__(self, translator):
            self.translator, self.compute_type = translator, translator.compute_type

        def translate_batch(self, sources, **options):
            calls.append((sources, options, self.translator.translate_batch(sources, **options)))
            return calls[-1][2]

    for penalty, told in ((0.0, NO_LENGTH_PENALTY), (2.0, 2.0)):
        search = {"num_beams": 3, "length_penalty": penalty, "early_stopping": True}
        exported = loading.load_engine(export, **search)
        exported.translator = Recording(exported.translator)
        calls.clear()
        expected = translate(loading.engine_for_model(model, tokenizer, slots=0, **search), texts).texts
        assert translate(exported, texts, max_sentences=len(texts)).texts == expected
        assert all(options["length_penalty"] == told and options["return_end_token"] and options["patience"] == 1
                   and options["max_input_length"] == model.config.max_position_embeddings
                   and options["beam_size"] == 3 for _, options, _ in calls)
    assert np.float32(1000) ** np.float32(NO_LENGTH_PENALTY) == 1.0
    # The batch at its longest limit, with all its beams' best hypotheses; again, in one call per limit and for the
    # best only, the sentences one of whose best hypotheses reached their own limit there (their search could have
    # ended otherwise at it).
    limit = exported.decoding.output_limit
    (sources, options, results), *again = calls
    assert options["max_decoding_length"] == max(limit(len(source)) for source in sources)
    assert options["num_hypotheses"] == 3 and all(options["num_hypotheses"] == 1 for _, options, _ in again)
    reached = [source for source, result in zip(sources, results) if limit(len(source)) < options["max_decoding_length"]
               and max(map(len, result.hypotheses)) >= limit(len(source))]
    shorter = [source for source in sources if limit(len(source)) < options["max_decoding_length"]]
    assert 0 < len(reached) < len(shorter)  # some outputs reach their limit, others end before it
    assert sorted(source for sources, _, _ in again for source in sources) == sorted(reached)
    assert all(len({limit(len(source)) for source in sources} | {options["max_decoding_length"]}) == 1
               for sources, options, _ in again)
    # One limit for every sentence (`max_new_tokens`, as the benchmarks decode): one call, for the best hypothesis.
    exported = loading.load_engine(export, num_beams=3, early_stopping=True, max_new_tokens=12)
    exported.translator = Recording(exported.translator)
    calls.clear()
    assert translate(exported, texts, max_sentences=len(texts)).texts == translate(
        loading.engine_for_model(model, tokenizer, slots=0, num_beams=3, early_stopping=True, max_new_tokens=12),
        texts).texts
    assert [(options["max_decoding_length"], options["num_hypotheses"]) for _, options, _ in calls] == [(12, 1)]
    with pytest.raises(ValueError, match="^early_stopping='never': not something the CTranslate2 engine"):
        loading.load_engine(export, num_beams=4, early_stopping="never")


def test_the_export_model_card_states_the_rule_ctranslate2_cannot_follow_with_its_measured_share(trained, tmp_path,
                                                                                                    monkeypatch):
    pytest.importorskip("ctranslate2")
    from vaswani.export import export_to_ctranslate2

    model, tokenizer = trained
    texts = sentences(120, seed=3)
    monkeypatch.setattr(model, "generation_config", GenerationConfig(**{**model.generation_config.to_diff_dict(),
                                                                        "num_beams": 4, "length_penalty": 2.0}))
    export = export_to_ctranslate2(model, tmp_path / "beam", tokenizer=tokenizer, measure_on=texts)
    pytorch = translate(loading.engine_for_model(model, tokenizer, slots=0), texts).texts
    exported = translate(loading.load_engine(export), texts).texts
    differing = sum(a != b for a, b in zip(pytorch, exported))
    assert differing > 0  # the stopping rule shows on this model
    card = (tmp_path / "beam" / "README.md").read_text(encoding="utf-8")
    assert "`early_stopping=False`" in card and \
        f"Measured at export, in float32: {differing} of {len(texts)} sentences" in card
    monkeypatch.setattr(model, "generation_config", GenerationConfig(**{**model.generation_config.to_diff_dict(),
                                                                        "early_stopping": True}))
    export_to_ctranslate2(model, tmp_path / "alike", tokenizer=tokenizer)
    assert "Every setting is one CTranslate2 follows" in (tmp_path / "alike" / "README.md").read_text()


def test_the_export_script_measures_the_share_on_a_file_of_sources(saved, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    sources = tmp_path / "sources.txt"
    sources.write_text("\n".join(sentences(30, seed=4)) + "\n\n", encoding="utf-8")  # a blank line is no sentence
    script_main("export_ctranslate2")(["--model", str(saved["beam"]), "--output_dir", str(tmp_path / "ct2"),
                                       "--measure_on", str(sources)])
    assert "of 35 sentences" in (tmp_path / "ct2" / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("field, value, named", [
    ("num_beams", 0, "num_beams=0 cannot be decoded with; it must be a whole number of at least 1"),
    ("length_penalty", float("nan"), "length_penalty=nan cannot be decoded with; it must be a finite number"),
    ("max_new_tokens", 0, "`max_new_tokens` must be greater than 0, but is 0"),
])
def test_a_checkpoint_whose_generation_settings_generate_cannot_honour_is_refused_before_loading(
        checkpoint, tmp_path, capsys, monkeypatch, field, value, named):
    path = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, path)
    settings = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**settings, field: value}))
    monkeypatch.setattr(AutoModelForSeq2SeqLM, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    message = f"{path / 'generation_config.json'}: {named}"

    with pytest.raises(ValueError) as refused:
        loading.load_engine(str(path), device="cpu")
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    output = tmp_path / "out.txt"
    fails_with_one_line(script_main("translate"), ["--model", str(path), "--device", "cpu", "--output_file",
                                                   str(output), "hi"], capsys, message.split(": ")[0])
    assert not output.exists()


def test_sources_are_bounded_and_reported_for_positions_without_an_end(capsys):
    """Sinusoidal positions work at any length, but a source is still cut where the config's positions end (CTranslate2's
    default, 1,024, for a default config; 16 here), and the warning counts it."""
    tokenizer = build_tokenizer()
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=len(tokenizer),
                                                               max_position_embeddings=16)).eval()
    engine = loading.engine_for_model(model, tokenizer, num_beams=1, max_new_tokens=2, slots=0)
    long = " ".join(SOURCES)
    assert len(tokenizer(long)["input_ids"]) > 16 == engine.max_source_length

    texts, truncated = translate(engine, [long, "cat"])

    assert truncated == 1
    assert capsys.readouterr().err.strip() == \
        "warning: 1 sentence(s) longer than the model's 16 source positions were truncated."
    cut = torch.tensor([tokenizer(long, truncation=True, max_length=16)["input_ids"]])
    with torch.inference_mode():
        assert texts[0] == tokenizer.decode(model.generate(input_ids=cut, max_new_tokens=2, num_beams=1)[0],
                                            skip_special_tokens=True).strip()
    assert VaswaniConfig().max_position_embeddings == 1024  # CTranslate2's default max_input_length


def test_validation_decodes_the_weights_the_test_score_decodes_under_bf16(tmp_path, monkeypatch):
    """Under --bf16, accelerate wraps the model's forward in an autocast for training; validation takes it off for
    its translations, as the test score does, and puts it back for the steps that follow."""
    scored = []

    def recording(model, tokenizer, split, batch_size):
        scored.append(("_original_forward" in model.__dict__, model.dtype, next(model.parameters()).data_ptr()))
        return original(model, tokenizer, split, batch_size)

    original = vaswani.trainer.score_split
    monkeypatch.setattr(vaswani.trainer, "score_split", recording)
    monkeypatch.setattr(vaswani.training, "score_split", recording)
    wrapped_during_training = []

    class Trainer(vaswani.training.VaswaniSeq2SeqTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            wrapped_during_training.append("_original_forward" in self.model.__dict__)
            return super().training_step(model, inputs, num_items_in_batch)

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", Trainer)
    corpus = distinct_corpus(tmp_path / "corpus.tsv")
    script_main("train_translation")(train_args(
        corpus, tmp_path / "out", "--max_steps", "4", "--eval_strategy", "steps", "--eval_steps", "2",
        "--predict_with_generate", "--max_eval_samples", "4", "--max_test_samples", "4", "--use_cpu", "--bf16",
        "--generation_num_beams", "1"))

    assert all(wrapped_during_training) and len(wrapped_during_training) == 4  # the autocast, back after validation
    assert len(scored) == 3  # two validations, then the test score
    assert {entry[:2] for entry in scored} == {(False, torch.float32)}
    assert len({entry[2] for entry in scored}) == 1  # the same weights
