"""The tokenization stage of the data: a tokenizer trained on a corpus's train split, tokenized datasets, both
cached beside the split's Arrow files (`vaswani.data`), and `WordCachedEncoder`, which gives a `VaswaniTokenizer`'s
ids for a corpus a word at a time.

This module prepares training data and is not shipped with checkpoints; the tokenizer itself (its pipeline, its
training on given texts) is `tokenization_vaswani.py`, which is shipped beside the weights.
"""

import hashlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path

import numpy as np
from datasets import Dataset, DatasetDict, Features, List, Value
from tokenizers import Tokenizer

from .data import CACHE_FORMAT, cache_key, load_translation_dataset
from .files import exclusive, staged_directory
from .tokenization_vaswani import WORD_START, VaswaniTokenizer, train_tokenizer

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Tokenizer training


def train_corpus_tokenizer(
    vocab_size: int,
    corpus: str | os.PathLike | None = None,
    source_lang: str = "en",
    target_lang: str = "fr",
    max_pairs: int | None = None,
    seed: int = 0,
    *,
    default_corpus: str | os.PathLike | None = None,
) -> VaswaniTokenizer:
    """Train the joint tokenizer on both sides of the train split only, so test sentences stay unseen;
    on at most `max_pairs` of its pairs (a seeded sample, see `tokenizer_training_sample`). The corpus is found as
    `resolve_corpus_path(corpus, default_corpus)` finds it."""
    train = load_translation_dataset(data_file=corpus, default_corpus=default_corpus, source_lang=source_lang,
                                     target_lang=target_lang)["train"]
    return train_tokenizer(training_texts(tokenizer_training_sample(train, max_pairs, seed)), vocab_size)


def tokenizer_training_sample(train: Dataset, max_pairs: int | None, seed: int = 0) -> Dataset:
    """At most `max_pairs` pairs of `train`, drawn at random with `seed` and kept in corpus order; all of it if it
    is no larger. BPE learns its merges from word counts, which a sample of a million sentences already estimates
    well, while the time and memory of counting grow with every sentence seen."""
    if max_pairs is None or len(train) <= max_pairs:
        return train
    chosen = np.random.default_rng(seed).choice(len(train), size=max_pairs, replace=False)
    return train.select(np.sort(chosen))


def training_texts(pairs: Dataset, batch_size: int = 10_000) -> Iterator[str]:
    """Every source, then every target, of `pairs`, read from Arrow a batch at a time."""
    for column in ("source", "target"):
        for batch in pairs.select_columns([column]).iter(batch_size=batch_size):
            yield from batch[column]


def cached_corpus_tokenizer(
    train: Dataset, vocab_size: int, max_pairs: int | None = None, seed: int = 0, overwrite_cache: bool = False
) -> tuple[VaswaniTokenizer, int]:
    """A tokenizer trained on `tokenizer_training_sample(train, max_pairs, seed)`, and how many sentences it saw.

    Saved beside `train`'s Arrow files, keyed by the split's fingerprint, the sample, the vocabulary size and the
    tokenizer's code, and loaded from there whenever it exists, by a later run or by the other processes of this
    one: all then hold a tokenizer read from the same files. A split held only in memory is trained on directly.
    """
    sample = tokenizer_training_sample(train, max_pairs, seed)
    sentences = 2 * len(sample)
    if not train.cache_files:
        return train_tokenizer(training_texts(sample), vocab_size), sentences
    code = hashlib.sha256(Path(sys.modules[VaswaniTokenizer.__module__].__file__).read_bytes()).hexdigest()
    key = cache_key(train._fingerprint, vocab_size, len(sample), seed if len(sample) < len(train) else None, code,
                    CACHE_FORMAT)
    directory = Path(train.cache_files[0]["filename"]).parent / f"tokenizer-{key}"
    if overwrite_cache or not (directory / "tokenizer.json").is_file():
        with exclusive(directory, wait=True):  # another run training the same tokenizer: wait for it, then reuse it
            if overwrite_cache or not (directory / "tokenizer.json").is_file():
                logger.info("Training a %d-token tokenizer on %d sentences.", vocab_size, sentences)
                with staged_directory(directory, tag=f"-{os.getpid()}") as staging:
                    train_tokenizer(training_texts(sample), vocab_size).save_pretrained(staging)
    else:
        logger.info("Reusing the tokenizer trained earlier on %d sentences, from %s.", sentences, directory)
    return VaswaniTokenizer.from_pretrained(directory), sentences


