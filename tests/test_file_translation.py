"""Streaming file translation (`vaswani.file_translation`, `scripts/translate.py`): chunks and token-budget batches,
the same lines as `vaswani.evaluation.translate`, bad input, resuming after SIGKILL, two processes, the dtype choice."""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from conftest import (SCRIPTS, fails_with_one_line, forked_script, interrupted_after, other_names, script_main,
                      slowed_chunks)
from tiny_translation_model import SOURCES, build_model_and_tokenizer

from vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani.batching import token_budget_batches
from vaswani.evaluation import translate
from vaswani.file_translation import Processes, check_output, count_lines, read_raw_chunks, translate_file
from vaswani.files import decode_lines, lock_path
from vaswani.loading import CPU_BF16_MIN_D_MODEL, choose_dtype, engine_for_model

GREEDY = {"num_beams": 1, "max_new_tokens": 8}
GREEDY_FLAGS = ["--num_beams", "1", "--max_new_tokens", "8"]
# Enough lines for several chunks at --chunk_lines 7, with empty and blank lines among them.
LINES = [*SOURCES, "", *SOURCES[::-1], "   ", *SOURCES[1:4]] * 3


@pytest.fixture(scope="module")
def expected(trained):
    """What the whole-file `translate` gives, one line per input line."""
    model, tokenizer = trained
    nonempty = sorted({line for line in LINES if line.strip()})
    translations = dict(zip(nonempty, translate(model, tokenizer, nonempty, batch_size=4, **GREEDY)))
    return "".join(f"{translations.get(line, '')}\n" for line in LINES)


def write_input(tmp_path, lines=LINES) -> str:
    path = tmp_path / "in.en"
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return str(path)


def test_token_budget_batches_are_longest_first_within_the_budget():
    lengths = [3, 9, 4, 9, 1, 5, 2, 7]
    batches = token_budget_batches(lengths, max_tokens=16)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert [lengths[batch[0]] for batch in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)
    assert all(len(batch) * lengths[batch[0]] <= 16 or len(batch) == 1 for batch in batches)
    assert token_budget_batches([20, 1], max_tokens=8) == [[0], [1]]  # too long for the budget: alone
    assert [len(b) for b in token_budget_batches([1] * 10, max_tokens=100, max_sentences=4)] == [4, 4, 2]


def test_chunks_split_lines_at_newlines_only_and_drop_crs():
    raw = "a\r\nb\u2028c\n\nd".encode()
    chunks = list(read_raw_chunks(io.BytesIO(raw), chunk_lines=2))
    assert [decode_lines(chunk, "x", 1) for chunk in chunks] == [["a", "b\u2028c"], ["", "d"]]
    assert list(read_raw_chunks(io.BytesIO(b""), 3)) == []


def test_count_lines_counts_a_last_line_without_a_newline(tmp_path):
    for text, lines in ((b"", 0), (b"a\n", 1), (b"a\nb", 2), (b"\n\n", 2)):
        (tmp_path / "f").write_bytes(text)
        assert count_lines(str(tmp_path / "f")) == lines


