"""The GPU measurements as plans that each fit one call of a lent GPU (benchmarks/README.md, "A lent GPU"), most
valuable first. Every stage runs under its own time limit (`STAGES`) inside its plan's budget (`PLANS`); the results
folder is packed into $ARCHIVE after every stage, so that a stage cut by its limit loses only its own results.

    python3 benchmarks/gpu_plan.py                  # the first plan: setup quality probe-4000
    python3 benchmarks/gpu_plan.py second           # the second plan: setup translation-trained probe-4000
    python3 benchmarks/gpu_plan.py third            # the third plan: setup kernels tests
    python3 benchmarks/gpu_plan.py second --budget 240   # within what the session has left, not the plan's 300 s
    python3 benchmarks/gpu_plan.py STAGE …          # chosen stages only, in order (setup always first)
    python3 benchmarks/gpu_plan.py --dry_run [second|STAGE …]   # the same at tiny sizes on this CPU, rehearsing
                                                    #   CUDA (VASWANI_REHEARSE_CUDA=1) before device time is spent
    python3 benchmarks/gpu_plan.py --limits [second|STAGE …]    # each stage's limit and their sum; runs nothing

Environment: RESULTS_DIR (default benchmarks/results), ARCHIVE (a .tar.gz), COMPILE_CACHE (default .compile-cache/,
carried: the compiled stages' torch.compile caches, each with its key, `<file>.key.json`: `cache_key`), INSTALL_WHEELS=0
(skip .whl/, the dry run's default), TRANSLATION_MODEL (for translation-trained where this machine made no quality
model). Each stage's log is gpu-<stage>.log beside its results. A stage gets its shorter limit only where its cache
was carried with this machine's key; otherwise it runs cold, and says so in one line. The caches come back as their
own file beside $ARCHIVE (`compile-cache.tar.gz`), each file checked against what a device call returns
(`RETURNED_FILES`). A dry run keeps its caches in a scratch folder: it never writes into $COMPILE_CACHE.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE_SECONDS = 20  # the step probe repeats its batches until Marian, the slowest, has trained this long
DRY_RUN_LIMIT = 480  # a dry run checks paths, not times: a shared CPU compiles the tiny model slower than a GPU base
# What one device call returns from $OUT: at most 8 files, 16 MiB each, 64 MiB in all (/work/.library/device).
RETURNED_FILES, RETURNED_FILE_MIB, RETURNED_MIB = 8, 16, 64
# What a compile cache was made by, besides the compiled code (`cache_key`): Inductor's own keys include each.
CACHE_KEY = """import importlib.metadata, json, torch
try:
    triton = importlib.metadata.version("triton")
except importlib.metadata.PackageNotFoundError:
    triton = None
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton,
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}))
"""
# The versions every stage imports (the carried wheels' and the image's), then the torch the package supports
# (pyproject.toml), checked before anything else runs.
CHECK_TORCH = """import importlib, platform, re, sys, torch
from packaging.specifiers import SpecifierSet
print("python", platform.python_version())
for name in ("torch", "transformers", "tokenizers", "datasets", "accelerate", "evaluate", "sacrebleu", "safetensors",
             "huggingface_hub", "dill", "multiprocess", "fsspec", "numpy"):
    print(name, importlib.import_module(name).__version__)
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
supported = re.search(r'"torch([^"]+)"', open("pyproject.toml").read()).group(1)
if torch.__version__.split("+")[0] not in SpecifierSet(supported):
    sys.exit(f"error: torch {torch.__version__} is outside the package's supported range {supported} (pyproject.toml)")
"""


@dataclass
class Run:
    """What the stages share: the plan's settings and the environment its commands run in."""

    dry: bool
    results: Path
    cache: Path
    env: dict

    def python(self, *args) -> list[str]:
        return [sys.executable if self.dry else "python3", *map(str, args)]

    def bench(self, script: str, *args) -> list[str]:
        device = ["--device", "cpu", "--threads", "2"] if self.dry else []
        return self.python(f"benchmarks/{script}", *device, "--results_dir", self.results, *args)


