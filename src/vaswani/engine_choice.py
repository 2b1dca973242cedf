"""Which engine translates a checkpoint for the scripts, decided in one place and the same for every run of a command
on one machine; and the engine, built once its settings are resolved (`load_default_engine`).

On a CPU three engines give a checkpoint's translations: PyTorch with its linear layers laid out for oneDNN
("pytorch", `vaswani.inference.pack_for_cpu`), PyTorch with torch's own ("pytorch-unpacked"), and the checkpoint's
CTranslate2 float32 export ("ctranslate2", where CTranslate2 follows its decoding settings: `ctranslate2_decodes`).
Which is fastest depends on the CPU, the model and the sentences, and nothing cheaper than decoding real sentences
predicted it (benchmarks/results/README.md, "CPU linear layers" and "A checkpoint's CTranslate2 float32 export by
default on a CPU?"). Their outputs can differ in the last bit of a sum, so an engine timed at run time would change
what a command writes behind the user's back: after another run timed it, or for a copied checkpoint. Hence:

* the choice is made once, by an explicit step (`choose_engine`; scripts/choose_engine.py, which scripts/main_job.sh
  runs after training): each engine, in a process of its own, translates a sample of the user's sentences in the
  batches `translate` cuts for scripts/translate.py, and the fastest is written, with its figures and this machine's
  key (`vaswani.machine.machine`, thread count included), into `engine_choice.json` beside the weights, which a copy
  carries;
* every later run on a machine with that key and the same decoding settings reads it (`recorded_choice`);
* elsewhere (no record, another CPU or thread count, a Hub checkpoint, a GPU) a fixed rule decides: the PyTorch engine
  as `load_engine` builds it (laid out for oneDNN where torch can), CTranslate2 for a CTranslate2 directory;
* flags decide over both: `--ctranslate2`, `--no-ctranslate2` (which never exports or times; with a record, the
  faster PyTorch layout), or an option only the PyTorch engine takes.

The choice, why and its figures are one line on stderr (`EngineChoice.line`, printed by `vaswani.cli`) and the
engine's `settings["engine_choice"]`, which the resume record and evaluate_bleu.py's report keep; a resumed run
decodes with its record's choice.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import torch
from transformers import AutoConfig

from .decoding_settings import DecodingSettings
from .export import cached_export, check_exportable
from .files import exclusive, write_atomically
from .generation_vaswani import runs_as
from .inference import PackedLinear
from .loading import EngineRequest, build_engine, checked_checkpoint, engine_request, load_engine
from .machine import machine, read_records
from .translation import CTranslate2Engine, translate

# The record beside a checkpoint's weights.
CHOICE_FILE = "engine_choice.json"
# The sentences timed: this many of the user's, spread evenly over their lengths (`choice_sample`); each engine's
# time is the faster of `CHOICE_REPEATS` passes after a warm one (kernels are chosen and memory mapped on the first).
CHOICE_SENTENCES = 384
CHOICE_REPEATS = 2


@dataclasses.dataclass(frozen=True)
class EngineChoice:
    """Which engine decodes ("pytorch", "pytorch-unpacked" or "ctranslate2"), why, and where it was timed, the
    seconds each engine took on `sample`."""

    engine: str
    reason: str
    seconds: dict[str, float] | None = None
    sample: str | None = None

    def record(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def line(self) -> str:
        """The choice in words, for the one line a run logs."""
        timed = ""
        if self.seconds:
            timed = f" ({', '.join(f'{name} {value:.3f} s' for name, value in self.seconds.items())}; {self.sample})"
        return f"{self.engine} by {self.reason}{timed}"


def load_default_engine(model_dir: str, *, device: str | torch.device | None = None, local_rank: int | None = None,
                        ctranslate2: bool | None = None, cache_dir: str | None = None, choice: dict | None = None,
                        **options):
    """`vaswani.loading.load_engine` as the scripts build it, with the engine `decide` names (or `choice`, a resumed
    run's, as its record keeps it), recorded in its `choice`. The settings are resolved once
    (`vaswani.loading.engine_request`: the device, `choose_device`'s of `device` and `local_rank`), read by `decide`
    and built from (`vaswani.loading.build_engine`). A checkpoint decoded with CTranslate2 goes through its float32
    export, made once and cached (`vaswani.export.cached_export` in `cache_dir`, made again when the weights
    change). `options`: `load_engine`'s."""
    request = engine_request(model_dir, device=device, local_rank=local_rank, **options)
    choice = EngineChoice(**choice) if choice else decide(request, ctranslate2)
    if choice.engine == "ctranslate2" and not request.exported:
        export_dir, _ = cached_export(model_dir, cache_dir)
        engine = build_engine(request, ctranslate2=True, export_dir=export_dir)
    else:
        engine = build_engine(request, ctranslate2=choice.engine == "ctranslate2",
                              pack=choice.engine != "pytorch-unpacked")
    engine.choice = choice.record()
    return engine


def decide(request: EngineRequest, ctranslate2: bool | None = None) -> EngineChoice:
    """The engine for the checkpoint or CTranslate2 directory that `request` asks of (`vaswani.loading.engine_request`)
    on its device: the flags' (`ctranslate2`, and the PyTorch engine's options the request gives), else this
    machine's record (`recorded_choice`), else the fixed rule (the module docstring's). Nothing is timed or exported
    here."""
    model_dir = request.model_dir
    if ctranslate2:
        return EngineChoice("ctranslate2", "--ctranslate2")
    if request.exported and ctranslate2 is None:
        return EngineChoice("ctranslate2", f"the fixed rule: {model_dir} is a CTranslate2 export")
    if given := [flag for flag, value in request.pytorch_only.items() if value]:
        return EngineChoice("pytorch", f"{', '.join(given)}, the PyTorch engine's")
    if runs_as(request.device) != "cpu":  # (a CPU rehearsing CUDA decides as a GPU does)
        return EngineChoice("pytorch", f"the fixed rule: on {request.device}, the PyTorch engine")
    recorded = None if request.exported else recorded_choice(model_dir, request.decoding)
    if ctranslate2 is False:
        if recorded is None or not recorded.seconds:
            return EngineChoice("pytorch", "--no-ctranslate2")
        layouts = {name: value for name, value in recorded.seconds.items() if name != "ctranslate2"}
        return dataclasses.replace(recorded, engine=min(layouts, key=layouts.get),
                                   reason=f"--no-ctranslate2 and the faster layout in {recorded.reason}")
    if recorded is not None:
        return recorded
    return EngineChoice("pytorch", f"the fixed rule: no choice for this machine and these settings in "
                        f"{os.path.join(model_dir, CHOICE_FILE)} (scripts/choose_engine.py makes one)")


def recorded_choice(model_dir: str, settings: DecodingSettings) -> EngineChoice | None:
    """The choice that `choose_engine` recorded beside the checkpoint in `model_dir` for this machine, at this
    process's thread count, and the decoding `settings` (the checkpoint's, resolved); None where there is none (a Hub
    id, no record, another machine)."""
    path = os.path.join(model_dir, CHOICE_FILE)
    if not os.path.isfile(path):
        return None
    key = choice_key(settings)
    for record in read_records(path):
        if {name: record.get(name) for name in key} == key:
            return EngineChoice(record["engine"], f"the record for this machine in {path}", record["seconds"],
                                record["sample"])
    return None


def choice_key(settings: DecodingSettings) -> dict:
    """What a recorded choice holds for: this machine at this thread count, and the decoding `settings` (resolved,
    so that `--num_beams 4` and a checkpoint's own 4 are one)."""
    key = {"machine": machine(torch.get_num_threads()), "decoding": settings.record()}
    return json.loads(json.dumps(key))  # as a record reads back: lists, not tuples


def ctranslate2_decodes(model_dir: str, settings: DecodingSettings) -> bool:
    """Whether a CTranslate2 export of the checkpoint in `model_dir` gives its own translations with `settings`:
    ctranslate2 is installed, the exporter takes the model, and CTranslate2 follows the settings exactly
    (`CTranslate2Engine.follows`; beam search under transformers' default `early_stopping=False` is not one of them,
    and stays with PyTorch)."""
    if importlib.util.find_spec("ctranslate2") is None:
        return False
    try:
        check_exportable(AutoConfig.from_pretrained(model_dir, trust_remote_code=False))
    except ValueError:
        return False
    return CTranslate2Engine.follows(settings)


def choice_sample(sentences: Sequence[str], count: int = CHOICE_SENTENCES) -> list[str]:
    """`count` of the non-blank `sentences` (all, where there are no more), spread evenly over their lengths, so that
    `translate` cuts them into batches like those of the run they stand for."""
    ordered = sorted((sentence for sentence in sentences if sentence.strip()), key=len)
    if len(ordered) <= count:
        return ordered
    return [ordered[(2 * i + 1) * len(ordered) // (2 * count)] for i in range(count)]


def choose_engine(model_dir: str, sentences: Sequence[str], *, max_tokens: int, max_sentences: int | None = None,
                  cache_dir: str | None = None, **decoding_overrides) -> EngineChoice:
    """Time the engines that give the translations of the checkpoint in `model_dir` (a local directory) with
    `decoding_overrides` on this CPU at this process's thread count, on `choice_sample(sentences)` in batches of at
    most `max_tokens` padded tokens and `max_sentences` sentences (`translate`'s), each engine in a process of its own
    (`time_engine`); record the fastest, with every engine's seconds, in its `CHOICE_FILE` under this machine's key
    (replacing an earlier choice for the same key), and return it. Only PyTorch is timed where CTranslate2 cannot
    follow the settings, and only its own layout where torch lays out no linear layer for oneDNN."""
    if not os.path.isdir(model_dir):
        raise NotADirectoryError(f"{model_dir} is not a local checkpoint directory; the engine choice is written "
                                 "beside the weights.")
    _, settings = checked_checkpoint(model_dir, **decoding_overrides)
    key = choice_key(settings)
    sample = choice_sample(sentences)
    if not sample:
        raise ValueError("no sentences to time the engines on: give a file of the sentences you will translate.")
    exports = ctranslate2_decodes(model_dir, settings)
    threads = torch.get_num_threads()
    decoding = {name: value for name, value in decoding_overrides.items() if value is not None}
    batches = {"max_tokens": max_tokens, "max_sentences": max_sentences}
    print(f"Timing the engines for {model_dir} on {len(sample)} sentences at {threads} thread(s) …", file=sys.stderr,
          flush=True)
    seconds = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", encoding="utf-8") as sentences_file:
        json.dump(sample, sentences_file)
        sentences_file.flush()
        seconds |= time_engine(model_dir, "pytorch", threads, decoding, sentences_file.name, batches)
        if exports:
            export_dir, _ = cached_export(model_dir, cache_dir)
            seconds |= time_engine(model_dir, "ctranslate2", threads, decoding, sentences_file.name, batches,
                                   export_dir)
    path = os.path.join(model_dir, CHOICE_FILE)
    described = (f"{len(sample)} sentences, batches of {max_tokens:,} tokens"
                 + (f" and {max_sentences} sentences" if max_sentences else "") + f", {threads} thread(s)")
    fastest = min(seconds, key=seconds.get)
    seconds = {name: round(value, 4) for name, value in seconds.items()}
    with exclusive(path, wait=True):
        records = [record for record in read_records(path)
                   if {name: record.get(name) for name in key} != key]
        records.append(key | {"engine": fastest, "seconds": seconds, "sample": described})
        write_atomically(path, json.dumps({"records": records}, indent=1))
    return EngineChoice(fastest, f"timing, recorded in {path}", seconds, described)


def time_engine(model_dir: str, engine: str, threads: int, decoding: dict, sentences_file: str, batches: dict,
                export_dir: str | None = None) -> dict[str, float]:
    """Seconds to translate the sentences in `sentences_file` (a JSON list) in `batches` (`translate`'s
    `max_tokens` and `max_sentences`) on a CPU at `threads` threads with the decoding settings `decoding`
    (`load_engine`'s keyword arguments), timed in a new process: CTranslate2 decodes more slowly for the rest of a
    process in which torch has run on several threads (`vaswani.export.one_torch_thread`). For `engine` "pytorch",
    the checkpoint in `model_dir` as `load_engine` loads it ("pytorch") and, where that lays its linear layers out for
    oneDNN, with torch's own ("pytorch-unpacked"); for "ctranslate2", its export in `export_dir`."""
    command = [sys.executable, "-m", "vaswani.engine_choice", model_dir, "--engine", engine, "--threads",
               str(threads), "--decoding", json.dumps(decoding), "--sentences", sentences_file,
               "--batches", json.dumps(batches)]
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


def seconds_to_translate(engines: dict, sources: Sequence[str], batches: dict,
                         repeats: int = CHOICE_REPEATS) -> dict[str, float]:
    """For each of `engines` (name → engine), the fastest of `repeats` timed translations of `sources` in `batches`
    after one untimed; the engines take turns, so that other load on the machine hits them alike."""
    for engine in engines.values():
        translate(engine, sources, warn=False, **batches)
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            translate(engine, sources, warn=False, **batches)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Time one engine translating the given sentences on a CPU; "
                                     "prints {\"seconds\": …} as JSON (`choose_engine` runs it).")
    parser.add_argument("model_dir")
    parser.add_argument("--engine", choices=("pytorch", "ctranslate2"), required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--decoding", default="{}", help="load_engine's keyword arguments, as JSON")
    parser.add_argument("--sentences", required=True, help="the sentences to translate: a JSON list")
    parser.add_argument("--batches", default="{}", help="translate()'s max_tokens and max_sentences, as JSON")
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
        print(json.dumps({"seconds": seconds_to_translate(engines, json.load(f), json.loads(args.batches))}))


if __name__ == "__main__":
    main()
