"""The GPU quality run: the `base` preset trained for a fixed time budget on one GPU (`scripts/train_translation.py`),
then multi-reference BLEU (beam 4) on the held-out fra-eng test split (`scripts/evaluate_bleu.py`, the saved model).

    python benchmarks/gpu_quality.py                                  # on a GPU: base, 300 s
    python benchmarks/gpu_quality.py --dry_run                        # anywhere: tiny, 20 s, 64 test sentences

Writes `gpu-quality-<device>.json/.md`: test BLEU on the whole split and on its first 1,000 sentences, steps, the
steady step read from the training log's intervals (`steady_step`: ms a step, real and padded tokens/s, MFU, the
seconds lost to warm-up and recompiles), the loss curve, `train_compile_seconds` (before the budget's clock starts),
the slow steps and how the run ended (`ended`). The report is rewritten at each logged interval while training runs,
then when training ends, however it ends (a stop signal, a NaN, a crash), then with the test scores or why they
failed (`score_test`): a run cut at any point leaves its figures so far.
Beside them the training's log, the model's test translations (`gpu-quality-<device>-test-translations.txt`) and
`gpu-quality-selected.txt` (the model's directory, for the translation benchmark that follows). The corpus is
train_translation.py's default ($VASWANI_FRA_ENG, ../shared/data/fra-eng, or its download); `--data_cache_dir` keeps
its splits, tokenizer and tokenized splits where `--prepare_only` made them beforehand (on another machine too: the
caches are keyed by the corpus' content).
"""

import argparse
import ast
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from transformers import HfArgumentParser

from bench_training import model_flops
from common import (
    GPU_TARGETS, REPO_ROOT, SHARED_CORPUS, Column, Device, Stopped, argument_parser, pick_device, report,
    result_name, stopping,
)
from vaswani.batching import TokenBatchSampler, batch_positions, example_lengths
from vaswani.evaluation import score_corpus
from vaswani.training import (
    DataArguments, ModelArguments, VaswaniTrainingArguments, build_model_and_tokenizer, prepare_data, tokenize_splits,
)

# The test split's first sentences, scored apart: the subset the CPU main job reports (results/main-job-cpu.md).
TEST_SUBSET = 1000
# The decoding loops the test score tries, in turn until one scores: the scripts' default (`--decoding auto`: the lean
# loop replayed as CUDA graphs on a GPU, the lean loop on a CPU), then transformers' own loop, which shares none of the
# lean loop's code, so that a fault in one loop costs a run its default loop, not its score.
SCORING_LOOPS = ("auto", "transformers")
# A logged interval whose ms a step is within this factor of the settled step time counts as steady; the settled time
# is the median interval of the run's second half, which the compiled warm-up and the first shapes do not reach.
STEADY_FACTOR = 1.2
# How often the running training's log is read for new intervals (seconds).
POLL_SECONDS = 2


def device_arguments(device: Device) -> list[str]:
    """train_translation.py's arguments for the device: on a GPU bf16 autocast, TF32 and torch.compile; on a CPU
    rehearsing CUDA (`Device.as_cuda`), the same but TF32, which a CPU lacks, on transformers' CPU backend
    (`--use_cpu true`, without which it refuses bf16 on a CPU); on a CPU, none."""
    if device.is_cuda:
        return ["--bf16", "--tf32", "true", "--torch_compile"]
    return ["--bf16", "--torch_compile", "--use_cpu", "true"] if device.as_cuda else []


