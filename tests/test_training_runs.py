"""Training runs that fail or stop, one test each (`vaswani.training`, `vaswani.trainer_internals`): the training
script's arguments and output directory, faults inside the Trainer, checkpoints written at a crash, and a run killed
and resumed. docs/reliability.md is their table."""

import gzip
import inspect
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import BertConfig, HfArgumentParser, Trainer

from conftest import fails_with_one_line, forked_script, script_main, snapshot, tiny_config
from training_script import SCRIPTS, synthetic_corpus, train_args, train_in_this_process

import vaswani.inference
import vaswani.tokenization
import vaswani.training
from vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani.files import DiskFullError
from vaswani.training import (
    DataArguments,
    ModelArguments,
    VaswaniSeq2SeqTrainer,
    VaswaniTrainingArguments,
    finished_run,
    prepare_output_dir,
    run_training,
)
from vaswani.run_directory import remove_old_checkpoints


@pytest.fixture(autouse=True)
def _malloc_left_alone(monkeypatch):
    """The training script's `main`, called in this process, leaves glibc's malloc as it is: keep_freed_cpu_memory
    would change it for the rest of the test process (and it finds the C library through `ldconfig -p`, a process,
    which the quick tier skips a test for)."""
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)


def parse_training_args(argv):
    return HfArgumentParser((ModelArguments, DataArguments, VaswaniTrainingArguments)).parse_args_into_dataclasses(
        args=argv)


# Training script: arguments and output directory ----------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path):
    return synthetic_corpus(tmp_path / "corpus.tsv", pairs=200)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--preset", "huge"], "Unknown --preset 'huge'"),
        (["--config_overrides", "d_modle=64"], "'d_modle' is not a VaswaniConfig field"),
        (["--config_overrides", "num_attention_heads=3"], "VaswaniConfig.d_model (32) must be divisible"),
        (["--config_overrides", "dropout=1.5"], "VaswaniConfig.dropout must be in [0, 1)"),
        (["--max_tokens_per_batch", "0"], "--max_tokens_per_batch must be positive"),
        (["--max_length", "0"], "--max_length must be a positive number"),
        (["--max_test_samples", "-1"], "--max_test_samples must be a non-negative number"),
        (["--resume", "--overwrite_output_dir"], "pass one of them"),
    ],
)
def test_bad_training_arguments_are_one_line_and_write_nothing(corpus, tmp_path, capsys, extra, message):
    output_dir = tmp_path / "out"
    fails_with_one_line(script_main("train_translation"), train_args(corpus, output_dir, *extra), capsys, message)
    assert not output_dir.exists()


def test_corpus_too_small_for_its_splits_is_one_line_before_training(tmp_path, capsys):
    corpus = tmp_path / "one-sentence.tsv"
    corpus.write_text("I have one cat.\tJ'ai un chat.\n" * 20)  # one source: all of it lands in the train split
    output_dir = tmp_path / "out"
    fails_with_one_line(script_main("train_translation"), train_args(corpus, output_dir), capsys,
                        "The test split of the corpus is empty; use a larger corpus")
    assert not output_dir.exists()


