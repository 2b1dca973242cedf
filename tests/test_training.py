"""The training script end to end on a small synthetic corpus: single process, then DDP with two CPU processes."""

import collections
import json
import os
import random
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import transformers
from packaging import version
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, TrainerCallback

import vaswani.data
import vaswani.evaluation
import vaswani.inference
import vaswani.loading
import vaswani.training
from conftest import free_port, script_main

REPO = Path(__file__).resolve().parents[1]
VaswaniSeq2SeqTrainer = vaswani.training.VaswaniSeq2SeqTrainer  # as imported, whatever a test patches
SCRIPTS = REPO / "scripts"

NUMBERS = [("one", "un"), ("two", "deux"), ("three", "trois"), ("four", "quatre"), ("five", "cinq")]
NOUNS = [("cat", "chat", "chats"), ("dog", "chien", "chiens"), ("book", "livre", "livres"), ("car", "voiture", "voitures")]


def synthetic_corpus(path: Path, pairs: int = 600, seed: int = 0) -> Path:
    """English<TAB>French lines from templates: enough structure for a tiny model to learn something."""
    rng = random.Random(seed)
    lines = []
    for _ in range(pairs):
        (en_n, fr_n), (en_s, fr_s, fr_p) = rng.choice(NUMBERS), rng.choice(NOUNS)
        if en_n == "one":
            lines.append(f"I have one {en_s}.\tJ'ai un {fr_s}.")
        else:
            lines.append(f"I have {en_n} {en_s}s.\tJ'ai {fr_n} {fr_p}.")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def train_args(corpus: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        "--preset", "tiny", "--vocab_size", "300", "--corpus", str(corpus), "--output_dir", str(output_dir),
        "--max_steps", "30", "--per_device_train_batch_size", "16", "--learning_rate", "3e-3",
        "--warmup_steps", "5", "--eval_strategy", "no", "--save_strategy", "no", "--logging_steps", "10",
        "--report_to", "none", "--max_test_samples", "20", "--generation_num_beams", "2", "--seed", "0",
        "--dataloader_pin_memory", "false", *extra,
    ]


def run_script(name: str, *args: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    corpus = synthetic_corpus(root / "corpus.tsv")
    output_dir = root / "model"
    result = run_script("train_translation.py", *train_args(corpus, output_dir, "--max_tokens_per_batch", "400"))
    assert result.returncode == 0, result.stderr[-3000:]
    return corpus, output_dir, result


def test_training_writes_a_complete_checkpoint(trained):
    _, output_dir, result = trained
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "configuration_vaswani.py", "modeling_vaswani.py", "README.md",
                 "metrics.json", "training_args.json", "pipeline_vaswani.py", "tokenization_vaswani.py"):
        assert (output_dir / name).is_file(), name
    assert not any(p.suffix in (".bin", ".pt", ".pth") for p in output_dir.iterdir())
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert 1 <= metrics["test_sentences"] <= 20 and 0.0 <= metrics["test_bleu"] <= 100.0
    assert metrics["train_loss"] > 0
    # The tokenizer learned from every pair of this small corpus, both sides; the card says so.
    assert metrics["tokenizer_training_sentences"] > 0
    assert f"trained on {metrics['tokenizer_training_sentences']:,} sentences" in (output_dir / "README.md").read_text()
    # The printed metrics are the saved ones: the number in the report comes from the evaluation.
    assert json.loads(result.stdout[result.stdout.index("{"):])["test_bleu"] == metrics["test_bleu"]


def test_trained_checkpoint_loads_and_translates(trained):
    _, output_dir, _ = trained
    model = AutoModelForSeq2SeqLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert type(model).__name__ == "VaswaniForConditionalGeneration"
    assert model.generation_config.num_beams == 2
    assert model.generation_config.length_penalty == 0.6  # --generation_length_penalty's default, the paper's α
    batch = tokenizer(["I have two cats."], return_tensors="pt")
    output = model.generate(**batch, max_new_tokens=10)
    assert output.shape[0] == 1


