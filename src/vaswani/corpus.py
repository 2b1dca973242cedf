"""Parallel corpora on disk: finding the English-French corpus (a path, $VASWANI_FRA_ENG, the caller's copy, or a
checked download from manythings.org) and reading tab-separated sentence pairs, with every skipped line counted.

The default corpus is manythings.org's English-French Anki file, built from Tatoeba sentences (CC-BY 2.0;
attribution: www.manythings.org/anki and tatoeba.org): about 163k lines `english<TAB>french`. `vaswani.data` turns a
corpus into train / validation / test splits.
"""

import gzip
import hashlib
import json
import logging
import os
import urllib.request
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from .files import write_atomically

logger = logging.getLogger(__name__)

CORPUS_URL = "http://www.manythings.org/anki/fra-eng.zip"
CORPUS_MEMBER = "fra.txt"  # the member of the zip that holds the sentence pairs
CORPUS_ENV_VAR = "VASWANI_FRA_ENG"
# manythings' files put English first and the other language second.
TSV_LANGUAGES = ("en", "fr")
# Skipped lines named one by one in the log; later ones are only counted.
NAMED_SKIPS = 5


# --------------------------------------------------------------------------------------------------
# Finding the corpus


def resolve_corpus_path(path: str | os.PathLike | None = None, default_corpus: str | os.PathLike | None = None) -> Path:
    """The corpus file to read: `path`, else $VASWANI_FRA_ENG, else `default_corpus` if that file exists (a copy
    the caller keeps, such as the one the scripts find beside a checkout), else a download.

    An explicit path or environment variable that points nowhere is an error rather than a reason to
    fall through to the next candidate: a typo should not silently train on another corpus.
    """
    for candidate, origin in ((path, "the given path"), (os.environ.get(CORPUS_ENV_VAR), f"${CORPUS_ENV_VAR}")):
        if candidate:
            candidate = Path(candidate).expanduser()
            if not candidate.is_file():
                raise FileNotFoundError(f"Corpus file {candidate} (from {origin}) does not exist or is not a file.")
            return candidate
    if default_corpus is not None and Path(default_corpus).is_file():
        return Path(default_corpus)
    return download_corpus()


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vaswani" / "fra-eng"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_corpus(
    cache_dir: str | os.PathLike | None = None, url: str = CORPUS_URL, expected_sha256: str | None = None
) -> Path:
    """Download manythings' zip once, check it, and return the path of the extracted `fra.txt`.

    manythings.org publishes no checksums and updates the file in place, so none can be pinned here. Instead
    the first download checks the structure (a zip whose `fra.txt` starts with a `english<TAB>french` line)
    and records the zip's and the extracted file's sha256 in `download.json`; later calls verify the cached
    file against that record. Pass `expected_sha256` (the zip's, as logged and recorded) to pin a version.
    Files go to `cache_dir`, by default $XDG_CACHE_HOME/vaswani/fra-eng (~/.cache/vaswani/fra-eng).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    corpus, record_path = cache_dir / CORPUS_MEMBER, cache_dir / "download.json"

    if corpus.is_file() and record_path.is_file():
        record = json.loads(record_path.read_text())
        if file_sha256(corpus) != record["sha256"][CORPUS_MEMBER]:
            raise ValueError(f"{corpus} no longer matches the sha256 recorded when it was downloaded; "
                             f"delete {cache_dir} to download it again.")
        if expected_sha256 is not None and record["sha256"]["zip"] != expected_sha256:
            raise ValueError(f"The corpus cached in {cache_dir} came from a zip with sha256 "
                             f"{record['sha256']['zip']}, not the expected {expected_sha256}.")
        return corpus

    cache_dir.mkdir(parents=True, exist_ok=True)
    archive = cache_dir / "download.zip.part"
    logger.info("Downloading %s to %s", url, cache_dir)
    # manythings.org refuses urllib's default User-Agent.
    request = urllib.request.Request(url, headers={"User-Agent": "Mozilla/5.0 (vaswani corpus download)"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response, open(archive, "wb") as out:
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
        zip_sha256 = file_sha256(archive)
        if expected_sha256 is not None and zip_sha256 != expected_sha256:
            raise ValueError(f"{url} has sha256 {zip_sha256}, not the expected {expected_sha256}.")
        _extract_corpus(archive, url, corpus)
    finally:
        archive.unlink(missing_ok=True)

    record = {"url": url, "sha256": {"zip": zip_sha256, CORPUS_MEMBER: file_sha256(corpus)}}
    write_atomically(record_path, json.dumps(record, indent=2) + "\n")
    logger.info("Downloaded %s (zip sha256 %s); pass expected_sha256 to pin this version.", url, zip_sha256)
    return corpus


def _extract_corpus(archive: Path, url: str, corpus: Path) -> None:
    """Check that `archive` is manythings' zip and write its sentence file to `corpus`."""
    try:
        with zipfile.ZipFile(archive) as bundle:
            if CORPUS_MEMBER not in bundle.namelist():
                raise ValueError(f"{url} has no {CORPUS_MEMBER} (it holds {bundle.namelist()}).")
            data = bundle.read(CORPUS_MEMBER)
    except zipfile.BadZipFile as err:
        raise ValueError(f"{url} did not return a zip file ({err}).") from err
    first_line = data.split(b"\n", 1)[0].decode("utf-8", errors="replace").split("\t")
    if len(first_line) < 2 or not all(column.strip() for column in first_line[:2]):
        raise ValueError(f"{CORPUS_MEMBER} from {url} does not start with an `english<TAB>french` line.")
    write_atomically(corpus, data)  # a crash never leaves a half-written corpus that looks complete


