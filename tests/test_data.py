"""corpus.py, data.py, tokenization.py and batching.py: corpus resolution and download, robust reading, splits,
dataset loading, tokenization, batching."""

import ast
import gzip
import hashlib
import http.server
import io
import itertools
import json
import os
import random
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import datasets
import pytest
import torch
from datasets import Dataset, DatasetDict
from tokenizers import normalizers, processors

from vaswani import corpus as vcorpus
from vaswani import data, tokenization
from vaswani.batching import (
    TokenBatchSampler,
    bucket_lengths,
    example_lengths,
    pad_to_shape,
    padded_lengths,
    token_budget_batches,
)
from vaswani.corpus import ReadSummary, download_corpus, read_parallel_tsv, resolve_corpus_path
from vaswani.data import group_references, load_translation_dataset, split_by_source, split_of
from vaswani.tokenization import tokenize_translation_dataset
from vaswani.tokenization_vaswani import VaswaniTokenizer, train_tokenizer
from conftest import SHARED_CORPUS, free_port, script_module

REPO = Path(__file__).parents[1]
# Where this repository keeps the English-French corpus, beside the checkout (as the scripts look for it).
ANIMALS = ["cat", "dog", "bird", "horse", "fish", "cow", "duck", "goat"]
ANIMAUX = ["chat", "chien", "oiseau", "cheval", "poisson", "vache", "canard", "chèvre"]


def made_up_pairs(count: int) -> list[tuple[str, str]]:
    """Distinct English sentences with one to three French translations each (like Tatoeba's)."""
    pairs = []
    for i in range(count):
        animal, animal_fr = ANIMALS[i % 8], ANIMAUX[i % 8]
        english = f"The {animal} number {i} is sleeping."
        for form in ("Le {} numéro {} dort.", "Le {} numéro {} est endormi\u202f!", "Le {} n°{} dort.")[: 1 + i % 3]:
            pairs.append((english, form.format(animal_fr, i)))
    return pairs


