#!/usr/bin/env python
"""The data path at WMT's scale: time to the first training step and peak memory of `train_translation.py`
(`--preset small --vocab_size 8000`, the main job's 1,000-token batches, `--preprocessing_num_workers` 2) on stand-in
corpora (each line joins 2-4 random fra-eng pairs, about 25 tokens a side, seeded), first run (empty cache) and
cached rerun, one process or two (torchrun, gloo). The script runs as a user runs it; its log is read as it comes
and the run stopped at the first logged step (`measure`; times and memory as the report's notes define them).

    python benchmarks/bench_data.py --build 1000000 --corpus_dir /tmp/corpora       # stand-in corpora first
    python benchmarks/bench_data.py --corpora /tmp/corpora/standin-1000000.tsv.gz --processes 1 2
"""

import argparse
import gzip
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil  # accelerate's dependency

from vaswani.corpus import read_parallel_tsv, resolve_corpus_path

from common import SHARED_CORPUS, Column, argument_parser, pick_device, report

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_translation.py"
# The main job's batches; max_steps only bounds a run that is not stopped.
TRAINING_ARGUMENTS = ["--max_tokens_per_batch", "1000", "--max_steps", "3", "--logging_steps", "1", "--disable_tqdm",
                      "true", "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--log_level",
                      "info", "--use_cpu", "--seed", "0"]
# Log lines that end a stage, as (stage, pattern); the first match's time is recorded.
STAGES = [("read", re.compile(r"\[vaswani\.corpus\] Read |\[vaswani\.data\] Reusing .*read earlier")),
          ("tokenizer", re.compile(r"\[vaswani\.tokenization\] (Tokenizing|Reusing the tokenized)")),
          ("tokenized", re.compile(r"\[transformers\] \*+ Running training|Running training")),
          ("first_step", re.compile(r"'loss'|\"loss\""))]
GIB = 1024**3


def build_stand_in_corpus(path: Path, pairs: int, seed: int = 0, source: Path | None = None) -> Path:
    """`pairs` lines of WMT-like length: each joins 2-4 random fra-eng pairs (about 25 tokens a side)."""
    base, _ = read_parallel_tsv(resolve_corpus_path(source, SHARED_CORPUS))
    rng = random.Random(seed)
    partial = path.with_name(path.name + ".part")
    with gzip.open(partial, "wt", encoding="utf-8", compresslevel=1) as out:
        for _ in range(pairs):
            chosen = [base[rng.randrange(len(base))] for _ in range(rng.randint(2, 4))]
            out.write(" ".join(en for en, _ in chosen) + "\t" + " ".join(fr for _, fr in chosen) + "\n")
    partial.replace(path)
    return path


def sample_tree(root: int) -> tuple[float, dict[str, float]]:
    """CPU seconds of the process tree under `root` (user + system, the children it has reaped included), and its
    memory: summed proportional set sizes (bytes) by kind, and the largest single resident set."""
    cpu, memory = 0.0, {"anon": 0.0, "file": 0.0, "largest_rss": 0.0}
    try:
        pids = [root, *(child.pid for child in psutil.Process(root).children(recursive=True))]
    except psutil.Error:
        return cpu, memory
    for pid in pids:
        try:
            cpu += sum(psutil.Process(pid).cpu_times()[:4])  # user, system, children_user, children_system
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
        except (psutil.Error, OSError, ValueError):
            continue
        kib = {name: float(value.split()[0]) * 1024 for name, value in fields.items()}
        memory["anon"] += kib.get("Pss_Anon", 0.0) + kib.get("Pss_Shmem", 0.0)
        memory["file"] += kib.get("Pss_File", 0.0)
        memory["largest_rss"] = max(memory["largest_rss"], kib.get("Rss", 0.0))
    return cpu, memory


def measure(command: list[str], env: dict, timeout: float, cache_dir: Path) -> dict:
    """Run `command` until its first training step is logged; stage times, peak memory, the machine's mean load
    while it ran and the size of `cache_dir` then."""
    load = os.getloadavg()[0]  # what else was running: 2 cores are busy at a load of 2
    start = time.monotonic()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                               start_new_session=True)
    times, tail = {}, []

    def read_log():
        for line in process.stderr:
            tail.append(line)
            del tail[:-40]
            for stage, pattern in STAGES:
                if stage not in times and pattern.search(line):
                    times[stage] = time.monotonic() - start

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    peak = {"anon": 0.0, "file": 0.0, "largest_rss": 0.0}
    by_stage = {stage: 0.0 for stage, _ in STAGES}  # the peak anon memory while each stage was under way
    cpu, loads = 0.0, []
    while process.poll() is None and "first_step" not in times and time.monotonic() - start < timeout:
        tree_cpu, sample = sample_tree(process.pid)
        peak = {key: max(peak[key], sample[key]) for key in peak}
        under_way = next((stage for stage, _ in STAGES if stage not in times), STAGES[-1][0])
        by_stage[under_way] = max(by_stage[under_way], sample["anon"])
        cpu = max(cpu, tree_cpu)
        loads.append(os.getloadavg()[0])
        time.sleep(0.2)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    process.wait()
    reader.join(timeout=10)
    if "first_step" not in times:
        raise RuntimeError(f"No training step was logged ({' '.join(command)}):\n{''.join(tail)}")
    return {**{f"{stage}_s": round(seconds, 1) for stage, seconds in times.items()}, "cpu_s": round(cpu),
            "peak_anon_gib": round(peak["anon"] / GIB, 2), "peak_file_gib": round(peak["file"] / GIB, 2),
            "peak_process_rss_gib": round(peak["largest_rss"] / GIB, 2), "load_before": round(load, 1),
            "peak_anon_by_stage_gib": " / ".join(f"{by_stage[stage] / GIB:.2f}" for stage, _ in STAGES),
            "load_during": round(sum(loads) / max(len(loads), 1), 1),
            "cache_gib": round(sum(file.stat().st_size for file in cache_dir.rglob("*") if file.is_file()) / GIB, 4)}


