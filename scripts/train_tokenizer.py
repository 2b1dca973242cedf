"""Train the joint English-French BPE tokenizer on a corpus' train split and save it with save_pretrained.

    python scripts/train_tokenizer.py --vocab_size 8000 --output_dir tokenizer/
"""

import argparse
import logging

from vaswani.cli import positive_int, user_errors_exit
from vaswani.tokenization import train_corpus_tokenizer

from shared_corpus import SHARED_CORPUS, SHARED_CORPUS_RELATIVE  # beside this script


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", help="tsv (manythings layout, may be gzipped), csv or jsonl file; default: "
                                         f"$VASWANI_FRA_ENG, then {SHARED_CORPUS_RELATIVE}, then a download")
    # 8k suits the 160k-pair Tatoeba corpus (the `small` preset's vocab_size); the paper's 32k-37k were for
    # WMT's millions of pairs and would leave most subwords too rare to learn here.
    parser.add_argument("--vocab_size", type=positive_int, default=8000)
    parser.add_argument("--tokenizer_train_pairs", type=positive_int, default=500_000,
                        help="learn from at most this many train pairs, a random sample drawn with --seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--source_lang", default="en")
    parser.add_argument("--target_lang", default="fr")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tokenizer = train_corpus_tokenizer(args.vocab_size, args.corpus, args.source_lang, args.target_lang,
                                       args.tokenizer_train_pairs, args.seed, default_corpus=SHARED_CORPUS)
    tokenizer.save_pretrained(args.output_dir)
    logging.getLogger(__name__).info("Saved a %d-token tokenizer to %s", len(tokenizer), args.output_dir)


if __name__ == "__main__":
    main()
