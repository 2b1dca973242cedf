"""A tiny Vaswani translation model and tokenizer, built offline in about a second, for the plumbing tests of
evaluation, the translation pipeline and Hub upload/download.

An untrained tiny model gives every input the same translation, which would hide sentences being mixed up, so
the model takes a few optimiser steps on a five-pair toy corpus: enough for its translations to depend on the
input (the tests check that they differ), not to be good.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani.tokenization_vaswani import VaswaniTokenizer, train_tokenizer

SOURCES = ["the cat sat on the mat", "a dog ran", "the bird flew under a tree", "cat", "the dog sat on a mat"]
TARGETS = ["le chat était assis sur le tapis", "un chien a couru", "l'oiseau a volé sous un arbre", "chat",
           "le chien était assis sur un tapis"]
TRAINING_STEPS = 40


def build_tokenizer():
    """A joint BPE vocabulary over the toy corpus: the 4 special and 256 byte tokens, then characters and merges."""
    return train_tokenizer(SOURCES + TARGETS, vocab_size=320)


def build_model_and_tokenizer(seed: int = 0, **config_overrides):
    """The `tiny` preset (2+2 layers of width 32; `config_overrides` change any field) after `TRAINING_STEPS`
    full-batch Adam steps, in eval mode."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=len(tokenizer), **config_overrides))
    batch = tokenizer(SOURCES, text_target=TARGETS, padding=True, return_tensors="pt")
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(TRAINING_STEPS):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    return model.eval(), tokenizer


def shared_model_and_tokenizer(directory: Path, seed: int = 0, **config_overrides):
    """`build_model_and_tokenizer(seed, **config_overrides)`, trained once per `directory` (one test session, shared by
    its xdist workers: the first to ask trains and saves it under a file lock, the others wait) and loaded fresh on
    each call, so that a caller's changes to its model reach no other test."""
    from filelock import FileLock

    key = hashlib.sha256(json.dumps([seed, config_overrides], sort_keys=True).encode()).hexdigest()[:16]
    path = directory / f"tiny-translation-model-{key}"
    with FileLock(f"{path}.lock"):
        if not path.is_dir():
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # tiny model: threads cost more than they save
            try:
                model, tokenizer = build_model_and_tokenizer(seed, **config_overrides)
            finally:
                torch.set_num_threads(threads)
            staging = directory / f".staging-{key}"
            shutil.rmtree(staging, ignore_errors=True)
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            staging.rename(path)  # a directory that exists is complete
    return VaswaniForConditionalGeneration.from_pretrained(path).eval(), VaswaniTokenizer.from_pretrained(path)