def write_tsv(path: Path, pairs, compress: bool = False) -> Path:
    text = "".join(f"{a}\t{b}\n" for a, b in pairs).encode("utf-8")
    path.write_bytes(gzip.compress(text) if compress else text)
    return path


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path, monkeypatch):
    """Keep datasets' cache and any download in the test's own directory."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(vcorpus.CORPUS_ENV_VAR, raising=False)


@pytest.fixture(scope="module")
def small_tokenizer() -> VaswaniTokenizer:
    return train_tokenizer((s for pair in made_up_pairs(300) for s in pair), vocab_size=400)


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
# Reading


def test_reader_skips_and_counts_every_kind_of_bad_line(tmp_path):
    path = tmp_path / "messy.tsv"
    path.write_bytes(
        b"\xef\xbb\xbfHello.\tBonjour.\r\n"  # byte-order mark and Windows line end: kept
        b"no tab on this line\n"
        b"\n"
        b"Go.\tVa !\tCC-BY 2.0 (France) Attribution: tatoeba.org #2877272 (CM)\n"  # 3rd column: kept
        b"Empty target.\t  \n"
        b"\tEmpty source.\n"
        b"Bad \xff\xfe bytes.\tOctets invalides.\n"
        b"Last.\tDernier.\n"
    )
    pairs, summary = read_parallel_tsv(path)
    assert pairs == [("Hello.", "Bonjour."), ("Go.", "Va !"), ("Last.", "Dernier.")]
    assert summary == ReadSummary(path=str(path), lines=8, pairs=3, blank=1, no_tab=1, empty_side=2,
                                  invalid_utf8=1, extra_columns=1, truncated=False)
    assert summary.skipped == 5


def test_reader_detects_gzip_by_content_not_name(tmp_path):
    pairs = [("One.", "Un."), ("Two.", "Deux.")]
    assert read_parallel_tsv(write_tsv(tmp_path / "plain.tsv.gz", pairs))[0] == pairs
    assert read_parallel_tsv(write_tsv(tmp_path / "packed.tsv", pairs, compress=True))[0] == pairs


def test_gzip_cut_short_keeps_what_was_read(tmp_path):
    rng = random.Random(0)  # random words compress badly, so half the file holds many whole lines
    pairs = [(" ".join(rng.choice(ANIMALS) for _ in range(8)) + f" {i}.", f"Phrase {i}.") for i in range(5000)]
    whole = write_tsv(tmp_path / "whole.tsv.gz", pairs, compress=True).read_bytes()
    cut = tmp_path / "cut.tsv.gz"
    cut.write_bytes(whole[: len(whole) // 2])

    read, summary = read_parallel_tsv(cut)
    assert summary.truncated
    assert 100 < len(read) < len(pairs)
    assert read == pairs[: len(read)]


def test_missing_and_unreadable_files_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_parallel_tsv(tmp_path / "absent.tsv")
    with pytest.raises(IsADirectoryError, match="not a file"):
        read_parallel_tsv(tmp_path)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can read files without permission")
def test_file_without_read_permission_raises(tmp_path):
    path = write_tsv(tmp_path / "locked.tsv", [("a", "b")])
    path.chmod(0)
    with pytest.raises(OSError, match="Cannot read corpus file"):
        read_parallel_tsv(path)


# --------------------------------------------------------------------------------------------------
# Finding and downloading the corpus


def test_resolution_order_path_then_env_then_shared_then_download(tmp_path, monkeypatch):
    explicit = write_tsv(tmp_path / "explicit.tsv", [("a", "b")])
    from_env = write_tsv(tmp_path / "env.tsv", [("a", "b")])
    shared = write_tsv(tmp_path / "shared.tsv.gz", [("a", "b")], compress=True)
    downloaded = tmp_path / "downloaded.txt"
    monkeypatch.setattr(vcorpus, "download_corpus", lambda: downloaded)

    assert resolve_corpus_path() == downloaded
    assert resolve_corpus_path(default_corpus=tmp_path / "not-there.tsv.gz") == downloaded
    assert resolve_corpus_path(default_corpus=shared) == shared
    monkeypatch.setenv(vcorpus.CORPUS_ENV_VAR, str(from_env))
    assert resolve_corpus_path(default_corpus=shared) == from_env
    assert resolve_corpus_path(explicit, default_corpus=shared) == explicit


class Called(Exception):
    pass


def test_the_scripts_pass_the_repository_copy_that_the_package_does_not_know(monkeypatch, tmp_path):
    """The copy beside a checkout is the scripts' default; the installed package names no such place."""
    assert not hasattr(data, "SHARED_CORPUS") and not hasattr(vcorpus, "SHARED_CORPUS")
    seen = {}

    def capture(**found):
        seen.update(found)
        raise Called

    tokenizer_script = script_module("train_tokenizer")
    monkeypatch.setattr(tokenizer_script, "train_corpus_tokenizer", lambda *args, **kwargs: capture(**kwargs))
    with pytest.raises(Called):
        tokenizer_script.main(["--output_dir", str(tmp_path / "tokenizer")])
    assert seen["default_corpus"] == SHARED_CORPUS

    training_script = script_module("train_translation")
    monkeypatch.setattr(training_script, "keep_freed_cpu_memory", lambda **kwargs: None)  # process-wide otherwise
    monkeypatch.setattr(training_script, "run_training", lambda model_args, data_args, args: capture(
        default_corpus=Path(data_args.default_corpus), corpus=data_args.corpus))
    with pytest.raises(Called):
        training_script.main(["--output_dir", str(tmp_path / "model"), "--use_cpu", "true"])
    assert seen == {"default_corpus": SHARED_CORPUS, "corpus": None}

    bleu_script = script_module("evaluate_bleu")
    assert bleu_script.SHARED_CORPUS == SHARED_CORPUS


def test_a_wrong_explicit_path_or_env_var_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="given path"):
        resolve_corpus_path(tmp_path / "typo.tsv")
    monkeypatch.setenv(vcorpus.CORPUS_ENV_VAR, str(tmp_path / "typo.tsv"))
    with pytest.raises(FileNotFoundError, match=vcorpus.CORPUS_ENV_VAR):
        resolve_corpus_path()