@pytest.mark.parametrize("chunk_lines", [1, 7, 1000])
def test_a_file_translates_to_the_lines_whole_file_translate_gives(trained, expected, tmp_path, chunk_lines):
    model, tokenizer = trained
    engine = engine_for_model(model, tokenizer, **GREEDY)
    output = tmp_path / "out.fr"
    result = translate_file(engine, write_input(tmp_path), str(output), chunk_lines=chunk_lines, max_tokens=24,
                            progress=False)
    assert output.read_text(encoding="utf-8") == expected
    assert result.lines == len(LINES) and result.chunks == -(-len(LINES) // chunk_lines)
    # The resume state stays, marked complete, and nothing else is left beside the output.
    assert json.loads((tmp_path / "out.fr.resume.json").read_text())["complete"] is True
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.en", "out.fr", "out.fr.resume.json"]


def test_stdin_to_stdout_and_an_empty_input(trained, expected):
    model, tokenizer = trained
    engine = engine_for_model(model, tokenizer, **GREEDY)
    stdout = io.BytesIO()
    translate_file(engine, None, None, chunk_lines=5, stdin=io.BytesIO("".join(f"{x}\n" for x in LINES).encode()),
                   stdout=stdout, progress=False)
    assert stdout.getvalue().decode() == expected
    stdout = io.BytesIO()
    translate_file(engine, None, None, stdin=io.BytesIO(b""), stdout=stdout, progress=False)
    assert stdout.getvalue() == b""


def test_an_undecodable_line_is_reported_with_its_number(checkpoint, tmp_path, capsys):
    path = tmp_path / "in.en"
    path.write_bytes(b"a dog ran\n" * 5 + b"caf\xe9\n" + b"cat\n")
    with pytest.raises(SystemExit) as exit_info:
        script_main("translate")(["--model", str(checkpoint), "--device", "cpu", "--input_file", str(path),
                                  "--chunk_lines", "4", "--num_beams", "1", "--max_new_tokens", "4"])
    assert exit_info.value.code == 2
    assert "line 6" in capsys.readouterr().err


def test_long_lines_are_truncated_and_counted(tmp_path, capsys):
    model, tokenizer = build_model_and_tokenizer(position_embedding_type="learned", max_position_embeddings=32)
    max_source_length, max_new_tokens = model.config.max_position_embeddings, 4
    engine = engine_for_model(model, tokenizer, num_beams=1, max_new_tokens=max_new_tokens,
                             max_source_length=max_source_length)
    stdout = io.BytesIO()
    long = " ".join(["the cat sat on the mat and the dog sat on a mat"] * 3)
    assert len(tokenizer(long)["input_ids"]) > max_source_length
    translate_file(engine, None, None, chunk_lines=2, stdin=io.BytesIO(f"{long}\ncat\n\n{long}\n".encode()),
                   stdout=stdout, progress=False)
    assert len(stdout.getvalue().decode().split("\n")) == 5
    warning = f"warning: 2 sentence(s) longer than the model's {max_source_length} learned positions were truncated"
    assert warning in capsys.readouterr().err


def test_the_script_streams_with_every_pytorch_option(checkpoint, expected, tmp_path, capsys):
    argv = ["--model", str(checkpoint), "--device", "cpu", "--input_file", write_input(tmp_path), "--chunk_lines",
            "7", "--num_beams", "1", "--max_new_tokens", "8"]
    script_main("translate")(argv)
    assert capsys.readouterr().out == expected
    for options in (["--decoding", "transformers"], ["--dtype", "bfloat16"]):
        script_main("translate")([*argv, *options, "--output_file", str(tmp_path / "out.fr")])
        lines = (tmp_path / "out.fr").read_text().split("\n")
        assert len(lines) == len(LINES) + 1 and [bool(x) for x in lines[:-1]] == [bool(x.strip()) for x in LINES]
    assert "lines/s" not in capsys.readouterr().err  # no progress bar when stderr is not a terminal


def test_progress_bar_when_asked(checkpoint, tmp_path, capsys):
    script_main("translate")(["--model", str(checkpoint), "--device", "cpu", "--input_file", write_input(tmp_path),
                              "--output_file", str(tmp_path / "out.fr"), "--chunk_lines", "7", "--num_beams", "1",
                              "--max_new_tokens", "4", "--progress"])
    err = capsys.readouterr().err
    assert f"{len(LINES)}/{len(LINES)}" in err and "lines/s" in err


def test_the_ctranslate2_export_streams_the_same_lines(trained, expected, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    from vaswani.export import export_to_ctranslate2

    model, tokenizer = trained
    export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    script_main("translate")(["--model", str(tmp_path / "ct2"), "--ctranslate2", "--device", "cpu", "--input_file",
                              write_input(tmp_path), "--chunk_lines", "7", "--num_beams", "1", "--max_new_tokens", "8"])
    assert capsys.readouterr().out == expected  # greedy: CTranslate2's outputs equal generate()'s


def test_resuming_needs_the_same_settings(checkpoint, tmp_path, capsys):
    output = tmp_path / "out.fr"
    output.write_text("x\n")
    (tmp_path / "out.fr.resume.json").write_text(json.dumps(
        {"chunks": 1, "lines": 1, "bytes": 2, "truncated": 0, "settings": {"num_beams": 4}}))
    argv = ["--model", str(checkpoint), "--device", "cpu", "--input_file", write_input(tmp_path), "--output_file",
            str(output), "--resume", "--num_beams", "1"]
    with pytest.raises(SystemExit):
        script_main("translate")(argv)
    assert "was started with other settings (" in capsys.readouterr().err and output.read_text() == "x\n"


def test_resume_refuses_an_output_it_did_not_write_and_leaves_it_untouched(checkpoint, tmp_path, capsys):
    output = tmp_path / "out.fr"
    output.write_text("someone else's\n")
    with pytest.raises(SystemExit) as exit_info:
        script_main("translate")(["--model", str(checkpoint), "--device", "cpu", "--input_file",
                                  write_input(tmp_path), "--output_file", str(output), "--resume"])
    assert exit_info.value.code == 2
    assert f"{output} has no resume state beside it" in capsys.readouterr().err
    assert output.read_text() == "someone else's\n" and sorted(p.name for p in tmp_path.iterdir()) == ["in.en",
                                                                                                        "out.fr"]


@pytest.mark.parametrize("output_exists", [True, False])
def test_resume_of_a_run_that_wrote_nothing_starts_from_the_beginning(trained, expected, tmp_path, output_exists):
    """An empty output without a resume state (what a kill right after creating it leaves, in versions that wrote
    the state after the output) or no output at all: nothing to lose, so `resume` translates the whole input."""
    model, tokenizer = trained
    output = tmp_path / "out.fr"
    if output_exists:
        output.write_bytes(b"")
    result = translate_file(engine_for_model(model, tokenizer, **GREEDY), write_input(tmp_path), str(output),
                            chunk_lines=7, max_tokens=24, resume=True, progress=False)
    assert output.read_text(encoding="utf-8") == expected and result.resumed_chunks == 0


def test_resume_of_a_complete_output_says_so_and_leaves_it(checkpoint, tmp_path, capsys, monkeypatch):
    output = tmp_path / "out.fr"
    argv = ["--model", str(checkpoint), "--device", "cpu", "--input_file", write_input(tmp_path), "--output_file",
            str(output), "--chunk_lines", "7", "--num_beams", "1", "--max_new_tokens", "4", "--resume"]
    script_main("translate")(argv)
    capsys.readouterr()
    before = {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in tmp_path.iterdir()}

    def must_not_run(*args, **kwargs):
        raise AssertionError("a complete output was translated again")

    monkeypatch.setattr("vaswani.file_translation.translate_chunk", must_not_run)
    script_main("translate")(argv)  # returns: status 0
    assert f"{output} is already complete ({len(LINES)} lines); nothing to do." in capsys.readouterr().err
    assert {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in tmp_path.iterdir()} == before
    with output.open("ab") as f:  # changed after it was completed: not ours to resume any more
        f.write(b"more\n")
    with pytest.raises(SystemExit):
        script_main("translate")(argv)
    assert f"{output} holds" in capsys.readouterr().err


def test_an_output_that_is_the_input_by_any_name_is_refused_and_the_input_kept(checkpoint, tmp_path, capsys):
    source = Path(write_input(tmp_path))
    content = source.read_bytes()
    for kind, name in other_names(source, tmp_path).items():
        before = sorted(path.name for path in tmp_path.iterdir())
        for resume in ([], ["--resume"]):
            fails_with_one_line(script_main("translate"), ["--model", str(checkpoint), "--device", "cpu",
                                                           "--input_file", str(source), "--output_file", str(name),
                                                           *resume], capsys, f"{name} is the input {source}")
            assert source.read_bytes() == content, kind
            assert sorted(path.name for path in tmp_path.iterdir()) == before, kind  # no resume record either
    with pytest.raises(ValueError, match="is the input"):  # the library refuses it too, before any engine runs
        translate_file(None, str(source), str(source))


def test_an_output_that_cannot_be_written_leaves_nothing_and_names_the_users_path(checkpoint, tmp_path, capsys):
    source = write_input(tmp_path)
    (tmp_path / "dir").mkdir()
    for output, message in ((tmp_path / "dir", "is a directory"), (f"{tmp_path / 'dir'}/", "is a directory"),
                            (tmp_path / "nowhere" / "out.fr", f"Cannot write {tmp_path / 'nowhere' / 'out.fr'}")):
        error = fails_with_one_line(script_main("translate"), ["--model", str(checkpoint), "--device", "cpu",
                                                               "--input_file", source, "--output_file", str(output)],
                                    capsys, message)
        assert ".tmp-" not in error and ".resume.json" not in error
        assert sorted(path.name for path in tmp_path.iterdir()) == ["dir", "in.en"] and not any(
            (tmp_path / "dir").iterdir())


# Every output the shell gives: stdout as a file, a pipe, a full device or a pipe whose reader has gone; --output_file
# as a file, a link, a device or a FIFO. A file (by any name) gets a record and can be resumed; anything else gets the
# lines as they come, with nothing written beside it.


def read_in_background(path) -> tuple[threading.Thread, list[bytes]]:
    """A reader of a FIFO or a pipe's read end (a path, or a descriptor), until its writer closes it."""
    got = []
    reader = threading.Thread(target=lambda: got.append(open(path, "rb").read()))
    reader.start()
    return reader, got


def beside(path: Path) -> set[str]:
    return {entry.name for entry in path.parent.iterdir()} - {path.name}


def test_outputs_that_are_not_files_get_the_lines_with_nothing_beside_them(trained, expected, tmp_path):
    engine = engine_for_model(*trained, **GREEDY)
    source = write_input(tmp_path)
    for device in (Path(os.devnull), tmp_path / "null"):  # by its name and by a link
        if device != Path(os.devnull):
            device.symlink_to(os.devnull)
        translate_file(engine, source, str(device), chunk_lines=7, progress=False)
        assert not Path(f"{device}.resume.json").exists()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader, got = read_in_background(fifo)
    translate_file(engine, source, str(fifo), chunk_lines=7, progress=False)
    reader.join(timeout=60)
    assert got == [expected.encode()]
    read, write = os.pipe()  # stdout a pipe
    reader, got = read_in_background(read)
    with open(write, "wb") as stdout:
        translate_file(engine, source, None, chunk_lines=7, progress=False, stdout=stdout)
    reader.join(timeout=60)
    assert got == [expected.encode()]
    assert beside(fifo) == {"in.en", "null"} and not Path(f"{os.devnull}.resume.json").exists()
    assert not lock_path(os.devnull).exists()


def test_a_link_to_a_file_is_written_and_resumed_through_it(trained, expected, tmp_path):
    engine = engine_for_model(*trained, **GREEDY)
    link, target = tmp_path / "link.fr", tmp_path / "target.fr"
    link.symlink_to(target)
    translate_file(engine, write_input(tmp_path), str(link), chunk_lines=7, progress=False)
    assert target.read_text(encoding="utf-8") == expected and link.is_symlink()
    assert json.loads(Path(f"{link}.resume.json").read_text())["complete"] is True
    result = translate_file(engine, write_input(tmp_path), str(link), chunk_lines=7, progress=False, resume=True)
    assert result.resumed_chunks == result.chunks and target.read_text(encoding="utf-8") == expected


@pytest.mark.parametrize("output", ["stdout a full device", "stdout a closed pipe", "--output_file a full device"])
def test_an_output_that_takes_no_more_is_one_line_naming_it(checkpoint, tmp_path, capsys, monkeypatch, output):
    argv = ["--model", str(checkpoint), "--device", "cpu", "--input_file", write_input(tmp_path), *GREEDY_FLAGS]
    name, message = "stdout", "No space left on the device to write stdout; it got the first 0 lines"
    if output == "--output_file a full device":
        name = tmp_path / "full"
        name.symlink_to("/dev/full")
        argv += ["--output_file", str(name)]
        message = f"No space left on the device to write {name}; it got the first 0 lines"
    else:
        if output == "stdout a full device":
            stream = open("/dev/full", "wb")
        else:
            read, write = os.pipe()
            os.close(read)
            stream = open(write, "wb")
            message = "stdout was closed by its reader; it got the first 0 lines"
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(stream))
    error = fails_with_one_line(script_main("translate"), argv, capsys, message)
    assert error.endswith("an output that is not a file cannot be resumed, so translate into a file (--output_file) "
                          "to keep what is done when a run stops.")
    assert beside(tmp_path / "in.en") <= {"full"}  # no record, no lock


@pytest.mark.parametrize("output", ["stdout", "/dev/null", "a FIFO"])
def test_resume_into_an_output_that_cannot_be_resumed_is_refused_before_the_model_loads(tmp_path, capsys, output):
    name = {"stdout": None, "/dev/null": os.devnull, "a FIFO": str(tmp_path / "fifo")}[output]
    if output == "a FIFO":
        os.mkfifo(name)
    kind = {"stdout": "stdout", "/dev/null": f"{os.devnull}, a character device,", "a FIFO": f"{name}, a FIFO,"}
    argv = ["--model", str(tmp_path / "missing"), "--input_file", write_input(tmp_path), "--resume"]
    fails_with_one_line(script_main("translate"), [*argv, *(["--output_file", name] if name else [])], capsys,
                        f"--resume needs an --output_file that is a regular file: {kind[output]} cannot be cut back")
    assert beside(tmp_path / "in.en") <= {"fifo"} and not Path(f"{os.devnull}.resume.json").exists()


def test_several_processes_need_an_input_file_and_a_regular_output_file(tmp_path):
    two = Processes(0, 2, 0)
    os.mkfifo(tmp_path / "fifo")
    for input_file, output in ((None, tmp_path / "out.fr"), (write_input(tmp_path), None),
                               (write_input(tmp_path), tmp_path / "fifo")):
        with pytest.raises(ValueError, match="Several processes need --input_file and an --output_file that is a "):
            check_output(output and str(output), input_file, processes=two)
    assert check_output(str(tmp_path / "out.fr"), write_input(tmp_path), processes=two)


def test_a_full_stdout_is_one_line_from_a_real_process(checkpoint, tmp_path):
    """`translate.py > /dev/full`, the whole process: one line and status 2, and nothing from the interpreter's exit,
    which flushes stdout again (a closed pipe takes the same way out, `vaswani.files.reporting_unwritable_stream`:
    one launch shows it). Before: `OSError: [Errno 28]` in a traceback from `self.sink.write`."""
    argv = [str(SCRIPTS / "translate.py"), "--model", str(checkpoint), "--device", "cpu", "--input_file",
            write_input(tmp_path), *GREEDY_FLAGS]
    with open("/dev/full", "wb") as stdout:
        process = subprocess.run([sys.executable, *argv], stdout=stdout, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert process.returncode == 2, process.stderr
    assert process.stderr.splitlines()[-1].startswith("error: No space left on the device to write stdout;")
    assert "Traceback" not in process.stderr and "Exception ignored" not in process.stderr, process.stderr


def test_resume_after_the_input_was_edited_is_refused_and_changes_nothing(trained, expected, tmp_path, monkeypatch):
    """Two lines joined (the same byte size, one line fewer), or a character changed, in lines already translated:
    the old translations would no longer line up, so resuming is refused, naming the input, and nothing changes."""
    model, tokenizer = trained
    engine, source = engine_for_model(model, tokenizer, **GREEDY), Path(write_input(tmp_path))
    output = tmp_path / "out.fr"
    state = tmp_path / "out.fr.resume.json"
    run = {"chunk_lines": 7, "max_tokens": 24, "progress": False}
    text = source.read_text(encoding="utf-8")
    translate_file(engine, str(source), str(output), **run)
    joined = text.replace("\n", " ", 1)
    assert len(joined) == len(text) and joined.count("\n") == text.count("\n") - 1
    source.write_text(joined, encoding="utf-8")
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=f"{source} has changed since {output} was written from it"):
        translate_file(engine, str(source), str(output), resume=True, **run)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before

    source.write_text(text, encoding="utf-8")
    with monkeypatch.context() as patch:  # a run stopped after two chunks, then an edit in its first chunk
        interrupted_after(2, patch)
        with pytest.raises(KeyboardInterrupt):
            translate_file(engine, str(source), str(output), **run)
    assert json.loads(state.read_text())["chunks"] == 2
    source.write_text(text.replace("cat", "cot", 1), encoding="utf-8")  # in line 1
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="its first 14 lines, already translated, are not the lines"):
        translate_file(engine, str(source), str(output), resume=True, **run)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_an_edit_past_the_translated_chunks_is_translated_on_resume(trained, tmp_path, monkeypatch):
    model, tokenizer = trained
    engine, source = engine_for_model(model, tokenizer, **GREEDY), Path(write_input(tmp_path))
    output = tmp_path / "out.fr"
    run = {"chunk_lines": 7, "max_tokens": 24, "progress": False}
    with monkeypatch.context() as patch:
        interrupted_after(2, patch)
        with pytest.raises(KeyboardInterrupt):
            translate_file(engine, str(source), str(output), **run)
    edited = [*LINES[:20], "We see three dogs.", *LINES[21:]]
    write_input(tmp_path, edited)
    translate_file(engine, str(source), str(output), resume=True, **run)
    fresh = tmp_path / "fresh.fr"
    translate_file(engine, str(source), str(fresh), **run)
    assert output.read_bytes() == fresh.read_bytes()
    assert len(output.read_text(encoding="utf-8").splitlines()) == len(edited)


