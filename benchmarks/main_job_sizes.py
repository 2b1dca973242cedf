"""Validation BLEU after so many steps, per model size of `--preset auto` (vaswani.sizing): the table it chooses by.

Each size trains once with the main job's recipe (scripts/main_job.sh's training flags, `RECIPE` below, which a test
keeps equal to the script's), for a fixed number of steps rather than a time, writing a checkpoint every 250 steps;
then each checkpoint of `--eval_steps` is scored on the validation split's first 1,000 sentences with
scripts/evaluate_bleu.py (beam 4 and length penalty 0.6 from the checkpoint, float32). The inverse-square-root schedule
does not depend on the run's length, so the checkpoint at step N is the model a run of N steps ends with.

    python benchmarks/main_job_sizes.py --work_dir /tmp/sizes --size d256-3x3 --max_steps 3000
    python benchmarks/main_job_sizes.py --work_dir /tmp/sizes --size d128-2x2 --max_steps 4000 --bf16
    python benchmarks/main_job_sizes.py --step_times   # each size's step time over the default's, as auto times it
    python benchmarks/main_job_sizes.py --work_dir /tmp/sizes --size d128-2x2 --max_steps 4000 --bf16 \
        --variant "--learning_rate 2e-3" --eval_steps 4000   # another recipe for a size: a row apart

Rows are added to benchmarks/results/main-job-sizes.json (one per size, step count and `--variant`, replacing an
older row of the same), with the commit, versions and CPU. Steps do not depend on the machine, only on the seed and
the batches, so a BLEU row holds on any CPU: the machine sets how many steps a budget buys (what `--preset auto`
times), not what a step teaches. bf16 autocast trains with the same loss per step as float32 (main-job-recipes.md).
"""

import argparse
import json
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from vaswani.machine import cpu_name
from vaswani.sizing import PEAK_LEARNING_RATE, SIZES

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "main-job-sizes.json"

# scripts/main_job.sh's training flags, but for the output, the length, the report and the test evaluation; each size
# trains at its own peak learning rate (PEAK_LEARNING_RATE, as --preset auto sets it).
RECIPE = ["--vocab_size", "8000", "--num_train_epochs", "10", "--max_tokens_per_batch", "1000",
          "--lr_scheduler_type", "inverse_sqrt", "--warmup_steps", "400",
          "--adam_beta2", "0.98", "--adam_epsilon", "1e-9", "--weight_decay", "0.0", "--generation_num_beams", "4",
          "--per_device_eval_batch_size", "64", "--seed", "0"]
CHECKPOINT_EVERY = 250
# Sizes measured and then removed from SIZES (main-job-sizes.md says why), kept so that their rows can be made again.
REMOVED_SIZES = {"d192-3x3": {"d_model": 192, "d_ff": 768}, "d128-3x3": {"d_model": 128, "d_ff": 512}}
MEASURED_SIZES = {**SIZES, **REMOVED_SIZES}
# The removed sizes were measured at the recipe's peak before the sizes had their own.
LEARNING_RATE = {**{size: 1e-3 for size in REMOVED_SIZES}, **PEAK_LEARNING_RATE}


def train(size: str, max_steps: int, directory: Path, bf16: bool, variant: list[str]) -> None:
    fields = ",".join(["dropout=0.0", *(f"{name}={value}" for name, value in MEASURED_SIZES[size].items())])
    precision = ["--bf16", "--use_cpu", "--attn_implementation", "eager"] if bf16 else []
    subprocess.run([sys.executable, str(REPO / "scripts" / "train_translation.py"), "--preset", "small",
                    "--config_overrides", fields, *precision, *RECIPE, "--learning_rate", f"{LEARNING_RATE[size]:g}",
                    "--output_dir", str(directory),
                    "--max_steps", str(max_steps), "--eval_strategy", "no", "--save_strategy", "steps",
                    "--save_steps", str(CHECKPOINT_EVERY), "--save_only_model", "true", "--logging_steps", "50",
                    "--report_to", "none", "--disable_tqdm", "true", "--max_test_samples", "0", *variant], check=True)


def validation_scores(checkpoint: Path) -> dict:
    report = checkpoint / "validation.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "evaluate_bleu.py"), "--model", str(checkpoint),
                    "--split", "validation", "--max_samples", "1000", "--dtype", "float32", "--device", "cpu",
                    "--output_file", str(report)], check=True, stdout=subprocess.DEVNULL)
    scores = json.loads(report.read_text())
    return {"validation_bleu": round(scores["bleu"], 2), "validation_chrf": round(scores["chrf"], 2)}


