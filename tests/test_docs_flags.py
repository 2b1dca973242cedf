"""Every `--flag` that README.md and docs/*.md name, in code blocks and in inline code, is one that the command it
follows accepts: a flag removed from a script's parser and still named in a doc fails here, naming the doc's line.

A flag is the nearest command's before it within a code block's line (its `\\` continuations joined; a `#` comment
read apart) or within an inline code span: after `scripts/X.py` (also written `X.py`) or `benchmarks/X.py`, that
script's, as its parser has it (`scripts/main_job.sh` passes its arguments on to train_translation.py); after another
tool (torchrun, accelerate, pip, pytest, git), that tool's, not checked; with no command before it, any script's.
The scripts' help (docstrings with their example commands, and each option's help) is held to the same. A removed
flag may be named only where its paragraph links the record of why it went (`REMOVED`).
"""

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Shell scripts that pass their arguments on to a Python script.
PASSED_ON = {"main_job": "train_translation"}
# The shell scripts' own flags (run_tests.sh passes the rest on to pytest, whose flags are not checked).
SHELL_FLAGS = {"run_tests": {"--quick"}}
# Flags removed on purpose, with the record that says why: a doc may name one only in a paragraph that links it.
REMOVED = {"--int8": "int8-cpu-decision.md"}

FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
COMMAND = re.compile(r"\b(\w+)\.(?:py|sh)\b")
TOOL = re.compile(r"\b(?:torchrun|accelerate|pip3?|pytest|git)\b|\bcheck_upstream\.sh\b")


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"docs_flags_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parser_of(path: Path, monkeypatch) -> argparse.ArgumentParser | None:
    """The parser that `path`'s `main` parses its arguments with (None: it has no such main).
    `main` is stopped where it parses, before it does anything else."""
    if "parse_args" not in path.read_text(encoding="utf-8"):
        return None  # no argparse parser (a `main` of this kind is not stopped before it works: not called)
    module = _load(path)
    if not hasattr(module, "main"):
        return None

    def parsed(self, *args, **kwargs):
        raise _Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", parsed)
        try:
            module.main([])
        except _Parsed as stop:
            return stop.parser
    return None


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    # argparse keeps every option string (aliases and `--no-` forms included) in this table.
    return set(parser._option_string_actions)


@pytest.fixture(scope="module")
def parsers():
    # The scripts and the benchmarks import their neighbours, as `python scripts/x.py` lets them.
    for folder in ("scripts", "benchmarks"):
        if str(REPO / folder) not in sys.path:
            sys.path.append(str(REPO / folder))
    found = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for path in sorted((REPO / "scripts").glob("*.py")) + sorted((REPO / "benchmarks").glob("*.py")):
            parser = _parser_of(path, monkeypatch)
            if parser is not None:
                found[path.stem] = parser
    return found


@pytest.fixture(scope="module")
def flags(parsers):
    return {**{name: _option_strings(parser) for name, parser in parsers.items()}, **SHELL_FLAGS}


def _commands(text: str):
    """(line number, shell command or inline code, its comment, its paragraph) of every code block's command and
    every inline code span; inline code comes with its paragraph."""
    lines = text.splitlines()
    paragraphs, start = {}, 0
    for number, line in enumerate(lines + [""], 1):
        if not line.strip():
            for inside in range(start + 1, number):
                paragraphs[inside] = "\n".join(lines[start:number - 1])
            start = number
    in_block = False
    pending, pending_line = "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            if not pending:
                pending_line = number
            pending += line
            if line.rstrip().endswith("\\"):
                pending = pending.rstrip()[:-1] + " "
                continue
            yield (pending_line, *_command_and_comment(pending), "")
            pending = ""
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield number, span, "", paragraphs.get(number, line)


def _command_and_comment(line: str) -> tuple[str, str]:
    code, _, comment = line.partition("#")
    return code, comment


def _help_texts(parser: argparse.ArgumentParser):
    """A script's help as (line number, text, comment, is a command): each line of its description (the script's
    docstring: prose, and examples that are commands) and each option's help (prose; line 0)."""
    for number, line in enumerate((parser.description or "").splitlines(), 1):
        if re.match(r"\s*(python3?|bash|accelerate|torchrun)\s", line):
            yield (number, *_command_and_comment(line), True)
        else:
            yield number, line, "", False
    for action in parser._actions:
        if action.help:
            yield 0, action.help, "", False


def _owners(text: str, scripts) -> list[tuple[int, str | None]]:
    """(position, script, or None for another tool) of each command that `text` names."""
    named = [(m.start(), PASSED_ON.get(m.group(1), m.group(1))) for m in COMMAND.finditer(text)]
    return sorted([(at, script) for at, script in named if script in scripts]
                  + [(m.start(), None) for m in TOOL.finditer(text)])


