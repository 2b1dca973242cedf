#!/usr/bin/env python
"""Translate English to French with a trained checkpoint: sentences from arguments, --input_file, or stdin.

    python scripts/translate.py --model outputs/en-fr "I lost." "I'm calm."
    cat english.txt | python scripts/translate.py --model outputs/en-fr --num_beams 4 > french.txt
"""

import argparse
import sys

from vaswani.cli import load_translator, user_errors_exit
from vaswani.evaluation import translate


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sentences", nargs="*", help="sentences to translate")
    parser.add_argument("--model", required=True, help="checkpoint directory or Hub id")
    parser.add_argument("--input_file", help="one sentence per line")
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--do_sample", action="store_true", help="sample instead of beam search")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    args = parser.parse_args(argv)

    if args.input_file:
        with open(args.input_file, encoding="utf-8") as f:
            sentences = [line.rstrip("\n") for line in f]
    elif args.sentences:
        sentences = args.sentences
    else:
        sentences = [line.rstrip("\n") for line in sys.stdin]
    model, tokenizer = load_translator(args.model, args.device)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    translations = translate(
        model,
        tokenizer,
        sentences,
        batch_size=args.batch_size,
        num_beams=1 if args.do_sample else args.num_beams,
        max_new_tokens=args.max_new_tokens,
        **(sampling if args.do_sample else {}),
    )
    for translation in translations:
        print(translation)


if __name__ == "__main__":
    main()
