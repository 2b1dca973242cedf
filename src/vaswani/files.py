"""Files: UTF-8 lines and JSON objects read with the file named on error, the checks that an output can be written
without destroying an input, one writer at a time per output (an OS lock), a full disk said in one line, and the one
way the package writes a file or directory atomically."""

import ctypes
import errno
import fcntl
import functools
import inspect
import json
import logging
import os
import shutil
import stat
import sys
from collections.abc import Iterable, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

logger = logging.getLogger(__name__)


def read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 text file, without their line ends; a decoding error names the file and the line."""
    with open(path, "rb") as f:
        return decode_lines((raw.removesuffix(b"\n") for raw in f), path)


def decode_lines(raw_lines: Iterable[bytes], name: str, first_line: int = 1) -> list[str]:
    """UTF-8 lines (ended at b"\n" only: U+2028 is not a line end) without a trailing \r; an undecodable line is a
    ValueError naming `name` and its line number (`first_line` is the number of the first)."""
    lines = []
    for number, raw in enumerate(raw_lines, first_line):
        try:
            lines.append(raw.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{name} is not UTF-8 text (line {number}: {error.reason}); convert it, e.g. with "
                             "`iconv -t utf-8`.") from error
    return lines


def read_json_object(path: str | os.PathLike, fix: str, fields: Sequence[str] = ()) -> dict:
    """The JSON object in `path`, which must hold `fields`; a file that is missing, empty, cut short, not JSON or
    without them is an error naming it and `fix` (what to do), in one line."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing; {fix}.") from None
    if not data.strip():
        raise ValueError(f"{path} is empty; {fix}.")
    try:
        value = json.loads(data)
    except ValueError as error:  # not UTF-8, or not JSON: cut short, or another file under this name
        raise ValueError(f"{path} is damaged: not valid JSON ({error}); {fix}.") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path} is damaged: it holds a JSON {type(value).__name__}, not an object; {fix}.")
    missing = [name for name in fields if name not in value]
    if missing:
        raise ValueError(f"{path} is not a {os.path.basename(path)}: it has no {', '.join(missing)}; {fix}.")
    return value


# Outputs --------------------------------------------------------------------------------------------------------------
# Every tool that reads files and writes another checks its output here before it opens anything for writing: the
# shell mistake `sort f > f` (an output that is the input, by the same name or another) must never empty an input.


def same_entry(first: str | os.PathLike, second: str | os.PathLike) -> bool:
    """Whether two paths name one file or directory, by any names (a symbolic or hard link): the same device and
    inode. False where either does not exist."""
    try:
        return os.path.samefile(first, second)
    except (OSError, ValueError):
        return False


def check_not_an_input(output: str | os.PathLike, inputs: Iterable[str | os.PathLike | None]) -> None:
    """Refuse (ValueError) an `output` that is one of `inputs` by any name, or a directory that holds one (a
    directory replaced whole would take the input with it). Inputs that do not exist here (a Hub id) are skipped."""
    for source in inputs:
        if source is None or not os.path.exists(source):
            continue
        if same_entry(output, source):
            raise ValueError(f"{output} is the input {source} (the same {_kind(source)}"
                             f"{'' if os.fspath(output) == os.fspath(source) else ' by another name'}): writing it "
                             "would destroy the input; choose another output.")
        for parent in Path(os.path.abspath(source)).parents:
            if same_entry(output, parent):
                raise ValueError(f"{output} holds the input {source}: replacing it would delete the input; choose "
                                 "another output.")


def check_output_file(output: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = (),
                      streams: bool = False) -> None:
    """Refuse, before anything is written, an output file that cannot be written as a file (a directory, a missing or
    read-only directory to hold it) or that is one of `inputs` (`check_not_an_input`); the messages name `output`.
    An output that is a device or a FIFO (`stream_kind`) is refused too, since a file is written beside it and
    renamed over it, unless the writer writes it as a `stream` (a translation's lines, as to stdout)."""
    if os.path.isdir(output) or os.fspath(output).endswith(os.sep):
        raise IsADirectoryError(f"{output} is a directory; give the path of a file to write.")
    kind = stream_kind(output)
    if kind is not None:
        if not streams or kind == "a socket":
            raise ValueError(f"{output} is {kind}, not a file; give the path of a file to write.")
        if not os.access(output, os.W_OK):
            raise PermissionError(f"Cannot write {output}: permission denied.")
        check_not_an_input(output, inputs)
        return
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"Cannot write {output}: the directory {parent} does not exist.")
    if not os.access(parent, os.W_OK) or (os.path.exists(output) and not os.access(output, os.W_OK)):
        raise PermissionError(f"Cannot write {output}: permission denied.")
    check_not_an_input(output, inputs)