def test_missing_corpus_is_one_line_and_writes_nothing(tmp_path, capsys):
    output_dir = tmp_path / "out"
    fails_with_one_line(script_main("train_translation"), train_args(tmp_path / "nope.tsv", output_dir), capsys,
                        "does not exist")
    assert not output_dir.exists()


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.tsv", b"", "Corpus file {path} is empty; it must hold one en<TAB>fr sentence pair per line"),
        ("empty.tsv.gz", gzip.compress(b""), "Corpus file {path} is empty"),
        ("no-tabs.tsv", b"I have one cat.\nJ'ai un chat.\n\n",
         "No line of corpus file {path} holds a sentence pair (3 lines: no_tab=2, blank=1)"),
        ("empty-sides.jsonl", b'{"en": "I have one cat.", "fr": ""}\n',
         "The train split of {path} holds no sentence pair with both sides non-empty"),
    ],
    ids=["empty", "empty-gzip", "no-tabs", "no-target"],
)
def test_a_corpus_without_a_sentence_pair_is_one_line_before_any_tokenizer_is_trained(tmp_path, capsys, monkeypatch,
                                                                                      name, content, message):
    corpus = tmp_path / name
    corpus.write_bytes(content)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a tokenizer was trained on a corpus without sentence pairs")

    # Every tokenizer training goes through it.
    monkeypatch.setattr(vaswani.tokenization, "train_tokenizer", must_not_run)
    output_dir = tmp_path / "out"
    fails_with_one_line(script_main("train_translation"), train_args(corpus, output_dir), capsys,
                        message.format(path=corpus))
    fails_with_one_line(script_main("train_tokenizer"), ["--corpus", str(corpus), "--output_dir", str(output_dir)],
                        capsys, message.format(path=corpus))
    assert not output_dir.exists()


@pytest.mark.parametrize("flag", ["--model_name_or_path", "--tokenizer_name_or_path"])
def test_a_checkpoint_path_that_is_a_file_is_one_line_before_any_data_is_read(tmp_path, capsys, flag):
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"")
    output_dir = tmp_path / "out"
    fails_with_one_line(script_main("train_translation"), train_args(tmp_path / "nope.tsv", output_dir, flag,
                                                                     str(a_file)),
                        capsys, f"{flag} {a_file} is a file; give the checkpoint directory")
    assert not output_dir.exists()


