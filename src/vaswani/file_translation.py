"""Translate a file of any length: in chunks, with progress, resumable after a kill, and across processes.

`translate_file` reads the input `chunk_lines` lines at a time, sorts each chunk's sentences by length into
batches of at most `max_tokens` padded source tokens (the token budget training uses, `vaswani.batching`), translates
them, and writes the chunk's lines in input order as soon as the chunk is done. Memory is that of one chunk,
whatever the length of the file; a length-sorted chunk of a few thousand lines pads about as little as a sorted
whole file (benchmarks/results/streaming-*.md).

Resuming: after each chunk, the output file is flushed to disk and a small state file beside it
(`<output>.resume.json`) records how many chunks and bytes are complete, and a digest of the input lines they
translate (computed as the chunks are read), written atomically. A run killed at any point and restarted with
`resume=True` reads the recorded chunks of the input again, refuses an input whose digest differs (edited since:
its old translations would no longer line up), cuts the output back to the last complete chunk and goes on from
there; the
result is the same file, byte for byte, as an uninterrupted run's, because every chunk is translated the same way
(the same batches, and with sampling the same seed) whichever run or process translates it. The state is written
before the output is created and stays beside the finished output, marked complete, so that a scheduler can requeue
the same command line, `resume=True` included, whenever it likes: a run killed before its first chunk starts
again, a complete one is left as it is (once its input is found unchanged), and an output this tool did not write
is refused untouched. A refused run leaves every file as it found it.

Processes: under `torchrun` or `accelerate launch` (which set RANK and WORLD_SIZE), process r translates the
chunks r, r + N, r + 2N, … and writes each to `<output>.parts/`; process 0 also appends the finished chunks to
the output in input order, keeps the resume state and shows the progress bar. A chunk's translation does not depend
on which process made it, so N processes write the file one process writes. Every process ends at the group's
barrier (`vaswani.peers.ending_process_group`): one that has done its share waits there, running, so that process 0,
which looks between chunks for a process that has ended, never takes a finished one for a lost one.

Outputs: a regular file (by any name: a link's record lies beside the link) is resumable. stdout, a device or a
FIFO gets the lines as they come, with no record or lock beside it, and `resume` into one is refused
(`check_output`); a full device or a reader that has gone is one line naming it.

One writer at a time: process 0 holds the output's lock (`vaswani.files.exclusive`) while it runs, so a second run
on the same output is refused instead of interleaving its chunks with the first's. A full disk is one
`DiskFullError` saying how many lines are complete and recorded. SIGTERM or SIGINT drops the chunk in flight (or,
arriving while a chunk is written out, lets it finish) and raises `vaswani.preemption.Preempted`: the output and its
record agree, and the same command with `resume=True` goes on from there.

The engine is any of `vaswani.translation`'s (`TorchEngine`: any `generate()` model, int8 or not, whichever decoding
loop; `CTranslate2Engine`: an exported model), and each chunk goes through `vaswani.translation.translate`, so every
engine streams the same way and translates a chunk as every other caller would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from . import files
from .files import decode_lines, read_json_object, sync_file, write_atomically
from .peers import PeerLost, Peers, barrier, ending_process_group, peer_lost
from .preemption import Preempted, catching_stop_signals, signal_name
from .translation import translate, warn_truncated

DEFAULT_CHUNK_LINES = 4096
DEFAULT_MAX_TOKENS = 4096


# --------------------------------------------------------------------------------------------------
# One chunk


def translate_chunk(engine, lines: Sequence[str], max_tokens: int | None, max_sentences: int | None = None,
                    ) -> tuple[list[str], int]:
    """(one translation per line in input order, how many sources were truncated), by
    `vaswani.translation.translate`. Empty or blank lines give empty lines; a line break inside a translation
    becomes a space, so that output line i is input line i's. The truncation warning is `translate_file`'s, once
    for the whole file."""
    nonempty = [i for i, line in enumerate(lines) if line.strip()]
    output = [""] * len(lines)
    texts, truncated = translate(engine, [lines[i] for i in nonempty], max_tokens=max_tokens,
                                 max_sentences=max_sentences, warn=False)
    for i, text in zip(nonempty, texts):
        output[i] = " ".join(text.replace("\r", "\n").split("\n")).strip()
    return output, truncated


# --------------------------------------------------------------------------------------------------
# Reading


def read_raw_chunks(stream, chunk_lines: int) -> Iterator[list[bytes]]:
    """Lists of `chunk_lines` raw lines (the last may be shorter) from a binary stream, line ends removed. A line
    ends at b"\\n" only (not at U+2028 or other characters `str.splitlines` takes), as in `vaswani.files.read_lines`."""
    chunk: list[bytes] = []
    for raw in stream:
        chunk.append(raw[:-1] if raw.endswith(b"\n") else raw)
        if len(chunk) == chunk_lines:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def count_lines(path: str) -> int:
    """The number of lines `read_raw_chunks` gives for the file at `path` (a last line without b"\\n" counts)."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def chunk_digest(raw_lines: Sequence[bytes]) -> str:
    """A digest of one chunk's raw lines (each with its line end: a missing last b"\\n" translates alike)."""
    digest = hashlib.blake2b(digest_size=16)
    for raw in raw_lines:
        digest.update(raw)
        digest.update(b"\n")
    return digest.hexdigest()


