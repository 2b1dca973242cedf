"""What the benchmarks share: the device and its timing/memory probes, the corpus and its tokenizer, the Vaswani /
Marian twins, and `report` (JSON + Markdown with the environment and the exact command). Engines are compared on
identical work: the same token ids, batches and precision and, for generation, the same number of decoding steps.
"""

import argparse
import contextlib
import copy
import ctypes
import gc
import hashlib
import importlib
import json
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani.convert import to_marian
from vaswani.corpus import CORPUS_ENV_VAR, read_parallel_tsv, resolve_corpus_path
from vaswani.data import load_translation_dataset
from vaswani.machine import cpu_name
from vaswani.files import write_atomically
from vaswani.generation_vaswani import runs_as
from vaswani.loading import choose_device, named_dtype
from vaswani.preemption import catching_stop_signals
from vaswani.tokenization import cached_corpus_tokenizer
from vaswani.tokenization_vaswani import VaswaniTokenizer

BENCHMARKS_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCHMARKS_DIR.parent
RESULTS_DIR = BENCHMARKS_DIR / "results"
CACHE_DIR = BENCHMARKS_DIR / ".cache"  # gitignored: the corpus' splits, its tokenizer, converted CTranslate2 models
sys.path.append(str(REPO_ROOT / "scripts"))
from shared_corpus import SHARED_CORPUS  # noqa: E402  the scripts' default corpus, read as they read it
# The paper's En-Fr vocabulary: 32,000 word pieces (§5.1).
DEFAULT_VOCAB_SIZE = 32000

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from the vendor data sheets, matched against
# torch.cuda.get_device_name() in this order (so "H100 PCIe" wins over "H100", "L40S" over "L4").
BF16_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0,  # H100: SXM
                    "A100": 312.0, "L40S": 362.0, "L4": 121.0}



@dataclass(frozen=True)
class Target:
    """A figure a lent GPU is to reach: its name, its words, the result's field that holds it and its bound."""

    name: str
    text: str
    field: str
    bound: float
    at_most: bool = False  # the figure must not exceed the bound (a time); otherwise, reach it

    def met(self, value: float | None) -> bool | None:
        """Whether `value` meets the target; None where there is no figure."""
        if value is None:
            return None
        return value <= self.bound if self.at_most else value >= self.bound


# The GPU targets, on an H100 or H200: the one list the quality run's notes and the landing of a GPU's figures
# (gpu_land.py) judge by.
GPU_TARGETS = (
    Target("steady step", "a steady 4,000-token base step ≤ 15 ms", "steady_ms_per_step", 15, at_most=True),
    Target("training × Marian", "base training ≥ 3× Marian's tokens/s on the same batches, with MFU reported",
           "training_vs_marian", 3),
    Target("BLEU, first 1,000", "after 300 s, test BLEU ≥ 62 on the first 1,000 sentences",
           "test_bleu_first_1000", 62),
    Target("BLEU, whole split", "after 300 s, test BLEU ≥ 45 on the whole split", "test_bleu", 45),
    Target("translation × Marian", "translation at beam 4 in bf16 ≥ 5× Marian's sentences/s on the quality model",
           "translation_vs_marian", 5),
)


class Stopped(Exception):
    """A stop signal (SIGTERM from a lent GPU's stage limit, SIGINT) reached a benchmark, which then writes what it
    has measured before it ends (`stopping`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stopping():
    """A block in which SIGTERM and SIGINT raise `Stopped` where the main thread is, so that the benchmark can write
    its figures so far and end with 128 + the signal's number."""

    def stop(signum: int):
        raise Stopped(signum)

    return catching_stop_signals(stop)