def fake_finished_model(output_dir: Path, *checkpoint_steps: int, complete: bool = True) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.json").write_text(json.dumps({"model_type": "vaswani"}))
    (output_dir / "model.safetensors").write_bytes(b"weights of an earlier model")
    for step in checkpoint_steps:
        (output_dir / f"checkpoint-{step}").mkdir()
        if complete:
            (output_dir / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")


def test_output_dir_holding_a_model_is_refused_and_left_untouched(corpus, tmp_path, capsys):
    output_dir = tmp_path / "out"
    fake_finished_model(output_dir, 10)
    before = snapshot(output_dir)
    fails_with_one_line(script_main("train_translation"), train_args(corpus, output_dir), capsys,
                        "already holds a model or checkpoints. Pass --resume")
    assert snapshot(output_dir) == before


def test_resume_of_a_finished_run_does_not_train_again(corpus, tmp_path, capsys, caplog, monkeypatch):
    """A requeued `--resume` of a run that has ended: status 0, its metrics on stdout, DIR untouched, nothing read."""
    output_dir = tmp_path / "out"
    fake_finished_model(output_dir, 5, 10)
    (output_dir / "metrics.json").write_text(json.dumps({"test_bleu": 12.5}))
    written = (output_dir / "checkpoint-10" / "trainer_state.json").stat().st_mtime
    os.utime(output_dir / "config.json", (written + 1, written + 1))  # the final model is saved after checkpoints
    before = snapshot(output_dir)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished run read its corpus again")

    monkeypatch.setattr(vaswani.training, "prepare_data", must_not_run)
    with caplog.at_level("WARNING", logger="vaswani.training"):
        script_main("train_translation")(train_args(corpus, output_dir, "--resume"))
    assert json.loads(capsys.readouterr().out) == {"test_bleu": 12.5}
    assert "holds the finished model of this run" in caplog.text
    assert snapshot(output_dir) == before


def test_a_finished_run_is_a_final_model_newer_than_every_complete_checkpoint(tmp_path):
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    assert finished_run(str(output_dir)) is None
    fake_finished_model(output_dir, 5)
    (output_dir / "checkpoint-7").mkdir()  # incomplete: not a checkpoint
    written = (output_dir / "checkpoint-5" / "trainer_state.json").stat().st_mtime
    os.utime(output_dir / "config.json", (written + 1, written + 1))
    assert finished_run(str(output_dir)) == {}  # no metrics.json: finished all the same
    # An --overwrite_output_dir run that stopped after its first checkpoint: the old model is not its end.
    os.utime(output_dir / "config.json", (written - 1, written - 1))
    assert finished_run(str(output_dir)) is None
    (output_dir / "config.json").unlink()  # weights without config.json: no complete model
    assert finished_run(str(output_dir)) is None


def test_a_finished_run_is_one_of_the_length_asked_for(tmp_path):
    """A `--resume` asking for more steps, epochs or time than the finished run trained continues it instead."""
    from types import SimpleNamespace

    output_dir = tmp_path / "out"
    fake_finished_model(output_dir, 5)
    written = (output_dir / "checkpoint-5" / "trainer_state.json").stat().st_mtime
    (output_dir / "training_args.json").write_text(json.dumps(
        {"max_steps": 10, "num_train_epochs": 3.0, "max_train_time": None}))
    os.utime(output_dir / "config.json", (written + 1, written + 1))
    same = SimpleNamespace(max_steps=10, num_train_epochs=3.0, max_train_time=None)
    assert finished_run(str(output_dir), same) == {}
    for longer in ({"max_steps": 20}, {"num_train_epochs": 6.0}, {"max_train_time": 60.0}):
        assert finished_run(str(output_dir), SimpleNamespace(**{**vars(same), **longer})) is None, longer


def test_resume_ignores_incomplete_checkpoints_and_removes_staging_directories(tmp_path):
    output_dir = tmp_path / "out"
    fake_finished_model(output_dir, 5, 10)
    (output_dir / "checkpoint-15").mkdir()  # no trainer_state.json: written by something that stopped half-way
    (output_dir / ".tmp-checkpoint-20" / "checkpoint-20").mkdir(parents=True)  # a crash while saving step 20
    args = VaswaniTrainingArguments(output_dir=str(output_dir), resume=True, report_to="none")
    assert prepare_output_dir(args) == str(output_dir / "checkpoint-10")
    assert not (output_dir / ".tmp-checkpoint-20").exists()


def test_resume_from_checkpoint_path_must_be_a_complete_checkpoint(tmp_path):
    fake_finished_model(tmp_path / "out", 10)
    (tmp_path / "out" / "checkpoint-15").mkdir()
    for step, expected in ((10, str(tmp_path / "out" / "checkpoint-10")), (15, None), (99, None)):
        checkpoint = str(tmp_path / "out" / f"checkpoint-{step}")
        args = VaswaniTrainingArguments(output_dir=str(tmp_path / "new"), resume_from_checkpoint=checkpoint,
                                        report_to="none")
        if expected:
            assert prepare_output_dir(args) == expected
        else:
            with pytest.raises(FileNotFoundError, match="is not a complete checkpoint directory"):
                prepare_output_dir(args)


def test_overwrite_output_dir_deletes_old_checkpoints_only(tmp_path):
    output_dir = tmp_path / "out"
    fake_finished_model(output_dir, 5, 10)
    (output_dir / "notes.txt").write_text("mine")
    args = VaswaniTrainingArguments(output_dir=str(output_dir), overwrite_output_dir=True, report_to="none")
    before = snapshot(output_dir)
    assert prepare_output_dir(args) is None
    assert snapshot(output_dir) == before  # nothing deleted until the run has read its corpus and built its model
    remove_old_checkpoints(args)
    assert sorted(p.name for p in output_dir.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]


def test_resume_with_another_configuration_is_refused(tmp_path):
    output_dir = tmp_path / "out"
    checkpoint = output_dir / "checkpoint-4"
    VaswaniConfig.tiny(d_model=64).save_pretrained(checkpoint)
    (checkpoint / "trainer_state.json").write_text("{}")
    from vaswani.training import check_checkpoint_matches

    with pytest.raises(ValueError, match=r"trained with d_model=64 \(this run: 32\)"):
        check_checkpoint_matches(str(checkpoint), VaswaniConfig.tiny())
    BertConfig().save_pretrained(checkpoint)
    with pytest.raises(ValueError, match="holds a 'bert' model"):
        check_checkpoint_matches(str(checkpoint), VaswaniConfig.tiny())


# Trainer faults (in this process, on a tiny fixed-length dataset) -------------------------------------------------


def tiny_trainer(output_dir: Path, **overrides) -> VaswaniSeq2SeqTrainer:
    config = tiny_config()
    model = VaswaniForConditionalGeneration(config)
    ids = torch.randint(4, config.vocab_size, (32, 6), generator=torch.Generator().manual_seed(0))
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                 "labels": ids.flip(-1).tolist()})
    settings = {"per_device_train_batch_size": 8, "max_steps": 4, "save_strategy": "steps", "save_steps": 2,
                "logging_steps": 100, "report_to": "none", "disable_tqdm": True, "learning_rate": 1e-3,
                "use_cpu": True, "dataloader_pin_memory": False, **overrides}
    args = VaswaniTrainingArguments(output_dir=str(output_dir), **settings)
    return VaswaniSeq2SeqTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset)


