"""What the tests of the data stages (test_corpus, test_data, test_tokenization, test_batching) share: made-up
sentence pairs and corpus files, a small tokenizer trained on them, and caches kept in each test's own directory.
A module takes the fixtures by importing them."""

import gzip
from pathlib import Path

import datasets
import pytest

from vaswani import corpus as vcorpus
from vaswani.tokenization_vaswani import VaswaniTokenizer, train_tokenizer

REPO = Path(__file__).parents[1]
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
