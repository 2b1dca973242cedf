"""Which of the CPU engines that give a checkpoint's translations decodes fastest on this machine: timed once,
on the user's own sentences, and remembered.

Which is faster depends on the CPU and on the sentences, not only on the model (benchmarks/results/README.md, "CPU
linear layers" and "A checkpoint's CTranslate2 float32 export by default on a CPU?"): at the main job's width,
CTranslate2 float32 was the faster engine on a 2-core AMD EPYC and the slower on a 2-core Intel Xeon; its beam search
decodes again each sentence whose search reached its own output limit, which costs most on long sentences; and the
PyTorch engine's linear layers laid out for oneDNN (`vaswani.inference.pack_for_cpu`) were the faster on the EPYC and
the slower on the Xeon. Nothing cheaper than decoding real sentences predicted it (isolated products, a decoding step on
made-up states, made-up sentences, whose translations run on to the output limit). So the engines translate batches of
sentences from across the lengths of the first run that has enough (`calibration_sentences`), at its thread count,
PyTorch and CTranslate2 each in a fresh process of its own (CTranslate2 slows down for the rest of a process in which
torch has run on several threads: `vaswani.export.one_torch_thread`). The seconds are kept per checkpoint, machine and
decoding settings (`engine_seconds`), so that later runs decide at once, whatever they translate.

    python -m vaswani.engine_timing outputs/en-fr --engine pytorch --threads 2 --sentences sentences.json
"""

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from .files import exclusive, write_atomically
from .inference import PackedLinear
from .loading import load_engine
from .translation import translate

# The sentences timed: batches of sentences of like length, as a run that sorts its sentences by length batches
# them, from across the lengths of the run's own (`calibration_sentences`); each engine's time is the fastest of a few
# passes after a warm one. A run with fewer sentences is not timed, and uses what an earlier run timed.
CALIBRATION_BATCH = 32
CALIBRATION_BATCHES = 4
CALIBRATION_SENTENCES = CALIBRATION_BATCH * CALIBRATION_BATCHES
CALIBRATION_REPEATS = 3
# Which revision of the engines' own decoding a timing measured: raised where a change to an engine alters its speed
# (2: CTranslate2's beam search, one call per batch at its longest output limit instead of one per limit), so that
# earlier timings are taken again.
ENGINES_REVISION = 2
# What changes which kernels run, besides the CPU itself: the variables torch, oneDNN and CTranslate2 read.
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "CT2_USE_MKL",
                    "OMP_NUM_THREADS", "LD_PRELOAD")


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name as the kernel gives it (`cpuinfo`), with its family and model numbers where it gives
    them: under a hypervisor the name can be only the vendor's line ("AMD EPYC"), the same for CPUs of different
    generations, whose kernels time differently (Zen 4 is family 25, Zen 5 family 26). Else the platform's
    processor string."""
    fields = {}
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if not name.strip():  # the first processor's block ends
                    break
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    numbers = [f"{name.removeprefix('cpu ')} {fields[name]}" for name in ("cpu family", "model") if name in fields]
    return f"{fields['model name']} ({', '.join(numbers)})" if numbers else fields["model name"]


def machine(threads: int) -> dict:
    """What a timing holds for: the CPU, its cores, the threads decoding uses, the kernels chosen and the versions
    (ctranslate2's None where it is not installed)."""
    try:
        ctranslate2 = importlib.metadata.version("ctranslate2")
    except importlib.metadata.PackageNotFoundError:
        ctranslate2 = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_name(), "cores": cores, "threads": threads,
            "aten": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "ctranslate2": ctranslate2,
            "environment": {name: os.environ[name] for name in KERNEL_VARIABLES if name in os.environ}}