def chain_digest(previous: str, chunk: str) -> str:
    """The digest of the input up to a chunk: the previous chunks' (`previous`; "" before the first) followed by the
    chunk's own. Chained per chunk, so that process 0 can extend it with chunks that other processes read."""
    return hashlib.blake2b(f"{previous}{chunk}".encode(), digest_size=16).hexdigest()


# --------------------------------------------------------------------------------------------------
# Processes


@dataclass(frozen=True)
class Processes:
    """This process's place among those `torchrun` or `accelerate launch` started (one process by default)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environment(cls, environ=os.environ) -> Processes:
        return cls(int(environ.get("RANK", 0)), int(environ.get("WORLD_SIZE", 1)), int(environ.get("LOCAL_RANK", 0)))


# --------------------------------------------------------------------------------------------------
# The file


@dataclass
class FileTranslation:
    """What `translate_file` did: lines written (this run and resumed ones), chunks, sources truncated, seconds."""

    lines: int = 0
    chunks: int = 0
    truncated: int = 0
    resumed_chunks: int = 0
    seconds: float = 0.0
    settings: dict = field(default_factory=dict)


def translate_file(engine, input_path: str | None, output_path: str | None, *, chunk_lines: int = DEFAULT_CHUNK_LINES,
                   max_tokens: int | None = DEFAULT_MAX_TOKENS, max_sentences: int | None = None,
                   resume: bool = False, progress: bool | None = None, seed: int | None = None,
                   settings: dict | None = None, processes: Processes | None = None,
                   stdin=None, stdout=None) -> FileTranslation:
    """Translate `input_path` (None: `stdin`, binary) into `output_path` (None: `stdout`, binary), one output line
    per input line, chunk by chunk (see the module docstring). Returns a `FileTranslation` (complete in process 0;
    the others report their own chunks).

    `max_tokens`/`max_sentences` bound a batch (`vaswani.batching.token_budget_batches`). `resume` continues a
    killed run from its last complete chunk; `settings` (what changes the output: model, beams, …) must equal the
    killed run's, and is checked together with `chunk_lines`; the input must hold the lines the killed run
    translated (a digest of them is recorded). `progress`: a bar on stderr
    (None: when stderr is a terminal). `seed`: with sampling, chunk i is sampled with seed `seed + i`, which makes
    resumed and multi-process runs reproduce a single run.
    """
    processes = processes or Processes.from_environment()
    stdin = stdin if stdin is not None else sys.stdin.buffer
    stdout = stdout if stdout is not None else sys.stdout.buffer
    if chunk_lines < 1:
        raise ValueError(f"chunk_lines={chunk_lines}; it must be positive.")
    resumable = check_output(output_path, input_path, resume=resume, processes=processes)
    name = input_path or "stdin"
    settings = {**(settings or {}), "chunk_lines": chunk_lines, "max_tokens": max_tokens,
                "max_sentences": max_sentences, "seed": seed}
    state_path = resume_record_path(output_path) if resumable else None
    parts_dir = f"{output_path}.parts" if resumable else None
    stop = _StopRequest(output_path, state_path, processes)
    lock = files.exclusive(output_path) if resumable and processes.rank == 0 else nullcontext()
    if resumable:
        reporting = files.reporting_full_disk(output_path, stop.kept)
    else:
        reporting = files.reporting_unwritable_stream(output_path or "stdout", stop.sent)
    with lock, reporting, catching_stop_signals(stop.request, holding_after=(PeerLost,)):
        try:
            # Every process ends at the group's barrier, process 0 once it has written the last chunk: none leaves
            # before the others are done, so a finished process is never taken for a lost one.
            with ending_process_group(processes.rank, processes.world_size):
                stop.peers = Peers.gather()
                if processes.rank == 0:
                    state = _prepare_output(output_path, state_path, parts_dir, settings, resume)
                barrier()
                if processes.rank != 0:
                    resumed = resume and os.path.exists(state_path)
                    state = (_read_state(state_path) if resumed
                             else {"chunks": 0, "lines": 0, "bytes": 0, "truncated": 0})
                    if state.get("complete"):  # process 0 checks the input and says so
                        return FileTranslation(lines=state["lines"], chunks=state["chunks"],
                                               truncated=state["truncated"], resumed_chunks=state["chunks"],
                                               settings=settings)
                return _translate_chunks(engine, input_path, name, stdin, stdout, output_path, state_path,
                                         parts_dir, state, settings, processes, max_tokens, max_sentences, progress,
                                         seed, chunk_lines, stop)
        except RuntimeError as error:  # what a collective raises when it lost a process
            if stop.peers and (ended := stop.peers.lost(error)):
                raise stop.lost(ended) from None
            raise


def check_output(output_path: str | None, input_path: str | None, *, resume: bool = False,
                 processes: Processes | None = None) -> bool:
    """Refuse, before anything is written (the script asks before the model loads), an output this run cannot
    write: the input by any name, a directory (`vaswani.files.check_output_file`); `resume` into an output that
    cannot be resumed; under several processes, one that cannot hold their parts beside it. Returns whether the
    output is resumable: a regular file (or a new one), locked while written and kept with its record. Any other
    output (stdout, a device, a FIFO) gets the lines as they come, with no record beside it."""
    processes = processes or Processes.from_environment()
    stream = "stdout"
    if output_path is not None:
        files.check_output_file(output_path, [input_path], streams=True)
        kind = files.stream_kind(output_path)
        stream = kind and f"{output_path}, {kind},"
    if resume and stream:
        raise ValueError(f"--resume needs an --output_file that is a regular file: {stream} cannot be cut back or "
                         "appended to. Run without --resume to translate the whole input into it.")
    if processes.world_size > 1 and (input_path is None or stream):
        raise ValueError("Several processes need --input_file and an --output_file that is a regular file: each "
                         "reads the input and writes its chunks beside the output.")
    return not stream


class _StopRequest:
    """SIGTERM or SIGINT during a file's translation: raised at once while a chunk is being translated (the chunk
    is dropped; nothing of it was written), otherwise once the chunk being written out is complete and recorded."""

    def __init__(self, output_path: str | None, state_path: str | None, processes: Processes):
        self.output_path, self.state_path, self.processes = output_path, state_path, processes
        self.signum = 0
        self.interruptible = False
        self.lines = 0  # written to stdout so far
        self.peers: Peers | None = None  # the launch's processes, where there are several

    def request(self, signum: int) -> None:
        self.signum = self.signum or signum
        if self.interruptible:
            self.interruptible = False
            raise self.error()

    def check(self) -> None:
        """Raise where a signal came, or where another process of the launch has ended: process 0 would otherwise
        wait for its chunks until torchrun stops it."""
        if self.signum:
            raise self.error()
        if self.peers and (ended := self.peers.ended()):
            raise self.lost(ended)

    def recorded_lines(self) -> int:
        if self.state_path and os.path.exists(self.state_path):
            return _read_state(self.state_path)["lines"]
        return 0

    def kept(self) -> str:
        """What a full disk leaves, and how to go on."""
        return (f"its first {self.recorded_lines()} lines are complete and recorded in {self.state_path}; free some "
                "space, then run the same command with --resume")

    def sent(self) -> str:
        """What a stream that cannot be written any more got, and how to go on."""
        return (f"it got the first {self.lines} lines; an output that is not a file cannot be resumed, so translate "
                "into a file (--output_file) to keep what is done when a run stops")

    def lost(self, ended: str) -> PeerLost:
        if self.processes.rank != 0:
            kept = f"run the same command with --resume to finish {self.output_path}."
        else:
            kept = (f"{self.output_path} holds its first {self.recorded_lines()} lines, recorded in "
                    f"{self.state_path}. Run the same command with --resume to finish it.")
        return peer_lost(ended, "translation", self.processes.rank, kept)

    def error(self) -> Preempted | PeerLost:
        """A stop signal's error; where another process has ended (torchrun stops the rest of a launch that lost
        one), the error that names it."""
        if self.peers and (ended := self.peers.ended()):
            return self.lost(ended)
        stopped = f"Translation stopped by {signal_name(self.signum)}"
        if self.processes.rank != 0:
            return Preempted(self.signum, f"{stopped} in process {self.processes.rank}.")
        if self.state_path is None:
            return Preempted(self.signum, f"{stopped} after {self.lines} lines.")
        return Preempted(self.signum, f"{stopped}; {self.output_path} holds its first {self.recorded_lines()} lines, "
                         f"recorded in {self.state_path}. Run the same command with --resume to finish it.")


def _translate_chunks(engine, input_path, name, stdin, stdout, output_path, state_path, parts_dir, state, settings,
                      processes, max_tokens, max_sentences, progress, seed, chunk_lines, stop) -> FileTranslation:
    start = time.perf_counter()
    result = FileTranslation(lines=state["lines"], chunks=state["chunks"], truncated=state["truncated"],
                             resumed_chunks=state["chunks"], settings=settings)
    merger = None
    source = open(input_path, "rb") if input_path else stdin
    try:
        chunks = enumerate(read_raw_chunks(source, chunk_lines))
        recorded = _read_recorded(chunks, state["chunks"])
        if processes.rank == 0:
            _check_same_input(recorded, state, name, output_path)
            if state.get("complete"):
                if next(chunks, None) is not None:
                    raise _changed_input(name, output_path, f"it has more lines than the {state['lines']} translated")
                print(f"{output_path} is already complete ({state['lines']} lines); nothing to do.", file=sys.stderr)
                return result
            if state_path:
                with open(output_path, "ab") as f:  # created here if the kill came before the output was
                    f.truncate(state["bytes"])
            total = count_lines(input_path) if input_path else None
            show = sys.stderr.isatty() if progress is None else progress
            bar = tqdm(total=total, initial=state["lines"], unit=" lines", disable=not show, file=sys.stderr,
                       dynamic_ncols=True, smoothing=0.1)
            sink = open(output_path, "ab") if output_path else stdout
            merger = _Merger(sink, bar, state, state_path, parts_dir, settings, result, engine, stop)
        index = state["chunks"] - 1
        for index, raw_lines in chunks:
            digest = chunk_digest(raw_lines)
            if merger:
                merger.digests[index] = digest
            if index % processes.world_size != processes.rank:
                continue
            if parts_dir and processes.world_size > 1 and _part_digest(parts_dir, index) == digest:
                continue  # translated from these lines before a kill: the resume state keeps its settings
            lines = decode_lines(raw_lines, name, index * chunk_lines + 1)
            if seed is not None:
                torch.manual_seed(seed + index)
            stop.interruptible = True
            try:
                translations, truncated = translate_chunk(engine, lines, max_tokens, max_sentences)
            finally:
                stop.interruptible = False
            text = "".join(f"{line}\n" for line in translations).encode("utf-8")
            if processes.world_size == 1:
                merger.append(index, text, len(lines), truncated, digest)
            else:
                _write_part(parts_dir, index, text, len(lines), truncated, digest)
                if merger:
                    merger.merge_ready()
            if processes.rank != 0:
                result.lines += len(lines)
                result.chunks += 1
                result.truncated += truncated
            stop.check()
        if merger:
            merger.finish(index + 1)
    finally:
        if input_path:
            source.close()
        if merger:
            merger.close(output_path is not None)
    result.seconds = time.perf_counter() - start
    return result


def _read_recorded(chunks, count: int) -> tuple[str, int] | None:
    """Read the first `count` chunks (those a resumed run has translated) from `chunks` (enumerated raw chunks):
    their digest (`chain_digest`) and lines, or None where the input holds fewer chunks now."""
    digest, lines = "", 0
    for _ in range(count):
        item = next(chunks, None)
        if item is None:
            return None
        digest, lines = chain_digest(digest, chunk_digest(item[1])), lines + len(item[1])
    return digest, lines


def _check_same_input(recorded: tuple[str, int] | None, state: dict, name: str, output_path: str | None) -> None:
    """Refuse to resume where the input's first chunks are not the lines their recorded translations came from."""
    if recorded is None:
        raise _changed_input(name, output_path, f"it has fewer lines than the {state['lines']} already translated")
    if recorded[0] != state["input_digest"]:
        raise _changed_input(name, output_path, f"its first {recorded[1]} lines, already translated, are not the "
                             "lines they were translated from")


