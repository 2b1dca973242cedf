"""data.py: the data stages in order, splits by source, other corpora, Arrow caches on disk, several processes
preparing the data once."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from vaswani import data
from vaswani.data import group_references, load_translation_dataset, split_by_source, split_of
from conftest import SHARED_CORPUS
from data_helpers import REPO, isolated_caches, made_up_pairs, write_tsv  # noqa: F401 (an autouse fixture)


# --------------------------------------------------------------------------------------------------
# The stages


def relative_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of each `from .module import names` in the file at `path` (module "" for `from . import`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(node.module or "", [alias.name for alias in node.names])
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]


def test_the_data_stages_import_downward_and_no_module_imports_private_names():
    """corpus ← data ← tokenization: a stage uses the stages before it, never one after it; and no module of the
    package imports a name another keeps private."""
    package = Path(data.__file__).parent
    stages = ["corpus", "data", "tokenization"]
    for position, stage in enumerate(stages):
        for module, names in relative_imports(package / f"{stage}.py"):
            assert not {module, *names} & set(stages[position + 1:]), f"{stage}.py imports a later stage"
    for path in sorted(package.glob("*.py")):
        for module, names in relative_imports(path):
            assert not [name for name in names if name.startswith("_")], f"{path.name} imports from .{module}: {names}"


# --------------------------------------------------------------------------------------------------
# Splits


def test_split_is_decided_by_the_normalised_source_alone():
    keys = [f"Sentence {i} !" for i in range(200)]
    reference = [split_of(key, 0.3, 0.3) for key in keys]
    assert [split_of(f"  SENTENCE {i}\u00a0! ", 0.3, 0.3) for i in range(200)] == reference
    assert set(reference) == {"train", "validation", "test"}
    assert {split_of(f"Sentence {i}.", 0.0, 0.0) for i in range(100)} == {"train"}
    assert {split_of(f"Sentence {i}.", 0.0, 1.0 - 1e-9) for i in range(100)} == {"test"}


def test_split_keeps_all_translations_of_a_source_together_and_groups_references():
    pairs = made_up_pairs(3000)
    splits = split_by_source(Dataset.from_dict({"source": [p[0] for p in pairs], "target": [p[1] for p in pairs]}),
                             validation_fraction=0.1, test_fraction=0.2)
    translations = {}
    for source, target in pairs:
        translations.setdefault(source, []).append(target)

    train_sources = set(splits["train"]["source"][:])
    for name in ("validation", "test"):
        split = splits[name]
        assert not train_sources & set(split["source"][:])
        assert split.column_names == ["source", "target", "references"]
        for row in split:
            assert row["references"] == translations[row["source"]] and row["target"] == row["references"][0]
    assert len(splits["train"]) == sum(len(translations[s]) for s in train_sources)
    # The fractions are of distinct sources; 3,000 draws keep each within a few points.
    assert 0.07 < len(splits["validation"]) / 3000 < 0.13 and 0.17 < len(splits["test"]) / 3000 < 0.23
    assert not set(splits["validation"]["source"][:]) & set(splits["test"]["source"][:])


def test_split_is_deterministic_and_ignores_row_order():
    pairs = made_up_pairs(500)
    as_dataset = lambda rows: Dataset.from_dict({"source": [p[0] for p in rows], "target": [p[1] for p in rows]})
    first = split_by_source(as_dataset(pairs), 0.1, 0.1)
    again = split_by_source(as_dataset(list(reversed(pairs))), 0.1, 0.1)
    for name in ("train", "validation", "test"):
        assert sorted(first[name]["source"][:]) == sorted(again[name]["source"][:])


def test_bad_fractions_are_refused():
    pairs = Dataset.from_dict({"source": ["a"], "target": ["b"]})
    with pytest.raises(ValueError, match="sum to less than 1"):
        split_by_source(pairs, 0.6, 0.5)


def test_references_differing_only_in_unicode_spaces_count_once():
    pairs = Dataset.from_dict({"source": ["Run!", "Run!", "Run!"], "target": ["Cours\u202f!", "Cours\xa0!", "Courez !"]})
    assert group_references(pairs)[0]["references"] == ["Cours\u202f!", "Courez !"]


def test_real_corpus_splits():
    if not SHARED_CORPUS.is_file():
        pytest.skip(f"the English-French corpus is not at {SHARED_CORPUS}")
    splits = load_translation_dataset(default_corpus=SHARED_CORPUS)
    assert 150_000 < len(splits["train"]) < 160_000
    assert 2_000 < len(splits["validation"]) < 2_600 and 3_000 < len(splits["test"]) < 3_800
    assert any(len(refs) > 1 for refs in splits["test"]["references"][:])
    train = set(splits["train"]["source"][:])
    assert not train & set(splits["validation"]["source"][:]) and not train & set(splits["test"]["source"][:])


# --------------------------------------------------------------------------------------------------
# Loading other corpora


def test_tsv_file_in_either_direction(tmp_path):
    path = write_tsv(tmp_path / "pairs.tsv.gz", made_up_pairs(200), compress=True)
    en_fr = load_translation_dataset(data_file=path, validation_fraction=0.2, test_fraction=0.2)
    fr_en = load_translation_dataset(data_file=path, source_lang="fr", target_lang="en",
                                     validation_fraction=0.2, test_fraction=0.2)
    assert en_fr["train"][0] == {"source": "The cat number 0 is sleeping.", "target": "Le chat numéro 0 dort."}
    assert set(fr_en["train"]["target"][:]) | set(fr_en["validation"]["target"][:]) | set(
        fr_en["test"]["target"][:]) == {p[0] for p in made_up_pairs(200)}
    with pytest.raises(ValueError, match="cannot read 'de'"):
        load_translation_dataset(data_file=path, source_lang="de")


def test_csv_and_jsonl_files(tmp_path):
    pairs = made_up_pairs(100)
    csv = tmp_path / "pairs.csv"
    csv.write_text("en,fr\n" + "".join(f'"{en}","{fr}"\n' for en, fr in pairs), encoding="utf-8")
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps({"translation": {"en": en, "fr": fr}}) + "\n" for en, fr in pairs))
    for path in (csv, jsonl):
        splits = load_translation_dataset(data_file=path, validation_fraction=0.2, test_fraction=0.2)
        total = len(splits["train"]) + sum(len(r) for r in splits["validation"]["references"][:]) + sum(
            len(r) for r in splits["test"]["references"][:])
        assert total == len(pairs)
        assert splits["train"].column_names == ["source", "target"]


def test_saved_hugging_face_dataset_keeps_its_own_splits(tmp_path):
    def translations(rows):
        return Dataset.from_dict({"translation": [{"en": en, "fr": fr, "de": "-"} for en, fr in rows], "id": list(range(len(rows)))})

    pairs = made_up_pairs(60)
    DatasetDict(train=translations(pairs[:80]), validation=translations(pairs[80:100] + [("Extra.", "  ")]),
                test=translations(pairs[100:])).save_to_disk(tmp_path / "saved")
    splits = load_translation_dataset(tmp_path / "saved")
    assert len(splits["train"]) == 80
    assert sum(len(r) for r in splits["validation"]["references"][:]) == 20  # the empty pair is dropped
    assert sum(len(r) for r in splits["test"]["references"][:]) == len(pairs) - 100
    assert splits["test"].column_names == ["source", "target", "references"]


def test_single_saved_dataset_gets_carved_and_bad_columns_are_explained(tmp_path):
    pairs = made_up_pairs(300)
    Dataset.from_dict({"en": [p[0] for p in pairs], "fr": [p[1] for p in pairs]}).save_to_disk(tmp_path / "flat")
    splits = load_translation_dataset(tmp_path / "flat", validation_fraction=0.2, test_fraction=0.2)
    assert len(splits["validation"]) > 20 and len(splits["test"]) > 20

    Dataset.from_dict({"english": ["a"], "french": ["b"]}).save_to_disk(tmp_path / "odd")
    with pytest.raises(ValueError, match="Cannot find 'en'/'fr'"):
        load_translation_dataset(tmp_path / "odd")
    with pytest.raises(ValueError, match="either"):
        load_translation_dataset(tmp_path / "odd", data_file=tmp_path / "x.tsv")


# --------------------------------------------------------------------------------------------------
# At scale: Arrow on disk, caches, several processes


def test_a_tsv_file_becomes_memory_mapped_arrow_read_once(tmp_path, caplog):
    pairs = made_up_pairs(300)
    path = write_tsv(tmp_path / "pairs.tsv.gz", pairs, compress=True)
    caplog.set_level("INFO", logger="vaswani")
    splits = load_translation_dataset(data_file=path, validation_fraction=0.2, test_fraction=0.2)
    # The same splits as grouping the pairs in memory, in the same order.
    in_memory = split_by_source(Dataset.from_dict({"source": [p[0] for p in pairs], "target": [p[1] for p in pairs]}),
                                0.2, 0.2)
    for name in ("train", "validation", "test"):
        assert splits[name][:] == in_memory[name][:]
        assert splits[name].cache_files and splits[name].data.__class__.__name__ == "MemoryMappedTable"
    assert any("Reading" in r.getMessage() for r in caplog.records)

    caplog.clear()
    again = load_translation_dataset(data_file=path, validation_fraction=0.2, test_fraction=0.2)
    assert [r.getMessage() for r in caplog.records if "Reading" in r.getMessage()] == []
    assert any("Reusing" in r.getMessage() for r in caplog.records)
    assert again["train"][:] == splits["train"][:]
    # Other fractions, or another file, are other entries of the cache.
    assert len(load_translation_dataset(data_file=path, validation_fraction=0.1, test_fraction=0.1)["train"]) > len(
        splits["train"])


def test_a_bad_line_in_a_long_file_is_named_counted_and_skipped(tmp_path, caplog):
    lines = [f"Sentence {i}.\tPhrase {i}." for i in range(20_000)]
    lines[12_344] = "a line without its tab"
    path = tmp_path / "long.tsv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    caplog.set_level("INFO", logger="vaswani")
    splits = load_translation_dataset(data_file=path)
    assert sum(len(split) for split in splits.values()) == 19_999
    assert any("line 12345 (no_tab)" in r.getMessage() for r in caplog.records)
    assert any("no_tab=1" in r.getMessage() for r in caplog.records)
    caplog.clear()
    load_translation_dataset(data_file=path)  # from the cache: the summary is logged again
    assert any("no_tab=1" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


@pytest.mark.slow
def test_two_processes_prepare_the_data_once_share_the_tokenizer_and_split_the_epoch(tmp_path):
    """Under torchrun with two CPU processes: the corpus is read, the tokenizer trained and the train split tokenized
    by one process only (the other loads the results), both hold byte-identical tokenizer files, and their
    batches are disjoint and together hold every example once, in each epoch, bucketed and packed (one launch: the
    batching is the trainer's, after the data)."""
    corpus = write_tsv(tmp_path / "pairs.tsv.gz", made_up_pairs(500), compress=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "tests" / "distributed_data_worker.py"), str(tmp_path),
               "--corpus", str(corpus), "--preset", "tiny", "--vocab_size", "400", "--tokenizer_train_pairs", "300",
               "--output_dir", str(tmp_path / "out"), "--max_tokens_per_batch", "200", "--ddp_backend", "gloo",
               "--use_cpu", "--report_to", "none", "--preprocessing_num_workers", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]

    def count(text):
        return [sum(text in message for message in rank["messages"]) for rank in ranks]

    assert count("Reading") == [1, 0] and count("Training a") == [1, 0]
    assert count("Tokenizing") == [2, 0]  # train and validation
    assert count("Reusing") == [0, 4]  # the corpus, the tokenizer, the tokenized train and validation splits
    files = sorted(p.name for p in (tmp_path / "tokenizer-0").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "tokenizer-1").iterdir()) and "tokenizer.json" in files
    for name in files:
        assert (tmp_path / "tokenizer-0" / name).read_bytes() == (tmp_path / "tokenizer-1" / name).read_bytes(), name
    examples = ranks[0]["train_examples"]
    assert sorted(ranks[0]["epochs"]) == ["bucketed", "packed"]
    assert ranks[0]["epochs"]["bucketed"] != ranks[0]["epochs"]["packed"]  # the packed run's own batches
    for batching in ("bucketed", "packed"):
        for epoch in range(2):
            first, second = ([i for batch in rank["epochs"][batching][epoch] for i in batch] for rank in ranks)
            assert not set(first) & set(second), batching
            assert sorted(first + second) == list(range(examples)), batching
            assert len(ranks[0]["epochs"][batching][epoch]) == len(ranks[1]["epochs"][batching][epoch]), batching
        assert ranks[0]["epochs"][batching][0] != ranks[0]["epochs"][batching][1], batching


