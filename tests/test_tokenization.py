"""tokenization.py: tokenized datasets, the word-cached encoder that gives the tokenizer's own ids, the tokenizer
trained on a sample of the train split (and scripts/train_tokenizer.py), caches on disk."""

import random
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict, List, Value
from tokenizers import normalizers, processors

from vaswani import tokenization
from vaswani.batching import example_lengths
from vaswani.data import group_references, load_translation_dataset
from vaswani.tokenization import tokenize_translation_dataset
from vaswani.tokenization_vaswani import VaswaniTokenizer, train_tokenizer
from conftest import script_main
from data_helpers import isolated_caches, made_up_pairs, small_tokenizer, write_tsv  # noqa: F401 (fixtures)


# --------------------------------------------------------------------------------------------------
# Tokenized datasets and the word-cached encoder


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
        most_in_a_batch = max(most_in_a_batch, len({w for t in batch for w in t.split(" ")}))
    assert any(later < earlier for earlier, later in zip(sizes, sizes[1:]))  # it started over
    assert max(sizes) <= max(50, most_in_a_batch)  # only one batch's own words can take it past its bound
    assert encoded == small_tokenizer(texts, truncation=True, max_length=20)["input_ids"]


def test_tokenizing_word_by_word_gives_the_same_dataset(small_tokenizer, monkeypatch):
    split = Dataset.from_dict({"source": tricky_texts(200, seed=2)[:1000], "target": tricky_texts(200, seed=3)[-1000:]})
    words = tokenize_translation_dataset(split, small_tokenizer, max_length=24)
    monkeypatch.setattr(tokenization.WordCachedEncoder, "for_tokenizer", lambda *args, **kwargs: None)
    whole = tokenize_translation_dataset(split, small_tokenizer, max_length=24)
    assert words[:] == whole[:]
    # Stored as narrow as the ids allow (datasets would keep labels in 64 bits): half the bytes at WMT's scale.
    assert words.features == tokenization.TOKENIZED_FEATURES


def test_tokenizers_with_another_pipeline_are_called_as_usual(small_tokenizer, tmp_path):
    """Word-by-word encoding is only for the pipeline it is exact for; any other tokenizer is called whole."""
    other = VaswaniTokenizer.from_pretrained(save_to(small_tokenizer, tmp_path / "other"))
    other.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert tokenization.WordCachedEncoder.for_tokenizer(other, 32) is None
    assert tokenization.WordCachedEncoder.for_tokenizer(small_tokenizer, 1) is None  # no room beside </s>
    left = VaswaniTokenizer.from_pretrained(tmp_path / "other", truncation_side="left")
    assert tokenization.WordCachedEncoder.for_tokenizer(left, 32) is None
    spanning = VaswaniTokenizer.from_pretrained(tmp_path / "other")
    spanning.add_tokens([" and then"])  # found across the spaces the encoder cuts the text at
    assert tokenization.WordCachedEncoder.for_tokenizer(small_tokenizer, 32) is not None
    assert tokenization.WordCachedEncoder.for_tokenizer(spanning, 32) is None
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


# --------------------------------------------------------------------------------------------------
# The tokenizer trained on a corpus, tokenization at scale


def test_train_tokenizer_script(tmp_path):
    corpus = write_tsv(tmp_path / "pairs.tsv", made_up_pairs(300))
    out = tmp_path / "tokenizer"
    script_main("train_tokenizer")(["--corpus", str(corpus), "--vocab_size", "400", "--output_dir", str(out)])
    tokenizer = VaswaniTokenizer.from_pretrained(out)
    assert len(tokenizer) == 400
    assert tokenizer.decode(tokenizer("Le chat numéro 7 dort !")["input_ids"], skip_special_tokens=True) == (
        "Le chat numéro 7 dort !"
    )


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


def test_a_cache_written_with_other_column_types_is_not_loaded(small_tokenizer, tmp_path, monkeypatch):
    """An earlier version stored the labels in 64 bits: its cache beside the same split is tokenized anew, not
    loaded against the 32-bit features (which datasets refuses with a schema error)."""
    path = write_tsv(tmp_path / "pairs.tsv", made_up_pairs(200))
    train = load_translation_dataset(data_file=path, validation_fraction=0.1, test_fraction=0.1)["train"]
    wide = tokenization.Features({**tokenization.TOKENIZED_FEATURES, "labels": List(Value("int64"))})
    with monkeypatch.context() as patched:
        patched.setattr(tokenization, "TOKENIZED_FEATURES", wide)
        before = tokenize_translation_dataset(train, small_tokenizer, max_length=12, num_proc=2)
    after = tokenize_translation_dataset(train, small_tokenizer, max_length=12, num_proc=2)
    assert after.features == tokenization.TOKENIZED_FEATURES and after[:] == before[:]
    assert after.cache_files != before.cache_files