# --------------------------------------------------------------------------------------------------
# Reading tab-separated sentence pairs


@dataclass
class ReadSummary:
    """What `read_parallel_tsv` found. Skipped lines are counted by reason; nothing is dropped silently."""

    path: str
    lines: int = 0
    pairs: int = 0
    blank: int = 0  # skipped
    no_tab: int = 0  # skipped
    empty_side: int = 0  # skipped: one side is empty or whitespace
    invalid_utf8: int = 0  # skipped
    extra_columns: int = 0  # kept: manythings' newer files add an attribution column; the first two are used
    truncated: bool = False  # the gzip stream is cut short or corrupt; the pairs read before the damage are kept

    @property
    def skipped(self) -> int:
        return self.blank + self.no_tab + self.empty_side + self.invalid_utf8

    def __str__(self) -> str:
        counts = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)[1:])
        return f"{self.path}: {counts}"


def read_parallel_tsv(path: str | os.PathLike) -> tuple[list[tuple[str, str]], ReadSummary]:
    """Read `first<TAB>second[<TAB>...]` lines, plain or gzip-compressed (detected by content, not name).

    Malformed lines are skipped and counted in the returned summary, which is also logged. A gzip file cut
    short ends the reading with the pairs read so far. Only a file that cannot be opened raises.
    """
    summary = ReadSummary(path=str(Path(path)))
    pairs = list(iter_parallel_tsv(path, summary))
    log_read_summary(summary)
    return pairs, summary


def iter_parallel_tsv(path: str | os.PathLike, summary: ReadSummary) -> Iterator[tuple[str, str]]:
    """`read_parallel_tsv` one pair at a time, counting into `summary` (which the caller logs when done).
    The first skipped lines are named in the log by number, so a bad line in a file of millions can be found."""
    with open_corpus(Path(path)) as stream:
        for raw in _lines_until_truncation(stream, summary):
            summary.lines += 1
            pair = _parse_line(raw, summary)
            if pair is not None:
                summary.pairs += 1
                yield pair


def log_read_summary(summary: ReadSummary) -> None:
    log = logger.warning if summary.skipped or summary.truncated else logger.info
    log("Read %s", summary)


def require_pairs(summary: ReadSummary) -> None:
    """Refuse a corpus file that gave no sentence pair, saying whether it is empty or why no line parsed: read on,
    it would fail later with an error about dataset columns, or train a tokenizer on nothing."""
    if summary.pairs:
        return
    layout = f"one {TSV_LANGUAGES[0]}<TAB>{TSV_LANGUAGES[1]} sentence pair per line"
    if not summary.lines:
        damaged = " (its gzip stream is damaged before the first line)" if summary.truncated else ""
        raise ValueError(f"Corpus file {summary.path} is empty{damaged}; it must hold {layout}.")
    reasons = ", ".join(f"{name}={getattr(summary, name)}" for name in ("no_tab", "blank", "empty_side", "invalid_utf8")
                        if getattr(summary, name))
    raise ValueError(f"No line of corpus file {summary.path} holds a sentence pair ({summary.lines} lines: {reasons}); "
                     f"it must hold {layout}.")


def open_corpus(path: Path):
    """The corpus file as a binary stream, gunzipped if it is gzip (by content, not name); a missing file, a directory
    or an unreadable file raises an error that names it."""
    if not path.exists():
        raise FileNotFoundError(f"Corpus file {path} does not exist.")
    if not path.is_file():
        raise IsADirectoryError(f"Corpus path {path} is not a file.")
    try:
        with open(path, "rb") as probe:
            is_gzip = probe.read(2) == b"\x1f\x8b"
        return gzip.open(path, "rb") if is_gzip else open(path, "rb")
    except OSError as err:
        # Same exception type (PermissionError stays PermissionError), so the scripts report it in one line.
        raise type(err)(f"Cannot read corpus file {path}: {err.strerror or err}") from err


def _lines_until_truncation(stream, summary: ReadSummary) -> Iterator[bytes]:
    while True:
        try:
            raw = stream.readline()
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            summary.truncated = True
            logger.warning("%s is damaged or cut short after %d lines (%s); keeping what was read.",
                           summary.path, summary.lines, err)
            return
        if not raw:
            return
        yield raw


def _parse_line(raw: bytes, summary: ReadSummary) -> tuple[str, str] | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return _skip(summary, "invalid_utf8")
    line = line.rstrip("\r\n")
    if summary.lines == 1:
        line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
    if not line.strip():
        return _skip(summary, "blank")
    columns = line.split("\t")
    if len(columns) < 2:
        return _skip(summary, "no_tab")
    if len(columns) > 2:
        summary.extra_columns += 1
    first, second = columns[0].strip(), columns[1].strip()
    if not first or not second:
        return _skip(summary, "empty_side")
    return first, second


def _skip(summary: ReadSummary, reason: str) -> None:
    setattr(summary, reason, getattr(summary, reason) + 1)
    if summary.skipped <= NAMED_SKIPS:
        later = "; further skipped lines are only counted" if summary.skipped == NAMED_SKIPS else ""
        logger.warning("%s: skipping line %d (%s)%s.", summary.path, summary.lines, reason, later)
