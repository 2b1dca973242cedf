"""The one translation path (`vaswani.translation.translate`): input order whatever the batches, the same outputs as
`generate()` sentence by sentence, one truncation rule and one warning, whichever caller goes through it."""

import io

import pytest
import torch
import transformers
from conftest import script_main
from tiny_translation_model import SOURCES, build_model_and_tokenizer, build_tokenizer
from datasets import Dataset
from transformers import AutoModelForSeq2SeqLM, GenerationConfig, pipeline
from transformers.testing_utils import CaptureLogger

from vaswani import VaswaniConfig, VaswaniForConditionalGeneration

from vaswani.batching import token_budget_batches
from vaswani.evaluation import translate as translate_model
from vaswani.file_translation import translate_file
from vaswani.pipeline_vaswani import register_pipeline
from vaswani.tokenization import TRUNCATION_TOKENS, tokenize_translation_dataset
from vaswani.tokenization_vaswani import VaswaniTokenizer
from vaswani.loading import engine_for_model
from vaswani.decoding_settings import DecodingSettings, model_decoding, write_decoding_defaults
from vaswani.translation import translate
from vaswani.visualize import attention_maps

LONG = " ".join(["the cat sat on the mat and the dog sat on a mat"] * 3)


@pytest.fixture(scope="module")
def learned():
    """A model with 32 learned positions, so that `LONG` must be truncated."""
    return build_model_and_tokenizer(position_embedding_type="learned", max_position_embeddings=32)


def one_by_one(model, tokenizer, sentences, max_length=None, **options):
    """Each sentence through `generate()` alone, truncated by the tokenizer: what any batching must reproduce."""
    limit = {"truncation": True, "max_length": max_length} if max_length else {}
    outputs = []
    for sentence in sentences:
        input_ids = torch.tensor([tokenizer(sentence, **limit)["input_ids"]])
        with torch.inference_mode():
            output_ids = model.generate(input_ids=input_ids, **options)
        outputs.append(tokenizer.decode(output_ids[0], skip_special_tokens=True).strip())
    return outputs


@pytest.mark.parametrize("max_tokens, max_sentences", [(None, None), (12, None), (None, 2), (24, 3), (1, None)])
def test_batches_of_any_budget_give_each_sentence_its_own_translation_in_input_order(trained, max_tokens,
                                                                                    max_sentences):
    model, tokenizer = trained
    sentences = [*SOURCES, *SOURCES[::-1], "cat"]
    engine = engine_for_model(model, tokenizer, num_beams=1, max_new_tokens=8)

    texts, truncated = translate(engine, sentences, max_tokens=max_tokens, max_sentences=max_sentences)

    assert texts == one_by_one(model, tokenizer, sentences, num_beams=1, max_new_tokens=8)
    assert truncated == 0
    assert translate(engine, []) == ([], 0)


