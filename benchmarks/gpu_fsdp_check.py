"""FSDP2 through the Trainer on one GPU: `scripts/train_translation.py --fsdp` (transformers' `fsdp=True`, tuned by
`--fsdp_config`) under `torchrun`, against the same run without FSDP. Both train the tiny preset for a few steps
in fp32 with dropout off from the same seed and data, save, and are reloaded with `from_pretrained`: the reloaded
models' losses on held-out pairs must agree, and the sharded run's saved weights must be a whole model. Then the
README's FSDP command as written (big preset, bf16, `--paper_recipe`), on one process and for a few seconds.

    python benchmarks/gpu_fsdp_check.py                 # on a GPU
    python benchmarks/gpu_fsdp_check.py --dry_run       # on a CPU: the second run is DDP over gloo instead (the
                                                        # Trainer shards only on GPUs), to check the path itself

Writes `gpu-fsdp-<device>.json/.md` and one log per run.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import (
    REPO_ROOT,
    SHARED_CORPUS,
    Column,
    add_result_arguments,
    pick_device,
    result_name,
    report,
)
from vaswani import VaswaniForConditionalGeneration, VaswaniTokenizer
from vaswani.data import load_translation_dataset

# Relative difference allowed between the two reloaded models' losses: both computed the same fp32 steps; what may
# differ is the order of floating-point sums (atomic adds in embedding backward, the sharded optimizer step).
TOLERANCE = 1e-3


def training_arguments(output_dir: Path, steps: int) -> list[str]:
    return ["--preset", "tiny", "--vocab_size", "16000", "--config_overrides", "dropout=0.0",
            "--output_dir", str(output_dir), "--max_steps", str(steps), "--max_tokens_per_batch", "2000",
            "--learning_rate", "1e-3", "--warmup_steps", "2", "--lr_scheduler_type", "inverse_sqrt",
            "--eval_strategy", "no", "--save_strategy", "no", "--logging_steps", "1", "--report_to", "none",
            "--max_test_samples", "32", "--dataloader_num_workers", "0", "--disable_tqdm", "true", "--seed", "0",
            "--overwrite_output_dir", "true"]


def torchrun(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *arguments]


def run(name: str, command: list[str], results_dir: Path, timeout: float) -> dict:
    log = results_dir / f"{name}.log"
    started = time.monotonic()
    with log.open("w") as handle:
        handle.write("$ " + shlex.join(command) + "\n")
        handle.flush()
        try:
            returncode = subprocess.run(command, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                        timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    return {"run": name, "returncode": returncode, "seconds": round(time.monotonic() - started, 1),
            "command": shlex.join(["python" if part == sys.executable else part for part in command])}


@torch.no_grad()
def held_out_loss(model_dir: Path, pairs: int, device: torch.device) -> float:
    """Mean label-smoothed loss of the saved model on the first `pairs` validation pairs, in fp32."""
    tokenizer = VaswaniTokenizer.from_pretrained(model_dir)
    model = VaswaniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    validation = load_translation_dataset(default_corpus=SHARED_CORPUS)["validation"].select(range(pairs))
    batch = tokenizer(list(validation["source"]), text_target=list(validation["target"]), padding=True,
                      return_tensors="pt")
    batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
    return float(model(**batch.to(device)).loss)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=256, help="validation pairs the reloaded models are scored on")
    parser.add_argument("--output_root", type=Path, default=REPO_ROOT / "outputs" / "gpu-fsdp")
    parser.add_argument("--timeout", type=float, default=180, help="seconds allowed to each training run")
    parser.add_argument("--dry_run", action="store_true", help="on a CPU: DDP over gloo in place of FSDP")
    add_result_arguments(parser)
    args = parser.parse_args(argv)
    device = pick_device("auto")
    if not device.is_cuda and not args.dry_run:
        parser.error("FSDP through the Trainer needs a GPU; --dry_run checks the path on a CPU")
    name = result_name(args, "gpu-fsdp", device)
    results_dir = args.results_dir
    results_dir.mkdir(parents=True, exist_ok=True)
    script = "scripts/train_translation.py"
    # FSDP2 as transformers 5 spells it: a bare --fsdp, tuned by --fsdp_config (inline JSON or a file).
    sharding = (["--fsdp", "--fsdp_config", '{"reshard_after_forward": true}'] if device.is_cuda
                else ["--use_cpu", "true", "--ddp_backend", "gloo"])

    rows = [run(f"{name}-plain", [sys.executable, script, *training_arguments(args.output_root / "plain", args.steps)],
                results_dir, args.timeout),
            run(f"{name}-sharded", torchrun(script, *training_arguments(args.output_root / "sharded", args.steps),
                                            *sharding), results_dir, args.timeout)]
    losses = {}
    for row, directory in zip(rows, ("plain", "sharded")):
        if row["returncode"] == 0:
            loss = held_out_loss(args.output_root / directory, args.pairs, device.device)
            row["held_out_loss"] = losses[directory] = loss
    agree = len(losses) == 2 and abs(losses["sharded"] - losses["plain"]) <= TOLERANCE * abs(losses["plain"])
    rows[1]["agrees_with_plain"] = "yes" if agree else "no"

    # README.md's FSDP command, as written but for the process count and a budget of seconds.
    readme = ["--preset", "big", "--bf16", "--fsdp", "--output_dir", str(args.output_root / "readme"),
              "--max_train_time", "20", "--max_tokens_per_batch", "25000", "--paper_recipe", "--save_strategy", "no",
              "--max_test_samples", "64", "--overwrite_output_dir", "true"]
    if not device.is_cuda:
        readme = ["--preset", "tiny", "--use_cpu", "true", "--ddp_backend", "gloo", "--output_dir",
                  str(args.output_root / "readme"), "--max_train_time", "5", "--max_tokens_per_batch", "2000",
                  "--paper_recipe", "--save_strategy", "no", "--max_test_samples", "16",
                  "--overwrite_output_dir", "true"]
    rows.append(run(f"{name}-readme-command", torchrun(script, *readme), results_dir, args.timeout))
    rows[-1]["saved"] = "yes" if (args.output_root / "readme" / "model.safetensors").is_file() else "no"

    notes = [f"Both first runs: tiny preset, {args.steps} steps, fp32, dropout 0, seed 0; loss of each reloaded "
             f"checkpoint on the first {args.pairs} validation pairs; agreement within {TOLERANCE:g} relative.",
             "The sharded run is `torchrun --nproc_per_node 1 ... --fsdp "
             "--fsdp_config '{\"reshard_after_forward\": true}'` "
             "(FSDP2 through accelerate)"
             + ("" if device.is_cuda else "; on this CPU dry run it is DDP over gloo instead") + ".",
             "The README command runs on one process (the README's has 8) for 20 s with 64 test sentences.",
             "Data: Tatoeba via manythings.org (fra-eng), CC-BY 2.0."]
    columns = [Column("run", "run"), Column("returncode", "exit"), Column("seconds", "seconds", "{:.1f}"),
               Column("held_out_loss", "held-out loss", "{:.6f}"), Column("agrees_with_plain", "agrees"),
               Column("saved", "saved")]
    report(__file__, argv, args, device, "gpu-fsdp", "FSDP2 through the Trainer on one GPU: same losses as without "
           "it, save and reload", rows, columns, notes, {"tolerance": TOLERANCE})
    return 0 if agree and rows[-1]["returncode"] == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