def test_a_complete_output_whose_input_grew_is_refused(trained, tmp_path):
    model, tokenizer = trained
    engine, source, output = engine_for_model(model, tokenizer, **GREEDY), write_input(tmp_path), tmp_path / "out.fr"
    run = {"chunk_lines": 5, "max_tokens": 24, "progress": False}
    assert len(LINES) % run["chunk_lines"] == 0  # the line added starts a chunk of its own
    translate_file(engine, source, str(output), **run)
    write_input(tmp_path, [*LINES, "One more line."])
    with pytest.raises(ValueError, match=f"has more lines than the {len(LINES)} translated"):
        translate_file(engine, source, str(output), resume=True, **run)
    write_input(tmp_path, [*LINES[:-1], "a cat"])  # the last line changed: its chunk no longer matches
    with pytest.raises(ValueError, match=f"its first {len(LINES)} lines, already translated, are not the lines"):
        translate_file(engine, source, str(output), resume=True, **run)


def run_script(argv, env=None, **kwargs):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, *argv], env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kwargs)


def killable(mode: str):
    """What makes translate.py's process, forked (`forked_script`), killable: each chunk slowed down ("slow"), so
    that a kill lands mid-way, or SIGKILL sent by the process itself at the worst moments: a chunk's lines on disk,
    the resume state not yet updated ("after_write"); the first resume state written, the output not yet created
    ("before_output"); the output created, empty, before the first chunk is translated ("before_first_chunk")."""
    import vaswani.file_translation as ft

    def kill(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def prepare():
        if mode == "slow":
            slowed_chunks(0.3)()
        elif mode == "after_write":  # the state is written at the start, then after each chunk: killed at the third
            calls, save = iter(range(10**6)), ft.write_atomically
            ft.write_atomically = lambda *a: save(*a) if next(calls) < 3 else kill()
        elif mode == "before_output":
            save = ft.write_atomically
            ft.write_atomically = lambda *a: (save(*a), kill())
        elif mode == "before_first_chunk":
            ft.translate_chunk = kill

    return prepare


@pytest.mark.parametrize("mode", ["slow", "after_write", "before_output", "before_first_chunk"])
def test_a_killed_run_resumes_to_the_same_bytes(checkpoint, expected, tmp_path, mode):
    """The same command line twice, `--resume` included, as a scheduler requeues a preempted job: the first in a
    process of its own, killed; the second through the script's `main` in this process."""
    output = tmp_path / "out.fr"
    argv = ["--model", str(checkpoint), "--device", "cpu", "--input_file", write_input(tmp_path), "--output_file",
            str(output), "--chunk_lines", "5", "--num_beams", "1", "--max_new_tokens", "8", "--resume"]
    process = forked_script("translate", argv, killable(mode))
    state = tmp_path / "out.fr.resume.json"
    if mode == "slow":  # kill it once two chunks are recorded, while it translates the third
        deadline = time.monotonic() + 120
        while not (state.exists() and json.loads(state.read_text() or "{}").get("chunks", 0) >= 2):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1]
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=120)
    assert process.returncode == -signal.SIGKILL
    recorded = json.loads(state.read_text())
    if mode == "before_output":
        assert recorded["bytes"] == 0 and not output.exists()
    elif mode == "before_first_chunk":
        assert recorded["bytes"] == 0 and output.read_bytes() == b""
    else:
        assert 0 < recorded["bytes"] <= output.stat().st_size and output.read_text() != expected
    if mode == "after_write":  # the third chunk reached the file, its record did not
        assert output.stat().st_size > recorded["bytes"]

    script_main("translate")(argv)
    assert output.read_text(encoding="utf-8") == expected
    assert json.loads(state.read_text())["complete"] is True and not (tmp_path / "out.fr.parts").exists()


