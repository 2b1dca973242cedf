"""Parallel corpora -> `datasets.DatasetDict` splits, kept in Arrow caches; `vaswani.tokenization` turns them into
tokenized examples and `vaswani.batching` into batches.

The default corpus is the English-French Tatoeba file that `vaswani.corpus` finds and reads. Any Hugging Face
translation dataset or local tsv/csv/jsonl file can be used instead (`load_translation_dataset`).

Every source gives the same schema:
  train                 one row per sentence pair:         {"source", "target"}
  validation and test   one row per distinct source:       {"source", "target", "references"}
                        `references` holds every translation of that source; `target` is the first.

Corpora of millions of lines stay on disk: a tsv file is read once, line by line, into Arrow files that are
memory-mapped (`datasets`' own loaders do the same for csv, jsonl and Hub datasets), and every costly step
(reading here, tokenizer training and tokenization in `vaswani.tokenization`) leaves its result in a cache keyed by
what it was made from (`cache_key`), so a second run, or a second process of a distributed run, reuses it instead of
repeating it.

Tatoeba has many sentences with several translations ("Run!" -> "Cours !", "Courez !"). Splitting by
pair would put some translations of a sentence in training and others in the test set, so the split is
decided by a hash of the normalised source sentence: all its translations land in one split, and a
sentence's split depends on nothing else, so it does not move when the corpus grows.
"""

import contextlib
import hashlib
import json
import logging
import os
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, Features, List, Value, load_dataset, load_from_disk
from datasets.table import InMemoryTable

from .corpus import (
    TSV_LANGUAGES,
    ReadSummary,
    file_sha256,
    iter_parallel_tsv,
    log_read_summary,
    open_corpus,
    require_pairs,
    resolve_corpus_path,
)
from .files import exclusive, read_json_object, staged_directory

logger = logging.getLogger(__name__)


# On the 2019 Tatoeba file (113,830 distinct English sentences) these give 2,257 validation and 3,437 test sources.
VALIDATION_FRACTION = 0.02
TEST_FRACTION = 0.03

PAIR_FEATURES = Features({"source": Value("string"), "target": Value("string")})
EVAL_FEATURES = Features(
    {"source": Value("string"), "target": Value("string"), "references": List(Value("string"))}
)
EVAL_SCHEMA = EVAL_FEATURES.arrow_schema

# Part of every cache key: raise it when the rules that made a cached result change, so stale results are not reused.
CACHE_FORMAT = 1
# Rows per Arrow record batch written while reading a tsv file: what reading holds in memory at a time.
WRITE_BATCH_ROWS = 100_000


# --------------------------------------------------------------------------------------------------
# Splits


def _split_key(sentence: str) -> str:
    """Spellings of one sentence that differ only in case, spacing or Unicode form share a split."""
    return " ".join(unicodedata.normalize("NFKC", sentence).casefold().split())


def split_of(source: str, validation_fraction: float, test_fraction: float) -> str:
    """"train", "validation" or "test", from a hash of the normalised source sentence alone."""
    digest = hashlib.sha256(_split_key(source).encode("utf-8")).digest()
    position = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    if position < validation_fraction:
        return "validation"
    if position < validation_fraction + test_fraction:
        return "test"
    return "train"


def split_by_source(pairs: Dataset, validation_fraction: float, test_fraction: float) -> DatasetDict:
    """Split a {"source", "target"} dataset into train / validation / test, keeping each source in one split."""
    _check_fractions(validation_fraction, test_fraction)
    assigned = pairs.map(
        lambda batch: {"split": [split_of(s, validation_fraction, test_fraction) for s in batch["source"]]},
        batched=True,
        desc="assigning splits",
    )

    def rows_of(name: str) -> Dataset:
        return assigned.filter(lambda batch: [s == name for s in batch["split"]], batched=True).remove_columns("split")

    return DatasetDict(
        train=rows_of("train"),
        validation=group_references(rows_of("validation")),
        test=group_references(rows_of("test")),
    )


def _check_fractions(validation_fraction: float, test_fraction: float) -> None:
    if not (0 <= validation_fraction and 0 <= test_fraction and validation_fraction + test_fraction < 1):
        raise ValueError(f"validation_fraction={validation_fraction} and test_fraction={test_fraction} must be "
                         "non-negative and sum to less than 1.")


