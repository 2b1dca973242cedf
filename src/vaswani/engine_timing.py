"""Which of two engines that give the same translations decodes faster on this machine: timed once, remembered.

A checkpoint's CTranslate2 float32 export translates as the PyTorch engine does, and which of the two is faster
depends on the CPU, not only on the model: at the main job's width CTranslate2 was the faster on a 2-core AMD EPYC
and the slower on a 2-core Intel Xeon (benchmarks/results/README.md, "A checkpoint's CTranslate2 float32 export by
default on a CPU?"). Nothing cheaper than decoding predicted it (isolated products, a decoding step on made-up
states), so both engines translate the same calibration sentences here, on this process's thread count, each in a
fresh process of its own: CTranslate2 slows down for the rest of a process in which torch has run on several threads
(`vaswani.export.one_torch_thread`). The seconds are kept per checkpoint, machine and decoding settings
(`engine_seconds`), so that later runs decide at once.

    seconds = engine_seconds("outputs/en-fr", "~/.cache/vaswani/ctranslate2/<key>", "timings.json", {})
    python -m vaswani.engine_timing outputs/en-fr --engine pytorch --threads 2    # one engine's time, as JSON
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

import torch

from .files import exclusive, write_atomically

# Calibration: sentences of the tokenizer's own pieces, long as short sentences are (4 to 24 pieces), drawn with a
# fixed seed so that both engines translate the same text, each timed as the fastest of a few passes after a warm one.
CALIBRATION_SENTENCES = 64
CALIBRATION_PIECES = (4, 24)
CALIBRATION_REPEATS = 3
ENGINES = ("pytorch", "ctranslate2")
# What changes which kernels run, besides the CPU itself: the variables torch, oneDNN and CTranslate2 read.
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "CT2_USE_MKL",
                    "OMP_NUM_THREADS", "LD_PRELOAD")


def cpu_name() -> str:
    """The CPU's model name as the kernel gives it (/proc/cpuinfo), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def machine(threads: int) -> dict:
    """What a timing holds for: the CPU, its cores, the threads decoding uses, the kernels chosen and the versions."""
    import ctranslate2

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_name(), "cores": cores, "threads": threads,
            "aten": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "ctranslate2": ctranslate2.__version__,
            "environment": {name: os.environ[name] for name in KERNEL_VARIABLES if name in os.environ}}


def calibration_sources(tokenizer, count: int = CALIBRATION_SENTENCES, seed: int = 0) -> list[str]:
    """`count` sentences of the tokenizer's own pieces, drawn at random with `seed`, of `CALIBRATION_PIECES` pieces:
    text for a model of any language pair, the same in every process."""
    draw = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    pieces = [i for i in range(len(tokenizer)) if i not in special]
    low, high = CALIBRATION_PIECES
    return [tokenizer.decode([draw.choice(pieces) for _ in range(draw.randint(low, high))]) for _ in range(count)]


def seconds_to_translate(engine, sources, repeats: int = CALIBRATION_REPEATS) -> float:
    """The fastest of `repeats` timed translations of `sources` by `engine`, after one untimed (kernels are chosen
    and memory is mapped on the first)."""
    from .translation import translate

    translate(engine, sources, warn=False)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        translate(engine, sources, warn=False)
        best = min(best, time.perf_counter() - start)
    return best


def time_engine(model_dir: str, engine: str, threads: int, decoding: dict, export_dir: str | None = None) -> float:
    """Seconds `engine` ("pytorch": the checkpoint in `model_dir`, as `vaswani.loading.load_engine` loads it;
    "ctranslate2": its export in `export_dir`) takes to translate the calibration sentences on a CPU, with the
    decoding settings `decoding` (`load_engine`'s keyword arguments), in a new process."""
    command = [sys.executable, "-m", "vaswani.engine_timing", model_dir, "--engine", engine, "--threads",
               str(threads), "--decoding", json.dumps(decoding)]
    if export_dir is not None:
        command += ["--export_dir", export_dir]
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root,
                                                                             os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    if done.returncode:  # the child's last line: its error, where Python raised one
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"Timing the {engine} engine on {model_dir} failed (exit status {done.returncode}): {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def engine_seconds(model_dir: str, export_dir: str, timings_file: str, source: dict,
                   decoding: dict | None = None) -> dict[str, float]:
    """Seconds each of `ENGINES` takes to translate the calibration sentences with `decoding` (`load_engine`'s
    keyword arguments) on this machine at this process's thread count: the checkpoint in `model_dir` with PyTorch,
    its export in `export_dir` with CTranslate2. Read from `timings_file` where it holds them for this machine,
    these settings and `source` (what identifies the checkpoint's files: `vaswani.export.export_source`), else timed
    now (`time_engine`, a few seconds) and added to it. Processes asking at once wait for the one that times."""
    decoding = {name: value for name, value in (decoding or {}).items() if value is not None}
    threads = torch.get_num_threads()
    key = {"machine": machine(threads), "decoding": decoding}
    with exclusive(timings_file, wait=True):
        timings = []
        try:
            with open(timings_file, encoding="utf-8") as f:
                remembered = json.load(f)
            if remembered.get("source") == source:
                timings = remembered["timings"]
        except (OSError, ValueError, AttributeError, KeyError):  # not timed yet, or for other weights
            pass
        for timing in timings:
            if timing["key"] == key:
                return timing["seconds"]
        print(f"Timing CTranslate2 against PyTorch on this CPU for {model_dir}, once "
              f"({CALIBRATION_SENTENCES} sentences each, remembered in {timings_file}) …", file=sys.stderr, flush=True)
        seconds = {engine: time_engine(model_dir, engine, threads, decoding,
                                       export_dir if engine == "ctranslate2" else None) for engine in ENGINES}
        print("… " + ", ".join(f"{engine}: {value:.3f} s" for engine, value in seconds.items()), file=sys.stderr,
              flush=True)
        timings.append({"key": key, "seconds": seconds})
        write_atomically(timings_file, json.dumps({"source": source, "timings": timings}, indent=1))
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Time one engine on a checkpoint's calibration sentences (CPU); "
                                     "prints {\"seconds\": …} as JSON.")
    parser.add_argument("model_dir")
    parser.add_argument("--engine", choices=ENGINES, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--decoding", default="{}", help="load_engine's keyword arguments, as JSON")
    parser.add_argument("--export_dir", help="the checkpoint's CTranslate2 export (with --engine ctranslate2)")
    args = parser.parse_args(argv)
    from .loading import load_engine

    torch.set_num_threads(args.threads)
    decoding = json.loads(args.decoding)
    if args.engine == "ctranslate2":
        engine = load_engine(args.export_dir, device="cpu", ctranslate2=True, export_of=args.model_dir, **decoding)
    else:
        engine = load_engine(args.model_dir, device="cpu", ctranslate2=False, **decoding)
    seconds = seconds_to_translate(engine, calibration_sources(engine.tokenizer))
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