# translate.py under each launcher, two processes writing one file: test_interruptions.py's resumes after a SIGTERM
# (torchrun) and a SIGKILL (torchrun and accelerate launch) finish the file to the bytes of one run.


def test_every_process_count_and_chunk_count_ends_complete_with_status_0(checkpoint, expected, tmp_path):
    """One launch of three processes translates the file six times, at 1, 4 and 9 chunks (processes left without a
    chunk, an uneven share, an even one; a first, a middle and a last process), twice each, with process 0 slowed so
    that the others finish their share first: every run must end with the file one process writes and its record
    marked complete, and the launch with status 0. Before, a process left once its last chunk was done, and process
    0 took it for a lost one ("process 1 of 2 … ended (killed or crashed)") and exited 1 with the record not
    complete. About 30 s on 2 cores (each process imports torch and loads the model; process 0 waits up to 5 s, once,
    for a process that left): one launch covers six runs. Two processes writing one file: test_interruptions.py."""
    world_size = 3
    input_file = write_input(tmp_path)
    plan = [(input_file, str(tmp_path / f"out-{chunk_lines}-{run}.fr"), chunk_lines)
            for run in range(2) for chunk_lines in (100, 12, 5)]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    process = run_script([*launcher, str(Path(__file__).with_name("file_translation_worker.py")), str(checkpoint),
                          json.dumps(plan)])
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err.decode()[-3000:]
    for _, output, _ in plan:
        assert Path(output).read_text(encoding="utf-8") == expected, output
        assert json.loads(Path(f"{output}.resume.json").read_text())["complete"] is True, output
        assert not Path(f"{output}.parts").exists()