def setup(run: Run) -> list[list[str]]:
    """The carried wheels into a scratch folder on the import path, then the versions."""
    wheels = sorted(map(str, REPO.glob(".whl/*.whl")))
    if not wheels or run.env.get("INSTALL_WHEELS", "0" if run.dry else "1") != "1":
        return [run.python("-c", CHECK_TORCH)]
    site = tempfile.mkdtemp()
    run.env["PYTHONPATH"] += os.pathsep + site
    return [run.python("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                       "--upgrade", "--target", site, *wheels), run.python("-c", CHECK_TORCH)]


def quality(run: Run) -> list[list[str]]:
    """gpu_quality.py (what it trains and reports: its docstring and benchmarks/README.md, "A lent GPU"), with
    TORCH_LOGS naming each recompilation's reason in the recipe's log."""
    run.env.setdefault("TORCH_LOGS", "recompiles")
    return [run.python("benchmarks/gpu_quality.py", "--results_dir", run.results, "--data_cache_dir",
                       "benchmarks/.cache/data", "--compile_cache", run.cache / "quality.bin",
                       *(["--dry_run"] if run.dry else []))]


def probe(name: str, budget: int = 4000, engines: str = "vaswani-compiled,marian", *extra: str):
    """The compiled base step at `budget` tokens against MarianMTModel on the same batches, for PROBE_SECONDS, with
    bench_training.py's `extra` arguments; the compile cache `<name>.bin` where no engine has CUDA graphs."""
    def stage(run: Run) -> list[list[str]]:
        size = ["--sizes", "tiny", "--batch_tokens", "256", "--steps", "1", "--warmup_steps", "1",
                "--seconds_per_setting", "1"] if run.dry else \
            ["--sizes", "base", "--batch_tokens", budget, "--steps", "10", "--seconds_per_setting", PROBE_SECONDS]
        graphs = "graphs" in engines  # CUDA only: the dry run steps the eager engines instead
        cache = [] if graphs else ["--compile_cache", run.cache / f"{name}.bin"]
        output = f"training-{name.removeprefix('probe-')}-{{device}}-{budget}"
        return [run.bench("bench_training.py", *size, "--engines", "vaswani,marian" if graphs and run.dry else engines,
                          *extra, *cache, "--output_name", output)]
    return stage


def kernels(run: Run) -> list[list[str]]:
    """The eager base step under each SDPA kernel and eager attention, interleaved on the same batches, no warm-up,
    3 passes (the first meets each shape for the first time); a kernel the device lacks costs its row."""
    size = ["--sizes", "tiny", "--batch_tokens", "256", "--steps", "3"] if run.dry else \
        ["--sizes", "base", "--batch_tokens", "4000", "--steps", "20"]
    return [run.bench("bench_training.py", *size, "--engines", "vaswani-efficient,vaswani-cudnn,vaswani-math,"
                      "vaswani-flash,vaswani-eager", "--warmup_steps", "0", "--passes", "3",
                      "--output_name", "training-kernels-{device}")]


def translation_trained(run: Run) -> list[list[str]]:
    """bench_translation.py on the quality run's model (else $TRANSLATION_MODEL, else random weights at forced
    lengths): transformers' loop, the scripts' default (on CUDA the lean loop as CUDA graphs), slots, Marian; each
    engine in its own process, a failing one costing its rows."""
    selected = run.results / "gpu-quality-selected.txt"
    model = selected.read_text().strip() if selected.is_file() else run.env.get("TRANSLATION_MODEL")
    work = ["--sizes", "tiny", "--num_sentences", "32", "--max_new_tokens", "40"] if run.dry else \
        ["--num_sentences", "1000"]
    return [run.bench("bench_translation.py", *(["--model", model] if model else []), *work, "--batch_sizes", "256",
                      "--beams", "4", "--stopping", "eos" if model else "forced", "--engines",
                      "vaswani-hfloop,vaswani,vaswani-slots,marian", "--keep_going",
                      "--output_name", "translation-trained-{device}")]


def tests(run: Run) -> list[list[str]]:
    """pytest -m gpu (all skipped without CUDA), the compiled CUDA graphs last in a process of their own."""
    pytest = run.python("-m", "pytest", "-v", "-m", "gpu", "tests/", "-p", "no:cacheprovider", "-k")
    return [pytest + ["not (cuda_graphs and compiled)"], pytest + ["cuda_graphs and compiled"]]


@dataclass
class Stage:
    commands: object  # Run → the commands to run, in order, each under what is left of the stage's limit
    limit: int  # seconds on an H100 or H200, with the stage's compile cache where it has one
    cold: int | None = None  # without its compile cache (None: the same)
    cache: str | None = None  # its file in $COMPILE_CACHE


# Limits: what each stage needs on an H100 or H200 with a margin (its parts' times: benchmarks/README.md, "A lent GPU").
STAGES = {
    "setup": Stage(setup, 25),
    # A retry with transformers' loop, where the default loop fails, may overrun: the training figures are reported
    # before the scoring starts.
    "quality": Stage(quality, 370, cold=455, cache="quality.bin"),
    "probe-4000": Stage(probe("probe"), 85, cold=195, cache="probe.bin"),
    # by name: packed rows against bucketed batches, padded to multiples of 1 and 8 (Marian on the bucketed ones)
    "probe-4000-packed": Stage(probe("probe-packing", 4000, "vaswani-compiled,marian", "--batchings",
                                     "bucketed,bucketed-8,packed,packed-8"), 100, cold=150, cache="probe-packing.bin"),
    # by name: CUDA graphs over 4 shape buckets against the same bucketed batches unpadded, which decides
    # --shape_buckets; at 4,000 tokens and at the paper's 25,000
    **{f"probe-{budget}{'-graphs' if budget == 4000 else ''}": Stage(probe(
        "probe-graphs", budget, "vaswani-compiled-graphs,vaswani-compiled,marian", "--shape_buckets", "4"), 150)
       for budget in (4000, 25000)},
    "translation-trained": Stage(translation_trained, 105),
    "kernels": Stage(kernels, 110),
    "tests": Stage(tests, 170),
}
# Each plan's budget is what its call leaves after the machine's start: the first is made at once, the second only
# where enough device time is left (benchmarks/README.md, "A lent GPU").
# The second holds the two × Marian figures the first may leave out: translation on the quality run's model first
# (it needs its whole limit for one setting's rows), then the step probe, whose timed steps so far are kept when it is
# cut; `--budget` cuts it to what the session has left. The third waits for a later session.
PLANS = {"first": (480, ["setup", "quality", "probe-4000"]),
         "second": (300, ["setup", "translation-trained", "probe-4000"]),
         "third": (300, ["setup", "kernels", "tests"])}


def plan(names: list[str]) -> tuple[int, list[str]]:
    """A plan's budget and stages: a named plan, or the stages named (after setup), whose budget is their limits."""
    if len(names) <= 1 and (names or ["first"])[0] in PLANS:
        return PLANS[(names or ["first"])[0]]
    if unknown := [name for name in names if name not in STAGES]:
        raise SystemExit(f"unknown stage {', '.join(unknown)} (stages: {', '.join(STAGES)})")
    stages = ["setup", *(name for name in names if name != "setup")]
    return sum(STAGES[name].cold or STAGES[name].limit for name in stages), stages


def cache_key(python: list[str], env: dict | None = None) -> dict:
    """What a compile cache made here now would be made by: torch, CUDA, Triton and the GPU (`CACHE_KEY`, run by
    the plan's Python), the compiled code (a hash of the package's sources, which a working tree without git has
    too) and, for the reader, its commit. Where the versions cannot be read, `versions` says why, and no cache
    matches."""
    read = subprocess.run([*python, "-c", CACHE_KEY], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = (read.stdout if read.returncode == 0 else read.stderr).strip().splitlines() or ["no output"]
    versions = json.loads(lines[-1]) if read.returncode == 0 else {"versions": f"unread: {lines[-1]}"}
    sources = hashlib.sha256()
    for path in sorted((REPO / "src" / "vaswani").glob("*.py")):
        sources.update(path.name.encode() + b"\0" + path.read_bytes())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    return {**versions, "code": sources.hexdigest()[:16], "commit": commit}


def key_path(cache_file: Path) -> Path:
    return cache_file.with_name(cache_file.name + ".key.json")


def cache_mismatch(cache_file: Path, key: dict) -> str | None:
    """Why `cache_file` cannot serve this machine, in words (None where it can): absent, without a key, or made by
    another torch, CUDA, Triton, GPU or code (the commit only informs)."""
    if not cache_file.is_file():
        return "no cache carried"
    try:
        made = json.loads(key_path(cache_file).read_text())
    except (OSError, ValueError):
        return f"{cache_file.name} carries no key"
    differ = [f"{field} {made.get(field)} ≠ {key[field]}" for field in key if field != "commit"
              and made.get(field) != key[field]]
    return f"{cache_file.name} was made by another {', '.join(differ)}" if differ else None


def stage_limit(name: str, cache: Path, key: dict) -> int:
    """The stage's warm limit where its compile cache was carried with this machine's `key`, else its cold one."""
    stage = STAGES[name]
    if stage.cache is None or cache_mismatch(cache / stage.cache, key) is None:
        return stage.limit
    return stage.cold or stage.limit


def set_aside(name: str, cache: Path, key: dict, limit: float) -> None:
    """A stage about to run cold (under `limit`): its cache, where one was carried that cannot serve (another
    machine's, or keyless), set aside so that the stage compiles and saves its own; the reason in one line."""
    stage = STAGES[name]
    why = stage.cache and cache_mismatch(cache / stage.cache, key)
    if why:
        print(f"== {name}: runs cold, limit {limit:.0f} s: {why}", flush=True)
        if (cache / stage.cache).is_file():
            os.replace(cache / stage.cache, cache / f"{stage.cache}.stale")


def sign(name: str, cache: Path, key: dict) -> None:
    """After a stage: its cache file, where it has one, marked with the key of the machine that made or used it."""
    stage = STAGES[name]
    if stage.cache and (cache / stage.cache).is_file():
        write_atomically(key_path(cache / stage.cache), json.dumps(key, indent=1) + "\n")


def write_atomically(path: Path, data: str | bytes) -> None:
    """`data` into `path` through a scratch file beside it: the file is whole or absent, whenever the plan stops."""
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(partial, path)


def pack(path: Path, folder: Path, names: list[str] | None = None) -> None:
    """`folder` (or its files `names`) into the .tar.gz `path`, which is whole or absent whenever the plan stops."""
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    with tarfile.open(partial, "w:gz") as packed:
        for name in names if names is not None else ["."]:
            packed.add(folder / name, arcname=name)
    os.replace(partial, path)


def publish(run: Run, archive: str | None) -> None:
    """The results packed into `archive`, and the compile caches with their keys into `compile-cache.tar.gz` beside
    it (each the whole folder, or the last pack). The returned files are checked against what a device call
    returns: a cache pack over a file's limit is left out, with the reason; any other excess is said."""
    if not archive:
        return
    archive = Path(archive)
    pack(archive, run.results)
    caches = archive.with_name("compile-cache.tar.gz")
    names = sorted(path.name for path in run.cache.glob("*") if path.is_file() and not path.name.endswith(".stale"))
    if names:
        pack(caches, run.cache, names)
        if (mib := caches.stat().st_size / 2**20) > RETURNED_FILE_MIB:
            caches.unlink()
            print(f"compile cache left out: {mib:.1f} MiB, over the {RETURNED_FILE_MIB} MiB a returned file may have",
                  flush=True)
    returned = [path for path in archive.parent.iterdir() if path.is_file()]
    total = sum(path.stat().st_size for path in returned) / 2**20
    large = [path.name for path in returned if path.stat().st_size > RETURNED_FILE_MIB * 2**20]
    if large or total > RETURNED_MIB or len(returned) > RETURNED_FILES:
        print(f"warning: {len(returned)} files, {total:.1f} MiB beside {archive.name} (a call returns "
              f"{RETURNED_FILES} files of {RETURNED_FILE_MIB} MiB, {RETURNED_MIB} MiB in all)"
              + (f"; over a file's limit: {', '.join(large)}" if large else ""), flush=True)


def run_stage(name: str, run: Run, limit: float) -> bool:
    """The stage's commands, each under what is left of `limit` (then its whole process group is stopped), their
    output to the console and the stage's log; whether they all succeeded."""
    log_path, started, ok = run.results / f"gpu-{name}.log", time.monotonic(), True
    with log_path.open("a") as log:
        for command in STAGES[name].commands(run):
            left = limit - (time.monotonic() - started)
            if left <= 5:
                print(f"skipped, no time left: {' '.join(command)}", file=log, flush=True)
                return False
            log.write(f"$ {' '.join(command)} (limit {left:.0f} s)\n")
            log.flush()
            process = subprocess.Popen(command, cwd=REPO, env=run.env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True)
            # The plan itself stopped (the device call's timeout): the stage's process group with it.
            signal.signal(signal.SIGTERM, lambda *_: (os.killpg(process.pid, signal.SIGKILL), sys.exit(143)))
            copy = threading.Thread(target=lambda: [(sys.stdout.write(line), log.write(line), log.flush())
                                                    for line in process.stdout])
            copy.start()
            try:
                process.wait(timeout=left)
            except subprocess.TimeoutExpired:
                log.write(f"stopped at the stage's limit of {limit:.0f} s\n")
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            copy.join()
            ok = process.returncode == 0 and ok
    return ok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    dry, limits_only = "--dry_run" in argv, "--limits" in argv
    cut_to = None
    if "--budget" in argv:  # what the session has left, where it is less than the plan's budget
        at = argv.index("--budget")
        cut_to, argv = int(argv[at + 1]), argv[:at] + argv[at + 2:]
    budget, stages = plan([arg for arg in argv if arg not in ("--dry_run", "--limits")])
    budget = min(budget, cut_to or budget)
    # A dry run compiles a tiny model on a CPU: its caches go to a scratch folder, never among the carried ones.
    cache = (Path(tempfile.mkdtemp(prefix="gpu-plan-dry-compile-cache-")) if dry
             else Path(os.environ.get("COMPILE_CACHE", REPO / ".compile-cache")).resolve())
    key = cache_key([sys.executable if dry else "python3"])
    limits = {name: DRY_RUN_LIMIT if dry else stage_limit(name, cache, key) for name in stages}
    if limits_only:
        print("\n".join(f"{name} {limit}" for name, limit in limits.items()) + f"\nbudget {budget}")
        return 0
    results = Path(os.environ.get("RESULTS_DIR", REPO / "benchmarks" / "results")).resolve()
    results.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "true",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO / "benchmarks"),
                                                       os.environ.get("PYTHONPATH")]))}
    if dry:
        env["VASWANI_REHEARSE_CUDA"] = "1"  # the CPU takes CUDA's branches (vaswani.generation_vaswani.runs_as)
    run, started, status = Run(dry, results, cache, env), time.monotonic(), 0
    for name in stages:
        # A stage runs under its limit or what the plan has left, whichever is less; under half its limit, not at all.
        left = (len(stages) * DRY_RUN_LIMIT if dry else budget) - (time.monotonic() - started)
        if left < limits[name] / 2:
            print(f"== {name}: left out, the plan has {left:.0f} s left of its {budget} s, under half the stage's "
                  f"limit of {limits[name]} s")
            status = 1
            continue
        limit = min(limits[name], left)
        set_aside(name, cache, key, limit)
        print(f"== {name} at {time.monotonic() - started:.0f} s, limit {limit:.0f} s", flush=True)
        begun = time.monotonic()
        ok = run_stage(name, run, limit)
        print(f"== {name}: {'ok' if ok else 'failed'} after {time.monotonic() - begun:.0f} s", flush=True)
        sign(name, cache, key)
        publish(run, os.environ.get("ARCHIVE"))
        status |= not ok
        if name == "setup" and not ok:
            break  # nothing runs without its packages
    print(f"== done at {time.monotonic() - started:.0f} s, exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