ARROW_RETAINED = """
import sys
import pyarrow as pa
import vaswani.data as vdata

def anon():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon")) / 1024

vdata.load_translation_dataset(data_file=sys.argv[1], cache_dir=sys.argv[2])
before = anon()
pa.default_memory_pool().release_unused()
print(before - anon())
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process' memory from /proc")
def test_reading_a_corpus_gives_back_what_arrow_freed(tmp_path):
    """After a corpus is read (a million pairs here), Arrow's allocator holds no freed memory for the run to carry:
    releasing it once more gives back less than 8 MiB (about 35 MiB before)."""
    printed = read_in_a_process(tmp_path, ARROW_RETAINED, pairs=1_000_000, sources=1_000_000)
    assert float(printed.split()[-1]) < 8, printed


def read_in_a_process(tmp_path, script: str, pairs: int, sources: int) -> str:
    """What `script` prints, run in a fresh process on a corpus of `pairs` made-up pairs of `sources` distinct
    English sentences."""
    corpus = tmp_path / "corpus.tsv"
    with open(corpus, "w", encoding="utf-8") as out:
        for i in range(pairs):
            out.write(f"sentence number {i % sources} is here and long enough\tla phrase numéro {i} est ici\n")
    (tmp_path / "read.py").write_text(script)
    done = subprocess.run([sys.executable, str(tmp_path / "read.py"), str(corpus), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process' memory from /proc")
def test_reading_holds_the_held_out_pairs_on_disk_not_in_memory(tmp_path):
    """Held-out pairs go to disk as they are read and are grouped there by Arrow, so reading's peak does not grow with
    them: 270,000 held-out pairs (of 300,000) raise it by under 70 MiB (49 here; 149 when they were grouped as Python
    objects, 83 with Arrow's own group_by)."""
    printed = read_in_a_process(tmp_path, READING_PEAK, pairs=300_000, sources=150_000)
    held, peak = printed.split()[-2:]
    assert int(held) > 250_000 and float(peak) < 70, printed


READING_PEAK = """
import sys, threading, time
import vaswani.data as vdata

def anon():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon")) / 1024

vdata.WRITE_BATCH_ROWS = 5_000  # what reading holds of each split at a time, small beside the held-out pairs
base = peak = anon()
done = threading.Event()

def sample():
    global peak
    while not done.is_set():
        peak = max(peak, anon())
        time.sleep(0.01)

sampler = threading.Thread(target=sample)
sampler.start()
splits = vdata.load_translation_dataset(data_file=sys.argv[1], cache_dir=sys.argv[2], validation_fraction=0.45,
                                        test_fraction=0.45)
done.set()
sampler.join()
print(sum(len(references) for name in ("validation", "test") for references in splits[name]["references"][:]),
      peak - base)
"""