def _changed_input(name: str, output_path: str | None, what: str) -> ValueError:
    return ValueError(f"{name} has changed since {output_path} was written from it ({what}); its translations would "
                      "not line up with the input. Start again without --resume, or restore the input.")


class _Merger:
    """Process 0's writer: appends chunks in input order, flushes them to disk, then records them in the resume
    state (so a kill between the two leaves bytes past the recorded end, which a resume cuts off)."""

    def __init__(self, sink, bar, state, state_path, parts_dir, settings, result, engine, stop):
        self.sink, self.bar, self.state, self.state_path = sink, bar, dict(state), state_path
        self.parts_dir, self.settings, self.result, self.engine = parts_dir, settings, result, engine
        self.stop = stop
        # The digests of the chunks this process has read and not yet appended: a part is appended only once its
        # chunk is read here and the part was translated from the same lines (not left by a kill before an edit).
        self.digests: dict[int, str] = {}

    def append(self, index: int, text: bytes, lines: int, truncated: int, digest: str) -> None:
        assert index == self.state["chunks"], "chunks are appended in input order"
        self.sink.write(text)
        if self.state_path:
            sync_file(self.sink)
        else:
            self.sink.flush()
        self.state.update(chunks=index + 1, lines=self.state["lines"] + lines,
                          bytes=self.state["bytes"] + len(text), truncated=self.state["truncated"] + truncated,
                          input_digest=chain_digest(self.state["input_digest"], digest))
        self.digests.pop(index, None)
        if self.state_path:
            write_atomically(self.state_path, json.dumps({**self.state, "settings": self.settings}))
        self.result.lines, self.result.chunks = self.state["lines"], self.state["chunks"]
        self.result.truncated = self.state["truncated"]
        self.stop.lines = self.state["lines"]
        self.bar.update(lines)

    def merge_ready(self) -> None:
        """Append every finished part that is next in input order."""
        while (digest := self.digests.get(self.state["chunks"])) is not None:
            path = _part_path(self.parts_dir, self.state["chunks"])
            if _part_digest(self.parts_dir, self.state["chunks"]) != digest:
                return  # not written yet, or left from other lines and about to be written again
            with open(path, "rb") as f:
                lines, truncated, _ = json.loads(f.readline())
                text = f.read()
            self.append(self.state["chunks"], text, lines, truncated, digest)
            os.remove(path)

    def finish(self, chunks: int) -> None:
        """Wait for the other processes' last parts (a process that fails ends the launch, and with it this)."""
        while self.parts_dir and self.state["chunks"] < chunks:
            self.merge_ready()
            if self.state["chunks"] < chunks:
                self.stop.check()
                time.sleep(0.05)
        if self.parts_dir:
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        if self.state_path:  # kept, marked complete: the same command with --resume then has nothing to do
            write_atomically(self.state_path, json.dumps({**self.state, "complete": True, "settings": self.settings}))
        self.bar.close()
        warn_truncated(self.engine, self.state["truncated"])

    def close(self, owned: bool) -> None:
        self.bar.close()
        if owned:
            self.sink.close()