def test_processes_read_their_place_from_the_launcher():
    assert Processes.from_environment({}) == Processes(0, 1, 0)
    assert Processes.from_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == Processes(3, 4, 1)


GREEDY_MIN, BEAM_MIN = CPU_BF16_MIN_D_MODEL["greedy"], CPU_BF16_MIN_D_MODEL["beam"]


@pytest.mark.parametrize(("requested", "device", "d_model", "beams", "int8", "cuda_bf16", "cpu_bf16", "chosen"), [
    ("auto", "cuda", 32, 1, False, True, False, torch.bfloat16),
    ("auto", "cuda", 512, 4, False, False, False, torch.float32),
    ("auto", "cpu", GREEDY_MIN, 1, False, None, True, torch.bfloat16),
    ("auto", "cpu", GREEDY_MIN - 1, 1, False, None, True, torch.float32),
    ("auto", "cpu", BEAM_MIN, 4, False, None, True, torch.bfloat16),
    ("auto", "cpu", BEAM_MIN - 1, 4, False, None, True, torch.float32),
    ("auto", "cpu", 1024, 4, False, None, False, torch.float32),
    ("auto", "cpu", 1024, 4, True, None, True, torch.float32),
    ("bfloat16", "cpu", 32, 1, False, None, False, torch.bfloat16),
    ("float32", "cuda", 512, 4, False, True, True, torch.float32),
])
def test_dtype_auto_is_bf16_where_native_and_faster(requested, device, d_model, beams, int8, cuda_bf16, cpu_bf16,
                                                    chosen):
    assert choose_dtype(requested, torch.device(device), d_model, num_beams=beams, int8=int8, cuda_bf16=cuda_bf16,
                        cpu_bf16=cpu_bf16) == chosen


