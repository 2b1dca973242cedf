"""`pipeline("translation")` must work on a model object after registration, and from a saved checkpoint through
`trust_remote_code` in a process that never imports vaswani."""

import json
import os
import subprocess
import sys

import pytest
from tiny_translation_model import SOURCES
from transformers import pipeline

from vaswani.evaluation import translate
from vaswani.hub import attach_translation_pipeline
from vaswani.pipeline_vaswani import VaswaniTranslationPipeline, register_pipeline

GENERATION = {"num_beams": 1, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_models):
    return tiny_models()


@pytest.fixture(scope="module")
def expected(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    translations = [translate(model, tokenizer, [sentence], **GENERATION)[0] for sentence in SOURCES]
    assert len(set(translations)) > 2, "the tiny model must translate different inputs differently for these tests"
    return translations


def test_pipeline_on_a_model_object(model_and_tokenizer, expected):
    register_pipeline()
    register_pipeline()  # idempotent: the package may be imported, and this called, more than once
    model, tokenizer = model_and_tokenizer
    translator = pipeline("translation", model=model, tokenizer=tokenizer, device="cpu", **GENERATION)
    assert isinstance(translator, VaswaniTranslationPipeline)
    assert translator(SOURCES[0]) == [{"translation_text": expected[0]}]
    assert translator(SOURCES, batch_size=2) == [{"translation_text": text} for text in expected]
    # Generation options per call; several sequences per input give a list per input.
    beams = translator(SOURCES[:2], num_beams=3, num_return_sequences=2, batch_size=2)
    assert [len(result) for result in beams] == [2, 2]
    assert all(set(item) == {"translation_text"} for result in beams for item in result)


def test_saved_checkpoint_runs_the_shipped_pipeline_with_trust_remote_code(model_and_tokenizer, expected, tmp_path):
    model, tokenizer = model_and_tokenizer
    checkpoint = tmp_path / "checkpoint"
    attach_translation_pipeline(model, checkpoint)
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["custom_pipelines"]["translation"]["impl"] == "pipeline_vaswani.VaswaniTranslationPipeline"

    # A fresh interpreter that does not import vaswani: the pipeline class must come from the checkpoint's copy.
    script = f"""
import json, sys
from transformers import pipeline
translator = pipeline("translation", model={str(checkpoint)!r}, trust_remote_code=True, device="cpu")
assert "vaswani" not in sys.modules, "the shipped pipeline must not import the vaswani package"
print(json.dumps({{"module": type(translator).__module__,
                   "translations": [r["translation_text"] for r in translator({SOURCES!r}, **{GENERATION!r})]}}))
"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["module"].startswith("transformers_modules.")
    assert result["translations"] == expected