def group_references(pairs: Dataset) -> Dataset:
    """One row per distinct source, in order of first appearance, with all its distinct translations.

    Translations that differ only in Unicode form (U+202F vs U+00A0 before "!" in Tatoeba) count once.
    """
    table = pairs.with_format("arrow")[:]  # the rows `pairs` shows (after a filter), as one Arrow table
    if "references" in table.column_names:  # already grouped: one row per (source, translation) again
        references = table.column("references")
        table = pa.table({"source": table.column("source").take(pc.list_parent_indices(references)),
                          "target": pc.list_flatten(references)})
    return Dataset(InMemoryTable(pa.Table.from_batches(list(grouped_batches(table)), schema=EVAL_SCHEMA)))


def grouped_batches(pairs: pa.Table) -> Iterator[pa.RecordBatch]:
    """`group_references`' rows for a {"source", "target"} table, in record batches of `WRITE_BATCH_ROWS` sources.

    Arrow numbers the distinct sources in order of first appearance and NumPy orders the rows by that number, so a
    million held-out pairs are grouped in little more memory than their text (as Python objects they take several
    times it); only one batch's translations are Python strings at a time, to drop those that differ from an
    earlier one only in Unicode form.
    """
    if not pairs.num_rows:
        return
    encoded = pc.dictionary_encode(pairs.column("source"))  # every chunk shares one dictionary: the distinct sources
    sources = encoded.chunk(0).dictionary
    codes = np.concatenate([chunk.indices.to_numpy() for chunk in encoded.chunks])
    rows = np.argsort(codes, kind="stable")  # each source's rows in row order, source after source
    ends = np.cumsum(np.bincount(codes, minlength=len(sources)))  # where each source's rows end in `rows`
    for first in range(0, len(sources), WRITE_BATCH_ROWS):
        last = min(first + WRITE_BATCH_ROWS, len(sources))
        bounds = np.concatenate([[ends[first - 1] if first else 0], ends[first:last]])
        translations = pairs.column("target").take(rows[bounds[0]:bounds[-1]]).to_pylist()
        references = [_distinct_forms(translations[start - bounds[0]:end - bounds[0]])
                      for start, end in zip(bounds[:-1], bounds[1:])]
        targets = pa.array([kept[0] for kept in references], pa.string())
        yield pa.record_batch([sources.slice(first, last - first), targets, pa.array(references, pa.list_(pa.string()))],
                              schema=EVAL_SCHEMA)


def _distinct_forms(translations: list[str]) -> list[str]:
    """`translations` without those that differ from an earlier one only in Unicode form (most have one)."""
    if len(translations) == 1:
        return translations
    kept, forms = [], set()
    for translation in translations:
        form = unicodedata.normalize("NFKC", translation)
        if form not in forms:
            forms.add(form)
            kept.append(translation)
    return kept


# --------------------------------------------------------------------------------------------------
# Loading any corpus into that schema


def load_translation_dataset(
    dataset_name: str | os.PathLike | None = None,
    dataset_config: str | None = None,
    *,
    data_file: str | os.PathLike | None = None,
    default_corpus: str | os.PathLike | None = None,
    source_lang: str = "en",
    target_lang: str = "fr",
    validation_fraction: float = VALIDATION_FRACTION,
    test_fraction: float = TEST_FRACTION,
    cache_dir: str | os.PathLike | None = None,
    overwrite_cache: bool = False,
) -> DatasetDict:
    """Load a parallel corpus as train / validation / test splits in this module's schema.

    Sources, in order of precedence:
      dataset_name   a Hugging Face Hub dataset (`load_dataset(dataset_name, dataset_config)`, e.g. "wmt14",
                     "fr-en") or a directory written by `save_to_disk`. Rows hold a `translation` dict
                     ({"en": ..., "fr": ...}, as run_translation.py expects), columns named by language, or
                     `source`/`target` columns.
      data_file      a local file: .csv, .json or .jsonl (columns as above), or tab-separated text, plain or
                     gzipped, laid out like manythings' files (English first).
      neither        the English-French Tatoeba corpus (`resolve_corpus_path(None, default_corpus)`).
    Validation and test splits the dataset provides are kept; missing ones are carved out of train by
    `split_by_source` with the given fractions.

    The splits are memory-mapped Arrow files. A tsv file is read once into `cache_dir` (default: `datasets`'
    cache, $HF_DATASETS_CACHE/vaswani), keyed by its content, the languages and the fractions; later calls reuse
    that unless `overwrite_cache`. The other sources are cached by `datasets` itself.
    """
    if dataset_name is not None and data_file is not None:
        raise ValueError("Pass either dataset_name or data_file, not both.")
    if dataset_name is not None:
        if Path(dataset_name, "dataset_dict.json").is_file() or Path(dataset_name, "state.json").is_file():
            loaded = load_from_disk(str(dataset_name))
        else:
            loaded = load_dataset(str(dataset_name), dataset_config)
    else:
        path = resolve_corpus_path(data_file, default_corpus)
        name = path.name.removesuffix(".gz")
        if not name.endswith((".csv", ".json", ".jsonl")):
            return _tsv_splits(path, source_lang, target_lang, validation_fraction, test_fraction,
                               Path(cache_dir) if cache_dir is not None else default_data_cache_dir(), overwrite_cache)
        loaded = load_dataset("csv" if name.endswith(".csv") else "json", data_files=str(path))
    if isinstance(loaded, Dataset):
        loaded = DatasetDict(train=loaded)
    if "train" not in loaded:
        raise ValueError(f"The dataset has no train split (it has {list(loaded)}).")

    splits = {name: _to_pairs(split, source_lang, target_lang) for name, split in loaded.items()
              if name in ("train", "validation", "test")}
    if not len(splits["train"]):
        raise ValueError(f"The train split of {path if dataset_name is None else dataset_name} holds no sentence "
                         "pair with both sides non-empty.")
    carved = split_by_source(
        splits["train"],
        validation_fraction if "validation" not in splits else 0.0,
        test_fraction if "test" not in splits else 0.0,
    )
    return DatasetDict(
        train=carved["train"],
        validation=group_references(splits["validation"]) if "validation" in splits else carved["validation"],
        test=group_references(splits["test"]) if "test" in splits else carved["test"],
    )