def test_translate_and_visualize_scripts(trained, tmp_path):
    _, output_dir, _ = trained
    result = run_script("translate.py", "--model", str(output_dir), "--num_beams", "2", "--max_new_tokens", "12",
                        "I have one dog.", "I have five books.")
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(result.stdout.strip().splitlines()) == 2
    stdin = subprocess.run([sys.executable, str(SCRIPTS / "translate.py"), "--model", str(output_dir),
                            "--num_beams", "1", "--max_new_tokens", "8"], input="I have one cat.\n",
                           capture_output=True, text=True, timeout=120)
    assert stdin.returncode == 0 and len(stdin.stdout.strip().splitlines()) == 1
    result = run_script("visualize_attention.py", "--model", str(output_dir), "--source", "I have two dogs.",
                        "--output_dir", str(tmp_path / "maps"))
    assert result.returncode == 0, result.stderr[-2000:]
    pngs = sorted((tmp_path / "maps").glob("*.png"))
    # tiny preset: 2 encoder + 2 decoder layers → encoder, decoder-self and cross maps per layer
    assert len(pngs) == 6 and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_evaluate_bleu_script_on_files(trained, tmp_path):
    _, output_dir, _ = trained
    (tmp_path / "src.en").write_text("I have one cat.\nI have two dogs.\n")
    (tmp_path / "ref1.fr").write_text("J'ai un chat.\nJ'ai deux chiens.\n")
    (tmp_path / "ref2.fr").write_text("\nJ'ai deux chiens !\n")
    result = run_script("evaluate_bleu.py", "--model", str(output_dir), "--source_file", str(tmp_path / "src.en"),
                        "--reference_file", str(tmp_path / "ref1.fr"), "--reference_file", str(tmp_path / "ref2.fr"),
                        "--num_beams", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    scores = json.loads(result.stdout)
    assert scores["sentences"] == 2 and {"bleu", "chrf", "ter"} <= scores.keys()


@pytest.mark.slow
def test_ddp_with_two_cpu_processes(tmp_path):
    """torchrun runs the unchanged script with DDP over gloo: both ranks train, one checkpoint is written, it loads."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv")
    output_dir = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(SCRIPTS / "train_translation.py"),
               *train_args(corpus, output_dir, "--max_steps", "10", "--ddp_backend", "gloo", "--logging_steps", "5")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    state = json.loads((output_dir / "metrics.json").read_text())
    assert state["train_world_size"] == 2
    assert (output_dir / "model.safetensors").is_file()
    model = AutoModelForSeq2SeqLM.from_pretrained(output_dir)
    assert torch.isfinite(next(model.parameters())).all()


def test_training_on_a_cpu_reuses_freed_memory_of_any_size(tmp_path, monkeypatch):
    """train_translation.py sets up glibc to reuse freed memory of any size before it trains on a CPU (the logits of
    a step are hundreds of MiB, and page-faulting them fresh each step cost about a fifth of the step's time)."""
    calls = []  # the real call would change this test process' malloc for good
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: calls.append(
        largest_block_mib))
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=100)
    script_main("train_translation")(train_args(corpus, tmp_path / "out", "--max_steps", "1", "--max_test_samples", "2",
                                                "--generation_num_beams", "1", "--use_cpu", "true"))
    assert calls == [None]


def test_bf16_on_a_cpu_trains_under_autocast_and_reports_the_float32_model(tmp_path, monkeypatch):
    """--bf16 --use_cpu --attn_implementation eager (the main job's recipe on CPUs with native bf16): the steps run
    under bf16 autocast with the chosen attention, batches are not padded to multiples of 8 (a GPU habit that only
    adds work on a CPU), and the test report decodes without autocast, as the saved float32 weights do."""
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    collators, training, evaluation = [], [], []
    real_collator = vaswani.training.DataCollatorForSeq2Seq

    def collator(*args, **kwargs):
        collators.append(kwargs.get("pad_to_multiple_of"))
        return real_collator(*args, **kwargs)

    real_build = vaswani.training.build_model_and_tokenizer

    def build(*args, **kwargs):
        model, tokenizer = real_build(*args, **kwargs)
        model.lm_head.register_forward_hook(
            lambda module, inputs, output: (training if module.training else evaluation).append(
                (output.dtype, model.config._attn_implementation)))
        return model, tokenizer

    monkeypatch.setattr(vaswani.training, "DataCollatorForSeq2Seq", collator)
    monkeypatch.setattr(vaswani.training, "build_model_and_tokenizer", build)
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=100)
    script_main("train_translation")(train_args(
        corpus, tmp_path / "out", "--max_steps", "2", "--max_test_samples", "2", "--generation_num_beams", "1",
        "--bf16", "--use_cpu", "--attn_implementation", "eager"))
    assert collators == [None]
    assert set(training) == {(torch.bfloat16, "eager")} and len(training) == 2
    assert evaluation and {dtype for dtype, _ in evaluation} == {torch.float32}
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["dtype"] == "float32" and "attn_implementation" not in json.dumps(saved)