def shared_arguments(args: argparse.Namespace, output_dir: Path, device: Device | None) -> list[str]:
    """train_translation.py's arguments. Adam β2 0.98, ε 1e-9 and the inverse-square-root schedule are the paper's
    (§5.3), with a warm-up shortened to the budget; dropout 0.1, the paper's base model's (§6.3), chosen over 0.3
    side by side on validation BLEU (results/gpu-quality-cuda-h100-80gb-hbm3.md); the device's (`device_arguments`;
    none with `device` None, for --prepare_only, whose data caches do not depend on them); beam 4 with length
    penalty 0.6 (§6.1), saved with the model for the test split, which `score_test` scores in a process of its own
    (`--max_test_samples 0`: training saves the model and its metrics, and scores nothing)."""
    gpu = [] if device is None else device_arguments(device)
    if "--torch_compile" in gpu and getattr(args, "compile_cache", None):
        gpu += ["--compile_cache", str(args.compile_cache)]
    cache = ["--data_cache_dir", str(args.data_cache_dir)] if args.data_cache_dir else []
    return ["--preset", args.preset, "--vocab_size", str(args.vocab_size), "--output_dir", str(output_dir),
            "--max_train_time", str(args.train_seconds), "--num_train_epochs", "1000", *gpu,
            "--max_tokens_per_batch", str(args.max_tokens), "--learning_rate", str(args.lr),
            "--lr_scheduler_type", "inverse_sqrt", "--warmup_steps", str(args.warmup),
            "--adam_beta2", "0.98", "--adam_epsilon", "1e-9", "--weight_decay", "0.0",
            "--eval_strategy", "no", "--save_strategy", "no", "--logging_steps", str(args.logging_steps),
            "--report_to", "none",
            "--generation_num_beams", "4", "--generation_length_penalty", "0.6",
            "--per_device_eval_batch_size", str(args.eval_batch_size), "--dataloader_num_workers", "2",
            "--disable_tqdm", "true", "--seed", "0", "--max_test_samples", "0", *cache,
            "--config_overrides", "dropout=0.1"]


def prepare_caches(argv: list[str]) -> tuple[dict, list]:
    """Read the corpus, train the tokenizer and tokenize the splits once, into the caches the training then loads
    (`vaswani.data`), so that `--prepare_only` can fill them beforehand. Returns the tokens of an epoch's batches
    (`epoch_tokens`) and the test split's references, in its order."""
    model_args, data_args, training_args = HfArgumentParser(
        (ModelArguments, DataArguments, VaswaniTrainingArguments)).parse_args_into_dataclasses(args=argv)
    data_args.default_corpus = str(SHARED_CORPUS)  # as train_translation.py, which the run starts, finds it
    data = prepare_data(model_args, data_args, training_args)
    model, tokenizer = build_model_and_tokenizer(model_args, data.tokenizer, None)
    train, _ = tokenize_splits(data, tokenizer, data_args, training_args)
    test = data.splits["test"]
    references = test["references"] if "references" in test.column_names else [[t] for t in test["target"]]
    return epoch_tokens(train, training_args.max_tokens_per_batch, training_args.pad_to_multiple_of,
                        model.config), references


def failure_line(log: Path) -> str | None:
    """Why a run failed, from its log: the last line the script's error handler printed (`error: ...`), else the
    log's last line, else None (no log)."""
    if not log.exists():
        return None
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("error:", "Traceback")) or "Error:" in line]
    return (errors or lines or [None])[-1]


def epoch_tokens(train, max_tokens: int, pad_to: int | None, config=None) -> dict:
    """Mean real and padded tokens (source + target) of a batch over one epoch of the token-budget batches the
    Trainer cuts (every epoch has the same batches in another order), each side padded to its longest example
    rounded up to `pad_to`: times steps/s, the run's tokens/s, with no count read back during training. With the
    model's `config`, also the mean training FLOPs of a batch (`bench_training.model_flops`, on the real lengths)."""
    sides = example_lengths(train, sides=True)
    sampler = TokenBatchSampler(sides.max(axis=0), max_tokens, shuffle=False, pad_to_multiple_of=pad_to)
    batches = sampler.batches_by_length()
    real, padded = batch_positions(batches, *sides, pad_to)
    tokens = {"batches": len(batches), "real_per_batch": real.sum() / len(batches),
              "padded_per_batch": padded.sum() / len(batches)}
    if config is not None:
        flops = sum(model_flops(config, sides[0][batch].tolist(), sides[1][batch].tolist()) for batch in batches)
        tokens["flops_per_batch"] = flops / len(batches)
    return tokens