def default_data_cache_dir() -> Path:
    """Where corpora read into Arrow, trained tokenizers and tokenized splits are kept: beside `datasets`' own
    cache ($HF_DATASETS_CACHE), which users of large corpora already point at a large disk."""
    return Path(datasets.config.HF_DATASETS_CACHE) / "vaswani"


def cache_key(*parts) -> str:
    """A short cache key for the given parts (strings, numbers, None); `CACHE_FORMAT` is meant to be one of them."""
    return hashlib.sha256(json.dumps([str(part) for part in parts]).encode("utf-8")).hexdigest()[:24]


def _tsv_splits(path: Path, source_lang: str, target_lang: str, validation_fraction: float, test_fraction: float,
                cache_dir: Path, overwrite_cache: bool) -> DatasetDict:
    """The splits of a tab-separated corpus as memory-mapped Arrow files, read once and then reused.

    One pass over the file: each pair is parsed, given its split by `split_of`, and written to its split's file a
    batch at a time, so memory does not grow with the corpus. Validation and test pairs (a few percent) are then
    grouped by source (`grouped_batches`). The read summary is kept beside the files and logged
    again on reuse, so skipped lines are never forgotten.
    """
    if source_lang not in TSV_LANGUAGES or target_lang not in TSV_LANGUAGES:
        raise ValueError(f"Tab-separated files hold {TSV_LANGUAGES[0]!r} then {TSV_LANGUAGES[1]!r}; "
                         f"cannot read {source_lang!r} -> {target_lang!r} from {path}.")
    _check_fractions(validation_fraction, test_fraction)
    if not path.is_file():
        open_corpus(path)  # raises the reader's error for a missing file or a directory
    key = cache_key(file_sha256(path), source_lang, target_lang, validation_fraction, test_fraction, CACHE_FORMAT)
    directory = cache_dir / f"corpus-{key}"
    if overwrite_cache or not (directory / "read.json").is_file():
        with exclusive(directory, wait=True):  # another run reading the same corpus: wait for it, then reuse its work
            if overwrite_cache or not (directory / "read.json").is_file():
                _write_tsv_splits(path, TSV_LANGUAGES.index(source_lang), TSV_LANGUAGES.index(target_lang),
                                  validation_fraction, test_fraction, directory)
    else:
        # A cache entry is published whole, so a damaged one was damaged afterwards (a disk, a hand): named, not reused.
        fix = f"delete {directory}, and the next run reads {path} again"
        recorded = read_json_object(directory / "read.json", fix, fields=("pairs",))
        summary = ReadSummary(**{**recorded, "path": str(path)})
        logger.info("Reusing %s, read earlier into %s.", path, directory)
        log_read_summary(summary)
    splits = {}
    for name in ("train", "validation", "test"):
        try:
            splits[name] = Dataset.from_file(str(directory / f"{name}.arrow"))
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"{directory / name}.arrow is damaged ({str(error).splitlines()[0]}); delete {directory}, "
                             f"and the next run reads {path} again.") from error
    # Arrow's allocator keeps what reading freed (about 35 MB a million pairs) for reuse; training never reuses it,
    # so it goes back to the system now.
    pa.default_memory_pool().release_unused()
    return DatasetDict(splits)