class CountingHandler(http.server.SimpleHTTPRequestHandler):
    requests = 0

    def do_GET(self):
        type(self).requests += 1
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def web_root(tmp_path):
    """A local HTTP server standing in for manythings.org; yields (folder it serves, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    CountingHandler.requests = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: CountingHandler(*a, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def make_zip(members: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        for name, text in members.items():
            bundle.writestr(name, text)
    return buffer.getvalue()


def test_download_extracts_verifies_records_and_reuses_the_cache(web_root, tmp_path):
    root, base = web_root
    lines = "Go.\tVa !\tCC-BY 2.0 (France) Attribution: tatoeba.org\nHi.\tSalut !\tCC-BY 2.0\n"
    archive = make_zip({"fra.txt": lines, "_about.txt": "About."})
    (root / "fra-eng.zip").write_bytes(archive)
    cache = tmp_path / "cache"

    corpus = download_corpus(cache, url=f"{base}/fra-eng.zip")
    assert corpus == cache / "fra.txt" and corpus.read_text() == lines
    record = json.loads((cache / "download.json").read_text())
    assert record["sha256"]["zip"] == hashlib.sha256(archive).hexdigest()
    assert not list(cache.glob("*.part"))
    pairs, summary = read_parallel_tsv(corpus)
    assert pairs == [("Go.", "Va !"), ("Hi.", "Salut !")] and summary.extra_columns == 2

    # Pinned to the recorded checksum, the cached copy is used without another request.
    assert download_corpus(cache, url=f"{base}/fra-eng.zip", expected_sha256=record["sha256"]["zip"]) == corpus
    assert CountingHandler.requests == 1
    with pytest.raises(ValueError, match="not the expected"):
        download_corpus(cache, url=f"{base}/fra-eng.zip", expected_sha256="0" * 64)

    corpus.write_text(lines + "Tampered.\tTrafiqué.\n")
    with pytest.raises(ValueError, match="no longer matches"):
        download_corpus(cache, url=f"{base}/fra-eng.zip")


@pytest.mark.parametrize(
    "served, message",
    [
        (make_zip({"deu.txt": "Go.\tGeh.\n"}), "has no fra.txt"),
        (make_zip({"fra.txt": "<html>Not found</html>\n"}), "does not start with"),
        (b"<html>Forbidden</html>", "did not return a zip"),
    ],
    ids=["other-language", "not-sentence-pairs", "not-a-zip"],
)
def test_download_rejects_what_is_not_the_corpus(web_root, tmp_path, served, message):
    root, base = web_root
    (root / "fra-eng.zip").write_bytes(served)
    with pytest.raises(ValueError, match=message):
        download_corpus(tmp_path / "cache", url=f"{base}/fra-eng.zip")
    assert not (tmp_path / "cache" / "fra.txt").exists() and not list((tmp_path / "cache").iterdir())


def test_download_with_a_wrong_pinned_checksum_caches_nothing(web_root, tmp_path):
    root, base = web_root
    (root / "fra-eng.zip").write_bytes(make_zip({"fra.txt": "Go.\tVa !\n"}))
    with pytest.raises(ValueError, match="not the expected"):
        download_corpus(tmp_path / "cache", url=f"{base}/fra-eng.zip", expected_sha256="0" * 64)
    assert not list((tmp_path / "cache").iterdir())


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
# Tokenization and batching


def test_tokenize_translation_dataset(small_tokenizer):
    pairs = made_up_pairs(20)
    splits = DatasetDict(train=Dataset.from_dict({"source": [p[0] for p in pairs], "target": [p[1] for p in pairs]}))
    splits["test"] = group_references(splits["train"])
    tokenized = tokenize_translation_dataset(splits, small_tokenizer, max_length=6)
    for split in tokenized.values():
        assert split.column_names == ["input_ids", "attention_mask", "labels"]
    row = tokenize_translation_dataset(splits["train"], small_tokenizer)[0]
    assert row["labels"] == small_tokenizer(text_target=pairs[0][1])["input_ids"]
    assert small_tokenizer.decode(row["input_ids"], skip_special_tokens=True) == pairs[0][0]
    assert max(example_lengths(tokenized["train"])) == 6
    assert all(ids[-1] == small_tokenizer.eos_token_id for ids in tokenized["train"]["labels"][:])


# Text where a word-by-word encoding could part from the tokenizer's own: spaces of every kind, characters that
# normalising turns into spaces, letters or "<", added tokens written out, "▁", controls, combining marks.
TRICKY = (list("aé e\u0301ß.,!?'-«»…") + ["\u00a0", "\u202f", "\t", "\n", "\x1c", "\u2028", "\u2003", "´", "¨", "＜",
          "＞", "<", ">", "/s", "</s>", "<s>", "<pad>", "<0x41>", "▁", "▁▁", "  ", "😀", "ﬁ", "①", "\u200b", "\x85",
          "\x00", "\ufeff", "\U0001e030", "ǅ", "İ", "U.S.A.", "l'a", "don't", "est-il", "(x)", '"q"', "chat", "chien"])


def tricky_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = ["", " ", "  a  ", "\t", "a\x1cb", *(s for pair in made_up_pairs(50) for s in pair)]
    texts += ["".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 30))) for _ in range(count)]
    # Every code point of the first planes' common scripts, and some beyond, inside and around a word.
    points = [*range(0x3000), *rng.sample(range(0xE000, 0x110000), 2000)]
    return texts + [f"a{chr(point)}b {chr(point)}x {chr(point)}" for point in points if not 0xD800 <= point < 0xE000]


@pytest.mark.parametrize(("max_length", "mostly_new"), [(128, 2.0), (6, 2.0), (2, 2.0), (128, 0.0)],
                         ids=["words", "words-truncated", "words-only-eos", "sentences"])
def test_word_cached_encoding_gives_the_tokenizers_own_ids(small_tokenizer, max_length, mostly_new, monkeypatch):
    """Word by word (a batch is never too new for it) and a sentence at a time (every batch is)."""
    monkeypatch.setattr(tokenization, "MOSTLY_NEW", mostly_new)
    texts = tricky_texts(3000)
    encoder = tokenization.WordCachedEncoder.for_tokenizer(small_tokenizer, max_length)
    encoded = [ids for start in range(0, len(texts), 500) for ids in encoder(texts[start:start + 500])]
    expected = small_tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    assert [text for text, got, want in zip(texts, encoded, expected) if got != want] == []
    assert (len(encoder._ids) > 1000) == (mostly_new > 1)


def test_ordinary_text_is_encoded_from_the_word_cache(small_tokenizer):
    encoder = tokenization.WordCachedEncoder.for_tokenizer(small_tokenizer, 64)
    texts = [s for pair in made_up_pairs(300) for s in pair]
    assert encoder(texts) == small_tokenizer(texts, truncation=True, max_length=64)["input_ids"]
    assert "chèvre" in encoder._ids and "dort." in encoder._ids  # the words went through the cache


def test_word_cache_stays_within_its_bound(small_tokenizer, monkeypatch):
    monkeypatch.setattr(tokenization, "MOSTLY_NEW", 2.0)  # never a sentence at a time
    texts = tricky_texts(500, seed=1)
    encoder = tokenization.WordCachedEncoder.for_tokenizer(small_tokenizer, max_length=20, max_words=50)
    encoded, sizes, most_in_a_batch = [], [], 0
    for start in range(0, len(texts), 40):
        batch = texts[start:start + 40]
        encoded += encoder(batch)
        sizes.append(len(encoder._ids))
        most_in_a_batch = max(most_in_a_batch, len({w for t in batch for w in encoder._words(t) or []}))
    assert any(later < earlier for earlier, later in zip(sizes, sizes[1:]))  # it started over
    assert max(sizes) <= max(50, most_in_a_batch)  # only one batch's own words can take it past its bound
    assert encoded == small_tokenizer(texts, truncation=True, max_length=20)["input_ids"]


def test_tokenizing_word_by_word_gives_the_same_dataset(small_tokenizer, monkeypatch):
    split = Dataset.from_dict({"source": tricky_texts(200, seed=2)[:1000], "target": tricky_texts(200, seed=3)[-1000:]})
    words = tokenize_translation_dataset(split, small_tokenizer, max_length=24)
    monkeypatch.setattr(tokenization.WordCachedEncoder, "for_tokenizer", lambda *args, **kwargs: None)
    whole = tokenize_translation_dataset(split, small_tokenizer, max_length=24)
    assert words.features == whole.features and words[:] == whole[:]


def test_tokenizers_with_another_pipeline_are_called_as_usual(small_tokenizer, tmp_path):
    """Word-by-word encoding is only for the pipeline it is exact for; any other tokenizer is called whole."""
    other = VaswaniTokenizer.from_pretrained(save_to(small_tokenizer, tmp_path / "other"))
    other.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert tokenization.WordCachedEncoder.for_tokenizer(other, 32) is None
    assert tokenization.WordCachedEncoder.for_tokenizer(small_tokenizer, 1) is None  # no room beside </s>
    left = VaswaniTokenizer.from_pretrained(tmp_path / "other", truncation_side="left")
    assert tokenization.WordCachedEncoder.for_tokenizer(left, 32) is None
    pairs = made_up_pairs(20)
    split = Dataset.from_dict({"source": [p[0].upper() for p in pairs], "target": [p[1] for p in pairs]})
    tokenized = tokenize_translation_dataset(split, other, max_length=32)
    assert tokenized["input_ids"][:] == other(split["source"][:], truncation=True, max_length=32)["input_ids"]
    assert tokenized["input_ids"][:] != tokenize_translation_dataset(split, small_tokenizer, 32)["input_ids"][:]


@pytest.mark.parametrize("settings", [{}, {"add_bos_token": True}, {"add_eos_token": False},
                                      {"add_bos_token": True, "add_eos_token": False}],
                         ids=["default", "bos-and-eos", "no-eos", "bos-only"])
def test_word_cached_encoding_adds_what_the_tokenizers_settings_ask_for(small_tokenizer, tmp_path, settings):
    """transformers writes `add_bos_token` and `add_eos_token` into the backend's post-processor, which the encoder
    reads: the same ids as the tokenizer's own call, truncated or not."""
    tokenizer = VaswaniTokenizer.from_pretrained(save_to(small_tokenizer, tmp_path / "tokenizer"), **settings)
    texts = tricky_texts(300, seed=4)
    for max_length in (128, 6, 3):
        expected = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
        assert tokenization.WordCachedEncoder.for_tokenizer(tokenizer, max_length)(texts) == expected
    # The settings took effect: a sentence starts with <s> only if asked, and ends with </s> unless asked not to.
    ids = tokenizer("The cat number 1 is sleeping.")["input_ids"]
    assert (ids[0] == tokenizer.bos_token_id) == settings.get("add_bos_token", False)
    assert (ids[-1] == tokenizer.eos_token_id) == settings.get("add_eos_token", True)


