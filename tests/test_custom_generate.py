"""`generate()` decodes with the lean loop by default (issue 20), for users of the package and, through the
checkpoint's `custom_generate/generate.py`, for Hub users without it; and every file a checkpoint ships survives
the stock fine-tune → `trainer.save_model` → `pipeline` round trip of a model loaded as remote code."""

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import WITHOUT_THE_PACKAGE
from tiny_translation_model import SOURCES, TARGETS, build_model_and_tokenizer
from transformers import TextStreamer

import vaswani.generation_vaswani as generation_vaswani
from vaswani.hub import attach_translation_pipeline


@pytest.fixture(scope="module")
def trained():
    return build_model_and_tokenizer()


def _count_loops(monkeypatch, model):
    """The decoding loops that run, by name: the lean ones, and transformers' own."""
    calls = []
    for owner, names in ((generation_vaswani, ("_greedy", "_beam")), (type(model), ("_sample", "_beam_search"))):
        for name in names:
            original = getattr(owner, name)
            monkeypatch.setattr(owner, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    return calls


def test_generate_takes_the_lean_loop_unless_asked_not_to(trained, monkeypatch):
    model, tokenizer = trained
    batch = tokenizer(SOURCES, return_tensors="pt", padding=True)
    calls = _count_loops(monkeypatch, model)
    for num_beams, lean_loop, own_loop in ((1, "_greedy", "_sample"), (4, "_beam", "_beam_search")):
        lean = model.generate(**batch, num_beams=num_beams, max_new_tokens=12)
        assert calls == [lean_loop]
        calls.clear()
        reference = model.generate(**batch, num_beams=num_beams, max_new_tokens=12, lean_decoding=False)
        assert calls == [own_loop]
        calls.clear()
        assert torch.equal(lean, reference)
    model.generate(batch["input_ids"], max_new_tokens=3)  # inputs given by position, as generate() allows
    assert calls == ["_greedy"]


def test_what_the_lean_loop_does_not_cover_goes_to_transformers_loop(trained, monkeypatch):
    model, tokenizer = trained
    batch = tokenizer(SOURCES[:2], return_tensors="pt", padding=True)
    calls = _count_loops(monkeypatch, model)
    torch.manual_seed(0)
    sampled = model.generate(**batch, do_sample=True, top_k=5, max_new_tokens=6)
    torch.manual_seed(0)
    assert torch.equal(sampled, model.generate(**batch, do_sample=True, top_k=5, max_new_tokens=6, lean_decoding=False))
    assert calls == ["_sample", "_sample"]
    calls.clear()
    # A streamer is generate()'s to hand to its loop: a decoding method passed as custom_generate would not get it.
    model.generate(**tokenizer(SOURCES[:1], return_tensors="pt"), max_new_tokens=4, streamer=TextStreamer(tokenizer))
    scored = model.generate(**batch, num_beams=2, max_new_tokens=6, output_scores=True, return_dict_in_generate=True)
    assert calls == ["_sample", "_beam_search"] and scored.sequences_scores is not None
    # Decoding methods that transformers moved to the Hub: the same refusal as without the lean loop.
    group_beams = dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0)
    with pytest.raises(ValueError, match="requires `trust_remote_code=True`"):
        model.generate(**batch, **group_beams)


def test_the_shipped_generation_code_is_self_contained(trained, tmp_path):
    model, _ = trained
    model.save_pretrained(tmp_path)
    shipped = (tmp_path / "custom_generate" / "generate.py").read_text()
    assert shipped == (tmp_path / "generation_vaswani.py").read_text()
    assert shipped == open(generation_vaswani.__file__).read()
    imported = set()
    for node in ast.walk(ast.parse(shipped)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "custom_generate/generate.py is loaded on its own: no relative imports"
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"torch", "transformers"}


