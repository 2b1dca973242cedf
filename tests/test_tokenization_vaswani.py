"""VaswaniTokenizer: special ids, round trips on real English and French, save/load, Auto* and remote code."""

import gzip
import itertools
import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from tokenizers import normalizers
from transformers import AutoTokenizer

from conftest import SHARED_CORPUS
import vaswani  # importing the package registers its classes with the Auto* factories
from vaswani.tokenization_vaswani import BYTE_TOKENS, VaswaniTokenizer, train_tokenizer

CORPUS = Path(os.environ.get("VASWANI_FRA_ENG") or SHARED_CORPUS)
VOCAB_SIZE = 1000


def corpus_pairs(start: int, step: int) -> list[tuple[str, str]]:
    """Every `step`-th pair of the corpus from line `start`: short and long sentences alike, in few lines."""
    if not CORPUS.is_file():
        pytest.skip(f"the English-French corpus is not at {CORPUS} (set VASWANI_FRA_ENG to its path)")
    with gzip.open(CORPUS, "rt", encoding="utf-8") as lines:
        return [tuple(line.rstrip("\n").split("\t")[:2]) for line in itertools.islice(lines, start, None, step)]


@pytest.fixture(scope="module")
def tokenizer() -> VaswaniTokenizer:
    pairs = corpus_pairs(start=0, step=40)  # ~4,000 pairs
    return train_tokenizer((sentence for pair in pairs for sentence in pair), VOCAB_SIZE)


@pytest.fixture(scope="module")
def held_out() -> list[str]:
    """Sentences the tokenizer was not trained on."""
    return [sentence for pair in corpus_pairs(start=17, step=80) for sentence in pair]


def normalised(text: str) -> str:
    """What the tokenizer's normaliser makes of `text`: NFKC, whitespace runs collapsed, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def test_special_tokens_have_fixed_ids(tokenizer):
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "</s>", "<unk>", "<s>"]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id) == (
        0, 1, 2, 3
    )
    assert len(tokenizer) == VOCAB_SIZE


def test_sources_and_labels_end_with_eos_only(tokenizer):
    batch = tokenizer(["How are you?", "Go."], text_target=["Comment allez-vous ?", "Va !"])
    for ids in batch["input_ids"] + batch["labels"]:
        assert ids[-1] == tokenizer.eos_token_id
        assert tokenizer.eos_token_id not in ids[:-1] and tokenizer.bos_token_id not in ids
    assert tokenizer.decode(batch["labels"][0], skip_special_tokens=True) == "Comment allez-vous ?"


def test_held_out_corpus_lines_round_trip(tokenizer, held_out):
    # The sample must contain what makes French hard, or this test would prove nothing.
    text = "".join(held_out)
    for needle in ("é", "à", "ç", "'", "«", "\u202f", "\xa0"):
        assert needle in text, f"sample lacks {needle!r}"
    ids = tokenizer(held_out)["input_ids"]
    decoded = tokenizer.batch_decode(ids, skip_special_tokens=True)
    mismatches = [(s, d) for s, d in zip(held_out, decoded) if d != normalised(s)]
    assert not mismatches, mismatches[:5]


@pytest.mark.parametrize("space", [" ", "\u202f", "\xa0"])
@pytest.mark.parametrize("mark", ["!", "?", ":", ";"])
def test_french_spacing_before_punctuation_decodes_as_a_plain_space(tokenizer, space, mark):
    text = f"Je suis calme{space}{mark}"
    ids = tokenizer(text)["input_ids"]
    assert ids == tokenizer(f"Je suis calme {mark}")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"Je suis calme {mark}"


def test_punctuation_is_split_from_word_edges_but_not_from_inside_words(tokenizer):
    pre_tokenize = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str
    words = [word for word, _ in pre_tokenize("« Il l'a fait, est-ce ? » He wants.")]
    assert words == ["▁«", "▁Il", "▁l'a", "▁fait", ",", "▁est-ce", "▁?", "▁»", "▁He", "▁wants", "."]


def test_unseen_characters_fall_back_to_bytes_not_unk(tokenizer):
    text = "Сергей a dit 你好 🙂"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert set(tokenizer.convert_ids_to_tokens(ids)) & set(BYTE_TOKENS)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_padded_batch_uses_pad_id_and_decodes_back(tokenizer):
    texts = ["Hi.", "Je ne suis pas d'accord avec toi."]
    batch = tokenizer(texts, padding=True)
    assert batch["input_ids"][0][-1] == tokenizer.pad_token_id and batch["attention_mask"][0][-1] == 0
    assert tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True) == texts


def test_it_says_whether_a_pipeline_encodes_each_word_on_its_own(tmp_path):
    """What `vaswani.tokenization.WordCachedEncoder` relies on: a sentence's ids are its words' ids end to end, for any
    vocabulary of this pipeline, and a tokenizer with another pipeline is told apart."""
    sentences = ["The cat sat on the mat.", "Je suis calme !", "Il a dit « non »,  puis\tpartit…", "l'oiseau a volé"]
    small = train_tokenizer(sentences * 3, 320)
    assert VaswaniTokenizer.encodes_words_independently(small)
    for sentence in sentences:
        words = [small(word, add_special_tokens=False)["input_ids"] for word in sentence.split()]
        assert small(sentence, add_special_tokens=False)["input_ids"] == [i for ids in words for i in ids]
    small.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert VaswaniTokenizer.encodes_words_independently(reloaded)
    reloaded.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert not VaswaniTokenizer.encodes_words_independently(reloaded)
    assert not VaswaniTokenizer.encodes_words_independently(object())  # not a fast tokenizer


def test_too_small_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["a b c"], vocab_size=len(BYTE_TOKENS))


def test_save_and_reload(tokenizer, held_out, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["auto_map"]["AutoTokenizer"][0] == "tokenization_vaswani.VaswaniTokenizer"
    assert (tmp_path / "tokenization_vaswani.py").is_file()

    expected = tokenizer(held_out[:200])["input_ids"]
    for reloaded in (VaswaniTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(tmp_path)):
        assert type(reloaded) is VaswaniTokenizer
        assert reloaded(held_out[:200])["input_ids"] == expected
        assert reloaded.decode(expected[0], skip_special_tokens=True) == normalised(held_out[0])


def test_autotokenizer_resolves_from_a_model_config(tokenizer, tmp_path):
    vaswani.VaswaniConfig.tiny().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert type(AutoTokenizer.from_pretrained(tmp_path)) is VaswaniTokenizer


def test_remote_code_loads_where_vaswani_is_not_importable(tokenizer, tmp_path):
    save_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(save_dir)
    texts = ["Je suis calme\u202f!", "« Où est-il ? »", "I don't know."]
    script = (
        "import json, sys\n"
        "sys.modules['vaswani'] = None  # any import of the package now fails\n"
        "from transformers import AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({str(save_dir)!r}, trust_remote_code=True)\n"
        f"ids = tok({texts!r})['input_ids']\n"
        "print(json.dumps([type(tok).__module__, ids, tok.batch_decode(ids, skip_special_tokens=True)]))\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    module, ids, decoded = json.loads(result.stdout.strip().splitlines()[-1])
    assert module.startswith("transformers_modules.")
    assert ids == tokenizer(texts)["input_ids"]
    assert decoded == [normalised(text) for text in texts]