def _part_path(parts_dir: str, index: int) -> str:
    return os.path.join(parts_dir, f"{index:09d}.part")


def _write_part(parts_dir: str, index: int, text: bytes, lines: int, truncated: int, digest: str) -> None:
    """A chunk's translation for process 0 to append: a header line (with the digest of the chunk's input lines),
    then the text; complete or absent."""
    os.makedirs(parts_dir, exist_ok=True)
    path = _part_path(parts_dir, index)
    files.write_atomically(path, json.dumps([lines, truncated, digest]).encode() + b"\n" + text)


def _part_digest(parts_dir: str, index: int) -> str | None:
    """The input digest a chunk's part was translated from, or None where there is no such part (yet)."""
    try:
        with open(_part_path(parts_dir, index), "rb") as f:
            header = json.loads(f.readline())
    except FileNotFoundError:
        return None
    return header[2] if len(header) == 3 else None


class RunCheck(NamedTuple):
    """What `check_run` found before the model loads."""

    processes: Processes
    resumable: bool  # `check_output`'s answer
    resumed: dict | None  # the settings in the resume record a `resume` continues (`check_resume_record`)


def check_run(output_path: str | None, input_path: str | None, *, resume: bool = False) -> RunCheck:
    """What a script asks before its model loads, in one call: this process's place among those launched
    (`Processes.from_environment`), whether the output can be written and resumed (`check_output`), and with
    `resume`, the settings in its resume record, a damaged one refused (`check_resume_record`)."""
    processes = Processes.from_environment()
    resumable = check_output(output_path, input_path, resume=resume, processes=processes)
    return RunCheck(processes, resumable, check_resume_record(output_path) if resume else None)