ROUND_TRIP = WITHOUT_THE_PACKAGE + textwrap.dedent(
    """
    import functools, json

    import torch
    from transformers import (AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainer,
                              Seq2SeqTrainingArguments, pipeline)

    checkpoint, work, sources, targets = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    torch.set_num_threads(1)
    result = {}

    def lean_loops(model):
        # The Hub's generate(): transformers replaced the model's with custom_generate/generate.py's.
        assert isinstance(model.generate, functools.partial), model.generate
        module = sys.modules[model.generate.func.__module__]
        assert module.__file__.endswith(os.path.join("custom_generate", "generate.py")), module.__file__
        calls = []
        for name in ("_greedy", "_beam"):
            original = getattr(module, name)
            setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
        return calls

    model = AutoModelForSeq2SeqLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True)
    calls = lean_loops(model)
    batch = tokenizer(sources, return_tensors="pt", padding=True)
    for num_beams in (1, 4):
        lean = model.generate(**batch, num_beams=num_beams, max_new_tokens=12)
        reference = model.generate(**batch, num_beams=num_beams, max_new_tokens=12, lean_decoding=False)
        result[f"beams{num_beams}"] = [lean.tolist(), reference.tolist()]
    result["hub_calls"] = list(calls)

    # Fine-tune and evaluate with the stock trainer, then save as it does.
    features = [dict(tokenizer(source, text_target=target)) for source, target in zip(sources, targets)]
    arguments = Seq2SeqTrainingArguments(
        output_dir=os.path.join(work, "trainer"), max_steps=2, per_device_train_batch_size=len(features),
        per_device_eval_batch_size=len(features), learning_rate=1e-3, predict_with_generate=True,
        generation_max_length=12, generation_num_beams=4, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, disable_tqdm=True,
    )
    trainer = Seq2SeqTrainer(model=model.train(), args=arguments, train_dataset=features, eval_dataset=features,
                             data_collator=DataCollatorForSeq2Seq(tokenizer, model=model), processing_class=tokenizer,
                             # without metrics to compute, evaluate() only computes the loss and generates nothing
                             compute_metrics=lambda prediction: {"rows": len(prediction.predictions)})
    trainer.train()
    calls.clear()
    result["evaluated_rows"] = trainer.evaluate()["eval_rows"]
    result["evaluation_calls"] = list(calls)
    finetuned = os.path.join(work, "finetuned")
    trainer.save_model(finetuned)
    result["files"] = sorted(os.path.relpath(os.path.join(root, name), finetuned)
                             for root, _, names in os.walk(finetuned) for name in names)

    translator = pipeline("translation", model=finetuned, trust_remote_code=True, device="cpu")
    calls = lean_loops(translator.model)
    result["pipeline"] = [r["translation_text"] for r in translator(sources, num_beams=4, max_new_tokens=12)]
    result["pipeline_calls"] = list(calls)
    reference = translator.model.generate(**batch, num_beams=4, max_new_tokens=12, lean_decoding=False)
    result["pipeline_reference"] = [text.strip() for text in
                                    tokenizer.batch_decode(reference, skip_special_tokens=True)]
    print(json.dumps(result))
    """
)


@pytest.mark.slow
def test_hub_users_get_the_lean_loop_through_the_stock_fine_tune_save_and_pipeline(trained, tmp_path):
    """In a process where `import vaswani` fails, as a Hub user: the checkpoint's own generation code decodes
    (and returns what transformers' loop returns), the stock Seq2SeqTrainer evaluates with it, and its
    `save_model` keeps custom_generate/ and the pipeline file, so `pipeline(dir, trust_remote_code=True)` works."""
    model, tokenizer = trained
    checkpoint, work = tmp_path / "checkpoint", tmp_path / "work"
    attach_translation_pipeline(model, checkpoint)
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP, str(checkpoint), str(work), json.dumps(SOURCES), json.dumps(TARGETS)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])

    for num_beams in (1, 4):
        lean, reference = result[f"beams{num_beams}"]
        assert lean == reference
    assert result["hub_calls"] == ["_greedy", "_beam"]  # the lean_decoding=False calls ran transformers' loop
    assert result["evaluation_calls"] == ["_beam"] and result["evaluated_rows"] == len(SOURCES)
    assert {"custom_generate/generate.py", "pipeline_vaswani.py", "modeling_vaswani.py",
            "generation_vaswani.py", "configuration_vaswani.py", "tokenization_vaswani.py"} <= set(result["files"])
    assert result["pipeline_calls"] == ["_beam"] * len(SOURCES)  # one call per sentence at batch size 1
    assert result["pipeline"] == result["pipeline_reference"] and len(set(result["pipeline"])) > 1
