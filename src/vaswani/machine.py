"""This machine, as a timing made on it must name it, and where what was measured on it is kept.

A timing holds for one CPU, its kernels and the versions that chose them (`machine`): under a hypervisor the CPU's
name can be only its vendor's line, so its family and model numbers are part of it (`cpu_name`). What is measured
once per machine and kept (`cache_dir`): whether bf16 products pay (`vaswani.loading.cpu_multiplies_bf16`) and the
checkpoints' cached CTranslate2 exports (`vaswani.export.cached_export`). Records made per machine are read from
files of `{"records": [...]}` (`read_records`): that bf16 answer, the step times `--preset auto` sizes a model by
(`vaswani.sizing`), both measured once by `measured_once`, and a checkpoint's engine choice (`vaswani.engine_choice`).
"""

import importlib.metadata
import json
import os
import platform
from collections.abc import Callable

import torch

from .files import exclusive, write_atomically

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


def machine(threads: int | None) -> dict:
    """What a timing holds for: the CPU, its cores, the threads decoding uses (None: any count), the kernels chosen
    and the versions (ctranslate2's None where it is not installed)."""
    try:
        ctranslate2 = importlib.metadata.version("ctranslate2")
    except importlib.metadata.PackageNotFoundError:
        ctranslate2 = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_name(), "cores": cores, "threads": threads,
            "aten": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "ctranslate2": ctranslate2,
            "environment": {name: os.environ[name] for name in KERNEL_VARIABLES if name in os.environ}}


def cache_dir(*parts: str) -> str:
    """$XDG_CACHE_HOME/vaswani/<parts>, else ~/.cache/vaswani/<parts>: what is kept per machine."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vaswani", *parts)


def read_records(path: str) -> list[dict]:
    """The records of a per-machine file (`{"records": [...]}`), none where it is missing or not whole."""
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)["records"]
        return records if isinstance(records, list) else []
    except (OSError, ValueError, KeyError, TypeError):
        return []


def measured_once(name: str, key: dict, measure: Callable[[], dict],
                  key_field: str = "key") -> tuple[dict, bool, OSError | None]:
    """The record whose `key_field` is `key` in `cache_dir(name)`, else the fields `measure()` returns, recorded under
    `key` for every later process (one process measures while the others wait for its record); whether they were
    measured now; and the error that kept them from being read or recorded, if one did: they then hold for this
    process alone."""
    path = cache_dir(name)
    fields = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with exclusive(path, wait=True):
            records = read_records(path)
            for record in records:
                if record.get(key_field) == key:
                    return record, False, None
            fields = measure()
            records.append({key_field: key, **fields})
            write_atomically(path, json.dumps({"records": records}, indent=1))
    except OSError as error:  # a failed write keeps what was measured
        return (fields if fields is not None else measure()), True, error
    return fields, True, None