def step_time_ratios(bf16: bool, repeats: int = 3) -> dict[str, float]:
    """Each size's seconds a step over the default size's, as `--preset auto` times them (vaswani.training.choose_size:
    the run's first token-budget batches, the main job's precision), the median of `repeats` timings."""
    import tempfile
    from statistics import median

    from transformers import HfArgumentParser

    from vaswani.sizing import DEFAULT_SIZE, seconds_per_step
    from vaswani.training import (DataArguments, ModelArguments, VaswaniTrainingArguments, autocast_dtype, new_model,
                                  prepare_data, timing_batches, tokenize_splits)

    sys.path.append(str(REPO / "scripts"))
    from shared_corpus import SHARED_CORPUS

    precision = ["--bf16", "--use_cpu", "--attn_implementation", "eager"] if bf16 else []
    with tempfile.TemporaryDirectory() as output_dir:
        model_args, data_args, args = HfArgumentParser(
            (ModelArguments, DataArguments, VaswaniTrainingArguments)).parse_args_into_dataclasses(
            ["--preset", "auto", "--config_overrides", "dropout=0.0", *precision, *RECIPE, "--output_dir",
             output_dir, "--max_train_time", "600"])
        data_args.default_corpus = str(SHARED_CORPUS)
        data = prepare_data(model_args, data_args, args)
        features, _ = tokenize_splits(data, data.tokenizer, data_args, args)
        batches = timing_batches(data.tokenizer, features, args)
        timings = [seconds_per_step(lambda size: new_model(model_args, data.tokenizer, size), batches, args.device,
                                    autocast_dtype(args)) for _ in range(repeats)]
    return {size: round(median(t[size] / t[DEFAULT_SIZE] for t in timings), 3) for size in SIZES}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(MEASURED_SIZES))
    parser.add_argument("--max_steps", type=int)
    parser.add_argument("--step_times", action="store_true", help="instead of training, time every size's step "
                        "as --preset auto does, in float32 and in bf16, and record the ratios to the default size's")
    parser.add_argument("--eval_steps", default="250,500,750,1000,1250,1500,2000,2500,3000,3500,4000,5000,6000,7000,"
                        "8000,9000,10000",
                        help="comma-separated steps whose checkpoints are scored (multiples of 250)")
    parser.add_argument("--work_dir", type=Path, help="where the runs and checkpoints go")
    parser.add_argument("--bf16", action="store_true", help="train under bf16 autocast with eager attention, as the "
                        "main job does where the CPU multiplies bf16 faster")
    parser.add_argument("--skip_training", action="store_true", help="score the checkpoints a run left")
    parser.add_argument("--variant", default="", help="training flags that replace the recipe's, e.g. "
                        "'--learning_rate 2e-3': a row of another recipe for this size, kept apart from the table's")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    environment = {"commit": commit, "torch": torch.__version__, "transformers": transformers.__version__,
                   "python": platform.python_version(), "cpu": cpu_name(), "threads": torch.get_num_threads(),
                   "command": " ".join(["python", "benchmarks/main_job_sizes.py", *(argv or sys.argv[1:])])}
    if args.step_times:
        ratios = {precision: step_time_ratios(precision == "bf16") for precision in ("fp32", "bf16")}
        record({"seconds_per_step_ratio": ratios, "seconds_per_step_ratio_environment": environment})
        print(json.dumps(ratios))
        return
    if not (args.size and args.max_steps and args.work_dir):
        parser.error("--size, --max_steps and --work_dir name the run (or give --step_times)")
    variant = shlex.split(args.variant)
    learning_rate = (float(variant[variant.index("--learning_rate") + 1]) if "--learning_rate" in variant
                     else LEARNING_RATE[args.size])
    directory = args.work_dir / "_".join([args.size, *(flag.lstrip("-") for flag in variant)])
    if not args.skip_training:
        train(args.size, args.max_steps, directory, args.bf16, variant)
    environment["bf16"] = args.bf16
    rows = []
    for steps in sorted(int(s) for s in args.eval_steps.split(",")):
        checkpoint = directory / f"checkpoint-{steps}"
        if steps <= args.max_steps and checkpoint.is_dir():
            rows.append({"size": args.size, "steps": steps, **({"variant": args.variant} if variant else {}),
                         "learning_rate": learning_rate,
                         **validation_scores(checkpoint), **environment})
            print(json.dumps(rows[-1]), flush=True)
    record(rows=rows)


def record(fields: dict | None = None, rows: list[dict] = ()) -> None:
    """Add `fields` and `rows` to the results file, read afresh (another run may have written it since this one
    began); a row replaces an older one of the same size, steps and variant."""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    results.update(fields or {})
    def key(row):
        return row["size"], row.get("variant", ""), row["steps"]

    added = {key(row) for row in rows}
    results["rows"] = sorted([row for row in results["rows"] if key(row) not in added] + list(rows), key=key)
    rows = ",\n".join(f"  {json.dumps(row)}" for row in results.pop("rows"))  # a row a line
    head = json.dumps(results, indent=1)[1:-1].strip("\n")
    RESULTS.write_text("{\n" + (f"{head},\n" if head else "") + f' "rows": [\n{rows}\n ]\n}}\n')


if __name__ == "__main__":
    main()