def test_time_budget_stops_training_then_evaluates_and_saves(tmp_path):
    corpus = synthetic_corpus(tmp_path / "corpus.tsv")
    output_dir = tmp_path / "budget"
    args = train_args(corpus, output_dir, "--max_steps", "100000", "--max_train_time", "3")
    result = run_script("train_translation.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    runtime = json.loads(result.stdout)["train_runtime"]
    assert 3 <= metrics["train_wall_seconds"] < 60 and runtime < 60
    assert "test_bleu" in metrics and (output_dir / "model.safetensors").is_file()
    # --save_strategy no: the budget ends in the final model only, not in an extra resumable checkpoint.
    assert not list(output_dir.glob("checkpoint-*"))
    # The progress bar counts the budget's 3 seconds, not the 100,000 steps that --max_steps allows.
    assert "| 3/3 s [" in result.stderr and "/100000" not in result.stderr, result.stderr[-2000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]  # no deprecation notices in normal use


# Loud, not silent: a model trained by the script must translate sentences it never saw, through the paths users take.
# transformers 5.24 renamed the decoding cache; a model that ignored the new name decoded every step without its past
# and looped on every sentence longer than a few tokens, while every shape- and smoke-test stayed green.
COUNTS = [("two", "deux"), ("three", "trois"), ("four", "quatre"), ("five", "cinq"), ("six", "six"),
          ("seven", "sept"), ("eight", "huit"), ("nine", "neuf"), ("ten", "dix")]
OBJECTS = [("cats", "chats"), ("dogs", "chiens"), ("books", "livres"), ("cars", "voitures"), ("birds", "oiseaux"),
           ("apples", "pommes"), ("houses", "maisons"), ("trees", "arbres")]
SUBJECTS = [("I have", "J'ai"), ("We see", "Nous voyons"), ("They want", "Ils veulent")]


def counting_pairs() -> list[tuple[str, str]]:
    return [(f"{en_s} {en_n} {en_o} today.", f"{fr_s} {fr_n} {fr_o} aujourd'hui.")
            for en_s, fr_s in SUBJECTS for en_n, fr_n in COUNTS for en_o, fr_o in OBJECTS]


@pytest.fixture(scope="module")
def counting_translator(tmp_path_factory):
    root = tmp_path_factory.mktemp("counting")
    corpus = root / "corpus.tsv"
    corpus.write_text("".join(f"{en}\t{fr}\n" for en, fr in counting_pairs() * 4), encoding="utf-8")
    output_dir = root / "model"
    args = train_args(corpus, output_dir, "--max_steps", "250", "--max_tokens_per_batch", "600",
                      "--max_test_samples", "100", "--vocab_size", "500")
    result = run_script("train_translation.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    held_out = [(en, fr) for en, fr in counting_pairs()
                if vaswani.data.split_of(en, vaswani.data.VALIDATION_FRACTION, vaswani.data.TEST_FRACTION) == "test"]
    assert len(held_out) >= 4  # the split is by a hash of the source: these sentences were never trained on
    return output_dir, held_out


@pytest.mark.slow
def test_a_trained_translator_translates_unseen_sentences(counting_translator):
    output_dir, held_out = counting_translator
    sources, references = [en for en, _ in held_out], [fr for _, fr in held_out]
    metrics = json.loads((output_dir / "metrics.json").read_text())  # the training script's own test evaluation
    assert metrics["test_bleu"] >= 90, metrics
    for decoding in ("lean", "transformers"):  # the scripts' loader: the lean loop (its default), or transformers' own
        model, tokenizer = vaswani.loading.load_translator(str(output_dir), decoding=decoding)
        batch = tokenizer(sources, return_tensors="pt", padding=True)
        for use_cache in (True, False):  # the checkpoint's own generation settings (beam search), cached or not
            output = model.generate(**batch, use_cache=use_cache)
            assert tokenizer.batch_decode(output, skip_special_tokens=True) == references, (decoding, use_cache)
        assert vaswani.evaluation.translate(model, tokenizer, sources, num_beams=1) == references, decoding


def test_the_learning_rate_decays_over_the_time_budget(tmp_path):
    """--lr_decay_over_time_budget: warm-up in steps, then linear (or cosine) decay of the budget's spent part,
    reaching zero as the budget runs out, instead of decaying over --max_steps, which a timed run never reaches."""
    from vaswani import VaswaniForConditionalGeneration
    from vaswani.training import TimeBudgetCallback, VaswaniSeq2SeqTrainer, VaswaniTrainingArguments

    from conftest import tiny_config

    for kind, halfway in (("linear", 0.5), ("cosine", 0.5), ("linear", 0.25)):
        args = VaswaniTrainingArguments(output_dir=str(tmp_path), max_train_time=100, lr_scheduler_type=kind,
                                        lr_decay_over_time_budget=True, warmup_steps=4, learning_rate=1.0,
                                        max_steps=100000, report_to="none", use_cpu=True)
        budget = TimeBudgetCallback(args.max_train_time)
        trainer = VaswaniSeq2SeqTrainer(model=VaswaniForConditionalGeneration(tiny_config()), args=args,
                                        time_budget=budget)
        trainer.create_optimizer()
        scheduler = trainer.create_scheduler(num_training_steps=100000)
        rates = []
        for step in range(1, 7):
            trainer.optimizer.step()
            scheduler.step()
            rates.append(scheduler.get_last_lr()[0])
        assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and rates[4:] == pytest.approx([1.0, 1.0])
        budget.fraction = halfway
        trainer.optimizer.step()
        scheduler.step()
        expected = 1 - halfway if kind == "linear" else 0.5 * (1 + torch.cos(torch.tensor(torch.pi * halfway))).item()
        assert scheduler.get_last_lr()[0] == pytest.approx(expected)
        budget.fraction = 1.0
        trainer.optimizer.step()
        scheduler.step()
        assert scheduler.get_last_lr()[0] == 0.0


def test_the_time_callbacks_share_one_clock_reading_per_step(monkeypatch):
    """The time budget and the interval checkpoints decide on the same all-reduced clock (one all-reduce per step
    under DDP, whichever callbacks read it), and an interval counts from the step of the last checkpoint."""
    from transformers import TrainerControl, TrainerState

    import vaswani.training as training

    now, reductions = [100.0], []
    monkeypatch.setattr(training.time, "monotonic", lambda: now[0])

    def slowest_rank(seconds, args):
        reductions.append(seconds)
        return seconds

    monkeypatch.setattr(training, "slowest_rank", slowest_rank)
    clock = training.TrainingClock()
    budget, interval = training.TimeBudgetCallback(10, clock), training.IntervalCheckpointCallback(3, clock)
    args, state = training.VaswaniTrainingArguments(output_dir="unused", use_cpu=True, report_to="none"), TrainerState()
    state.max_steps = 100
    for callback in (budget, interval):
        callback.on_train_begin(args, state, TrainerControl())
    saved, stopped = [], None
    for step in range(1, 8):
        now[0] += 2.0
        state.global_step, control = step, TrainerControl()
        for callback in (budget, interval):
            control = callback.on_step_end(args, state, control)
        if control.should_save:
            saved.append(step)
            interval.on_save(args, state, control)
        if control.should_training_stop:
            stopped = step
            break
    assert len(reductions) == stopped == 5  # one reading per step, shared by both callbacks
    assert saved == [2, 4, 5] and budget.fraction == 1.0  # 4 s, 8 s, then the budget's last step (10 s)


@pytest.mark.parametrize("extra, message", [
    (["--lr_decay_over_time_budget"], "needs --max_train_time"),
    (["--lr_decay_over_time_budget", "--max_train_time", "5", "--lr_scheduler_type", "inverse_sqrt"], "linear or cosine"),
    (["--lr_decay_over_time_budget", "--max_train_time", "5", "--lr_scheduler_type", "linear", "--paper_recipe"],
     "Pass one of them"),
    (["--ema_decay", "1.5"], "between 0 and 1"),
    (["--attn_implementation", "fastest"], "Unknown --attn_implementation 'fastest'"),
    (["--average_last_checkpoints", "5"], "write some with --save_interval_seconds"),
    (["--average_last_checkpoints", "5", "--save_interval_seconds", "60", "--save_total_limit", "3"],
     "keeps fewer checkpoints"),
    (["--average_last_checkpoints", "5", "--save_interval_seconds", "60", "--ema_decay", "0.9"], "Pass one of them"),
    (["--save_interval_seconds", "0"], "must be positive"),
])
def test_schedule_and_averaging_options_refuse_what_they_cannot_do(tmp_path, extra, message):
    result = run_script("train_translation.py", *train_args(tmp_path / "none.tsv", tmp_path / "out", *extra))
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_the_weight_average_becomes_the_final_model():
    """--ema_decay: every step moves the average towards the weights by 1 − min(decay, (1 + n) / (10 + n)); at the
    end of training the model holds the average."""
    from vaswani import VaswaniForConditionalGeneration
    from vaswani.training import WeightAverageCallback

    from conftest import tiny_config

    model = VaswaniForConditionalGeneration(tiny_config())
    callback = WeightAverageCallback(decay=0.9)
    callback.on_train_begin(None, None, None, model=model)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    for n in range(1, 31):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        callback.on_step_end(None, None, None)
        weight = 1 - min(0.9, (1 + n) / (10 + n))
        for name, p in model.named_parameters():
            expected[name] += weight * (p.detach() - expected[name])
    last = {name: p.detach().clone() for name, p in model.named_parameters()}
    callback.on_train_end(None, None, None)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name])
        assert not torch.equal(p.detach(), last[name])