def test_long_sources_are_truncated_by_one_rule_and_reported_by_one_warning(learned, capsys):
    model, tokenizer = learned
    max_source_length, max_new_tokens = model.config.max_position_embeddings, 4
    assert len(tokenizer(LONG)["input_ids"]) > max_source_length
    engine = engine_for_model(model, tokenizer, num_beams=1, max_new_tokens=max_new_tokens,
                         max_source_length=max_source_length)
    sentences = [LONG, "cat", LONG + " cat"]
    warning = f"warning: 2 sentence(s) longer than the model's {max_source_length} learned positions were truncated."

    texts, truncated = translate(engine, sentences, max_tokens=64)

    assert truncated == 2
    assert capsys.readouterr().err.strip() == warning
    # The tokenizer's own truncation (which keeps the end of sentence), then generate() as for any sentence.
    assert texts == one_by_one(model, tokenizer, sentences, max_source_length, num_beams=1,
                               max_new_tokens=max_new_tokens)
    assert translate(engine, sentences, warn=False) == (texts, 2)
    assert capsys.readouterr().err == ""

    # Evaluation and file translation go through the same path: the same translations, the same warning (a file's
    # once, for all its chunks).
    assert translate_model(model, tokenizer, sentences, num_beams=1, max_new_tokens=max_new_tokens,
                           max_source_length=max_source_length) == texts
    assert capsys.readouterr().err.strip() == warning
    stdout = io.BytesIO()
    translate_file(engine, None, None, chunk_lines=1, stdin=io.BytesIO("\n".join(sentences).encode()),
                   stdout=stdout, progress=False)
    assert stdout.getvalue().decode().splitlines() == texts
    assert capsys.readouterr().err.strip() == warning


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_evaluation_and_the_translate_script_truncate_a_source_alike(request, positions, tmp_path, capsys,
                                                                    single_thread):
    """`TorchEngine` decides for both: learned positions truncate at their table's size, sinusoidal ones at the
    config's `max_position_embeddings` (64 here, longer than `LONG`), whatever the tokenizer's `model_max_length`
    says (here 16, shorter than `LONG` and than the table)."""
    model, tokenizer = request.getfixturevalue("learned" if positions == "learned" else "trained")
    path = tmp_path / "checkpoint"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tokenizer = VaswaniTokenizer.from_pretrained(path, model_max_length=16)
    tokenizer.save_pretrained(path)
    sentences = [LONG, "cat", LONG + " cat"]
    options = {"num_beams": 1, "max_new_tokens": 4}

    script_main("translate")(["--model", str(path), "--device", "cpu", "--num_beams", "1", "--max_new_tokens", "4",
                              *sentences])
    printed = capsys.readouterr()
    evaluated = translate_model(model, tokenizer, sentences, **options)
    warned = capsys.readouterr().err

    positions_taken = 32 if positions == "learned" else None
    assert printed.out.splitlines() == evaluated == one_by_one(model, tokenizer, sentences, positions_taken, **options)
    warning = "warning: 2 sentence(s) longer than the model's 32 learned positions were truncated."
    assert [line for line in printed.err.splitlines() if line.startswith("warning")] == \
        [line for line in warned.splitlines() if line.startswith("warning")] == ([warning] if positions_taken else [])


def test_no_output_runs_past_a_learned_position_table_whatever_the_caller_asks(learned):
    """The output limit is the engine's too: the default (longest source + 50) and an explicit one alike stop where a
    learned position table ends, so evaluation, evaluate_bleu.py and translate.py decode with one rule."""
    model, tokenizer = learned
    longest = model_decoding(model).longest_output
    asked = []
    generate = model.generate
    # The limit reaches generate() as max_length, which counts the decoder's start token (length_options).
    model.generate = lambda *args, **kwargs: (asked.append(kwargs["max_length"] - 1), generate(*args, **kwargs))[1]
    try:
        for requested in (None, 10_000, 4):
            translate_model(model, tokenizer, [LONG, "cat"], num_beams=1, max_new_tokens=requested, batch_size=1)
    finally:
        del model.generate
    source = len(tokenizer("cat")["input_ids"])
    assert asked == [longest, min(longest, source + 50), longest, longest, 4, 4]


def test_a_sentence_budget_alone_cuts_longest_first_batches_of_that_size():
    lengths = [3, 9, 1, 9, 4, 7, 2]
    # Sorted by length, longest first (ties in input order), then cut every max_sentences.
    assert token_budget_batches(lengths, None, 3) == [[1, 3, 5], [4, 0, 6], [2]]
    assert token_budget_batches(lengths, None) == [[1, 3, 5, 4, 0, 6, 2]]


@pytest.mark.parametrize("num_beams", [1, 4])
def test_an_engine_in_slots_gives_each_sentence_what_generate_gives_it_alone(trained, num_beams, monkeypatch):
    """An engine in slots: translate() hands it every sentence at once, longest first (whatever the budget); each
    output is generate()'s for that sentence alone, within the paper's limit for its own source (its length plus 50
    tokens, within the positions) or the engine's max_new_tokens; in input order. Evaluation goes through it alike."""
    import vaswani.translation as translation

    model, tokenizer = trained
    sentences = [*SOURCES, *SOURCES[::-1], "cat"]
    streams = []
    original = translation.decode_in_slots
    monkeypatch.setattr(translation, "decode_in_slots",
                        lambda model, sources, limits, **options: streams.append((sources, limits))
                        or original(model, sources, limits, **options))
    engine = engine_for_model(model, tokenizer, num_beams=num_beams, slots=3)
    assert engine.continuous

    texts, truncated = translate(engine, sentences, max_tokens=12, max_sentences=2)

    ((sources, limits),) = streams
    lengths = [len(ids) for ids in sources]
    assert lengths == sorted(lengths, reverse=True) and len(sources) == len(sentences)
    longest = model.config.max_position_embeddings - 1  # the decoder start takes the first position
    assert limits == [min(length + 50, longest) for length in lengths]
    expected = [one_by_one(model, tokenizer, [sentence], num_beams=num_beams,
                           max_new_tokens=min(len(tokenizer(sentence)["input_ids"]) + 50, longest))[0]
                for sentence in sentences]
    assert texts == expected and truncated == 0
    short = engine_for_model(model, tokenizer, num_beams=num_beams, max_new_tokens=3, slots=2)
    assert translate(short, sentences).texts == one_by_one(model, tokenizer, sentences, num_beams=num_beams,
                                                          max_new_tokens=3)
    assert translate_model(model, tokenizer, sentences, num_beams=num_beams, slots=3) == texts