def stream_kind(path: str | os.PathLike) -> str | None:
    """What `path` names (through links) where it is neither a regular file nor a directory: "a character device",
    "a block device", "a FIFO" or "a socket"; None otherwise, or where nothing is there yet."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, kind in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def _kind(path: str | os.PathLike) -> str:
    return "directory" if os.path.isdir(path) else "file"


# One writer at a time ------------------------------------------------------------------------------------------------
# Every tool that writes a file or directory a user names holds an flock(2) on it while it writes: a second writer
# (the same command launched twice, a requeue while the first still runs) is refused at once instead of interleaving
# its output with the first's. The kernel drops the lock when its process dies, however it dies, so nothing stale is
# ever left to clear by hand. Under torchrun or accelerate only the main process takes it (the others write nothing
# the main one does not coordinate), so one lock covers the run.


class OutputInUseError(FileExistsError):
    """Another process holds the lock on an output this one would write."""


# The locks this process holds, by lock file: asking again for one of them is a no-op (a script that locks its output
# before loading the model calls library functions that lock the same output).
_held: dict[str, int] = {}


def lock_path(target: str | os.PathLike) -> Path:
    """The lock file of `target`: `.NAME.lock` beside it, so that the lock survives `target` being replaced whole."""
    target = Path(os.path.abspath(target))
    return target.with_name(f".{target.name}.lock")


@contextmanager
def exclusive(target: str | os.PathLike, *, wait: bool = False):
    """Hold the OS lock on `target` (a file or directory about to be written; it need not exist) for the block.
    Where another process holds it: `OutputInUseError` naming `target` and that process, or, with `wait`, wait
    for it to end (a cache entry another run is building, which this one then reuses). The lock file holds the
    holder's process id and is removed when the block ends."""
    path = lock_path(target)
    if os.fspath(path) in _held:
        yield
        return
    descriptor = _acquire(path, target, wait)
    _held[os.fspath(path)] = descriptor
    try:
        yield
    finally:
        del _held[os.fspath(path)]
        # Removed while still held: a process that opened it meanwhile finds, once it gets the lock, that the name
        # points elsewhere (`_acquire` compares inodes) and locks the new file instead, never a forgotten one.
        with suppress(FileNotFoundError):
            os.unlink(path)
        os.close(descriptor)