class Device:
    """Where a benchmark runs and at which precision: bf16 where CUDA's defaults are taken (`as_cuda`: on a GPU, and
    on a CPU rehearsing one, `generation_vaswani.runs_as`), fp32 on a CPU (where bf16 is an engine's option)."""

    def __init__(self, device: torch.device):
        self.device, self.is_cuda, self.as_cuda = device, device.type == "cuda", runs_as(device) == "cuda"
        self.dtype_name = "bfloat16" if self.as_cuda else "float32"
        self.dtype = named_dtype(self.dtype_name)
        self.name = torch.cuda.get_device_name(device) if self.is_cuda else None
        # A short name for result files: `cpu`, or the GPU's model, e.g. `cuda-h100-80gb-hbm3`.
        self.tag = ("cuda-" + re.sub(r"[^a-z0-9]+", "-", self.name.lower().replace("nvidia", "")).strip("-")
                    if self.is_cuda else "cpu")
        # The dense bf16 peak that MFU is measured against; None on a CPU and on a GPU the table lacks.
        self.bf16_peak_tflops = (next((peak for key, peak in BF16_PEAK_TFLOPS.items() if key in self.name), None)
                                 if self.is_cuda else None)

    def sync(self) -> None:
        if self.is_cuda:  # wall-clock time covers the queued kernels' work, not just their launch
            torch.cuda.synchronize(self.device)


def pick_device(name: str = "auto", threads: int | None = None) -> Device:
    """The device `vaswani.loading.choose_device` picks for `name`, with the thread count and TF32 set."""
    device = choose_device(name)
    if threads:
        torch.set_num_threads(threads)
    if device.type == "cuda":  # TF32 matmuls for any fp32 leftovers (bf16 autocast covers the model itself)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return Device(device)


def timed(device: Device, fn: Callable[[], object]) -> tuple[object, float]:
    """Run fn once and return (its result, seconds), synchronising CUDA on both sides."""
    device.sync()
    start = time.perf_counter()
    result = fn()
    device.sync()
    return result, time.perf_counter() - start


def _proc_status_mib(field: str) -> float | None:
    """VmRSS (resident now) or VmHWM (its peak) of this process, from /proc/self/status; None off Linux."""
    try:
        return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024
    except (OSError, AttributeError):
        return None


def resident_mib(device: Device, settle: bool = False) -> float | None:
    """Memory in use now (CUDA tensors, or the resident set; None off Linux), after freeing garbage if `settle`, so
    that the next peak is its own."""
    if settle:
        gc.collect()
        if device.is_cuda:
            torch.cuda.empty_cache()
        elif sys.platform.startswith("linux"):  # glibc keeps freed small blocks: handed back, the baseline is honest
            with contextlib.suppress(OSError):  # not glibc (musl): nothing kept to hand back
                ctypes.CDLL("libc.so.6").malloc_trim(0)
    return torch.cuda.memory_allocated(device.device) / 2**20 if device.is_cuda else _proc_status_mib("VmRSS")


class PeakMemory:
    """How much memory one measurement adds at its peak (`added_mib`) over what was resident when it started, or over
    `baseline_mib`. CUDA: `max_memory_allocated` (tensors only); CPU: the peak resident set, VmHWM, which Linux resets
    on writing 5 to /proc/self/clear_refs (tensors and allocator slack; None elsewhere)."""

    def __init__(self, device: Device, baseline_mib: float | None = None):
        self.device, self.added_mib, self._baseline = device, None, baseline_mib

    def __enter__(self) -> "PeakMemory":
        if self._baseline is None:  # with a given baseline the caller has just settled memory
            self._baseline = resident_mib(self.device, settle=True)
        if self.device.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:  # no peak to reset, none to measure
                self._baseline = None
        return self

    def __exit__(self, *exc) -> None:
        peak = (torch.cuda.max_memory_allocated(self.device.device) / 2**20 if self.device.is_cuda
                else _proc_status_mib("VmHWM"))
        if self._baseline is not None and peak is not None:
            self.added_mib = max(peak - self._baseline, 0.0)


def test_sources(corpus: str | None) -> tuple[Path, list[str]]:
    """The corpus file and the English side of its held-out test split, as a trained checkpoint's was split."""
    path = resolve_corpus_path(corpus, SHARED_CORPUS)  # as the scripts find it
    return path, list(load_translation_dataset(data_file=str(path))["test"]["source"])


