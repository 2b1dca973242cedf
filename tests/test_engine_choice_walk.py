"""The path from translate.py's arguments to a running engine enters each module of the package at most twice: the
settings are resolved once, each by one module, and no two modules hand one decision back and forth (engine_choice →
loading → engine_choice → loading …).

Measured in this process with a profiler hook, from the start of the script's `main` (which parses the arguments)
to the engine's first `translate_batch`. A visit is a call of a module's function or class from code of another
module of the package or the script; calls one after the other from one function into one module, with no other
module entered between them, are one visit. Not visits: a method or property of an object in hand (the engine's
`settings`, an `EngineChoice`'s `line`), which is the object's wherever its class is written, and calls that other
libraries make (argparse calling a flag's type, transformers calling the model's configuration as it loads).
Held to the rule: every module of the package but the shipped model files (`*_vaswani.py`, the model itself, which
transformers loads and runs) and `HELPERS`, which every layer asks to check or read a file, reach the other processes
or cut batches; their entries are in the failure message."""

import contextlib
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
from conftest import greedy_checkpoint, interrupted_after, script_main
from tiny_translation_model import SOURCES

import vaswani.engine_choice as engine_choice
from vaswani.engine_choice import choose_engine

SCRIPT = "script_translate"  # the module name `script_main` gives scripts/translate.py
SHIPPED = {"vaswani.configuration_vaswani", "vaswani.modeling_vaswani", "vaswani.tokenization_vaswani",
           "vaswani.generation_vaswani", "vaswani.pipeline_vaswani"}
HELPERS = {"vaswani.files", "vaswani.checkpoints", "vaswani.peers", "vaswani.preemption", "vaswani.batching",
           "vaswani.slots"}


def module_of(frame) -> str | None:
    """The package module (or the script) whose code `frame` runs; None for any other code."""
    name = frame.f_globals.get("__name__", "")
    return name if name == SCRIPT or name.startswith("vaswani.") else None


def is_method(code) -> bool:
    """Whether `code` is a method or property called on an object (a constructor is the class's own call)."""
    return code.co_argcount > 0 and code.co_varnames[0] == "self" and code.co_name != "__init__"


@contextlib.contextmanager
def walk():
    """Record the visits made inside the block, from the script's `main` to the first `translate_batch` an engine is
    asked for; yields `.visits` (module entered, function, module it came from), filled as the block runs, and
    `.reached` (whether that batch came)."""
    walked = SimpleNamespace(visits=[], reached=False)
    started = []
    last = []  # the last crossing: the calling frame (kept, so that its id is not reused) and the module it entered

    def profile(frame, event, arg):
        if event != "call" or walked.reached:
            return
        module = module_of(frame)
        if module is None:
            return
        code = frame.f_code
        if not started:
            started.extend([True] if module == SCRIPT and code.co_name == "main" else [])
            return
        if code.co_name == "translate_batch":
            walked.reached = True
            return
        caller = module_of(frame.f_back) if frame.f_back is not None else None
        if caller is None or caller == module or is_method(code):
            return
        # Calls one after the other from one function into one module are one visit.
        if last != [frame.f_back, module]:
            walked.visits.append((module, code.co_qualname, caller))
        last[:] = [frame.f_back, module]

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield walked
    finally:
        sys.setprofile(previous)
        last.clear()


def held_to_the_rule(visits) -> Counter:
    """The visits of each module held to the rule (the module docstring's)."""
    return Counter(module for module, _, _ in visits if module not in SHIPPED | HELPERS)


def translate(argv: list[str]) -> list[tuple[str, str, str]]:
    """The visits of translate.py's walk with `argv` (it must reach a translated batch)."""
    with walk() as walked:
        script_main("translate")(argv)
    assert walked.reached, walked.visits
    return walked.visits


@pytest.mark.parametrize("case", ["fixed rule", "recorded choice", "resumed", "ctranslate2"])
def test_the_walk_from_the_arguments_to_a_running_engine_enters_each_module_at_most_twice(
        case, checkpoint, tmp_path, monkeypatch, capsys):
    path = greedy_checkpoint(checkpoint, tmp_path / "model")
    lines = tmp_path / "in.en"
    lines.write_text("".join(f"{sentence}\n" for sentence in SOURCES * 2), encoding="utf-8")
    argv = ["--model", str(path), "--device", "cpu"]
    if case == "fixed rule":
        argv += SOURCES[:2]
    elif case == "recorded choice":  # a record for this machine: the choice reads it, with the resolved settings
        monkeypatch.setattr(engine_choice, "time_engine", lambda *args, **kwargs: {"pytorch": 1.0})
        choose_engine(str(path), SOURCES, max_tokens=4096)
        argv += ["--input_file", str(lines), "--output_file", str(tmp_path / "out.fr")]
    elif case == "resumed":  # a killed run resumed: its record is read before the model loads, its choice decodes
        argv += ["--input_file", str(lines), "--output_file", str(tmp_path / "out.fr"), "--chunk_lines", "4",
                 "--resume"]
        with monkeypatch.context() as patch:
            interrupted_after(1, patch)
            with pytest.raises((KeyboardInterrupt, SystemExit)):
                script_main("translate")(argv)
    else:  # the checkpoint's export, made by an earlier run (making it loads the checkpoint through vaswani.export)
        pytest.importorskip("ctranslate2")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        argv += ["--ctranslate2", *SOURCES[:2]]
        script_main("translate")(argv)
    visits = translate(argv)
    assert "engine: " in capsys.readouterr().err
    counts = held_to_the_rule(visits)
    assert counts, visits
    entered = Counter(module for module, _, _ in visits)
    over = sorted(module for module, count in counts.items() if count > 2)
    assert not over, (f"entered more than twice: {over}, by {[visit for visit in visits if visit[0] in over]}; "
                      f"every module's entries: {sorted(entered.items())}")