def test_dtype_refuses_bf16_with_int8():
    with pytest.raises(ValueError, match="int8"):
        choose_dtype("bfloat16", torch.device("cpu"), 512, int8=True)


# Failure modes ------------------------------------------------------------------------------------------------------


def test_translate_script_keeps_empty_lines_and_truncates_for_learned_positions(good_checkpoint, tmp_path, capsys,
                                                                                 single_thread):
    tokenizer = AutoTokenizer.from_pretrained(good_checkpoint)
    learned = VaswaniForConditionalGeneration(VaswaniConfig.tiny(
        vocab_size=len(tokenizer), position_embedding_type="learned", max_position_embeddings=12))
    path = tmp_path / "learned"
    learned.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (tmp_path / "in.txt").write_text("the cat\n\n" + "the dog " * 30 + "\n   \n")
    script_main("translate")(["--model", str(path), "--input_file", str(tmp_path / "in.txt"), "--num_beams", "1",
                              "--max_new_tokens", "50"])
    captured = capsys.readouterr()
    lines = captured.out.split("\n")[:-1]
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # one output line per input line
    assert "1 sentence(s) longer than the model's 12 learned positions were truncated" in captured.err


def test_input_file_that_is_not_utf8_is_one_line(good_checkpoint, tmp_path, capsys):
    (tmp_path / "latin1.txt").write_bytes(b"the cat\ncaf\xe9\n")
    fails_with_one_line(script_main("translate"), ["--model", str(good_checkpoint), "--input_file",
                                                   str(tmp_path / "latin1.txt")], capsys, "is not UTF-8 text (line 2")