def resume_record_path(output_path: str) -> str:
    return f"{output_path}.resume.json"


def check_resume_record(output_path: str) -> dict | None:
    """The settings in the resume record of `output_path`, where there is one, read whole: a damaged one is refused
    in one line naming it, which the script asks for before the model loads."""
    if os.path.exists(resume_record_path(output_path)):
        return _read_state(resume_record_path(output_path))["settings"]
    return None


def _read_state(state_path: str) -> dict:
    """The resume record; one written whole (`write_atomically`) and damaged since is named, not trusted."""
    return read_json_object(state_path, "start again without --resume", ("chunks", "lines", "bytes", "settings"))


def _prepare_output(output_path, state_path, parts_dir, settings, resume) -> dict:
    """The state to start from: a fresh output, or with `resume` the killed run's or a complete run's (which
    `translate_file` leaves as it is), once their settings are found the same; nothing is changed before the input
    is checked (`_translate_chunks` then cuts the output back to the last complete chunk). A fresh state is written
    before the output is created, so an output this tool has created always has one beside it; with `resume`, an
    output without one is started again only if it is missing or empty (nothing to lose), and refused otherwise."""
    fresh = {"chunks": 0, "lines": 0, "bytes": 0, "truncated": 0, "input_digest": ""}
    if state_path is None:  # a stream: nothing to resume
        return fresh
    if resume and os.path.exists(state_path):
        state = _read_state(state_path)
        changed = sorted(key for key in settings.keys() | state["settings"].keys()
                         if settings.get(key) != state["settings"].get(key))
        if changed:
            listed = ", ".join(f"{key} {state['settings'].get(key)!r} → {settings.get(key)!r}" for key in changed)
            raise ValueError(f"{output_path} was started with other settings ({listed}); resume with the same "
                             "ones, or start again without --resume.")
        size = os.path.getsize(output_path) if os.path.exists(output_path) else 0
        if size < state["bytes"] or (state.get("complete") and size != state["bytes"]):
            raise ValueError(f"{output_path} holds {size} bytes, its resume state {state_path} records "
                             f"{state['bytes']}: it was changed by something else; start again without --resume.")
        del state["settings"]
        return state
    if resume and os.path.exists(output_path) and os.path.getsize(output_path) > 0:
        raise ValueError(f"{output_path} has no resume state beside it ({state_path}), so it was not written by this "
                         "tool; it is left as it is. Start again without --resume to replace it.")
    shutil.rmtree(parts_dir, ignore_errors=True)
    had_state = os.path.exists(state_path)
    write_atomically(state_path, json.dumps({**fresh, "settings": settings}))
    try:
        with open(output_path, "wb"):
            pass
    except OSError:
        if not had_state:  # refused: nothing of this run is left behind
            os.remove(state_path)
        raise
    return fresh