def calibration_sentences(sentences: Sequence[str]) -> list[str] | None:
    """`CALIBRATION_BATCHES` batches of `CALIBRATION_BATCH` of `sentences` of like length, one from the middle of each
    of as many bands of their lengths, shortest first; None where there are fewer than `CALIBRATION_SENTENCES`
    non-blank ones."""
    ordered = sorted((sentence for sentence in sentences if sentence.strip()), key=len)
    if len(ordered) < CALIBRATION_SENTENCES:
        return None
    picked = []
    for band in range(CALIBRATION_BATCHES):
        middle = (2 * band + 1) * len(ordered) // (2 * CALIBRATION_BATCHES)
        start = min(max(middle - CALIBRATION_BATCH // 2, 0), len(ordered) - CALIBRATION_BATCH)
        picked += ordered[start:start + CALIBRATION_BATCH]
    return picked


def seconds_to_translate(engines: dict, sources, repeats: int = CALIBRATION_REPEATS) -> dict[str, float]:
    """For each of `engines` (name → engine), the fastest of `repeats` timed translations of `sources` (in batches of
    `CALIBRATION_BATCH`), after one untimed (kernels are chosen and memory is mapped on the first); the engines take
    turns, so that other load on the machine hits them alike."""
    for engine in engines.values():
        translate(engine, sources, max_sentences=CALIBRATION_BATCH, warn=False)
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            translate(engine, sources, max_sentences=CALIBRATION_BATCH, warn=False)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def time_engine(model_dir: str, engine: str, threads: int, decoding: dict, sentences_file: str,
                export_dir: str | None = None) -> dict[str, float]:
    """Seconds to translate the sentences in `sentences_file` (a JSON list) on a CPU at `threads` threads with the
    decoding settings `decoding` (`load_engine`'s keyword arguments), timed in a new process: for `engine`
    "pytorch", the checkpoint in `model_dir` as `vaswani.loading.load_engine` loads it ("pytorch") and, where that
    lays its linear layers out for oneDNN, with torch's own ("pytorch-unpacked"); for "ctranslate2", its export in
    `export_dir`."""
    command = [sys.executable, "-m", "vaswani.engine_timing", model_dir, "--engine", engine, "--threads",
               str(threads), "--decoding", json.dumps(decoding), "--sentences", sentences_file]
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


def engine_seconds(model_dir: str, timings_file: str, source: dict, decoding: dict | None = None,
                   sentences: Sequence[str] | None = None,
                   export: Callable[[], str] | None = None) -> dict[str, float] | None:
    """Seconds each engine took to translate `calibration_sentences` of a run's sentences with `decoding`
    (`load_engine`'s keyword arguments) on this machine at this process's thread count (`time_engine`): the
    checkpoint in `model_dir` with PyTorch, packed and not, and, with `export`, its export (the directory `export()`
    returns, made when first needed) with CTranslate2. Read from `timings_file` where it holds them for this machine,
    these settings and `source` (what identifies the checkpoint's files: `vaswani.export.export_source`); else timed
    now on `sentences` (seconds, once) and added to it; None where neither, because fewer sentences are given.
    Processes asking at once wait for the one that times."""
    decoding = {name: value for name, value in (decoding or {}).items() if value is not None}
    threads = torch.get_num_threads()
    key = {"machine": machine(threads), "decoding": decoding, "ctranslate2": export is not None,
           "engines": ENGINES_REVISION}
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
        sentences = calibration_sentences(sentences or ())
        if sentences is None:
            return None
        exports = {"ctranslate2": export()} if export is not None else {}
        print(f"Timing the engines on this CPU for {model_dir}, once, on {len(sentences)} of this run's sentences "
              f"(remembered in {timings_file}) …", file=sys.stderr, flush=True)
        seconds = {}
        with tempfile.NamedTemporaryFile("w", suffix=".json", encoding="utf-8") as sentences_file:
            json.dump(sentences, sentences_file)
            sentences_file.flush()
            for engine in ("pytorch", *exports):
                seconds |= time_engine(model_dir, engine, threads, decoding, sentences_file.name, exports.get(engine))
        print("… " + ", ".join(f"{engine}: {value:.3f} s" for engine, value in seconds.items()), file=sys.stderr,
              flush=True)
        timings.append({"key": key, "seconds": seconds})
        write_atomically(timings_file, json.dumps({"source": source, "timings": timings}, indent=1))
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Time one engine translating the given sentences on a CPU; "
                                     "prints {\"seconds\": …} as JSON.")
    parser.add_argument("model_dir")
    parser.add_argument("--engine", choices=("pytorch", "ctranslate2"), required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--decoding", default="{}", help="load_engine's keyword arguments, as JSON")
    parser.add_argument("--sentences", required=True, help="the sentences to translate: a JSON list")
    parser.add_argument("--export_dir", help="the checkpoint's CTranslate2 export (with --engine ctranslate2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    decoding = json.loads(args.decoding)
    if args.engine == "ctranslate2":
        engines = {"ctranslate2": load_engine(args.export_dir, device="cpu", ctranslate2=True,
                                              export_of=args.model_dir, **decoding)}
    else:  # with its linear layers laid out for oneDNN where it has any, and with torch's own
        engines = {"pytorch": load_engine(args.model_dir, device="cpu", ctranslate2=False, **decoding)}
        if any(isinstance(module, PackedLinear) for module in engines["pytorch"].model.modules()):
            engines["pytorch-unpacked"] = load_engine(args.model_dir, device="cpu", ctranslate2=False, pack=False,
                                                      **decoding)
    with open(args.sentences, encoding="utf-8") as f:
        print(json.dumps({"seconds": seconds_to_translate(engines, json.load(f))}))


if __name__ == "__main__":
    main()
