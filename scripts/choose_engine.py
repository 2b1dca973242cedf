#!/usr/bin/env python
"""Choose, once, which engine translates a checkpoint on this machine's CPU, and write the choice beside it.

    python scripts/choose_engine.py --model outputs/en-fr --input_file english.txt
    python scripts/choose_engine.py --model outputs/en-fr            # on the fra-eng test split's sources

Each engine that gives the checkpoint's translations (PyTorch with its linear layers laid out for oneDNN and with
torch's own; the checkpoint's CTranslate2 float32 export where CTranslate2 follows its decoding settings) translates
384 of the sentences, spread over their lengths, in scripts/translate.py's batches (--max_tokens_per_batch), each in
a process of its own at this process's thread count. The fastest is written, with every engine's seconds and this
machine's key, into engine_choice.json in the checkpoint's directory; translate.py and evaluate_bleu.py then decode
with it on this machine, at this thread count and with these decoding settings, and say so
(vaswani.engine_choice). Run it again to time anew: it replaces this machine's record. scripts/main_job.sh runs it
after training.
"""

import argparse

from vaswani.cli import add_search_arguments, positive_int, user_errors_exit
from vaswani.data import load_translation_dataset
from vaswani.engine_choice import choose_engine
from vaswani.file_translation import DEFAULT_MAX_TOKENS
from vaswani.files import read_lines

from shared_corpus import SHARED_CORPUS, SHARED_CORPUS_RELATIVE  # beside this script


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local checkpoint directory")
    parser.add_argument("--input_file", help="sentences like those you will translate, one a line (default: the "
                        "test split's sources of --corpus)")
    parser.add_argument("--corpus", help="parallel corpus file (default: the fra-eng corpus from $VASWANI_FRA_ENG, "
                        f"{SHARED_CORPUS_RELATIVE} or its download)")
    parser.add_argument("--max_tokens_per_batch", type=positive_int, default=DEFAULT_MAX_TOKENS,
                        help="padded source tokens per batch, as translate.py will decode them")
    parser.add_argument("--batch_size", type=positive_int, default=None,
                        help="at most this many sentences per batch too, as translate.py's --batch_size")
    add_search_arguments(parser)
    args = parser.parse_args(argv)
    if args.input_file:
        sentences = read_lines(args.input_file)
    else:
        sentences = load_translation_dataset(data_file=args.corpus, default_corpus=SHARED_CORPUS)["test"]["source"]
    choice = choose_engine(args.model, sentences, max_tokens=args.max_tokens_per_batch, max_sentences=args.batch_size,
                           num_beams=args.num_beams, max_new_tokens=args.max_new_tokens,
                           length_penalty=args.length_penalty)
    print(f"engine: {choice.line}")


if __name__ == "__main__":
    main()