def sample_sentences(pairs: Sequence[tuple[str, str]], count: int, seed: int) -> list[tuple[str, str]]:
    """`count` pairs drawn uniformly (seeded) from the whole corpus, whose file is sorted by length."""
    return random.Random(seed).sample(list(pairs), min(count, len(pairs)))


def corpus_and_tokenizer(corpus: str | None, cache_dir: Path = CACHE_DIR, vocab_size: int = DEFAULT_VOCAB_SIZE,
                         ) -> tuple[Path, list[tuple[str, str]], VaswaniTokenizer]:
    """The corpus file (`corpus`, else found as the scripts find it), all its sentence pairs and the joint BPE as
    training makes it (on the train split only, `vaswani.tokenization.cached_corpus_tokenizer`), cached under
    `cache_dir`/data, which GPU sessions carry."""
    corpus = resolve_corpus_path(corpus, SHARED_CORPUS)
    pairs, _ = read_parallel_tsv(corpus)
    train = load_translation_dataset(data_file=corpus, cache_dir=cache_dir / "data")["train"]
    return corpus, pairs, cached_corpus_tokenizer(train, vocab_size)[0]


ENGINE_LABELS = {"vaswani": "Vaswani", "marian": "Marian (HF)", "ct2": "CT2"}
OPTION_LABELS = {"hfloop": "transformers' loop", "lean": "lean loop", "graphs": "CUDA graphs", "float32": "fp32",
                 "steps": "compiled steps"}


def engine_label(name: str) -> str:
    """An engine's name as the tables show it: its model, then its options (`vaswani-int8-hfloop` → "Vaswani int8
    transformers' loop")."""
    base, *options = name.split("-")
    return " ".join([ENGINE_LABELS.get(base, base), *(OPTION_LABELS.get(option, option) for option in options)])


def build_seq2seq(engine: str, config: VaswaniConfig, device: Device, dtype: torch.dtype, seed: int = 0):
    """A Vaswani translation model with random weights (seeded: speed does not depend on their values once the amount
    of work is fixed) on `device` in `dtype`, or its Marian twin (`vaswani.convert.to_marian`: the same function)."""
    torch.manual_seed(seed)
    # A copy: an engine's own setting (`set_attn_implementation`) must not reach the others built from `config`.
    model = VaswaniForConditionalGeneration(copy.deepcopy(config))
    return (to_marian(model) if engine == "marian" else model).to(device=device.device, dtype=dtype)