def test_the_special_tokens_come_from_the_post_processor(small_tokenizer, tmp_path):
    """None adds no special token; a post-processor other than a template of special tokens is not guessed at."""
    bare = VaswaniTokenizer.from_pretrained(save_to(small_tokenizer, tmp_path / "bare"))
    bare.backend_tokenizer.post_processor = None
    texts = tricky_texts(100, seed=5)
    expected = bare(texts, truncation=True, max_length=8)["input_ids"]
    assert tokenization.WordCachedEncoder.for_tokenizer(bare, 8)(texts) == expected
    assert bare("a dog")["input_ids"][-1] != bare.eos_token_id
    other = VaswaniTokenizer.from_pretrained(tmp_path / "bare")
    other.backend_tokenizer.post_processor = processors.RobertaProcessing(("</s>", 1), ("<s>", 3))
    assert tokenization.WordCachedEncoder.for_tokenizer(other, 32) is None
    no_sequence = {"type": "TemplateProcessing", "single": [], "special_tokens": {}}
    assert tokenization.special_tokens_around(no_sequence) is None


def save_to(tokenizer, directory: Path) -> Path:
    tokenizer.save_pretrained(directory)
    return directory


def random_lengths(count: int = 2000, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 60) for _ in range(count)]


def test_batches_respect_the_token_budget_and_cover_every_example_once():
    lengths = random_lengths()
    sampler = TokenBatchSampler(lengths, max_tokens=256, seed=3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert all(len(b) * max(lengths[i] for i in b) <= 256 for b in batches)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    # Grouping by length is the point: padding should be a small share of what is computed.
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert sum(lengths) / padded > 0.9


def test_batches_are_deterministic_per_seed_and_epoch():
    lengths = random_lengths()

    def batches(seed, epoch):
        sampler = TokenBatchSampler(lengths, max_tokens=256, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert batches(0, 0) == batches(0, 0)
    assert batches(0, 0) != batches(0, 1)
    assert batches(0, 0) != batches(1, 0)
    ordered = list(TokenBatchSampler(lengths, max_tokens=256, shuffle=False))
    flat = [i for b in ordered for i in b]
    assert [lengths[i] for i in flat] == sorted(lengths)


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_budget_counts_the_padding_to_a_multiple(replicas):
    """With the collator's `pad_to_multiple_of`, a batch computes its size times its longest length rounded up to
    the multiple: that, not the unpadded size, stays within the budget, and translation's batches follow the rule."""
    lengths = random_lengths()
    sampler = TokenBatchSampler(lengths, max_tokens=256, seed=2, num_replicas=replicas, pad_to_multiple_of=8)
    batches = list(sampler)
    assert len(batches) % replicas == 0
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    padded = [len(b) * -(-max(lengths[i] for i in b) // 8) * 8 for b in batches]
    assert max(padded) <= 256
    # Without the multiple the same budget holds more examples: batches that padding would push over it.
    unpadded = list(TokenBatchSampler(lengths, max_tokens=256, seed=2, num_replicas=replicas))
    assert max(len(b) * -(-max(lengths[i] for i in b) // 8) * 8 for b in unpadded) > 256
    assert len(unpadded) < len(batches)
    assert list(padded_lengths([1, 8, 9, 16], 8)) == [8, 8, 16, 16] and list(padded_lengths([3, 9], None)) == [3, 9]
    for batch in token_budget_batches(lengths, max_tokens=256, pad_to_multiple_of=8):
        assert len(batch) * -(-max(lengths[i] for i in batch) // 8) * 8 <= 256


@pytest.mark.parametrize("replicas", [1, 3])
def test_shape_buckets_declare_a_few_shapes_within_the_budget(replicas):
    """With shape buckets every batch fits one of at most N declared (rows, length) shapes, and padded up to it
    (rows and length) still holds at most the budget's tokens; every example is in one batch, once."""
    lengths = random_lengths()
    sampler = TokenBatchSampler(lengths, max_tokens=256, seed=1, num_replicas=replicas, pad_to_multiple_of=8,
                                shape_buckets=4)
    buckets = sampler.shape_buckets
    assert len(buckets.shapes) == 4 and list(buckets.lengths) == sorted(buckets.lengths)
    assert all(length % 8 == 0 for length in buckets.lengths) and buckets.lengths[-1] == 64  # 60, padded to 8
    batches = list(sampler)
    assert len(batches) % replicas == 0
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    shapes = [buckets.shape(max(lengths[i] for i in b)) for b in batches]
    assert set(shapes) == set(buckets.shapes)
    assert all(len(b) <= rows and rows * length <= 256 for b, (rows, length) in zip(batches, shapes))
    assert TokenBatchSampler(lengths, max_tokens=256).shape_buckets is None


def test_bucket_lengths_pad_an_epoch_least():
    """The chosen lengths are those of fewest padded tokens among every choice of as many (found by trying all)."""
    rng = random.Random(4)
    lengths = [rng.choice([3, 5, 6, 9, 12, 17, 20, 21, 30]) for _ in range(300)]

    def padded(buckets):
        return int(padded_lengths(lengths, None, buckets).sum())

    distinct = sorted(set(lengths))
    for count in (1, 2, 3, 4):
        chosen = bucket_lengths(lengths, count)
        best = min(padded([*others, 30]) for others in itertools.combinations(distinct[:-1], count - 1))
        assert len(chosen) == count and chosen[-1] == 30 and padded(chosen) == best
    assert list(bucket_lengths(lengths, 20)) == distinct  # no more buckets than lengths
    assert list(bucket_lengths([7, 9, 10], 2, pad_to_multiple_of=8)) == [8, 16]
    assert bucket_lengths([], 3).size == 0
    with pytest.raises(ValueError, match="longer than the longest bucket"):
        padded_lengths([5, 40], None, [8, 16])


def test_padding_a_batch_to_its_shape_adds_examples_the_loss_ignores():
    batch = {"input_ids": torch.tensor([[5, 6, 2], [7, 2, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
             "labels": torch.tensor([[8, 2], [9, -100]])}
    padded = pad_to_shape(batch, 4, 5, {"input_ids": 0, "attention_mask": 0, "labels": -100})
    assert padded["input_ids"].tolist() == [[5, 6, 2, 0, 0], [7, 2, 0, 0, 0], [0] * 5, [0] * 5]
    # A padding row sees one token, so that no attention row is entirely masked.
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert padded["labels"].tolist() == [[8, 2, -100, -100, -100], [9, -100, -100, -100, -100], [-100] * 5, [-100] * 5]
    with pytest.raises(ValueError, match="No padding value for the batch's 'labels'"):
        pad_to_shape(batch, 4, 5, {"input_ids": 0, "attention_mask": 0})
    with pytest.raises(ValueError, match=r"does not fit \(1, 5\)"):
        pad_to_shape(batch, 1, 5, {"input_ids": 0, "attention_mask": 0, "labels": -100})


def test_an_example_longer_than_the_budget_once_padded_is_refused():
    TokenBatchSampler([10, 49, 20], max_tokens=50)
    with pytest.raises(ValueError, match="56 tokens padded.*longer than max_tokens=50"):
        TokenBatchSampler([10, 49, 20], max_tokens=50, pad_to_multiple_of=8)


def test_an_example_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="longer than max_tokens=50"):
        TokenBatchSampler([10, 51, 20], max_tokens=50)


def test_sampler_drives_a_dataloader(small_tokenizer):
    pairs = made_up_pairs(100)
    tokenized = tokenize_translation_dataset(
        Dataset.from_dict({"source": [p[0] for p in pairs], "target": [p[1] for p in pairs]}), small_tokenizer
    )
    sampler = TokenBatchSampler(example_lengths(tokenized), max_tokens=128)

    def collate(rows):
        return small_tokenizer.pad([{"input_ids": r["input_ids"]} for r in rows], return_tensors="pt")

    loader = torch.utils.data.DataLoader(tokenized, batch_sampler=sampler, collate_fn=collate)
    shapes = [batch["input_ids"].shape for batch in loader]
    assert len(shapes) == len(sampler) and sum(s[0] for s in shapes) == len(pairs)
    assert all(s[0] * s[1] <= 128 for s in shapes)


# --------------------------------------------------------------------------------------------------
# Script


def test_train_tokenizer_script(tmp_path):
    corpus = write_tsv(tmp_path / "pairs.tsv", made_up_pairs(300))
    out = tmp_path / "tokenizer"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_tokenizer.py"), "--corpus", str(corpus),
         "--vocab_size", "400", "--output_dir", str(out)],
        capture_output=True, text=True, env={**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf")},
    )
    assert result.returncode == 0, result.stderr
    tokenizer = VaswaniTokenizer.from_pretrained(out)
    assert len(tokenizer) == 400
    assert tokenizer.decode(tokenizer("Le chat numéro 7 dort !")["input_ids"], skip_special_tokens=True) == (
        "Le chat numéro 7 dort !"
    )


# --------------------------------------------------------------------------------------------------
# At scale: Arrow on disk, caches, parallel tokenization, several processes


def greedy_batches(sorted_lengths, max_tokens):
    """The greedy cut example by example, as `TokenBatchSampler` describes it: the reference for its fast one."""
    batches, batch = [], []
    for index, length in enumerate(sorted_lengths):
        if batch and (len(batch) + 1) * length > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(index)
    return batches + [batch] if batch else batches


@pytest.mark.parametrize("max_tokens", [60, 61, 256, 1000])
def test_the_cut_worked_out_per_length_is_the_greedy_cut(max_tokens):
    lengths = random_lengths(5000, seed=max_tokens) + [60] * 50 + [1] * 300
    ordered = list(TokenBatchSampler(lengths, max_tokens=max_tokens, shuffle=False))
    order = [i for batch in ordered for i in batch]
    sorted_lengths = [lengths[i] for i in order]
    assert [len(batch) for batch in ordered] == [len(batch) for batch in greedy_batches(sorted_lengths, max_tokens)]


@pytest.mark.parametrize("replicas", [2, 3, 8])
def test_batches_for_several_processes_come_in_a_multiple_of_their_number(replicas):
    lengths = random_lengths(1001)
    sampler = TokenBatchSampler(lengths, max_tokens=256, seed=1, num_replicas=replicas)
    batches = list(sampler)
    assert len(batches) == len(sampler) and len(batches) % replicas == 0
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 256 for b in batches)
    single = TokenBatchSampler(lengths, max_tokens=256, seed=1)
    assert len(single) <= len(sampler) < len(single) + replicas


def test_example_lengths_come_from_arrow_as_numbers(small_tokenizer, tmp_path):
    path = write_tsv(tmp_path / "pairs.tsv", made_up_pairs(200))
    train = load_translation_dataset(data_file=path, validation_fraction=0.1, test_fraction=0.1)["train"]
    tokenized = tokenize_translation_dataset(train.select(range(10, 90)), small_tokenizer)
    lengths = example_lengths(tokenized)
    expected = [max(len(s), len(t)) for s, t in zip(tokenized["input_ids"][:], tokenized["labels"][:])]
    assert lengths.dtype == "int64" and lengths.tolist() == expected


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


def test_the_tokenizer_learns_from_a_bounded_seeded_sample_and_is_trained_once(tmp_path, caplog):
    path = write_tsv(tmp_path / "pairs.tsv", made_up_pairs(600))
    train = load_translation_dataset(data_file=path, validation_fraction=0.1, test_fraction=0.1)["train"]
    sample = tokenization.tokenizer_training_sample(train, 100, seed=0)
    assert len(sample) == 100 and sample[:] == tokenization.tokenizer_training_sample(train, 100, seed=0)[:]
    assert sample[:] != tokenization.tokenizer_training_sample(train, 100, seed=1)[:]
    positions = {source: i for i, source in enumerate(train["source"][:])}
    assert [positions[s] for s in sample["source"][:]] == sorted(positions[s] for s in sample["source"][:])
    assert tokenization.tokenizer_training_sample(train, 10**6) is train

    caplog.set_level("INFO", logger="vaswani")
    tokenizer, sentences = tokenization.cached_corpus_tokenizer(train, 400, max_pairs=100)
    assert sentences == 200 and any("Training" in r.getMessage() for r in caplog.records)
    caplog.clear()
    again, _ = tokenization.cached_corpus_tokenizer(train, 400, max_pairs=100)
    assert not any("Training" in r.getMessage() for r in caplog.records)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    # On the whole split, the tokenizer is the one trained on every sentence, sources first.
    whole, sentences = tokenization.cached_corpus_tokenizer(train, 400)
    assert sentences == 2 * len(train)
    direct = train_tokenizer(train["source"][:] + train["target"][:], 400)
    assert whole.backend_tokenizer.to_str() == direct.backend_tokenizer.to_str()


def test_tokenization_runs_in_parallel_and_is_reused_from_disk(small_tokenizer, tmp_path, caplog):
    path = write_tsv(tmp_path / "pairs.tsv", made_up_pairs(400))
    train = load_translation_dataset(data_file=path, validation_fraction=0.1, test_fraction=0.1)["train"]
    caplog.set_level("INFO", logger="vaswani")
    two = tokenize_translation_dataset(train, small_tokenizer, max_length=12, num_proc=2)
    assert any("Tokenizing" in r.getMessage() for r in caplog.records) and len(two.cache_files) == 2
    in_memory = tokenize_translation_dataset(Dataset.from_dict(train[:]), small_tokenizer, max_length=12)
    assert two[:] == in_memory[:]
    caplog.clear()
    again = tokenize_translation_dataset(train, small_tokenizer, max_length=12)  # any number of processes reuses it
    assert any("Reusing" in r.getMessage() for r in caplog.records) and not any(
        "Tokenizing" in r.getMessage() for r in caplog.records)
    assert again[:] == in_memory[:] and again.cache_files == two.cache_files
    assert tokenize_translation_dataset(train, small_tokenizer, max_length=10).cache_files != two.cache_files
    assert tokenize_translation_dataset(train, small_tokenizer, max_length=12, overwrite_cache=True)[:] == in_memory[:]


@pytest.mark.slow
def test_two_processes_prepare_the_data_once_share_the_tokenizer_and_split_the_epoch(tmp_path):
    """Under torchrun with two CPU processes: the corpus is read, the tokenizer trained and the train split tokenized
    by one process only (the other loads the results), both hold byte-identical tokenizer files, and their
    batches are disjoint and together hold every example once, in each epoch."""
    corpus = write_tsv(tmp_path / "pairs.tsv.gz", made_up_pairs(500), compress=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(REPO / "tests" / "distributed_data_worker.py"), str(tmp_path),
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
    for epoch in range(2):
        first, second = ([i for batch in rank["epochs"][epoch] for i in batch] for rank in ranks)
        assert not set(first) & set(second)
        assert sorted(first + second) == list(range(examples))
        assert len(ranks[0]["epochs"][epoch]) == len(ranks[1]["epochs"][epoch])
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]