def test_an_engine_decodes_in_batches_where_slots_do_not_cover_the_options(trained):
    """Options that the slots do not decode (a logits processor here) and slots=0 keep the batches."""
    model, tokenizer = trained
    assert not engine_for_model(model, tokenizer, num_beams=4, no_repeat_ngram_size=2, slots=3).continuous
    assert not engine_for_model(model, tokenizer, num_beams=4, slots=0).continuous
    assert not engine_for_model(model, tokenizer, num_beams=4).continuous  # batches unless told


def test_settings_left_out_are_the_generation_configs_and_sampling_takes_one_beam():
    config = GenerationConfig(num_beams=5, max_new_tokens=7, length_penalty=0.6)
    resolved = DecodingSettings.resolve(config, positions=64)
    assert (resolved.num_beams, resolved.max_new_tokens, resolved.length_penalty, resolved.early_stopping) == \
        (5, 7, 0.6, False)
    assert (resolved.max_source_length, resolved.longest_output) == (64, 63)  # past the decoder start's position
    told = DecodingSettings.resolve(config, num_beams=2, max_new_tokens=None, length_penalty=None)
    assert (told.num_beams, told.max_new_tokens, told.length_penalty) == (2, 7, 0.6)
    sampled = DecodingSettings.resolve(config, do_sample=True, top_k=None, temperature=0.5)
    assert (sampled.do_sample, sampled.num_beams, sampled.options) == (True, 1, (("temperature", 0.5),))
    assert sampled.generate_options() == {"num_beams": 1, "do_sample": True, "temperature": 0.5}
    assert DecodingSettings.resolve(config, do_sample=True, num_beams=3).num_beams == 3  # a count given is kept
    plain = DecodingSettings.resolve(GenerationConfig(), positions=64, learned=True)
    assert (plain.num_beams, plain.length_penalty, plain.max_new_tokens) == (1, 1.0, None)
    # The one length rule, per source, within a learned table (less the decoder start).
    assert [plain.output_limit(n) for n in (1, 7, 30)] == [51, 57, 63]
    assert DecodingSettings.resolve(config).output_limit(30) == 7
    assert DecodingSettings.resolve(GenerationConfig(), positions=32, learned=True,
                                    max_source_length=100).max_source_length == 32


@pytest.mark.parametrize("field, value, message", [
    ("num_beams", 0, "must be a whole number of at least 1"),
    ("length_penalty", float("nan"), "must be a finite number"),
    ("length_penalty", float("inf"), "must be a finite number"),
    ("min_new_tokens", -1, "must be a whole number of at least 0"),
    ("do_sample", "yes", "must be true or false"),
])
def test_settings_generate_cannot_honour_are_refused_naming_where_they_came_from(field, value, message):
    config = GenerationConfig()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"^ckpt/generation_config.json: {field}={value!r} cannot be decoded with; "
                                         f"it {message}.$"):
        DecodingSettings.resolve(config, origin="ckpt/generation_config.json")
    with pytest.raises(ValueError, match=f"^the caller's options: {field}={value!r}"):
        DecodingSettings.resolve(GenerationConfig(), **{field: value})