def _flags_in(texts, scripts):
    """(line number, the script whose flag it is or None for any, flag) for every flag of `texts`, (line number,
    text, comment, is a command) each. A flag is the nearest command's before it in its text (skipped where that
    is another tool); prose that names a script is not that script's command, so its flags may be any script's.
    A comment's flag with no command before it in the comment is any script's, or skipped on a line that starts only
    other tools."""
    for number, text, comment, is_command in texts:
        owners = _owners(text, scripts)
        tools_line = bool(owners) and all(script is None for _, script in owners)
        for part in (text, comment):
            part_owners = _owners(part, scripts) if part is comment else owners
            for flag in FLAG.finditer(part):
                before = [script for at, script in part_owners if at < flag.start()]
                if (before and before[-1] is None) or (not before and part is comment and tools_line):
                    continue
                yield number, before[-1] if before and is_command else None, flag.group()


def _named_flags(doc: Path, scripts):
    """(line number, the script whose flag it is or None for any, flag, paragraph) for every flag the doc names."""
    for number, command, comment, paragraph in _commands(doc.read_text(encoding="utf-8")):
        for _, script, flag in _flags_in([(number, command, comment, True)], scripts):
            yield number, script, flag, paragraph


def test_every_flag_the_docs_name_is_accepted_by_the_command_it_follows(flags):
    assert {"translate", "train_translation", "evaluate_bleu", "bench_translation"} <= flags.keys()
    # The training script takes every Seq2SeqTrainingArguments flag, as transformers' HfArgumentParser makes them.
    assert {"--learning_rate", "--report_to", "--torch_compile"} <= flags["train_translation"]
    anywhere = set().union(*flags.values())
    wrong = []
    for doc in DOCS:
        for number, script, flag, paragraph in _named_flags(doc, flags):
            accepted = flags[script] if script else anywhere
            if flag not in accepted and not (flag in REMOVED and REMOVED[flag] in paragraph):
                wrong.append(f"{doc.relative_to(REPO)}:{number}: {flag}"
                             + (f" ({script} has no such flag)" if script else " (no script has it)"))
    assert not wrong, "\n".join(wrong)


def test_every_flag_a_scripts_help_names_is_accepted_by_the_command_it_follows(parsers, flags):
    """The same for each script's help: its docstring (with its examples) and its options' help."""
    anywhere = set().union(*flags.values())
    wrong = []
    for name, parser in parsers.items():
        for number, script, flag in _flags_in(_help_texts(parser), flags):
            if flag not in (flags[script] if script else anywhere):
                wrong.append(f"{name}'s help" + (f", line {number}" if number else "") + f": {flag}")
    assert not wrong, "\n".join(wrong)


def test_the_doc_reader_finds_a_flag_where_the_docs_put_one(tmp_path):
    """The reader itself: flags in code blocks (continued lines, comments, launchers, other tools) and in inline code,
    the latter with their paragraph; in prose, a flag after a script's name may be any script's."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Run `translate.py --slots -2` or `--resume`.\n"
        "\n"
        "```bash\n"
        "accelerate launch --num_processes 2 scripts/translate.py --model m \\\n"
        "  --input_file a   # or --push_to_hub (or torchrun --nproc_per_node 2)\n"
        "pip install --pre x && python scripts/evaluate_bleu.py --source_file s\n"
        "bash scripts/check_upstream.sh transformers   # or: --pre transformers\n"
        "bash scripts/main_job.sh --max_steps 5\n"
        "python -m pytest tests/test_cli.py --durations 5\n"
        "```\n", encoding="utf-8")
    scripts = {"translate", "evaluate_bleu", "train_translation"}
    paragraph = "Run `translate.py --slots -2` or `--resume`."
    assert list(_named_flags(doc, scripts)) == [
        (1, "translate", "--slots", paragraph), (1, None, "--resume", paragraph),
        (4, "translate", "--model", ""), (4, "translate", "--input_file", ""), (4, None, "--push_to_hub", ""),
        (6, "evaluate_bleu", "--source_file", ""), (8, "train_translation", "--max_steps", ""),
    ]
    prose = [(1, "Decodes as scripts/export_ctranslate2.py does, else --no-ctranslate2", "", False)]
    assert list(_flags_in(prose, {"export_ctranslate2"})) == [(1, None, "--no-ctranslate2")]


def test_a_doc_naming_a_removed_flag_fails(flags, tmp_path, monkeypatch):
    """The check itself, on a doc that tells users to pass --int8 (removed), and on one that says it was removed,
    linking the record that says why."""
    telling = tmp_path / "telling.md"
    telling.write_text("```bash\npython scripts/translate.py --model m --int8 \"Hi\"\n```\n", encoding="utf-8")
    removed = tmp_path / "removed.md"
    removed.write_text("`--int8` is gone\n([why](benchmarks/results/int8-cpu-decision.md)).\n", encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "DOCS", [telling])
    with pytest.raises(AssertionError, match=r"telling.md:2: --int8 \(translate has no such flag\)"):
        test_every_flag_the_docs_name_is_accepted_by_the_command_it_follows(flags)
    monkeypatch.setattr(sys.modules[__name__], "DOCS", [removed])
    test_every_flag_the_docs_name_is_accepted_by_the_command_it_follows(flags)