def training_log(log: Path, logging_steps: int) -> list[dict]:
    """The training's logged intervals from its log, in order: the Trainer prints each as a dict every
    `logging_steps` steps, with its loss and (once the clock runs) `elapsed_seconds`. Each entry: `step`, `loss`,
    `elapsed_seconds` (None before the clock started). A line cut mid-write is skipped."""
    entries = []
    text = log.read_text(errors="replace") if log.exists() else ""
    for line in text.splitlines():
        if not line.startswith("{'loss'"):
            continue
        try:
            logged = ast.literal_eval(line)
        except (ValueError, SyntaxError):
            continue
        elapsed = logged.get("elapsed_seconds")
        entries.append({"step": logging_steps * (len(entries) + 1), "loss": float(logged["loss"]),
                        "elapsed_seconds": None if elapsed is None else float(elapsed)})
    return entries


def steady_step(entries: list[dict], compile_seconds: float | None, tokens: dict,
                peak_tflops: float | None) -> dict:
    """The steady step of a run from its logged intervals (`training_log`): each interval's ms a step; the run
    settles at the first interval within `STEADY_FACTOR` of the median interval of the run's second half, and the
    steady ms a step is the median interval from there on. Seconds lost: `warmup_seconds`, the compilation before
    the clock plus what the intervals before settling took over the steady step, and `recompile_seconds`, what the
    later intervals slower than `STEADY_FACTOR` × steady took over it. Tokens/s and MFU (against `peak_tflops`, the
    GPU's dense bf16 peak) are the steady step's, on an epoch's mean batch (`epoch_tokens`). Empty before three
    timed intervals."""
    timed = [entry for entry in entries if entry["elapsed_seconds"] is not None]
    if len(timed) < 3:
        return {}
    ms, steps, step, seconds = [], [], 0, 0.0
    for entry in timed:
        steps.append(entry["step"] - step)
        ms.append(1000 * (entry["elapsed_seconds"] - seconds) / steps[-1])
        step, seconds = entry["step"], entry["elapsed_seconds"]
    settled_time = statistics.median(ms[len(ms) // 2:])
    settled = next(i for i, interval in enumerate(ms) if interval <= STEADY_FACTOR * settled_time)
    steady = statistics.median(ms[settled:])
    warmup = sum((interval - steady) * count for interval, count in zip(ms[:settled], steps[:settled])) / 1000
    recompiles = sum((interval - steady) * count for interval, count in zip(ms[settled:], steps[settled:])
                     if interval > STEADY_FACTOR * steady) / 1000
    flops = tokens.get("flops_per_batch")
    return {"steady_ms_per_step": steady, "steady_from_step": timed[settled - 1]["step"] if settled else 0,
            "steady_intervals": len(ms) - settled,
            "steady_real_tokens_per_second": tokens["real_per_batch"] * 1000 / steady,
            "steady_padded_tokens_per_second": tokens["padded_per_batch"] * 1000 / steady,
            "steady_mfu": flops * 1000 / steady / (peak_tflops * 1e12) if flops and peak_tflops else None,
            "warmup_seconds": (compile_seconds or 0.0) + warmup, "recompile_seconds": recompiles}


def how_it_ended(returncode: int | None, stopped: Stopped | None, log: Path) -> str:
    """How the training ended, in words: still running (a report written during training), trained, cut by a
    signal, stopped by a non-finite loss, or crashed with the line its log ends on."""
    if stopped is not None:
        return f"cut by {stopped} (the stage's limit, or stopped by hand)"
    if returncode is None:
        return "running (the last interval logged; a run killed outright ends here)"
    if returncode == 0:
        return "trained"
    why = failure_line(log) or "no log"
    if "NaN/inf" in why:
        return f"stopped by a non-finite loss: {why}"
    return f"crashed (exit {returncode}): {why}"


def step_rates(metrics: dict, tokens: dict) -> dict:
    """Epochs, ms a step and real and padded tokens/s of a finished run's training after its compilation (the
    Trainer's `train_runtime` is that time; `train_compile_seconds` the compilation's)."""
    steps, seconds = metrics.get("train_steps"), metrics.get("train_runtime")
    if not steps or not seconds:
        return {}
    return {"train_epochs": steps / tokens["batches"], "ms_per_step": 1000 * seconds / steps,
            "real_tokens_per_second": tokens["real_per_batch"] * steps / seconds,
            "padded_tokens_per_second": tokens["padded_per_batch"] * steps / seconds}


def subset_bleu(translations: Path, references: list, count: int) -> float | None:
    """BLEU of the first `count` test translations (one a line, in the split's order) against their references."""
    if not translations.exists():
        return None
    hypotheses = translations.read_text(encoding="utf-8").removesuffix("\n").split("\n")[:count]
    return score_corpus(hypotheses, references[:len(hypotheses)])["bleu"]


def train(command: list[str], log: Path, logging_steps: int, on_interval) -> int:
    """Run the training `command` into `log`, calling `on_interval()` each time the log holds a new interval;
    returns its exit status."""
    process, seen = launch(command, log), 0
    while True:
        try:
            return process.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            if (logged := len(training_log(log, logging_steps))) > seen:
                seen = logged
                on_interval()


def launch(command: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("$ " + shlex.join(command) + "\n")
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log.open("a"), stderr=subprocess.STDOUT)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv=None):
    parser, add = argument_parser(__doc__, corpus=False)
    add("--preset", default="base")
    add("--train_seconds", type=float, default=300)
    add("--vocab_size", type=int, default=16000)
    # 4,000-token batches, a 400-step warm-up: more steps in the budget, most past the peak rate (benchmarks/README.md).
    add("--max_tokens", type=int, default=4000, help="padded tokens per side per batch")
    add("--logging_steps", type=int, default=100, help="steps per logged interval: the steady step's resolution")
    add("--lr", type=float, default=7e-4)
    add("--warmup", type=int, default=400)
    add("--eval_batch_size", type=int, default=256)
    add("--output_root", type=Path, default=REPO_ROOT / "outputs" / "gpu-quality")
    add("--data_cache_dir", type=Path, default=None, help="train_translation.py's data caches (default: its own, "
        "$HF_DATASETS_CACHE/vaswani)")
    add("--dry_run", action="store_true", help="tiny preset, 20 s, 64 test sentences: checks the whole path on any "
        "machine (with VASWANI_REHEARSE_CUDA=1 on a CPU, with the GPU's bf16 and torch.compile)")
    add("--compile_cache", type=Path, default=None, help="train_translation.py's --compile_cache: torch.compile's "
        "cache, loaded where the file exists and saved after the compilation")
    add("--prepare_only", action="store_true", help="only fill the data caches the training loads (the corpus' "
        "splits, the tokenizer, the tokenized splits), then exit")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.preset, args.train_seconds, args.warmup, args.max_tokens = "tiny", min(args.train_seconds, 20), 50, 1000
        args.eval_batch_size, args.logging_steps = 32, 2
    device = pick_device("auto")
    name = result_name(args, "gpu-quality", device)

    started = time.monotonic()
    tokens, references = prepare_caches(shared_arguments(args, args.output_root / "prepare", None))
    prepare_seconds = time.monotonic() - started
    print(f"data ready in {prepare_seconds:.0f} s", flush=True)
    if args.prepare_only:
        return 0

    output_dir = args.output_root / "model"
    command = [sys.executable, "scripts/train_translation.py", *shared_arguments(args, output_dir, device),
               "--overwrite_output_dir", "true"]
    log = args.results_dir / f"{name}-train.log"
    run = {"output_dir": output_dir, "command": command, "returncode": None, "metrics": None, "stopped": None,
           "log": log, "logging_steps": args.logging_steps}

    def write(*_) -> None:
        write_report(argv, args, device, run, tokens, references, prepare_seconds)

    # A stop signal (the stage's limit) ends the run with its report written; a run killed outright keeps the report
    # of its last logged interval, which is rewritten as each interval is logged.
    with stopping():
        try:
            run["returncode"] = train(command, log, args.logging_steps, write)
            run["metrics"] = read_json(output_dir / "metrics.json") if run["returncode"] == 0 else None
            print(f"training done in {time.monotonic() - started:.0f} s", flush=True)
            # The training figures are reported now, before anything scores: a scoring that fails, or a device taken
            # back during it, leaves them.
            write()
        except Stopped as stopped:
            run["stopped"] = stopped
            write()
            return 128 + stopped.signum
    if run["metrics"] is None:
        return 1
    run.update(score_test(output_dir, args, args.results_dir / name))
    if run["test"]:
        (output_dir / "test_translations.txt").write_text(
            "".join(line.replace("\n", " ") + "\n" for line in run["test"]["hypotheses"]), encoding="utf-8")
    write_report(argv, args, device, run, tokens, references, prepare_seconds)
    if not run["test"]:
        return 1
    (args.results_dir / "gpu-quality-selected.txt").write_text(str(output_dir) + "\n")
    # The test split's translations, so that the score can be recomputed against the split's references.
    shutil.copyfile(output_dir / "test_translations.txt", args.results_dir / f"{name}-test-translations.txt")
    return 0


def score_test(model_dir: Path, args: argparse.Namespace, log_stem: Path) -> dict:
    """The test split's scores of the saved model, by scripts/evaluate_bleu.py in a process of its own (so that its
    failure leaves the training's figures): beam 4 with length penalty 0.6 (the checkpoint's generation config,
    which training wrote), PyTorch in float32 (the saved weights, as training's own evaluations decode them). The
    loops of `SCORING_LOOPS` are tried in turn until one scores. Returns `test` (evaluate_bleu.py's report, None
    where every loop failed), `test_decoding` (the loop that scored) and `test_failures` (each failed loop's one-line
    reason, from its log)."""
    failures = {}
    for loop in SCORING_LOOPS:
        output_file = args.output_root / f"test-{loop}.json"
        output_file.unlink(missing_ok=True)
        command = [sys.executable, "scripts/evaluate_bleu.py", "--model", str(model_dir), "--split", "test",
                   "--batch_size", str(args.eval_batch_size), "--no-ctranslate2", "--dtype", "float32",
                   "--decoding", loop, "--output_file", str(output_file)]
        if args.dry_run:
            command += ["--max_samples", "64"]  # the test sentences a dry run scores
        log = log_stem.with_name(f"{log_stem.name}-test-{loop}.log")
        result = read_json(output_file) if launch(command, log).wait() == 0 else None
        if result is not None:
            return {"test": result, "test_decoding": loop, "test_failures": failures}
        failures[loop] = failure_line(log) or "no result"
        print(f"the test score with --decoding {loop} failed: {failures[loop]}", flush=True)
    return {"test": None, "test_decoding": None, "test_failures": failures}


def result_row(run: dict, tokens: dict, references: list, peak_tflops: float | None) -> dict:
    """The report's row: how the training ended (`ended`), its logged intervals (the loss curve, the steady step:
    `steady_step`), the training's figures (metrics.json, written where training ended by itself) and, once
    `score_test` has run, the test scores or why they failed (`test_score`)."""
    metrics, test = run["metrics"] or {}, run.get("test") or {}
    state = ("scored" if test else "failed") if "test_failures" in run else "not scored yet" if metrics else None
    first = subset_bleu(run["output_dir"] / "test_translations.txt", references, TEST_SUBSET) if test else None
    entries = training_log(run["log"], run["logging_steps"])
    return {"returncode": run["returncode"], "ended": how_it_ended(run["returncode"], run["stopped"], run["log"]),
            f"test_bleu_first_{TEST_SUBSET}": first,
            **{f"test_{key}": test.get(key) for key in ("bleu", "chrf", "ter", "sentences")}, "test_score": state,
            "test_decoding": run.get("test_decoding"), "test_failures": run.get("test_failures"),
            "train_steps": metrics.get("train_steps", entries[-1]["step"] if entries else None),
            "train_seconds": metrics.get("train_wall_seconds"),
            "train_loss": metrics.get("train_loss"), **{f"train_{key}": metrics.get(f"train_{key}") for key in (
                "compile_seconds", "graphs_compiled_on_the_clock", "slow_steps", "slow_steps_recompiling",
                "slow_steps_seconds")},
            **step_rates(metrics, tokens),
            **steady_step(entries, metrics.get("train_compile_seconds"), tokens, peak_tflops),
            "loss_curve": [[entry["step"], entry["loss"]] for entry in entries],
            "command": shlex.join(["python", *run["command"][1:]]), "metrics": metrics}


def slow_steps_note(row: dict) -> str | None:
    """The slow steps by name, each with its cause: recompiled (torch.compile built a graph during it) or kernel
    set-up (none built: a kernel's plan or autotuning for a shape new to the process, or the host waiting)."""
    named = row["metrics"].get("train_slow_steps_named")
    if not named:
        return None
    steps = ", ".join(f"step {step['step']} ({step['seconds']:.2f} s, "
                      + (f"recompiled: {step['graphs']} graph{'s' if step['graphs'] > 1 else ''})" if step["graphs"]
                         else "kernel set-up: no graph built)") for step in named)
    more = row["train_slow_steps"] - len(named)
    return f"Slow steps: {steps}" + (f", and {more} more." if more else ".")


def score_note(row: dict) -> str | None:
    """What the test score came to where the default loop did not score it."""
    failures = row["test_failures"] or {}
    reasons = "; ".join(f"--decoding {loop} failed: {why}" for loop, why in failures.items())
    if row["test_score"] == "not scored yet":
        return "Trained; the test score has not run yet (or did not end)."
    if row["test_score"] == "failed":
        return f"The test score failed with every loop ({reasons}); the training figures stand."
    if failures:
        return f"Scored with --decoding {row['test_decoding']} after the default failed ({reasons})."
    return None


def write_report(argv, args: argparse.Namespace, device: Device, run: dict, tokens: dict, references: list,
                 prepare_seconds: float) -> None:
    """The report of the run as it stands (`report`'s JSON and Markdown, rewritten at each stage)."""
    name = result_name(args, "gpu-quality", device)
    row = result_row(run, tokens, references, device.bf16_peak_tflops)
    notes = [
        f"Training {row['ended']}; budget {args.train_seconds:.0f} s with the device to itself.",
        f"Steady step: the median of the logged {args.logging_steps}-step intervals from the first within "
        f"{STEADY_FACTOR}× the second half's median (column `from step`); `warm-up s` is the compilation before the "
        "clock plus what the intervals before it took over the steady step, `recompile s` what later intervals over "
        f"{STEADY_FACTOR}× steady took over it; tokens/s and MFU at the steady step (MFU: bench_training.model_flops "
        "on an epoch's mean batch, against the GPU's dense bf16 peak). The loss curve: the JSON's `loss_curve`.",
        "torch.compile compiles the step before the budget starts (column `compile s`), so the budget is training "
        "alone; `graphs on the clock` counts the graphs it built after that (0 where the warm-up built all a run "
        "needed; the training's log names each recompilation's reason). `slow steps` counts the steps whose forward "
        "and backward took over 10× the median step and at least 1 s, `recompiled` those during which it built a "
        "graph (the others: a kernel's plan or autotuning for a shape new to the process, or the host waiting), "
        "and `slow s` their seconds; a note names the first of them, and the training's log each with its batch's "
        "shape." if "--torch_compile" in device_arguments(device)
        else "No compilation on this device.",
        f"mean ms/step and tokens/s: the training after the compilation (metrics.json's train_runtime over its steps); "
        f"tokens a step are the mean of one epoch's {tokens['batches']} token-budget batches (the same each epoch): "
        f"{tokens['real_per_batch']:.0f} real and {tokens['padded_per_batch']:.0f} padded (source + target, each "
        "side padded to its longest sentence as the collator pads it).",
        f"The test split's translations, one a line in the split's order: `{name}-test-translations.txt` (the "
        "split is train_translation.py's, from the corpus and the seed; its references are not committed), "
        "scored by evaluate_bleu.py from the saved model (PyTorch, float32) with the loop in column `decoding` "
        f"({' where it fails, then '.join(f'--decoding {loop}' for loop in SCORING_LOOPS)}).",
        f"Data preparation in this process (corpus read, tokenizer trained, splits tokenized; nothing to do where "
        f"`--prepare_only` filled the caches before) took {prepare_seconds:.0f} s, before the budget started.",
        f"Targets on an H100 or H200: {'; '.join(target.text for target in GPU_TARGETS)}.",
        "Data: Tatoeba via manythings.org (fra-eng), CC-BY 2.0.",
    ]
    if row["returncode"] not in (0, None):  # the reason in the report itself: a device's logs may not all come back
        why = failure_line(args.results_dir / f"{name}-train.log")
        notes.insert(0, f"Training failed (exit {row['returncode']})" + (f": {why}" if why else "."))
    notes[:0] = [note for note in (score_note(row), slow_steps_note(row)) if note]
    if row.get("steady_ms_per_step") is not None:
        mfu = "" if row["steady_mfu"] is None else f", MFU {row['steady_mfu']:.1%}"
        notes.insert(0, f"Steady step: {row['steady_ms_per_step']:.1f} ms from step {row['steady_from_step']}, "
                     f"{row['steady_real_tokens_per_second']:.0f} real tokens/s{mfu}; "
                     f"{row['warmup_seconds']:.1f} s lost to warm-up, {row['recompile_seconds']:.1f} s to recompiles.")
    if row["test_bleu"] is not None:
        first = row[f"test_bleu_first_{TEST_SUBSET}"]
        first = "" if first is None else f", {first:.2f} on the first {TEST_SUBSET} sentences"
        notes.insert(0, f"Result: test BLEU {row['test_bleu']:.2f}{first}, {row['train_steps']} steps.")
    columns = [Column(f"test_bleu_first_{TEST_SUBSET}", f"test BLEU first {TEST_SUBSET}", "{:.2f}"),
               Column("test_bleu", "test BLEU", "{:.2f}"), Column("test_chrf", "test chrF", "{:.2f}"),
               Column("test_ter", "test TER", "{:.2f}"), Column("test_score", "test score"),
               Column("test_decoding", "decoding"), Column("train_steps", "steps"),
               Column("steady_ms_per_step", "steady ms/step", "{:.1f}"), Column("steady_from_step", "from step"),
               Column("steady_real_tokens_per_second", "steady real tokens/s", "{:.0f}"),
               Column("steady_padded_tokens_per_second", "steady padded tokens/s", "{:.0f}"),
               Column("steady_mfu", "MFU", "{:.1%}"), Column("warmup_seconds", "warm-up s", "{:.1f}"),
               Column("recompile_seconds", "recompile s", "{:.1f}"),
               Column("train_epochs", "epochs", "{:.1f}"), Column("ms_per_step", "mean ms/step", "{:.1f}"),
               Column("real_tokens_per_second", "real tokens/s", "{:.0f}"),
               Column("padded_tokens_per_second", "padded tokens/s", "{:.0f}"),
               Column("train_compile_seconds", "compile s", "{:.1f}"),
               Column("train_graphs_compiled_on_the_clock", "graphs on the clock"),
               Column("train_slow_steps", "slow steps"), Column("train_slow_steps_recompiling", "recompiled"),
               Column("train_slow_steps_seconds", "slow s", "{:.1f}"), Column("train_loss", "train loss", "{:.3f}")]
    report(__file__, argv, args, device, "gpu-quality", "Quality: base preset, fixed time budget, multi-reference "
           "BLEU on the held-out test split", [row], columns, notes, {"command": row["command"]})


if __name__ == "__main__":
    sys.exit(main())