def random_checkpoint(size: str, tokenizer, seed: int, directory: Path) -> str:
    """A checkpoint of the preset `size` with random weights (seeded) and `tokenizer`, loaded as a trained one is."""
    config = VaswaniConfig.from_preset(size, vocab_size=len(tokenizer))
    build_seq2seq("vaswani", config, pick_device("cpu"), torch.float32, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


# SDPA's kernels by short name (efficient and cudnn exist on CUDA only).
SDPA_BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def sdpa_backend(name: str | None):
    """A context manager that makes SDPA use one kernel (`None`: torch's default choice, no restriction)."""
    return contextlib.nullcontext() if name is None else sdpa_kernel(SDPA_BACKENDS[name])


# What an attention kernel leaves among the aten operators it runs (the first match names it): SDPA's kernels their
# own operators, its math fallback `_safe_softmax`, eager attention a plain softmax.
ATTENTION_OPERATORS = {"flash_attention": "flash", "efficient_attention": "efficient", "cudnn_attention": "cudnn",
                       "flex_attention": "flex", "_safe_softmax": "math", "aten._softmax": "eager"}
# The weights' products, whose dtype is the engine's precision (attention's own batched products are left out: SDPA's
# math kernel computes them in fp32 for bf16 inputs on a CPU), and which kernel family ran them: torch's own
# products, or oneDNN's with weights laid out once (`vaswani.inference.PackedLinear`).
MATMULS = {"aten.mm": "aten", "aten.addmm": "aten", "aten.linear": "aten", "mkldnn._linear_pointwise": "onednn-packed"}


def attention_ran(encode: Callable[[], object]) -> dict:
    """What one call of `encode` (a forward in the engine's autocast and SDPA settings) ran, seen at torch's
    dispatcher below autocast: its attention kernels, its weights' products' dtypes and their kernel family
    (`MATMULS`), each a sorted list."""
    kernels, dtypes, linear = set(), set(), set()

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            kernel = next((kernel for key, kernel in ATTENTION_OPERATORS.items() if key in name), None)
            kernels.update([kernel] if kernel else [])
            linear.update([MATMULS[name]] if name in MATMULS else [])
            if kernel in ("flash", "efficient", "cudnn") or name in MATMULS:  # a softmax may run in fp32
                dtypes.update(str(a.dtype).removeprefix("torch.") for a in args[:2] if torch.is_tensor(a))
            return func(*args, **(kwargs or {}))

    with Seen():  # with gradients, as a training step chooses its kernels
        encode()
    return {name: ",".join(sorted(found))
            for name, found in (("attention", kernels), ("dtype", dtypes), ("linear", linear))}


class WrongKernel(RuntimeError):
    """An engine ran another attention kernel, dtype or linear kernel family than its name says."""


def check_ran(engine: str, ran: dict, attention: set[str] | None, dtype: str, linear: str | None = None) -> None:
    """Stop where `engine` ran another attention kernel than `attention` (None: any), another dtype than `dtype`, or
    its linear layers on another kernel family than `linear` (None: any)."""
    kernels = set(ran["attention"].split(",")) - {""}
    if (attention is not None and not kernels <= attention) or not kernels or ran["dtype"] != dtype:
        raise WrongKernel(f"{engine} ran attention {ran['attention'] or 'none seen'} in {ran['dtype']}, not "
                          f"{'/'.join(sorted(attention or {'any'}))} in {dtype}; its row would not be its own.")
    if linear is not None and ran["linear"] != linear:
        raise WrongKernel(f"{engine} ran its linear layers on {ran['linear'] or 'none seen'}, not {linear}; its row "
                          "would not be its own.")


# The variables that limit torch's CPU kernels to an older instruction set (ATen's, oneDNN's, fbgemm's), as .ci/run
# sets them to run an AVX2-only CPU's kernels; CTranslate2's bundled oneDNN reads ONEDNN_MAX_CPU_ISA too.
KERNEL_ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS")


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command as run (`argv` None: this process' own), to be pasted in the repository root; preceded by the
    kernel-limiting variables that are set, since they change what runs."""
    path = Path(script).resolve()
    path = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    limits = [f"{name}={os.environ[name]}" for name in KERNEL_ISA_VARIABLES if os.environ.get(name)]
    return shlex.join([*limits, "python", str(path), *(sys.argv[1:] if argv is None else argv)])


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: Device) -> dict:
    """The device, the library versions and the model code's revision (uncommitted edits are flagged)."""
    versions = {"python": platform.python_version()}
    for name in ("torch", "transformers", "ctranslate2", "tokenizers"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = None
    modeling = REPO_ROOT / "src" / "vaswani" / "modeling_vaswani.py"
    return {
        "device": device.tag, "device_name": device.name or cpu_name(), "dtype": device.dtype_name,
        "rehearsing_cuda": device.as_cuda and not device.is_cuda, "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the instruction set of ATen's CPU kernels
        "cpu_count": os.cpu_count(), "cpu": cpu_name(), "platform": platform.platform(), "versions": versions,
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "model_code_uncommitted_changes": bool(_git("status", "--porcelain", "--", "src/vaswani")),
        "modeling_vaswani_sha1": hashlib.sha1(modeling.read_bytes()).hexdigest()[:12] if modeling.is_file() else None,
        **({"cuda": torch.version.cuda, "bf16_peak_tflops": device.bf16_peak_tflops} if device.is_cuda else {}),
    }


@dataclass
class Column:
    key: str
    header: str
    fmt: str = "{}"

    def render(self, row: dict) -> str:
        value = row.get(self.key)
        return "–" if value is None else value if isinstance(value, str) else self.fmt.format(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.render(row) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def report(script: str, argv: Sequence[str] | None, args: argparse.Namespace, device: Device, benchmark: str,
           title: str, rows: Sequence[dict], columns: Sequence[Column], notes: Sequence[str],
           settings: dict | None = None, extra_tables: Sequence[tuple[str, Sequence[dict], Sequence[Column]]] = (),
           ) -> Path:
    """The one way a benchmark ends: `<name>.json` (everything) and `<name>.md` (the tables, the command, the
    environment, the notes) written atomically in --results_dir (`result_name`), the main table printed; settings
    are the run's arguments and `settings`. Returns the JSON file's path."""
    name, command, env = result_name(args, benchmark, device), command_line(script, argv), environment(device)
    settings = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, **(settings or {})}
    payload = {"benchmark": title, "command": command, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "environment": env, "settings": settings, "results": list(rows), "notes": notes,
               **{heading: list(extra_rows) for heading, extra_rows, _ in extra_tables}}
    table = markdown_table(rows, columns)
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    md = [f"# {title}", "", "```bash", command, "```", "",
          f"Device: **{env['device_name']}** ({env['device']}, {env['dtype']}, {env['torch_threads']} torch threads, "
          f"ATen CPU kernels {env['cpu_capability']}). "
          f"Versions: {versions}. Model code: commit {env['git_commit']}"
          + (" with uncommitted changes" if env["model_code_uncommitted_changes"] else "")
          + f" (modeling_vaswani.py sha1 {env['modeling_vaswani_sha1']}).", "", table]
    for heading, extra_rows, extra_columns in extra_tables:
        md += ["", f"## {heading}", "", markdown_table(extra_rows, extra_columns)]
    if notes:
        md += ["", "## Notes", ""] + [f"- {note}" for note in notes]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.results_dir / f"{name}.json", args.results_dir / f"{name}.md"
    write_atomically(json_path, json.dumps(payload, indent=2, default=str) + "\n")
    write_atomically(md_path, "\n".join(md) + "\n")
    print(f"{table}\n\nwrote {json_path} and {md_path}")
    return json_path


def result_name(args: argparse.Namespace, benchmark: str, device: Device) -> str:
    """The result file stem: --output_name with {device} filled in, or <benchmark>-<device tag>."""
    return (args.output_name or f"{benchmark}-{{device}}").format(device=device.tag)


def argument_parser(doc: str, corpus: bool = True) -> tuple[argparse.ArgumentParser, Callable]:
    """A benchmark's parser, its docstring the help, and its `add_argument` for the script's own options: where it
    writes its report (--results_dir and --output_name, read by `report`) and, with `corpus`, what every benchmark of
    the corpus takes: device, threads, corpus, vocabulary, caches, seed."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    if corpus:
        add("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1 …")
        add("--threads", type=int, default=None, help="torch (and CTranslate2) CPU threads; default: all cores")
        add("--corpus", default=None, help=f"english<TAB>french file; default ${CORPUS_ENV_VAR}, else "
            f"{SHARED_CORPUS}, else a download")
        add("--vocab_size", type=int, default=DEFAULT_VOCAB_SIZE, help="joint BPE vocabulary size")
        add("--cache_dir", type=Path, default=CACHE_DIR, help="the corpus' splits and tokenizer (under data/), "
            "converted models")
        add("--seed", type=int, default=0)
    add("--results_dir", type=Path, default=RESULTS_DIR)
    add("--output_name", default=None, help="result file stem, in which {device} stands for the device tag (cpu, "
        "cuda-h100, …); default <benchmark>-{device}")
    return parser, add


def csv_of(cast: Callable[[str], object], choices: Sequence | None = None) -> Callable[[str], list]:
    """An argparse type for comma-separated lists (`--sizes tiny,base`), refusing any item not in `choices`."""

    def parse(text: str) -> list:
        items = [cast(item) for item in text.split(",") if item]
        if choices is not None and (unknown := [str(item) for item in items if item not in choices]):
            allowed = ", ".join(map(str, choices))
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {allowed}")
        return items

    return parse