def test_a_timed_run_with_decay_and_averaging_ends_near_a_zero_rate(tmp_path):
    corpus = synthetic_corpus(tmp_path / "corpus.tsv")
    output_dir = tmp_path / "decayed"
    args = train_args(corpus, output_dir, "--max_steps", "100000", "--max_train_time", "4", "--logging_steps", "1",
                      "--lr_scheduler_type", "cosine", "--lr_decay_over_time_budget", "--ema_decay", "0.9")
    result = run_script("train_translation.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    rates = [float(rate) for rate in re.findall(r"'learning_rate': '?([-+.e0-9]+)", result.stderr)]
    assert len(rates) > 10, result.stderr[-2000:]
    peak = max(rates)
    assert peak == pytest.approx(3e-3, rel=0.01)
    after_peak = rates[rates.index(peak):]
    assert all(b <= a for a, b in zip(after_peak, after_peak[1:])) and after_peak[-1] < 0.1 * peak, rates
    assert (output_dir / "model.safetensors").is_file()


@pytest.mark.slow
def test_accelerate_launch_with_two_cpu_processes_checkpoints_resumes_and_evaluates(tmp_path):
    """`accelerate launch --num_processes 2` on CPU, as the README shows it: a run that writes checkpoints and ends
    with the final evaluation, then `--resume` from its last checkpoint to more steps. Every process of both
    launches exits cleanly (status 0, no abort at teardown), and the data is prepared once per launch."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv")
    output_dir = tmp_path / "accelerate"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    # `--multi_gpu` is Accelerate's name for its torchrun launcher; `--use_cpu` keeps the processes on the CPU (gloo).
    # (Accelerate's `--cpu` would start one process, or hand several to MPI.)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port()), str(SCRIPTS / "train_translation.py")]
    common = ["--use_cpu", "--save_strategy", "steps", "--save_steps", "3", "--logging_steps", "3",
              "--max_tokens_per_batch", "300", "--log_level", "info"]

    first = subprocess.run([*launch, *train_args(corpus, output_dir, "--max_steps", "6", "--tokenizer_train_pairs", "200",
                                                 *common)], capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["train_world_size"] == 2 and metrics["tokenizer_training_sentences"] == 400

    second = subprocess.run([*launch, *train_args(corpus, output_dir, "--max_steps", "9", "--resume", *common)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "Resuming from" in second.stderr and "checkpoint-6" in second.stderr
    assert "Reusing the tokenized" in second.stderr and "Reading" not in second.stderr
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["train_world_size"] == 2 and 1 <= metrics["test_sentences"] <= 20
    assert json.loads((output_dir / "checkpoint-9" / "trainer_state.json").read_text())["global_step"] == 9
    for result in (first, second):
        assert "terminate called" not in result.stderr and "Traceback" not in result.stderr
        assert json.loads(result.stdout[result.stdout.index("{"):])["train_world_size"] == 2
    assert "Reading" in first.stderr and "Training a" in first.stderr


def test_checkpoints_at_a_time_interval_and_their_average_as_the_final_model(tmp_path):
    """--save_interval_seconds writes checkpoints by the clock, through the same atomic writer; with
    --average_last_checkpoints the final model (evaluated, saved, carded) is the mean of the last ones."""
    from safetensors.torch import load_file

    from vaswani.checkpoints import average_state_dicts

    corpus = synthetic_corpus(tmp_path / "corpus.tsv")
    output_dir = tmp_path / "averaged"
    args = train_args(corpus, output_dir, "--max_steps", "100000", "--max_train_time", "5",
                      "--save_interval_seconds", "0.5", "--average_last_checkpoints", "3", "--save_total_limit", "4")
    result = run_script("train_translation.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    assert len(checkpoints) == 4, checkpoints  # rotated by --save_total_limit, none half-written
    assert not list(output_dir.glob(".tmp-*"))
    assert all((path / "trainer_state.json").is_file() for path in checkpoints)
    states = [json.loads((path / "trainer_state.json").read_text()) for path in checkpoints]
    assert states[-1]["global_step"] == json.loads(result.stdout)["train_steps"]  # the last step is one of them
    final = load_file(output_dir / "model.safetensors")
    expected = average_state_dicts([str(path) for path in checkpoints[-3:]])
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["averaged_checkpoints"] == 3 and "test_bleu" in metrics
    card = (output_dir / "README.md").read_text()
    assert "## Checkpoint averaging" in card and all(path.name in card for path in checkpoints[-3:])

    # The interval checkpoints are ordinary ones: --resume continues from the last, here as if the run had been
    # killed after it, before its final model was saved (a finished run's --resume trains nothing).
    (output_dir / "config.json").unlink()
    resumed = run_script("train_translation.py", *args, "--resume", "--log_level", "info")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {checkpoints[-1]}." in resumed.stderr
    assert json.loads(resumed.stdout)["train_steps"] > states[-1]["global_step"]


def test_no_training_batch_exceeds_the_token_budget_once_padded(tmp_path):
    """The Trainer's batches, as its collator pads them (to multiples of 8, as on GPUs under bf16), hold at most
    --max_tokens_per_batch tokens on each side: the budget counts what the device computes."""
    from transformers import DataCollatorForSeq2Seq, HfArgumentParser

    from vaswani import training

    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    parser = HfArgumentParser((training.ModelArguments, training.DataArguments, training.VaswaniTrainingArguments))
    model_args, data_args, args = parser.parse_args_into_dataclasses(
        args=train_args(corpus, tmp_path / "out", "--max_tokens_per_batch", "100", "--use_cpu"))
    data = training.prepare_data(model_args, data_args, args)
    model, tokenizer = training.build_model_and_tokenizer(model_args, data.tokenizer)
    features, _ = training.tokenize_splits(data, tokenizer, data_args, args)
    trainer = training.VaswaniSeq2SeqTrainer(
        model=model, args=args, train_dataset=features, processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8), max_tokens_per_batch=100)
    batches = list(trainer.get_train_dataloader())
    assert sum(len(batch["input_ids"]) for batch in batches) == len(features)
    assert {batch["input_ids"].shape[1] % 8 for batch in batches} == {0}
    assert max(max(batch["input_ids"].numel(), batch["labels"].numel()) for batch in batches) <= 100
    # Short sentences padded to 8 or 16: the budget allows fewer of them than their own lengths would.
    assert max(len(batch["input_ids"]) for batch in batches) <= 100 // 8
    # With loader workers: the same batches, from workers kept for the next epoch instead of started again.
    args.dataloader_num_workers = 1
    loader = trainer.get_train_dataloader()
    assert loader.persistent_workers
    assert [batch["input_ids"].tolist() for batch in loader] == [batch["input_ids"].tolist() for batch in batches]
    # Padded up to declared shapes, rows included, the batches stay within the budget too (padded to multiples of 2
    # here: multiples of 8 leave these sentences a single length).
    args.dataloader_num_workers = 0
    trainer = training.VaswaniSeq2SeqTrainer(
        model=model, args=args, train_dataset=features, processing_class=tokenizer, shape_buckets=3,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=2), max_tokens_per_batch=100)
    batches = list(trainer.get_train_dataloader())
    declared = set(trainer.batch_sampler.shape_buckets.shapes)
    assert len(declared) == 3 and all(length % 2 == 0 for _, length in declared)
    assert {tuple(batch[name].shape) for batch in batches for name in batch} == declared
    assert max(rows * length for rows, length in declared) <= 100
    examples = [batch["labels"][(batch["labels"] != -100).any(dim=1)] for batch in batches]
    assert sum(len(rows) for rows in examples) == len(features)


# Ops that hand a tensor's value to the host: on an accelerator each makes the host wait for the device.
READ_BACK_OPS = {"_local_scalar_dense", "is_nonzero", "nonzero", "item", "equal"}


class HostReads(TorchDispatchMode):
    """Counts the ops that read a value back, and the tensors made from host data (`lift_fresh`: `torch.tensor`,
    on an accelerator a blocking copy to it) while `in_step`, each with the code that asked for it."""

    def __init__(self):
        super().__init__()
        self.reads, self.lifted, self.in_step = collections.Counter(), collections.Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READ_BACK_OPS or (name == "lift_fresh" and self.in_step):
            caller = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()[-8:-1])
            (self.reads if name in READ_BACK_OPS else self.lifted)[f"{name} at {caller}"] += 1
        return func(*args, **(kwargs or {}))


class SteadyStepReads(TrainerCallback):
    """Counts `HostReads` over the steps after `first` up to `last` (their data loading, forward, backward,
    optimiser step and every callback); `in_step` covers the steps proper, without the loader's collation."""

    def __init__(self, first: int, last: int):
        self.first, self.last, self.mode = first, last, None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.mode is not None:
            self.mode.in_step = True

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.first:
            self.mode = HostReads()
            self.mode.__enter__()
        elif state.global_step == self.last:
            self.mode.__exit__(None, None, None)
        if self.mode is not None:
            self.mode.in_step = False


def test_a_steady_training_step_reads_nothing_back_from_the_device(tmp_path, monkeypatch):
    """Through the training script, with a time budget, interval checkpoints and a weight average (every
    per-step callback on), a steady step between logging steps reads no value back to the host and copies no host
    value to the device: nothing makes the host wait for the device, which can then run ahead of it. The counts
    hold on any device, so this CPU run stands for the GPU's."""
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    counter = SteadyStepReads(first=4, last=10)
    trainers = []

    class CountingTrainer(vaswani.training.VaswaniSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(counter)
            trainers.append(self)

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", CountingTrainer)
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    script_main("train_translation")(train_args(
        corpus, tmp_path / "out", "--max_steps", "12", "--max_test_samples", "2", "--generation_num_beams", "1",
        "--use_cpu", "--bf16", "--attn_implementation", "eager", "--max_tokens_per_batch", "200",
        "--max_train_time", "600", "--save_interval_seconds", "600", "--ema_decay", "0.99", "--logging_steps", "100"))
    assert counter.mode is not None and not counter.mode.in_step
    lifted = dict(counter.mode.lifted)
    if version.parse(transformers.__version__) < version.parse("5.21"):
        # Before 5.21, transformers' eager attention mask (masking_utils.eager_mask) makes its zero from a host
        # scalar, once per mask; 5.21 makes it on the device. Upstream's copy, not the package's: only that one.
        lifted = {where: count for where, count in lifted.items() if "masking_utils.py" not in where}
    assert dict(counter.mode.reads) == {} and lifted == {}
    assert not trainers[0].args.logging_nan_inf_filter
    # The batches are copied without waiting where they come from pinned memory (on CUDA).
    arguments = vaswani.training.VaswaniTrainingArguments
    assert arguments(output_dir=str(tmp_path / "a"), report_to="none").accelerator_config.non_blocking
    assert not arguments(output_dir=str(tmp_path / "b"), report_to="none",
                         dataloader_pin_memory=False).accelerator_config.non_blocking


def test_the_step_compiles_once_before_the_clock_for_every_batch_shape(tmp_path, monkeypatch):
    """--torch_compile with token-budget batches of many shapes: Dynamo builds one graph of the step, with no
    graph break, before the time budget's clock starts (a warm-up on the extreme shapes, sizes marked dynamic), and
    none while training. metrics.json reports the compilation apart from the runtime, every logged line carries the
    elapsed seconds, and the warm-up changes nothing in training: the losses are those of a run without it (whose
    graphs are compiled inside the timed steps, a static one and then a dynamic one)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    graphs, shapes, trainers = {}, set(), []

    class Graphs(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            graphs["begin"] = counters["stats"]["unique_graphs"]

        def on_train_end(self, args, state, control, **kwargs):
            graphs["end"], graphs["breaks"] = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    class CountingTrainer(vaswani.training.VaswaniSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(Graphs())
            trainers.append(self)

        def training_step(self, model, inputs, num_items_in_batch=None):
            shapes.add((tuple(inputs["input_ids"].shape), tuple(inputs["labels"].shape)))
            return super().training_step(model, inputs, num_items_in_batch)

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", CountingTrainer)
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)

    def train(output_dir):
        torch._dynamo.reset()
        counters.clear()
        script_main("train_translation")(train_args(
            corpus, output_dir, "--max_steps", "20", "--max_test_samples", "2", "--generation_num_beams", "1",
            "--use_cpu", "--max_tokens_per_batch", "150", "--max_train_time", "600", "--logging_steps", "5",
            "--torch_compile", "--torch_compile_backend", "eager"))
        return [entry["loss"] for entry in trainers[-1].state.log_history if "loss" in entry]

    losses = train(tmp_path / "warm")
    assert len(shapes) >= 5  # many shapes, one graph
    assert graphs == {"begin": 1, "end": 1, "breaks": 0}
    metrics = json.loads((tmp_path / "warm" / "metrics.json").read_text())
    assert 0 < metrics["train_compile_seconds"] < metrics["train_wall_seconds"]
    assert metrics["train_runtime"] < metrics["train_wall_seconds"] - metrics["train_compile_seconds"]
    assert all("elapsed_seconds" in entry for entry in trainers[-1].state.log_history)
    assert len(losses) == 4

    monkeypatch.setattr(CountingTrainer, "compile_before_the_clock", lambda self: None)
    unwarmed = train(tmp_path / "cold")
    assert graphs["begin"] == 0 and graphs["end"] == 2
    torch.testing.assert_close(losses, unwarmed, rtol=1e-5, atol=1e-6)


class ShapesSeen(TrainerCallback):
    """The (input_ids, labels) shapes of the batches trained on, and Dynamo's graphs at the start and end."""

    def __init__(self):
        self.shapes, self.graphs, self.padding_rows = set(), {}, 0

    def on_train_begin(self, args, state, control, **kwargs):
        from torch._dynamo.utils import counters

        self.graphs["begin"] = counters["stats"]["unique_graphs"]

    def on_train_end(self, args, state, control, **kwargs):
        from torch._dynamo.utils import counters

        self.graphs["end"], self.graphs["breaks"] = counters["stats"]["unique_graphs"], sum(
            counters["graph_break"].values())


def bucketed_run(monkeypatch, corpus, output_dir, *extra):
    """train_translation.py with shape buckets: the trainer, and the `ShapesSeen` of its training steps."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    seen, trainers = ShapesSeen(), []

    class Trainer(VaswaniSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(seen)
            trainers.append(self)

        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.training_started is not None:  # not the warm-up's
                seen.shapes.add((tuple(inputs["input_ids"].shape), tuple(inputs["labels"].shape)))
                seen.padding_rows += int((inputs["labels"] == -100).all(dim=1).sum())
            return super().training_step(model, inputs, num_items_in_batch)

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", Trainer)
    torch._dynamo.reset()
    counters.clear()
    script_main("train_translation")(train_args(
        corpus, output_dir, "--max_test_samples", "2", "--generation_num_beams", "1", "--max_tokens_per_batch", "150",
        "--shape_buckets", "3", "--max_train_time", "600", "--config_overrides", "dropout=0", *extra))
    return trainers[-1], seen


def logged(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def test_shape_buckets_train_as_the_batches_unpadded_do(tmp_path, monkeypatch):
    """Batches padded up to their shape bucket (columns, and rows the loss ignores) give the losses and gradient
    norms of the same batches unpadded, step by step (fp32, no dropout: padding draws other dropout masks)."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    steps = ("--max_steps", "8", "--logging_steps", "1", "--use_cpu")
    trainer, seen = bucketed_run(monkeypatch, corpus, tmp_path / "bucketed", *steps)
    declared = set(trainer.batch_sampler.shape_buckets.shapes)
    assert {inputs for inputs, labels in seen.shapes} <= declared and all(a == b for a, b in seen.shapes)
    assert seen.padding_rows > 0  # rows of ignored labels were there, and left the loss as it was
    losses, norms = logged(trainer, "loss"), logged(trainer, "grad_norm")
    assert len(losses) == len(norms) == 8

    monkeypatch.setattr(vaswani.training.ShapePaddedCollator, "__call__", lambda self, features: self.collator(features))
    trainer, seen = bucketed_run(monkeypatch, corpus, tmp_path / "unpadded", *steps)
    assert not {inputs for inputs, labels in seen.shapes} <= declared  # the same batches, at their own widths
    torch.testing.assert_close(logged(trainer, "loss"), losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logged(trainer, "grad_norm"), norms, rtol=1e-4, atol=1e-6)


def test_shape_buckets_compile_one_graph_per_shape_before_the_clock(tmp_path, monkeypatch):
    """--torch_compile with shape buckets over batches of many lengths: every batch trained on takes a declared
    shape, and Dynamo builds one static graph per shape before the clock starts, none while training, no break."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    trainer, seen = bucketed_run(monkeypatch, corpus, tmp_path / "out", "--max_steps", "30", "--use_cpu",
                                 "--torch_compile", "--torch_compile_backend", "eager", "--logging_steps", "10")
    declared = trainer.batch_sampler.shape_buckets.shapes
    assert len(declared) == 3
    assert {inputs for inputs, labels in seen.shapes} == set(declared) and all(a == b for a, b in seen.shapes)
    assert seen.graphs == {"begin": 3, "end": 3, "breaks": 0}
    assert trainer.compile_seconds > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shape_buckets_as_cuda_graphs_train_as_eager_does(tmp_path, monkeypatch):
    """On CUDA, --torch_compile_mode reduce-overhead with shape buckets (each shape's step recorded as a CUDA graph
    before the clock, replayed while training) gives the losses of the uncompiled step on the same batches."""
    from torch._dynamo.utils import counters

    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    steps = ("--max_steps", "12", "--logging_steps", "1", "--dataloader_pin_memory", "true")
    trainer, seen = bucketed_run(monkeypatch, corpus, tmp_path / "graphs", *steps, "--torch_compile",
                                 "--torch_compile_mode", "reduce-overhead")
    assert trainer.args.device.type == "cuda"
    assert seen.graphs["begin"] == seen.graphs["end"] == len(trainer.batch_sampler.shape_buckets.shapes)
    assert counters["inductor"]["cudagraph_skips"] == 0
    graphed = logged(trainer, "loss")
    trainer, _ = bucketed_run(monkeypatch, corpus, tmp_path / "eager", *steps)
    torch.testing.assert_close(graphed, logged(trainer, "loss"), rtol=1e-3, atol=1e-4)