@pytest.mark.parametrize("max_new_tokens", [None, 5])
def test_written_decoding_defaults_rule_our_engine_and_a_stock_generate_after_a_reload(max_new_tokens, tmp_path):
    """An untrained model never ends a sentence, so every output runs to the length its decoder allows: the source
    plus 50 tokens in our engine (or `max_new_tokens`), the position table's end (`max_length`) in a stock
    `generate()`, not `generate()`'s 20 tokens."""
    tokenizer = build_tokenizer()
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=len(tokenizer))).eval()
    table = model.config.max_position_embeddings
    write_decoding_defaults(model.generation_config, num_beams=2, length_penalty=0.5, max_new_tokens=max_new_tokens,
                            max_length=table)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    reloaded.generation_config.validate(strict=True)
    source = tokenizer(["the cat"], return_tensors="pt")
    expected_length = (max_new_tokens or len(source["input_ids"][0]) + 50) + 1  # and the decoder start token

    engine = engine_for_model(reloaded, tokenizer, slots=0)
    asked = []
    generate = reloaded.generate
    reloaded.generate = lambda *args, **kwargs: (asked.append(kwargs), generate(*args, **kwargs))[1]
    with CaptureLogger(transformers.utils.logging.get_logger("transformers.generation.utils")) as said:
        translate(engine, ["the cat"])
    del reloaded.generate
    assert said.out == ""  # no warning that the generation config sets a length beside the engine's
    stock = reloaded.generate(**source, lean_decoding=False)  # no options: all from generation_config.json

    # The engine passes its resolved settings, the checkpoint's where the caller gave none.
    assert (asked[0]["num_beams"], asked[0]["length_penalty"], asked[0]["early_stopping"]) == (2, 0.5, False)
    assert asked[0]["max_length"] == expected_length
    assert stock.shape[1] == (expected_length if max_new_tokens else table)
    options = {"max_new_tokens": max_new_tokens} if max_new_tokens else {"max_length": table}
    assert torch.equal(stock, reloaded.generate(**source, lean_decoding=False, num_beams=2, length_penalty=0.5,
                                                **options))

    greedy = GenerationConfig(length_penalty=0.6)
    write_decoding_defaults(greedy, num_beams=1, length_penalty=0.6, max_new_tokens=9)
    greedy.validate(strict=True)  # transformers refuses a length penalty beside one beam
    assert (greedy.num_beams, greedy.length_penalty, greedy.max_new_tokens) == (1, None, 9)
    with pytest.raises(ValueError, match="max_length"):
        write_decoding_defaults(greedy, num_beams=4, length_penalty=0.6)


def test_training_data_is_truncated_at_one_default_length():
    """`TRUNCATION_TOKENS` is where `tokenize_translation_dataset` cuts both sides when not told (training's
    `--max_length` default too), the end of sentence kept."""
    tokenizer = build_tokenizer()
    long = " ".join(["the cat sat"] * 200)
    split = Dataset.from_dict({"source": [long, "cat"], "target": [long, "chat"]})
    rows = tokenize_translation_dataset(split, tokenizer)
    assert [len(ids) for ids in rows["input_ids"]][0] == len(rows["labels"][0]) == TRUNCATION_TOKENS
    assert rows["input_ids"][0][-1] == tokenizer.eos_token_id and len(rows["input_ids"][1]) < TRUNCATION_TOKENS


def test_the_engine_the_pipeline_and_the_heatmaps_stop_an_output_by_one_rule():
    """An untrained model never ends a sentence, so each output shows its limit: the source's length plus 50
    tokens, or the generation config's `max_new_tokens`, or the caller's."""
    tokenizer = build_tokenizer()
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=len(tokenizer))).eval()
    source = "the cat"
    length = len(tokenizer(source)["input_ids"])
    register_pipeline()
    translator = pipeline("translation", model=model, tokenizer=tokenizer, device="cpu", num_beams=1)
    generated = []
    generate = model.generate
    model.generate = lambda *args, **kwargs: generated.append(generate(*args, **kwargs)) or generated[-1]

    def output_lengths(max_new_tokens=None):
        """Tokens generated (less the decoder start) by the engine, the pipeline and the heatmaps' translation."""
        generated.clear()
        translate(engine_for_model(model, tokenizer, num_beams=1, max_new_tokens=max_new_tokens, slots=0), [source])
        translator(source, **({"max_new_tokens": max_new_tokens} if max_new_tokens else {}))
        attention_maps(model, tokenizer, source, max_new_tokens=max_new_tokens)
        return [output.shape[1] - 1 for output in generated]

    assert output_lengths() == [length + 50] * 3
    model.generation_config.max_new_tokens = 6
    assert output_lengths() == [6] * 3
    assert output_lengths(max_new_tokens=3) == [3] * 3