def training_command(corpus: Path, processes: int, output_dir: Path, cache_dir: Path, args) -> list[str]:
    arguments = [str(SCRIPT), "--corpus", str(corpus), "--output_dir", str(output_dir), "--overwrite_output_dir",
                 "--data_cache_dir", str(cache_dir), "--preprocessing_num_workers", str(args.workers),
                 "--preset", args.preset, "--vocab_size", str(args.vocab_size), *TRAINING_ARGUMENTS]
    if processes == 1:
        return [sys.executable, *arguments]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
            "29517", *arguments, "--ddp_backend", "gloo"]


def main(argv: list[str] | None = None) -> None:
    parser, add = argument_parser(__doc__, corpus=False)
    add("--build", type=int, nargs="*", default=[], help="build stand-in corpora of these sizes")
    add("--source", type=Path, default=None, help="the corpus they are drawn from (default: fra-eng)")
    add("--corpus_dir", type=Path, default=Path("stand-in-corpora"))
    add("--corpora", type=Path, nargs="*", default=[], help="measure on these corpus files")
    add("--processes", type=int, nargs="+", default=[1, 2])
    add("--workers", type=int, default=2, help="--preprocessing_num_workers")
    add("--preset", default="small", help="the model trained (its size matters little here)")
    add("--vocab_size", type=int, default=8000)
    add("--work_dir", type=Path, default=Path("bench-data-work"),
        help="the cache and output directories of the measured runs (emptied before first runs)")
    add("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)

    for pairs in args.build:
        args.corpus_dir.mkdir(parents=True, exist_ok=True)
        print(build_stand_in_corpus(args.corpus_dir / f"standin-{pairs}.tsv.gz", pairs, source=args.source))
    rows, env = [], {**os.environ, "OMP_NUM_THREADS": "1"}
    for corpus in args.corpora:
        with gzip.open(corpus, "rb") as file:
            pairs = sum(block.count(b"\n") for block in iter(lambda: file.read(1 << 24), b""))
        for processes in args.processes:
            cache_dir = args.work_dir / "cache"
            shutil.rmtree(cache_dir, ignore_errors=True)
            for run in ("first", "cached"):
                command = training_command(corpus, processes, args.work_dir / "output", cache_dir, args)
                result = measure(command, env, args.timeout, cache_dir)
                row = {"corpus": corpus.name, "pairs": pairs, "processes": processes, "run": run, **result,
                       "first_step_s_per_million_pairs": round(result["first_step_s"] / (pairs / 1e6), 1)}
                print(json.dumps(row), flush=True)
                rows.append(row)
                data_report(rows, args, argv)  # after every row: a long series stopped early keeps what it measured
        shutil.rmtree(args.work_dir, ignore_errors=True)


def data_report(rows: list[dict], args: argparse.Namespace, argv: list[str] | None) -> None:
    rows = sorted(rows, key=lambda row: (row["pairs"], row["processes"], row["run"] != "first"))
    columns = [Column("pairs", "pairs", "{:,}"), Column("processes", "processes"), Column("run", "run"),
               Column("read_s", "corpus read (s)"), Column("tokenizer_s", "tokenizer ready (s)"),
               Column("tokenized_s", "tokenized, training starts (s)"), Column("first_step_s", "first step (s)"),
               Column("first_step_s_per_million_pairs", "s per M pairs"), Column("cpu_s", "CPU s to first step"),
               Column("peak_anon_gib", "peak anon (GiB)"),
               Column("peak_anon_by_stage_gib", "peak anon while reading / tokenizer / tokenizing / to step 1 (GiB)"),
               Column("peak_file_gib", "peak mapped files (GiB)"),
               Column("peak_process_rss_gib", "largest process RSS (GiB)"),
               Column("cache_gib", "cache on disk (GiB)", "{:.2f}"), Column("load_before", "load average before"),
               Column("load_during", "mean load average during")]
    notes = [
        "Stand-in corpora: each line joins 2-4 random fra-eng pairs (seed 0), about 25 tokens a side.",
        "Times: seconds from the command's start to the end of each stage, read from the training script's log "
        "('first step': the Trainer logs step 1). Load averages (1-minute) before and, averaged, during the run: well "
        "above the core count, other jobs shared the cores; CPU s (user + system of the process tree) is what such "
        "contention inflates least.",
        "Cache on disk: the corpus' Arrow splits, the tokenizer and the tokenized splits, as the run left them.",
        "Memory: proportional set sizes summed over the process tree, sampled every 0.2 s ('anon': owned by the "
        "processes; 'mapped files': memory-mapped pages, Arrow and libraries, the kernel can drop).",
    ]
    report(__file__, argv, args, pick_device("cpu"), "data",
           "Data path at scale: time to the first training step and peak memory", rows, columns, notes,
           {"training_arguments": TRAINING_ARGUMENTS})


if __name__ == "__main__":
    main()
