#!/usr/bin/env python
"""Stand-in corpora at WMT's scale, built from the fra-eng corpus."""

import argparse
import gzip
import random
from pathlib import Path

from vaswani.data import read_parallel_tsv, resolve_corpus_path


def build_stand_in_corpus(path: Path, pairs: int, seed: int = 0, source: Path | None = None) -> Path:
    """`pairs` lines of WMT-like length: each joins 2-4 random fra-eng pairs (about 25 tokens a side)."""
    base, _ = read_parallel_tsv(resolve_corpus_path(source))
    rng = random.Random(seed)
    partial = path.with_name(path.name + ".part")
    with gzip.open(partial, "wt", encoding="utf-8", compresslevel=1) as out:
        for _ in range(pairs):
            chosen = [base[rng.randrange(len(base))] for _ in range(rng.randint(2, 4))]
            out.write(" ".join(en for en, _ in chosen) + "\t" + " ".join(fr for _, fr in chosen) + "\n")
    partial.replace(path)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    build_stand_in_corpus(args.output, args.pairs)
