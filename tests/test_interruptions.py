"""What a shared cluster does to a file translation, with real processes: a second writer of the same output, a
full disk (injected into each write, and a real one on a small tmpfs), SIGTERM or SIGINT mid-way; and the counts
that every script checks when it parses its arguments. docs/reliability.md is their table."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import SCRIPTS, Forked, forked_script, script_main, slowed_chunks
from tiny_translation_model import SOURCES

import vaswani.file_translation
from vaswani import files
from vaswani.file_translation import translate_file
from vaswani.files import DiskFullError, OutputInUseError, exclusive, lock_path
from vaswani.loading import engine_for_model

GREEDY = {"num_beams": 1, "max_new_tokens": 8}
LINES = [*SOURCES, "", *SOURCES[::-1], "   ", *SOURCES[1:4]] * 3
CHUNK = 5


@pytest.fixture(scope="module")
def expected(trained, tmp_path_factory):
    """The output of an uninterrupted translation of the file, as the script translates it (`translate_file`, with the
    script's chunks and batches), in this process: every interrupted run of the script below must end with it."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    output = directory / "out.fr"
    translate_file(engine_for_model(*trained, **GREEDY), write_input(directory), str(output), chunk_lines=CHUNK,
                   progress=False)
    return output.read_bytes()


def write_input(directory: Path, lines=LINES) -> str:
    path = directory / "in.en"
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return str(path)


def translate_argv(checkpoint, input_file, output, *extra):
    return [str(SCRIPTS / "translate.py"), "--model", str(checkpoint), "--device", "cpu", "--input_file",
            str(input_file), "--output_file", str(output), "--chunk_lines", str(CHUNK), *GREEDY_FLAGS, *extra]


GREEDY_FLAGS = ["--num_beams", "1", "--max_new_tokens", "8"]

# translate.py with every chunk slowed down, so that a signal lands while a launcher's processes translate.
SLOW = """
import runpy, sys, time
import vaswani.file_translation as ft
chunk, delay = ft.translate_chunk, float(sys.argv[1])
ft.translate_chunk = lambda *a, **k: (time.sleep(delay), chunk(*a, **k))[1]
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def start(argv):
    """`python ARGV` (a launcher's), in a fresh interpreter."""
    return subprocess.Popen([sys.executable, *argv], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def translation(argv, slow: float | None = None) -> Forked:
    """translate.py (`argv`: the script and its arguments) as one process of its own, forked from this one
    (`forked_script`: the same `main`, without a fresh interpreter's imports), each chunk `slow` seconds longer if
    given, as SLOW does under a launcher."""
    return forked_script("translate", argv[1:], slowed_chunks(slow) if slow is not None else None)


def recorded(output: Path) -> dict:
    state = Path(f"{output}.resume.json")
    return json.loads(state.read_text() or "{}") if state.exists() else {}


def wait_for_chunks(process, output: Path, chunks: int) -> None:
    deadline = time.monotonic() + 120
    while recorded(output).get("chunks", 0) < chunks:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1]
        time.sleep(0.02)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# One writer at a time ------------------------------------------------------------------------------------------------


# A process that holds the lock on argv[1] (for argv[2] seconds, 600 by default). vaswani.files imports only the
# standard library, so the holder loads that file alone, not the package (whose import of transformers takes seconds):
# the same lock code, in a process that starts in a tenth of a second.
HOLDER = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("vaswani_files", {files.__file__!r})
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)
with files.exclusive(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 600)
"""


def test_a_lock_refuses_a_second_process_naming_the_first_and_dies_with_its_holder(tmp_path):
    target = tmp_path / "out.fr"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(OutputInUseError, match=rf"^{target} is being written by another process \(process "
                           rf"{holder.pid}\); wait for it to end"), exclusive(target):
            pass
    finally:
        holder.kill()  # SIGKILL: no clean-up runs, the kernel drops the lock
        holder.wait()
    with exclusive(target):
        assert lock_path(target).read_text() == f"{os.getpid()}\n"
        with exclusive(target):  # this process already holds it
            pass
    assert not lock_path(target).exists() and not target.exists()


def test_waiting_for_a_lock_takes_it_once_its_holder_ends(tmp_path):
    target = tmp_path / "cache-entry"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(target), "1"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    started = time.monotonic()
    with exclusive(target, wait=True):
        assert time.monotonic() - started > 0.5  # the holder sleeps 1 s with the lock
        assert lock_path(target).read_text() == f"{os.getpid()}\n"
    holder.wait()


def test_a_second_translation_of_the_same_output_is_refused_and_the_first_completes(checkpoint, expected, tmp_path):
    """The same `--resume` command launched twice at once (or requeued while the first still runs): before, both
    exited 0 and left twice the lines, interleaved. Whichever takes the lock first translates; the other is
    refused in one line naming it."""
    output = tmp_path / "out.fr"
    argv = translate_argv(checkpoint, write_input(tmp_path), output, "--resume")
    runs = [translation(argv, slow=1.0), translation(argv, slow=1.0)]
    results = [(run, *run.communicate(timeout=300)) for run in runs]
    assert sorted(run.returncode for run in runs) == [0, 2], [err for _, _, err in results]
    (winner, _, _), (loser, _, err) = sorted(results, key=lambda result: result[0].returncode)
    assert last_line(err) == (f"error: {output} is being written by another process (process {winner.pid}); wait "
                              "for it to end (or stop it), then run this again.")
    assert output.read_bytes() == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.en", "out.fr", "out.fr.resume.json"]


def test_a_second_evaluation_report_writer_is_refused(checkpoint, tmp_path, capsys):
    report = tmp_path / "report.json"
    (tmp_path / "src.en").write_text("a dog ran\n")
    (tmp_path / "ref.fr").write_text("un chien a couru\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(report)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SystemExit) as exit_info:
            script_main("evaluate_bleu")(["--model", str(checkpoint), "--device", "cpu", "--source_file",
                                          str(tmp_path / "src.en"), "--reference_file", str(tmp_path / "ref.fr"),
                                          "--output_file", str(report), *GREEDY_FLAGS])
    finally:
        holder.kill()
        holder.wait()
    assert exit_info.value.code == 2
    assert last_line(capsys.readouterr().err) == (f"error: {report} is being written by another process (process "
                                                  f"{holder.pid}); wait for it to end (or stop it), then run this "
                                                  "again.")
    assert not report.exists()


@pytest.mark.parametrize("tool", ["average", "export", "marian", "llama"])
def test_every_directory_writer_holds_its_outputs_lock(tool, tmp_path):
    """Averaging, the export and both conversions take the lock before they check or write their output."""
    from vaswani.averaging import average_checkpoints
    from vaswani.convert import convert_llama_checkpoint, convert_marian_checkpoint
    from vaswani.export import export_to_ctranslate2

    writers = {"average": lambda out: average_checkpoints([tmp_path / "run"], out),
               "export": lambda out: export_to_ctranslate2(str(tmp_path / "model"), out),
               "marian": lambda out: convert_marian_checkpoint(str(tmp_path / "model"), out),
               "llama": lambda out: convert_llama_checkpoint(str(tmp_path / "model"), out)}
    output = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(output)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(OutputInUseError, match=f"process {holder.pid}"):
            writers[tool](str(output))
    finally:
        holder.kill()
        holder.wait()
    assert not output.exists()


# A full disk ---------------------------------------------------------------------------------------------------------


def full_disk_at(target: str, monkeypatch, module, name: str, call: int) -> None:
    """Make the `call`-th call of `module.name` fail as a full disk does."""
    real, calls = getattr(module, name), []

    def fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, fail)


@pytest.mark.parametrize(("write", "call", "lines_kept"), [
    ("sync_file", 3, 2 * CHUNK),  # the third chunk's lines (flushed to the output)
    ("write_atomically", 3, 1 * CHUNK),  # the second chunk's record (the first write is the fresh record)
    ("write_atomically", 1, 0),  # the first record, before the output exists
])
def test_a_full_disk_while_translating_names_the_output_and_what_is_kept_and_resumes(
        trained, tmp_path, monkeypatch, expected, write, call, lines_kept):
    model, tokenizer = trained
    engine = engine_for_model(model, tokenizer, **GREEDY)
    output, source = tmp_path / "out.fr", write_input(tmp_path)
    run = {"chunk_lines": CHUNK, "max_tokens": 4096, "progress": False}
    with monkeypatch.context() as patch:
        full_disk_at(str(output), patch, vaswani.file_translation, write, call)
        with pytest.raises(DiskFullError) as error:
            translate_file(engine, source, str(output), resume=True, **run)
    assert str(error.value) == (f"No space left on the device to write {output}; its first {lines_kept} lines are "
                                f"complete and recorded in {output}.resume.json; free some space, then run the same "
                                "command with --resume.")
    assert recorded(output).get("lines", 0) == lines_kept
    translate_file(engine, source, str(output), resume=True, **run)
    assert output.read_bytes() == expected


def test_a_full_disk_in_the_script_is_one_line_with_status_2(checkpoint, tmp_path, monkeypatch, capsys):
    output = tmp_path / "out.fr"
    full_disk_at(str(output), monkeypatch, vaswani.file_translation, "sync_file", 2)
    with pytest.raises(SystemExit) as exit_info:
        script_main("translate")(translate_argv(checkpoint, write_input(tmp_path), output)[1:])
    assert exit_info.value.code == 2
    assert last_line(capsys.readouterr().err) == (
        f"error: No space left on the device to write {output}; its first {CHUNK} lines are complete and recorded "
        f"in {output}.resume.json; free some space, then run the same command with --resume.")


def test_a_full_disk_while_publishing_a_file_or_directory_keeps_the_old_one(tmp_path, monkeypatch):
    report = tmp_path / "report.json"
    report.write_text("old")
    full_disk_at(str(report), monkeypatch, files, "sync_file", 1)
    with pytest.raises(DiskFullError, match=rf"^No space left on the device to write {report}; {report} is left as "
                       "it was.$"):
        files.write_atomically(report, "new")
    assert report.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    directory = tmp_path / "model"
    with pytest.raises(DiskFullError, match=rf"^No space left on the device to write {directory}; {directory} was "
                       "not created.$"), files.staged_directory(directory) as staging:
        (staging / "weights").write_bytes(b"1")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed") from OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


@contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` (root only; the test skips where mounting is refused)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_real_full_disk_under_translate_then_resume_after_freeing_space(trained, checkpoint, tmp_path):
    # 450 lines, about 7 KB translated; the disk's four 4 KB pages hold the resume state, its atomic rewrite's copy
    # and about 4 KB of output: the disk fills part-way, with whole chunks kept.
    lines = LINES * 10
    with small_tmpfs(tmp_path / "disk", "16k") as disk:
        output = disk / "out.fr"
        argv = translate_argv(checkpoint, write_input(tmp_path, lines), output, "--resume")
        process = translation(argv)
        _, err = process.communicate(timeout=300)
        assert process.returncode == 2, err
        kept = recorded(output)["lines"]
        assert 0 < kept < len(lines) and kept % CHUNK == 0
        assert last_line(err) == (f"error: No space left on the device to write {output}; its first {kept} lines are "
                                  f"complete and recorded in {output}.resume.json; free some space, then run the same "
                                  "command with --resume.")
        subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)
        process = translation(argv)
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        # The same file translated in one go, as `expected` is.
        again = tmp_path / "uninterrupted.fr"
        translate_file(engine_for_model(*trained, **GREEDY), write_input(tmp_path, lines), str(again),
                       chunk_lines=CHUNK, progress=False)
        assert output.read_bytes() == again.read_bytes() and len(again.read_bytes().splitlines()) == len(lines)


# Preemption ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_translation_stops_at_a_chunk_boundary_and_resumes_to_the_same_bytes(
        checkpoint, expected, tmp_path, signum):
    output = tmp_path / "out.fr"
    argv = translate_argv(checkpoint, write_input(tmp_path), output, "--resume")
    process = translation(argv, slow=0.3)
    wait_for_chunks(process, output, 2)
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err
    state = recorded(output)
    assert state["lines"] in (2 * CHUNK, 3 * CHUNK)  # the chunk in flight dropped, or finished
    assert output.stat().st_size == state["bytes"]  # the output and its record agree
    assert last_line(err) == (f"Translation stopped by {signal.Signals(signum).name}; {output} holds its first "
                              f"{state['lines']} lines, recorded in {output}.resume.json. Run the same command with "
                              "--resume to finish it.")
    script_main("translate")(argv[1:])  # the same command again, through the script's `main` in this process
    assert output.read_bytes() == expected


def slowed_torchrun_translation(checkpoint, tmp_path, launcher="torchrun"):
    """translate.py with --resume under torchrun (or `launcher`), 2 processes, each chunk slowed (SLOW), started and
    waited for until two chunks are written: the launcher's arguments, the script's, the output file and the running
    launch."""
    from test_training_interruptions import LAUNCHERS

    output = tmp_path / "out.fr"
    wrapper = tmp_path / "slow.py"
    wrapper.write_text(SLOW)
    launch = LAUNCHERS[launcher]()
    argv = translate_argv(checkpoint, write_input(tmp_path), output, "--resume")
    process = start([*launch, str(wrapper), "0.5", *argv])
    wait_for_chunks(process, output, 2)
    return launch, argv, output, process


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_translation_processes_and_resumes_to_the_same_bytes(checkpoint, expected,
                                                                                           tmp_path):
    launch, argv, output, process = slowed_torchrun_translation(checkpoint, tmp_path)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode != 0
    state = recorded(output)
    assert output.stat().st_size == state["bytes"] and not state.get("complete")
    assert "Translation stopped by SIGTERM in process 1." in err, err[-3000:]
    assert (f"Translation stopped by SIGTERM; {output} holds its first {state['lines']} lines" in err), err[-3000:]
    resumed = start([*launch, *argv])
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err[-3000:]
    assert output.read_bytes() == expected and not Path(f"{output}.parts").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "victim"), [("torchrun", 1), ("accelerate", 0)])
def test_a_translation_process_killed_ends_the_other_in_one_line_and_resumes_to_the_same_bytes(
        checkpoint, expected, tmp_path, launcher, victim):
    """SIGKILL mid-file to process 1 of 2 under torchrun, or to process 0 under accelerate launch (each launcher,
    each rank): the survivor (waiting for its chunks, translating its own, or stopped by the launcher's SIGTERM) ends
    within seconds with one line of ours, before the launcher's report, naming the process that died and what the
    output holds; the output holds its recorded lines (and, where process 0 died while writing a chunk, perhaps
    part of the next, which a resume cuts off), the lock is released, and `--resume` finishes it to the bytes of
    one run: its two processes, under either launcher, write the one file, with no part file left."""
    from test_training_interruptions import ours, rank_process

    launch, argv, output, process = slowed_torchrun_translation(checkpoint, tmp_path, launcher)
    pid = rank_process(process, victim)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _, err = process.communicate(timeout=120)
    assert time.monotonic() - killed < 60 and process.returncode != 0
    state = recorded(output)
    assert output.stat().st_size >= state["bytes"] and not state.get("complete")
    errors = [line for line in ours(err).splitlines() if line.startswith("error: ")]
    lost = (f"error: process {victim} of 2 (pid {pid}) of this translation ended (killed or crashed), so process "
            f"{1 - victim} stops too;")
    kept = (f"{output} holds its first {state['lines']} lines, recorded in {output}.resume.json. Run the same "
            "command with --resume to finish it." if victim else
            f"run the same command with --resume to finish {output}.")
    assert errors == [f"{lost} {kept}"], err[-3000:]
    assert "Traceback" not in ours(err), err[-3000:]
    resumed = start([*launch, *argv])
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err[-3000:]
    assert output.read_bytes() == expected and not Path(f"{output}.parts").exists()


# Counts checked when the arguments are parsed ------------------------------------------------------------------------


@pytest.mark.parametrize(("script", "argv", "message"), [
    ("translate", ["--slots", "-2"], "argument --slots: must be 0 or more, got -2"),
    ("translate", ["--chunk_lines", "0"], "argument --chunk_lines: must be positive, got 0"),
    ("translate", ["--top_k", "-1"], "argument --top_k: must be 0 or more, got -1"),
    ("translate", ["--temperature", "0"], "argument --temperature: must be above 0, got 0"),
    ("translate", ["--top_p", "1.5"], "argument --top_p: must be above 0 and at most 1, got 1.5"),
    ("translate", ["--length_penalty", "nan"], "argument --length_penalty: must be a finite number, got nan"),
    ("evaluate_bleu", ["--slots", "-1"], "argument --slots: must be 0 or more, got -1"),
    ("average_checkpoints", ["--inputs", "run", "--last", "0"], "argument --last: must be positive, got 0"),
    ("export_ctranslate2", ["--max_positions", "-5"], "argument --max_positions: must be positive, got -5"),
    ("train_tokenizer", ["--vocab_size", "0"], "argument --vocab_size: must be positive, got 0"),
    ("train_tokenizer", ["--tokenizer_train_pairs", "-3"], "argument --tokenizer_train_pairs: must be positive"),
])
def test_a_count_out_of_range_is_refused_when_parsed_and_nothing_is_written(tmp_path, capsys, script, argv, message):
    """Before the model is loaded (it does not even exist here) and before any output or resume record."""
    output = tmp_path / "out"
    common = {"translate": ["--model", str(tmp_path / "missing"), "--input_file", str(tmp_path / "missing.en"),
                            "--output_file", str(output)],
              "evaluate_bleu": ["--model", str(tmp_path / "missing"), "--output_file", str(output)],
              "average_checkpoints": ["--output_dir", str(output)],
              "export_ctranslate2": ["--model", str(tmp_path / "missing"), "--output_dir", str(output)],
              "train_tokenizer": ["--output_dir", str(output)]}[script]
    with pytest.raises(SystemExit) as exit_info:
        script_main(script)([*common, *argv])
    assert exit_info.value.code == 2
    assert message in last_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def stop_signal_handler(take: bool, *names: str) -> None:
    """Send itself the signals `names` inside `catching_stop_signals`, whose handler takes them or declines."""
    from vaswani.preemption import catching_stop_signals

    # What a process has before the block, whatever it inherited (a shell's background job starts with SIGINT
    # ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print("set", flush=True)
    taken = []
    with catching_stop_signals(lambda signum: taken.append(signum) or take):  # take: None (taken); decline: False
        for name in names:
            os.kill(os.getpid(), getattr(signal, name))
            time.sleep(0.1)
            print("after", name, flush=True)
    print("taken", taken, flush=True)


def test_a_declined_stop_signal_acts_as_without_the_handler():
    """A stop-signal handler that declines (returns False: training's before it begins) leaves SIGINT to Python's
    KeyboardInterrupt and SIGTERM to its default action, which ends the process; one that takes it only records.
    Each in a forked process (`Forked`), which the signals end."""

    def run(*argv):
        done = Forked(lambda: stop_signal_handler(*argv))
        return done, *done.communicate(timeout=60)

    done, out, err = run(True, "SIGINT", "SIGTERM")
    assert done.returncode == 0, err
    assert out.split("\n") == ["set", "after SIGINT", "after SIGTERM", "taken [2, 15]", ""], err
    done, out, err = run(False, "SIGINT")
    assert "KeyboardInterrupt" in err and out == "set\n", (out, err)
    done, out, err = run(False, "SIGTERM")
    assert done.returncode == -signal.SIGTERM and out == "set\n", (out, err)