# --------------------------------------------------------------------------------------------------
# Tokenization

# What `WordCachedEncoder` gives, stored as narrow as its values: at WMT's tens of millions of pairs, every byte a
# token is gigabytes written and read (datasets would store the labels in 64 bits). The collator makes them tensors
# of 64-bit ids as before.
TOKENIZED_FEATURES = Features({"input_ids": List(Value("int32")), "attention_mask": List(Value("int8")),
                               "labels": List(Value("int32"))})
# Where training truncates sources and targets when not told: long enough for all but a handful of the corpus'
# sentences, short enough that one overlong pair cannot blow up a token-budget batch.
TRUNCATION_TOKENS = 128


def tokenize_translation_dataset(
    dataset: Dataset | DatasetDict,
    tokenizer,
    max_length: int = TRUNCATION_TOKENS,
    num_proc: int | None = None,
    overwrite_cache: bool = False,
) -> Dataset | DatasetDict:
    """`input_ids`, `attention_mask` and `labels` for seq2seq training; the text columns are dropped.

    Both sides are truncated to `max_length` tokens (including the final </s>). `num_proc` processes tokenize
    shards in parallel. A split kept in Arrow files is tokenized into a file beside them, keyed by the split's
    fingerprint, the tokenizer and `max_length`, which later runs and the other processes of a distributed run
    load instead of tokenizing again (unless `overwrite_cache`).
    """
    if isinstance(dataset, DatasetDict):
        return DatasetDict({name: tokenize_translation_dataset(split, tokenizer, max_length, num_proc, overwrite_cache)
                            for name, split in dataset.items()})

    words = WordCachedEncoder.for_tokenizer(tokenizer, max_length)
    features = None
    if words is None:
        def encode(batch):
            return tokenizer(batch["source"], text_target=batch["target"], truncation=True, max_length=max_length)
    else:
        features = TOKENIZED_FEATURES

        def encode(batch):
            input_ids, labels = words(batch["source"]), words(batch["target"])
            return {"input_ids": input_ids, "attention_mask": [[1] * len(ids) for ids in input_ids], "labels": labels}

    cache = {}
    if dataset.cache_files:
        # The features are part of the key: a cache written with other column types is not one this call can load.
        key = cache_key(dataset._fingerprint, tokenizer_state_digest(tokenizer), max_length, CACHE_FORMAT,
                        *([features.to_dict()] if features else []))
        path = Path(dataset.cache_files[0]["filename"]).parent / f"tokenized-{key}.arrow"
        cache = {"cache_file_name": str(path), "new_fingerprint": key, "load_from_cache_file": not overwrite_cache}
        if not overwrite_cache and any(path.parent.glob(f"{path.stem}*.arrow")):
            logger.info("Reusing the tokenized %d examples in %s.", len(dataset), path.parent)
        else:
            logger.info("Tokenizing %d examples into %s.", len(dataset), path.parent)
    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenizing", features=features,
                       num_proc=num_proc if num_proc and num_proc > 1 and len(dataset) > num_proc else None, **cache)


# Words not in `WordCachedEncoder`'s cache are encoded this many to a text.
WORDS_PER_TEXT = 256
# A batch whose words are more than this share new ones is encoded a sentence at a time: cheaper then.
MOSTLY_NEW = 0.35