def test_checkpoints_hold_no_pickled_arguments(tmp_path, single_thread):
    tiny_trainer(tmp_path / "out", max_steps=2).train()
    names = {p.name for p in (tmp_path / "out" / "checkpoint-2").iterdir()}
    assert "training_args.json" in names and "training_args.bin" not in names
    assert {"model.safetensors", "trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= names


def test_crash_while_writing_a_checkpoint_leaves_only_complete_ones(tmp_path, single_thread):
    output_dir = tmp_path / "out"
    trainer = tiny_trainer(output_dir)
    save_rng_state, calls = trainer._save_rng_state, []

    def fail_on_second_save(directory):
        calls.append(directory)
        if len(calls) == 2:
            raise OSError("No space left on device (simulated)")
        save_rng_state(directory)

    trainer._save_rng_state = fail_on_second_save
    # The full disk is said in one line naming the checkpoint and what is kept (docs/reliability.md, A full disk).
    with pytest.raises(DiskFullError, match=r"No space left on the device to write .*checkpoint-4; its complete "
                       r"checkpoints are kept \(the last: .*checkpoint-2\); free some space, then run the same "
                       "command with --resume"):
        trainer.train()
    assert sorted(p.name for p in output_dir.iterdir()) == [".tmp-checkpoint-4", "checkpoint-2"]
    assert (output_dir / "checkpoint-2" / "trainer_state.json").is_file()
    args = VaswaniTrainingArguments(output_dir=str(output_dir), resume=True, report_to="none")
    assert prepare_output_dir(args) == str(output_dir / "checkpoint-2")
    assert sorted(p.name for p in output_dir.iterdir()) == ["checkpoint-2"]


def test_best_checkpoint_and_rotation_point_at_renamed_directories(tmp_path, single_thread):
    output_dir = tmp_path / "out"
    # greater_is_better on the loss: the best checkpoint is an early one, so rotation must keep an older directory.
    trainer = tiny_trainer(output_dir, max_steps=8, eval_strategy="steps", eval_steps=2, save_total_limit=1,
                           metric_for_best_model="loss", greater_is_better=True, load_best_model_at_end=True)
    trainer.train()
    losses = {entry["step"]: entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry}
    best = output_dir / f"checkpoint-{max(losses, key=losses.get)}"
    assert trainer.state.best_model_checkpoint == str(best) and best.is_dir()
    saved_best = json.loads((best / "trainer_state.json").read_text())["best_model_checkpoint"]
    assert saved_best == str(best)
    remaining = sorted(p.name for p in output_dir.iterdir())
    assert not any(name.startswith(".tmp-") for name in remaining) and len(remaining) <= 2


def test_non_finite_loss_stops_training_naming_the_step_and_saves_nothing_after_it(tmp_path, single_thread):
    output_dir = tmp_path / "out"
    trainer = tiny_trainer(output_dir, max_steps=6, save_steps=1)
    compute_loss = trainer.compute_loss

    def poisoned(model, inputs, *args, **kwargs):
        loss = compute_loss(model, inputs, *args, **kwargs)
        return loss * float("inf") if trainer.state.global_step == 2 else loss  # the third step

    trainer.compute_loss = poisoned
    with pytest.raises(FloatingPointError, match="NaN/inf at step 3"):
        trainer.train()
    assert sorted(p.name for p in output_dir.iterdir()) == ["checkpoint-1", "checkpoint-2"]


def test_non_finite_loss_ends_the_script_with_one_line_and_status_2(corpus, tmp_path, capsys, single_thread):
    """Through the script's `main` in this process: its status 2 and its last line are what a fresh process shows."""
    with pytest.raises(SystemExit) as exit_info:
        script_main("train_translation")(train_args(corpus, tmp_path / "out", "--learning_rate", "1e30",
                                                    "--warmup_steps", "0", "--max_steps", "8", "--logging_steps", "4"))
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2, stderr[-2000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: Training loss became NaN/inf at step "), last
    assert not (tmp_path / "out").exists()  # no checkpoint was due: nothing is left behind


def dirty_gzip_corpus(path: Path) -> Path:
    """The synthetic corpus with one line of every malformed kind, gzipped and then cut short."""
    clean = synthetic_corpus(path.with_suffix(".clean"), pairs=200).read_bytes()
    dirty = (b"no tab on this line\n" + b"I have one cat.\tJ'ai un chat.\textra column\n" + b"\tOnly French.\n"
             + b"caf\xe9\tcaf\xc3\xa9\n" + b"\n" + clean)
    compressed = gzip.compress(dirty)
    path.write_bytes(compressed[: len(compressed) - 40])
    return path


def test_same_seed_gives_identical_weights_even_from_a_dirty_corpus(tmp_path, caplog, single_thread):
    corpus = dirty_gzip_corpus(tmp_path / "dirty.tsv.gz")
    weights = []
    for run in ("a", "b"):
        argv = train_args(corpus, tmp_path / run, "--max_steps", "6", "--max_test_samples", "4",
                          "--generation_num_beams", "1", "--generation_max_length", "8", "--disable_tqdm", "true")
        with caplog.at_level("WARNING", logger="vaswani.data"):
            run_training(*parse_training_args(argv))
        weights.append((tmp_path / run / "model.safetensors").read_bytes())
    assert weights[0] == weights[1]
    log = caplog.text
    for count in ("no_tab=1", "extra_columns=1", "empty_side=1", "invalid_utf8=1", "blank=1"):
        assert count in log, log
    assert "cut short" in log


# SIGKILL in the middle of an epoch, then --resume ---------------------------------------------------------------------


def kill_and_resume_args(corpus: Path, output_dir: Path, *extra: str) -> list[str]:
    # 200 pairs in batches of at most 300 tokens: 10 steps per epoch, so checkpoint-16 is in the middle of epoch 2.
    return [str(SCRIPTS / "train_translation.py"),
            *train_args(corpus, output_dir, "--max_train_samples", "200", "--max_tokens_per_batch", "300",
                        "--max_steps", "24", "--save_strategy", "steps", "--save_steps", "8", "--logging_steps", "8",
                        "--generation_num_beams", "1", "--disable_tqdm", "true", *extra)]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_matches_an_uninterrupted_run(tmp_path):
    """Three runs of 24 steps and their test evaluations: the uninterrupted one, one killed in the middle of epoch 2
    (the only process of its own, forked: a SIGKILL) and its resume (both in this process), which must match."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv")
    reference, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    train_in_this_process(*kill_and_resume_args(corpus, reference)[1:])

    process = forked_script("train_translation", kill_and_resume_args(corpus, killed)[1:])
    deadline = time.monotonic() + 240
    while process.poll() is None and time.monotonic() < deadline:
        if killed.is_dir():
            for path in killed.iterdir():  # a visible checkpoint is always complete
                if path.name.startswith("checkpoint-"):
                    assert (path / "trainer_state.json").is_file(), path
            if (killed / "checkpoint-16").is_dir():
                process.send_signal(signal.SIGKILL)
                break
        time.sleep(0.005)
    assert process.wait() == -signal.SIGKILL, "training ended before it could be killed"
    assert not (killed / "checkpoint-24").exists() and not (killed / "config.json").exists()

    resumed_at = time.time()
    train_in_this_process(*kill_and_resume_args(corpus, killed, "--resume")[1:])
    # It continued from checkpoint-16 (a restart would have written checkpoints 8 and 16 again).
    assert all((killed / f"checkpoint-{step}").stat().st_mtime < resumed_at for step in (8, 16))
    assert (killed / "checkpoint-24").stat().st_mtime > resumed_at

    def final_loss(run: Path) -> float:
        history = json.loads((run / "checkpoint-24" / "trainer_state.json").read_text())["log_history"]
        return [entry["loss"] for entry in history if "loss" in entry][-1]

    assert final_loss(killed) == pytest.approx(final_loss(reference), abs=1e-4)
    expected, resumed = (json.loads((run / "metrics.json").read_text()) for run in (reference, killed))
    for metric in ("test_bleu", "test_chrf", "test_ter"):
        assert resumed[metric] == pytest.approx(expected[metric], abs=1e-6), metric
    weights, reference_weights = load_file(killed / "model.safetensors"), load_file(reference / "model.safetensors")
    for name, tensor in reference_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5)


def killed_as_training_starts():
    """Makes train_translation.py's process, forked (`forked_script`), SIGKILL itself at the start of training:
    output_dir created, no checkpoint yet."""
    import vaswani.training

    vaswani.training.VaswaniSeq2SeqTrainer.train = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow  # three runs of the training script (the last two in this process)
def test_sigkill_before_the_first_checkpoint_then_resume_trains_from_the_start_and_only_once(tmp_path, capsys,
                                                                                            caplog):
    """The same command line, `--resume` included, as a scheduler requeues it: after a kill before any checkpoint it
    trains from the start; once the run has ended, it trains no more and leaves the output as it is (the two runs
    after the kill through the script's `main` in this process)."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=200)
    output_dir = tmp_path / "out"
    argv = [str(SCRIPTS / "train_translation.py"),
            *train_args(corpus, output_dir, "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
                        "--max_test_samples", "4", "--generation_num_beams", "1", "--generation_max_length", "8",
                        "--disable_tqdm", "true", "--resume")]
    killed = forked_script("train_translation", argv[1:], killed_as_training_starts)
    assert killed.wait(timeout=300) == -signal.SIGKILL, killed.communicate()[1][-3000:]
    assert output_dir.is_dir() and not any(path.name.startswith("checkpoint-") for path in output_dir.iterdir())

    with caplog.at_level("WARNING", logger="vaswani"):
        train_in_this_process(*argv[1:])
    assert "holds no complete checkpoint; starting from scratch" in caplog.text
    caplog.clear()
    assert {"checkpoint-2", "checkpoint-4", "config.json", "model.safetensors"} <= {p.name for p in output_dir.iterdir()}

    before = snapshot(output_dir), {path: path.stat().st_mtime_ns for path in output_dir.rglob("*")}
    with caplog.at_level("WARNING", logger="vaswani.training"):
        script_main("train_translation")(argv[1:])
    assert "holds the finished model of this run" in caplog.text
    assert json.loads(capsys.readouterr().out) == json.loads((output_dir / "metrics.json").read_text())
    assert (snapshot(output_dir), {path: path.stat().st_mtime_ns for path in output_dir.rglob("*")}) == before


def test_the_trainer_reads_its_resume_state_with_weights_only():
    """What a resume reads besides safetensors (optimizer, scheduler, RNG state) goes through torch.load with
    weights_only=True in transformers itself; this guards that claim of docs/reliability.md."""
    for method in (Trainer._load_rng_state, Trainer._load_optimizer_and_scheduler):
        source = inspect.getsource(method)
        calls = source.count("torch.load(")
        assert calls and source.count("weights_only=True") >= calls, method.__name__
