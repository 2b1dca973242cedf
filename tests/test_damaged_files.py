"""Every file a tool reads a checkpoint or a corpus from, damaged in every way a copy, a download or a disk damages
it (missing, empty, cut short, another file under its name): each script refuses in one line that names the file and
what to do, before it loads anything else."""

import json
from contextlib import nullcontext
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest
from hub_stub import HubStub
from training_script import train_args

from conftest import SCRIPTS, script_main, snapshot, subprocess_env
from vaswani.data import load_translation_dataset

# What a failed download leaves under a file's name: the server's error page.
ERROR_PAGE = b"<!DOCTYPE html>\n<html><body><h1>502 Bad Gateway</h1></body></html>\n"


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "missing":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "another file":
        path.write_bytes(ERROR_PAGE if path.suffix != ".safetensors" else b'{"error": "not found"}')
    else:
        raise AssertionError(how)


SHARDED_INDEX = "model.safetensors.index.json"
FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
         SHARDED_INDEX, "model-00002-of-00002.safetensors", "trainer_state.json"]
DAMAGES = ["missing", "empty", "truncated", "another file"]


@pytest.fixture(scope="module")
def checkpoints(good_checkpoint, tmp_path_factory):
    """The good checkpoint, as one weights file and in two shards, each with a Trainer's resume record."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSeq2SeqLM

    single, sharded = tmp_path_factory.mktemp("single") / "good", tmp_path_factory.mktemp("sharded") / "good"
    shutil.copytree(good_checkpoint, single)
    shutil.copytree(good_checkpoint, sharded)
    (sharded / "model.safetensors").unlink()
    model = AutoModelForSeq2SeqLM.from_pretrained(good_checkpoint)
    size = sum(t.numel() * t.element_size() for t in load_file(good_checkpoint / "model.safetensors").values())
    model.save_pretrained(sharded, max_shard_size=size * 3 // 4)
    assert (sharded / "model-00002-of-00002.safetensors").is_file()
    for path in (single, sharded):
        (path / "trainer_state.json").write_text(json.dumps({"global_step": 4, "epoch": 0.5, "log_history": []}))
    return {"single": single, "sharded": sharded}


def copy_for(checkpoints: dict, name: str, run: Path) -> Path:
    """A copy of the checkpoint that holds `name`, as `run/checkpoint-4` (where a resumed run finds it)."""
    kind = "sharded" if name == SHARDED_INDEX or name.startswith("model-") else "single"
    path = run / "checkpoint-4"
    shutil.copytree(checkpoints[kind], path)
    return path


def translate(checkpoint: Path, tmp_path: Path) -> list[str]:
    return ["--model", str(checkpoint), "--device", "cpu", "a cat"]


def evaluate_bleu(checkpoint: Path, tmp_path: Path) -> list[str]:
    (tmp_path / "src.en").write_text("the cat\n")
    (tmp_path / "ref.fr").write_text("le chat\n")
    return ["--model", str(checkpoint), "--device", "cpu", "--source_file", str(tmp_path / "src.en"),
            "--reference_file", str(tmp_path / "ref.fr")]


def export_ctranslate2(checkpoint: Path, tmp_path: Path) -> list[str]:
    return ["--model", str(checkpoint), "--output_dir", str(tmp_path / "ct2")]


def average_checkpoints(checkpoint: Path, tmp_path: Path) -> list[str]:
    older = checkpoint.parent / "checkpoint-2"
    shutil.copytree(checkpoint, older)
    return ["--inputs", str(checkpoint.parent), "--output_dir", str(tmp_path / "average")]


def push_to_hub(checkpoint: Path, tmp_path: Path) -> list[str]:
    return ["--model_dir", str(checkpoint), "--repo_id", "someone/model", "--token", "hf_stand_in"]


def train_translation(checkpoint: Path, tmp_path: Path) -> list[str]:
    # No corpus: a run that got past the checkpoint's files would fail on it instead.
    return train_args(tmp_path / "no-corpus.tsv", checkpoint.parent, "--resume")


SCRIPTS_READING = [translate, evaluate_bleu, export_ctranslate2, average_checkpoints, push_to_hub, train_translation]

# Files whose absence is no damage: the tokenizer loads from tokenizer.json and config.json without its own config
# (the Hub upload needs it: model cards and remote code read it); a checkpoint without its resume record is one being
# written, which a resumed run skips; averaging and the Hub take a checkpoint's decoding settings as they are.
MAY_BE_MISSING = {
    "tokenizer_config.json": {translate, evaluate_bleu, export_ctranslate2, average_checkpoints, train_translation},
    "trainer_state.json": set(SCRIPTS_READING),
    "generation_config.json": {average_checkpoints, push_to_hub, train_translation},
}


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("script", SCRIPTS_READING, ids=lambda script: script.__name__)
def test_every_damaged_file_of_a_checkpoint_is_one_line_naming_it(checkpoints, tmp_path, capsys, monkeypatch,
                                                                  script, name, how):
    if how == "missing" and script in MAY_BE_MISSING.get(name, ()):
        pytest.skip(f"{script.__name__} needs no {name}")
    if name == "trainer_state.json" and script not in (train_translation, average_checkpoints):
        pytest.skip(f"{script.__name__} does not read {name}")
    checkpoint = copy_for(checkpoints, name, tmp_path / "run")
    argv = script(checkpoint, tmp_path)
    damage(checkpoint / name, how)
    before = snapshot(tmp_path)
    with HubStub() if script is push_to_hub else nullcontext() as hub:  # where a push past the checks would go
        if hub is not None:
            monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.endpoint)
            monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        with pytest.raises(SystemExit) as exit_info:
            script_main(script.__name__)(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exit_info.value.code == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]  # nothing loaded, nothing said before it
    named = str(checkpoint / name) in lines[0] or (str(checkpoint) in lines[0] and name in lines[0])
    assert named, lines[0]
    assert "again" in lines[0] or "Copy" in lines[0], lines[0]  # what to do
    assert hub is None or hub.repos == {}
    assert snapshot(tmp_path) == before  # nothing written, nothing removed


def test_a_damaged_generation_config_is_one_line_and_status_2_from_a_real_process(good_checkpoint, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(good_checkpoint, checkpoint)
    damage(checkpoint / "generation_config.json", "truncated")
    run = subprocess.run([sys.executable, str(SCRIPTS / "translate.py"), "--model", str(checkpoint), "a cat"],
                         capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith(f"error: {checkpoint / 'generation_config.json'} is damaged: not valid JSON")
    assert run.stderr.count("\n") == 1, run.stderr


# The corpus cache -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["empty", "truncated", "another file", "missing"])
@pytest.mark.parametrize("name", ["read.json", "train.arrow", "validation.arrow", "test.arrow"])
def test_a_damaged_corpus_cache_entry_is_one_line_naming_it(good_checkpoint, tmp_path, capsys, monkeypatch, name,
                                                           how):
    if (name, how) == ("read.json", "missing"):
        pytest.skip("an entry without its index is one being built: it is built again")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("".join(f"the cat {i}\tle chat {i}\n" for i in range(300)))
    load_translation_dataset(data_file=corpus)
    (entry,) = (tmp_path / "cache").rglob("corpus-*")
    damage(entry / name, how)
    with pytest.raises(SystemExit) as exit_info:
        script_main("evaluate_bleu")(["--model", str(good_checkpoint), "--corpus", str(corpus), "--device", "cpu"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {entry / name} is ") and f"delete {entry}" in lines[0], lines[0]


# A finished run's records -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["empty", "truncated", "another file"])
@pytest.mark.parametrize("name", ["training_args.json", "metrics.json"])
def test_a_damaged_record_of_a_finished_run_is_one_line_naming_it(good_checkpoint, tmp_path, capsys, name, how):
    run = tmp_path / "run"
    shutil.copytree(good_checkpoint, run)
    (run / "training_args.json").write_text(json.dumps({"max_steps": 30, "num_train_epochs": 3.0}))
    (run / "metrics.json").write_text(json.dumps({"test_bleu": 1.0}))
    damage(run / name, how)
    with pytest.raises(SystemExit) as exit_info:
        script_main("train_translation")(train_args(tmp_path / "no-corpus.tsv", run, "--resume"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {run / name} is "), lines[0]


@pytest.mark.parametrize("how", ["empty", "truncated", "another file"])
def test_a_damaged_resume_record_of_a_translation_is_one_line_naming_it(good_checkpoint, tmp_path, capsys, how):
    (tmp_path / "in.txt").write_text("a cat\nthe dog\n")
    argv = ["--model", str(good_checkpoint), "--device", "cpu", "--input_file", str(tmp_path / "in.txt"),
            "--output_file", str(tmp_path / "out.txt")]
    script_main("translate")(argv)
    capsys.readouterr()
    record = tmp_path / "out.txt.resume.json"
    damage(record, how)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        script_main("translate")([*argv, "--resume"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {record} is ") and "start again without --resume" in lines[0], lines[0]
    assert snapshot(tmp_path) == before