class WordCachedEncoder:
    """`tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]`, a word at a time from a cache.

    A `VaswaniTokenizer` normalises a sentence (NFKC, every run of white space made one space, stripped), cuts it at
    its spaces and encodes each word on its own (see tokenization_vaswani). Normalising never joins characters across
    a space (a space is a starter that composes with nothing), so a sentence's ids are, end to end, the ids of the
    pieces of text between its spaces, each normalised and encoded on its own. `tokenizers` spends most of its time
    per sentence on bookkeeping that training does not use (offsets, alignments, an `Encoding` object), while a
    corpus repeats its words: looking each piece up in a dict, raw as the corpus spells it, and normalising and
    encoding only the pieces not seen yet, a batch at a time, gives the same ids for much less CPU time where words
    repeat as in Tatoeba, and less of a gain where more of them are new (benchmarks/results/data-encoder-cpu.md). A
    batch of mostly new words is encoded a sentence at a time instead (`MOSTLY_NEW`). The cache holds at most
    `max_words` pieces and starts over when full, so its memory does not grow with the corpus.

    The special tokens the tokenizer adds around a sentence are read from its post-processor
    (`special_tokens_around`). Sentences that might hold an added token such as "</s>" (which `tokenizers` finds in
    the raw text, before normalising) or a "▁" are encoded whole. A tokenizer with another pipeline, or whose added
    tokens could start with white space, gets no encoder: `for_tokenizer` then returns None and the tokenizer is
    called as usual.
    """

    def __init__(self, backend: Tokenizer, prefix: list[int], suffix: list[int], max_length: int,
                 max_words: int = 500_000):
        self._backend = backend
        self._normalize = backend.normalizer.normalize_str
        self._prefix, self._suffix = prefix, suffix
        self._keep = max_length - len(prefix) - len(suffix)  # how transformers truncates a single sequence
        # Added tokens are found in the raw text, and a "▁" in the text is cut at like a space but not merged with
        # the space before it: sentences holding either are encoded whole.
        added = [token.content for token in backend.get_added_tokens_decoder().values() if token.content]
        self._whole_if = frozenset([WORD_START, *(content[0] for content in added)])
        self._max_words = max_words
        self._ids: dict[str, tuple[int, ...] | None] = {}  # None: a sentence holding this piece is encoded whole
        self._whole_words: set[str] = set()

    @classmethod
    def for_tokenizer(cls, tokenizer, max_length: int, max_words: int = 500_000) -> "WordCachedEncoder | None":
        """An encoder for `tokenizer`, or None where its pipeline does not encode words independently, an added
        token starts with white space, its post-processor is not one `special_tokens_around` can read, or
        `max_length` leaves no room beside the special tokens."""
        if not VaswaniTokenizer.encodes_words_independently(tokenizer) or tokenizer.truncation_side != "right":
            return None
        saved = tokenizer.backend_tokenizer.to_str()
        around = special_tokens_around(json.loads(saved)["post_processor"])
        if around is None or max_length <= len(around[0]) + len(around[1]):
            return None
        backend = Tokenizer.from_str(saved)  # a copy whose truncation and padding the tokenizer's calls leave alone
        if any(token.content[:1].isspace() for token in backend.get_added_tokens_decoder().values()):
            return None  # such a token would span the spaces the text is cut at
        backend.no_truncation()
        backend.no_padding()
        return cls(backend, *around, max_length, max_words)

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        ids = self._ids
        sentences = [text.split(" ") for text in texts]
        words = set(chain.from_iterable(sentences))
        missing = words.difference(ids)
        if len(missing) > MOSTLY_NEW * sum(map(len, sentences)):
            # A new word costs several times its share of a whole sentence's encoding.
            return self._encode_whole(texts)
        if len(ids) + len(missing) > self._max_words:
            ids.clear()
            self._whole_words.clear()
            missing = words
        if missing:
            self._encode_words(missing)
        whole_words = self._whole_words.intersection(words)
        whole = iter(self._encode_whole([text for text, pieces in zip(texts, sentences)
                                         if not whole_words.isdisjoint(pieces)]) if whole_words else ())
        # `_complete` written out: this line runs once a sentence, and a call there costs a tenth of its time.
        lookup, prefix, suffix, keep = ids.__getitem__, self._prefix, self._suffix, self._keep
        return [prefix + list(chain.from_iterable(map(lookup, pieces)))[:keep] + suffix
                if not whole_words or whole_words.isdisjoint(pieces) else next(whole) for pieces in sentences]

    def _encode_whole(self, texts: Sequence[str]) -> list[list[int]]:
        """`texts`' ids from the tokenizer itself, completed by `_complete`."""
        return [self._complete(encoding.ids)
                for encoding in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def _complete(self, content: list[int]) -> list[int]:
        """A sentence's ids, truncated and with the special tokens the tokenizer adds."""
        return self._prefix + content[:self._keep] + self._suffix

    def _encode_words(self, words: Iterable[str]) -> None:
        """Put `words`' ids in the cache: each is normalised (which may cut it into several words, or none) and its
        words encoded many to a text, as a pre-split text whose `word_ids` say which word each token comes from:
        `tokenizers` costs most per text, not per word. A word that might hold an added token or a "▁" is marked
        instead, for its sentences to be encoded whole."""
        normalized = {}
        for word in words:
            # Normalising leaves printable ASCII as it is, and the text was cut at its only white space, " ".
            text = word if word.isascii() and word.isprintable() else self._normalize(word)
            if any(start in word or start in text for start in self._whole_if):
                self._ids[word] = None
                self._whole_words.add(word)
            else:
                normalized[word] = text.split(" ") if text else []
        pieces = list({piece for split in normalized.values() for piece in split})
        chunks = [pieces[start:start + WORDS_PER_TEXT] for start in range(0, len(pieces), WORDS_PER_TEXT)]
        encoded = {}
        for chunk, encoding in zip(chunks, self._backend.encode_batch(chunks, is_pretokenized=True,
                                                                     add_special_tokens=False)):
            per_piece = [[] for _ in chunk]
            for token, piece in zip(encoding.ids, encoding.word_ids):
                per_piece[piece].append(token)
            encoded.update(zip(chunk, per_piece))
        # Tuples of ints: smaller than lists, and not tracked by the garbage collector.
        self._ids.update((word, tuple(chain.from_iterable(map(encoded.__getitem__, split))))
                         for word, split in normalized.items())


def special_tokens_around(post_processor: dict | None) -> tuple[list[int], list[int]] | None:
    """The ids a `tokenizers` post-processor (as `Tokenizer.to_str()` writes it) puts before and after a single
    sequence; none without a post-processor. transformers writes its settings (`add_bos_token`, `add_eos_token`)
    into a `TemplateProcessing` of special tokens around the sequence; None for any other post-processor."""
    if post_processor is None:
        return [], []
    if post_processor["type"] != "TemplateProcessing":
        return None
    before, after, sequences = [], [], 0
    for piece in post_processor["single"]:
        if "Sequence" in piece:
            sequences += 1
        elif "SpecialToken" in piece:
            token = post_processor["special_tokens"][piece["SpecialToken"]["id"]]
            (after if sequences else before).extend(token["ids"])
        else:
            return None
    return (before, after) if sequences == 1 else None


def tokenizer_state_digest(tokenizer) -> str:
    """What decides a tokenizer's output: its `tokenizers` pipeline and the settings transformers adds (the backend's
    truncation and padding state, which every call resets, left out). A tokenizer without a `tokenizers` backend
    (a sentencepiece one, such as an OPUS-MT checkpoint's `MarianTokenizer`) is keyed by the files it saves."""
    if getattr(tokenizer, "is_fast", False):
        state = json.loads(tokenizer.backend_tokenizer.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        return cache_key(json.dumps(state, sort_keys=True), type(tokenizer).__name__, tokenizer.model_max_length)
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        files = sorted(Path(directory).iterdir())
        return cache_key(type(tokenizer).__name__, tokenizer.model_max_length,
                         *(f"{file.name}:{hashlib.sha256(file.read_bytes()).hexdigest()}" for file in files))