def _write_tsv_splits(path: Path, source_column: int, target_column: int, validation_fraction: float,
                      test_fraction: float, directory: Path) -> None:
    # Several processes may build the same entry at once: each stages its own, and the first published stands.
    with staged_directory(directory, tag=f"-{os.getpid()}") as staging:
        _write_splits_into(staging, path, source_column, target_column, validation_fraction, test_fraction)


def _write_splits_into(staging: Path, path: Path, source_column: int, target_column: int, validation_fraction: float,
                       test_fraction: float) -> None:
    summary = ReadSummary(path=str(path))
    logger.info("Reading %s into %s.", path, staging.parent)
    # Each split's pairs go to their own file a batch at a time, so what reading holds does not grow with the corpus;
    # held-out pairs are then grouped by source from their memory-mapped file.
    names = ("train", "validation", "test")
    with contextlib.ExitStack() as files:
        writers = {name: files.enter_context(_PairWriter(staging / (name if name == "train" else f"{name}-pairs")))
                   for name in names}
        for pair in iter_parallel_tsv(path, summary):
            source = pair[source_column]
            writers[split_of(source, validation_fraction, test_fraction)].add(source, pair[target_column])
    log_read_summary(summary)
    require_pairs(summary)
    for name in names[1:]:
        pairs_file = staging / f"{name}-pairs.arrow"
        with pa.memory_map(str(pairs_file)) as source, pa.OSFile(str(staging / f"{name}.arrow"), "wb") as sink, \
                pa.ipc.new_stream(sink, EVAL_SCHEMA) as writer:
            for batch in grouped_batches(pa.ipc.open_stream(source).read_all()):
                writer.write_batch(batch)
        pairs_file.unlink()
    (staging / "read.json").write_text(json.dumps(summary.__dict__, indent=1) + "\n")


class _PairWriter:
    """Appends (source, target) pairs to `{stem}.arrow` as an Arrow stream, `WRITE_BATCH_ROWS` at a time."""

    def __init__(self, stem: Path):
        self.path = stem.with_suffix(".arrow")
        self.sources, self.targets = [], []

    def __enter__(self):
        self.sink = pa.OSFile(str(self.path), "wb")
        self.writer = pa.ipc.new_stream(self.sink, PAIR_FEATURES.arrow_schema)
        return self

    def add(self, source: str, target: str) -> None:
        self.sources.append(source)
        self.targets.append(target)
        if len(self.sources) == WRITE_BATCH_ROWS:
            self._write()

    def _write(self) -> None:
        columns = [pa.array(self.sources, pa.string()), pa.array(self.targets, pa.string())]
        self.writer.write_batch(pa.record_batch(columns, schema=PAIR_FEATURES.arrow_schema))
        self.sources.clear()
        self.targets.clear()

    def __exit__(self, *exc_info) -> None:
        try:
            if self.sources and exc_info[0] is None:
                self._write()
            self.writer.close()
        finally:
            self.sink.close()


def _to_pairs(split: Dataset, source_lang: str, target_lang: str) -> Dataset:
    """Bring a split's columns to {"source", "target"} (plus `references` if it has them), dropping empty pairs."""
    columns = split.column_names
    if "translation" in columns:
        def extract(batch):
            return {"source": [row[source_lang] for row in batch["translation"]],
                    "target": [row[target_lang] for row in batch["translation"]]}
    elif source_lang in columns and target_lang in columns:
        def extract(batch):
            return {"source": batch[source_lang], "target": batch[target_lang]}
    elif "source" in columns and "target" in columns:
        def extract(batch):
            return {"source": batch["source"], "target": batch["target"]}
    else:
        raise ValueError(f"Cannot find {source_lang!r}/{target_lang!r} sentences in columns {columns}: expected a "
                         "`translation` dict column, columns named by language, or `source` and `target` columns.")
    keep = ["references"] if "references" in columns else []
    pairs = split.map(extract, batched=True, remove_columns=[c for c in columns if c not in keep],
                      desc="extracting sentence pairs")
    pairs = pairs.map(lambda batch: {"source": [s.strip() for s in batch["source"]],
                                     "target": [t.strip() for t in batch["target"]]}, batched=True)
    kept = pairs.filter(lambda batch: [bool(s and t) for s, t in zip(batch["source"], batch["target"])],
                        batched=True)
    if len(kept) < len(pairs):
        logger.warning("Dropped %d of %d pairs with an empty side.", len(pairs) - len(kept), len(pairs))
    return kept