def locking(parameter: str):
    """Decorate a function that writes the file or directory its argument `parameter` names: it runs holding that
    output's lock (`exclusive`), from its first check of the output to its last write."""

    def decorate(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with exclusive(signature.bind(*args, **kwargs).arguments[parameter]):
                return function(*args, **kwargs)

        return wrapper

    return decorate


def _acquire(path: Path, target, wait: bool) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = lock_holder(descriptor)
                if not wait:
                    raise OutputInUseError(f"{target} is being written by another process{holder}; wait for it to "
                                           "end (or stop it), then run this again.") from None
                logger.info("Waiting for the process%s writing %s.", holder, target)
                fcntl.flock(descriptor, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(descriptor).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(descriptor, 0)
                os.write(descriptor, f"{os.getpid()}\n".encode())
                return descriptor
        except BaseException:
            os.close(descriptor)
            raise
        os.close(descriptor)  # released and removed by its holder meanwhile: lock the file now under that name


def lock_holder(descriptor: int) -> str:
    """The process id a lock file holds, as " (process N)"; empty where its holder has not written it yet."""
    text = os.pread(descriptor, 32, 0).decode("ascii", "replace").strip()
    return f" (process {text})" if text.isdigit() else ""


# A full disk -------------------------------------------------------------------------------------------------------
# A write that fails for want of space (ENOSPC), of quota (EDQUOT) or past the largest file allowed (EFBIG) is one
# line naming what was being written and what is kept, never a traceback from deep inside a writer. The writers
# themselves keep what they had complete: a staged entry never replaces the old one, a translation's record lags its
# output, a checkpoint stays in its staging directory.

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# How writers that do not raise an OSError say the same: Rust's io::Error (safetensors), C++'s strerror.
FULL_DISK_WORDS = ("No space left on device", "Disk quota exceeded", "File too large", "StorageFull",
                   "QuotaExceeded", "FileTooLarge")
# torch.save's stream writer on a failed write says only "unexpected pos N vs M": taken for a full disk where the
# disk has less than this left.
NEARLY_FULL_BYTES = 64 << 20


class DiskFullError(OSError):
    """A write failed for want of space; the message names the path and what is kept."""


def is_full_disk(error: BaseException, path: str | os.PathLike | None = None) -> bool:
    """Whether `error`, or an error it was raised from, is a write that failed for want of space."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, DiskFullError) or (isinstance(error, OSError) and error.errno in FULL_DISK_ERRNOS):
            return True
        text = str(error)
        if any(words in text for words in FULL_DISK_WORDS):
            return True
        if "unexpected pos" in text and path is not None and free_bytes(path) < NEARLY_FULL_BYTES:
            return True
        error = error.__cause__ or error.__context__
    return False


def free_bytes(path: str | os.PathLike) -> int:
    """The bytes an unprivileged writer may still use on the filesystem of `path` (or of its nearest ancestor)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


@contextmanager
def reporting_full_disk(path: str | os.PathLike, kept):
    """Turn a write that fails for want of space inside the block into `DiskFullError`: "No space left on the
    device to write PATH; KEPT." `kept` (a string, or a function giving one when it happens) says what is kept and
    how to go on. Blocks nest: the outermost, which knows most of what the writer keeps, words the message."""
    try:
        yield
    except Exception as error:
        if not is_full_disk(error, path):
            raise
        cause = error.__cause__ if isinstance(error, DiskFullError) else error
        raise DiskFullError(f"No space left on the device to write {path}; "
                            f"{kept() if callable(kept) else kept}.") from cause


# Streams ------------------------------------------------------------------------------------------------------------
# stdout, a device or a FIFO get a translation's lines as they come; they cannot be cut back or appended to, so nothing
# is resumed there. A write that fails (a full device, a pipe or FIFO whose reader has gone, as after `| head -1`) is
# one line naming the stream and what it got, never a traceback.


class ClosedOutputError(OSError):
    """The reader of the pipe or FIFO this process writes has gone; the message names it and what it got."""


@contextmanager
def reporting_unwritable_stream(name: str, kept):
    """Turn a write inside the block that fails for want of space or of a reader into `DiskFullError` or
    `ClosedOutputError`: "No space left on the device to write NAME; KEPT." / "NAME was closed by its reader; KEPT."
    `kept` (a string, or a function giving one) says what the stream got and how to go on."""
    try:
        yield
    except OSError as error:
        closed = _is_closed_pipe(error)
        if not closed and not is_full_disk(error):
            raise
        what = kept() if callable(kept) else kept
        if closed:
            raise ClosedOutputError(f"{name} was closed by its reader; {what}.") from error
        raise DiskFullError(f"No space left on the device to write {name}; {what}.") from error


def _is_closed_pipe(error: BaseException) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.EPIPE:
            return True
        error = error.__cause__ or error.__context__
    return False


# Atomic writes --------------------------------------------------------------------------------------------------------
# Every file and directory the package publishes goes through the helpers below, with one set of rules: the new entry
# is written under a staging name beside its target; its bytes (every file of a staged directory) are fsynced; one
# rename puts it in place; the parent directory is fsynced, so that the rename itself survives a power cut. A reader
# therefore sees the old entry or the complete new one, never part of either. Staging names start with
# `STAGING_PREFIX`, which no reader of the package looks for; a crash leaves at most such a name behind.

STAGING_PREFIX = ".tmp-"


def staging_path(target: str | os.PathLike, tag: str = "") -> Path:
    """The staging name of `target`, beside it: `.tmp-<name><tag>`. Writers that may run at once in several
    processes pass a `tag` of their own (e.g. the process id)."""
    target = Path(target)
    return target.with_name(f"{STAGING_PREFIX}{target.name}{tag}")


def sync_file(f) -> None:
    """Flush an open file and its data to disk."""
    f.flush()
    os.fsync(f.fileno())


def sync_directory(path: str | os.PathLike) -> None:
    """Make the entries of a directory (a rename into it) durable. Platforms that cannot open a directory (Windows)
    have nothing to sync."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under `path` (a staged directory about to be published)."""
    for root, _, names in os.walk(path):
        sync_files(root, names)
        sync_directory(root)


def sync_files(directory: str | os.PathLike, names: Iterable[str]) -> None:
    """fsync the files `names` of `directory` (a symbolic link's target is no part of it)."""
    for name in names:
        if os.path.islink(os.path.join(directory, name)):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            os.fsync(f.fileno())


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `data` (text as UTF-8, or bytes) to `path`: the file is the complete new one or the old one (or
    absent), whenever the process or the machine stops."""
    temporary = staging_path(path, f"-{os.getpid()}")
    with reporting_full_disk(path, lambda: f"{path} is left as it was" if os.path.exists(path) else
                             "nothing was written"):
        _write_atomically(path, temporary, data)


def _write_atomically(path, temporary: Path, data: str | bytes) -> None:
    try:
        try:
            f = open(temporary, "wb")
        except OSError as error:  # the message names the file asked for, not the staging name
            raise type(error)(error.errno, error.strerror, os.fspath(path)) from error
        with f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            sync_file(f)
        os.replace(temporary, path)
        sync_directory(Path(path).parent)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def replace_directory(staging: str | os.PathLike, target: str | os.PathLike) -> bool:
    """Publish the complete directory `staging` as `target`, replacing any directory there. Returns False, with
    `staging` removed, where another process published `target` while this one was renaming (a cache entry both
    built; theirs is as good).

    On Linux an existing `target` is swapped with `staging` in one step (`exchange`), so a reader finds the old
    entry or the new one, never neither. Elsewhere POSIX renames a directory only onto an absent or empty one, so an
    existing `target` is first renamed aside (to a staging name) and removed once the new one is in: between those
    two renames a reader finds no entry (never a partial or mixed one), and a crash there leaves the old entry under
    its staging name."""
    staging, target = Path(staging), Path(target)
    sync_tree(staging)
    if target.exists() and exchange(staging, target):
        sync_directory(target.parent)
        shutil.rmtree(staging, ignore_errors=True)  # now the old entry
        return True
    aside = None
    if target.exists():
        aside = staging_path(target, f".old-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
    try:
        os.rename(staging, target)
    except OSError:
        if not target.exists():
            if aside is not None:
                os.replace(aside, target)
            raise
        shutil.rmtree(staging, ignore_errors=True)
        published = False
    else:
        published = True
    sync_directory(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return published


# renameat2(2)'s arguments: paths relative to the working directory, and the flag that swaps two existing entries.
AT_FDCWD, RENAME_EXCHANGE = -100, 2


def exchange(first: str | os.PathLike, second: str | os.PathLike) -> bool:
    """Swap two existing entries in one atomic step (Linux's renameat2 with RENAME_EXCHANGE, which the standard
    library does not offer). False, with nothing changed, where the platform, its C library or the filesystem cannot;
    any other failure is an OSError."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library older than glibc 2.28, or none that ctypes can open
        return False
    if renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # an old kernel, or a filesystem without the flag
        return False
    raise OSError(code, os.strerror(code), os.fspath(first), None, os.fspath(second))


@contextmanager
def staged_directory(target: str | os.PathLike, tag: str = "", *, last: str | None = None, nested: bool = False,
                     remove_on_error: bool = True, kept=None):
    """Yield an empty staging directory to write into; when the block ends without an error, publish it as `target`,
    otherwise remove it. The one way the package publishes a directory:

    * by default the staging directory is beside `target` and replaces it whole (`replace_directory`);
    * with `last`, `target` holds other entries that stay (a run directory's checkpoints and logs): the staged
      directory gets every entry of `target` that it does not hold itself, as hard links (no data is copied), and
      then replaces `target` whole, so a reader (or a crash) finds the old set of files or the new one, never a mix.
      Where `target` cannot be replaced whole (`replaceable`: a mount point, a symbolic link, the working
      directory, a parent that cannot be written) or its filesystem makes no hard links, the staged files are moved
      in one by one with `publish_files`, `last` (the file whose presence says the set is complete) last;
    * with `nested`, the writer names its output itself (the Trainer writes `checkpoint-N` into the directory it is
      given): the block writes into the staging directory, and `<staging>/<target's name>` is published;
    * with `remove_on_error` False, a failed block leaves the staging directory for the next writer (or a resumed
      run) to remove, as a crash would: other processes may still be writing into it.

    A write that fails for want of space is a `DiskFullError` naming `target` and `kept` (what is kept and how to
    go on; by default, that `target` is left as it was)."""
    target = Path(os.path.abspath(target))  # "." and ".." have no name to stage beside
    whole = last is None or replaceable(target)
    staging = staging_path(target if whole else target / "staged", tag)
    if kept is None:
        def kept():
            return f"{target} is left as it was" if target.exists() else f"{target} was not created"
    shutil.rmtree(staging, ignore_errors=True)  # the remains of a crash
    try:
        with reporting_full_disk(target, kept):
            staging.mkdir(parents=True)
            yield staging
            if last is not None and whole and not carry_over(target, staging):
                inside = staging_path(target / "staged", tag)
                shutil.rmtree(inside, ignore_errors=True)
                os.rename(staging, inside)
                staging, whole = inside, False
            if not whole:
                publish_files(staging, target, last)
            else:
                replace_directory(staging / target.name if nested else staging, target)
                shutil.rmtree(staging, ignore_errors=True)  # a nested entry's parent (or, after an exchange, nothing)
    except BaseException:
        if remove_on_error:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def replaceable(directory: Path) -> bool:
    """Whether `directory` can be replaced whole by a directory beside it: not a mount point or a symbolic link
    (a rename would not reach what it points to), nor the working directory or one that holds it (this process
    would be left in the deleted old one), and in a parent that this process may write, on the same filesystem."""
    if not directory.exists():
        return os.access(directory.parent, os.W_OK)
    if directory.is_symlink() or os.path.ismount(directory):
        return False
    resolved, working = directory.resolve(), Path.cwd().resolve()
    if resolved == working or resolved in working.parents:
        return False
    return os.access(resolved.parent, os.W_OK) and os.stat(resolved.parent).st_dev == os.stat(resolved).st_dev


def carry_over(target: Path, staging: Path) -> bool:
    """Give `staging` every entry of `target` that it does not hold, as hard links (directories as directories of
    hard links, symbolic links as such), and `target`'s permissions; staging remains (`STAGING_PREFIX`) are left
    behind. False, with nothing carried over, where the filesystem refuses a hard link."""
    if not target.exists():
        return True
    carried = []
    try:
        for entry in sorted(target.iterdir()):
            destination = staging / entry.name
            if entry.name.startswith(STAGING_PREFIX) or os.path.lexists(destination):
                continue
            carried.append(destination)
            if entry.is_symlink():
                os.symlink(os.readlink(entry), destination)
            elif entry.is_dir():
                shutil.copytree(entry, destination, symlinks=True, copy_function=os.link)
            else:
                os.link(entry, destination)
        shutil.copymode(target, staging)
    except OSError:
        for destination in carried:
            if destination.is_dir() and not destination.is_symlink():
                shutil.rmtree(destination, ignore_errors=True)
            elif os.path.lexists(destination):
                destination.unlink()
        return False
    return True


def publish_files(staging: str | os.PathLike, directory: str | os.PathLike, last: str) -> None:
    """Move the files of the complete directory `staging` into `directory`, which holds other entries too (so it
    cannot be replaced whole), then remove `staging`. Each file is renamed in complete (subdirectories with
    `replace_directory`), and `last`, the file whose presence says the set is complete, is removed first and
    moved in last: a crash never leaves a truncated file, nor `last` beside files of another set."""
    staging, directory = Path(staging), Path(directory)
    sync_files(staging, [entry.name for entry in staging.iterdir() if not entry.is_dir()])  # subdirectories: below
    (directory / last).unlink(missing_ok=True)
    for entry in sorted(staging.iterdir(), key=lambda entry: entry.name == last):
        if entry.is_dir():
            replace_directory(entry, directory / entry.name)
        else:
            os.replace(entry, directory / entry.name)
    sync_directory(directory)
    staging.rmdir()
