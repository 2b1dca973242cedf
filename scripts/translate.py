#!/usr/bin/env python
"""Translate English to French with a trained checkpoint: sentences from arguments, --input_file, or stdin.

    python scripts/translate.py --model outputs/en-fr "I lost." "I'm calm."
    cat english.txt | python scripts/translate.py --model outputs/en-fr --num_beams 4 > french.txt
    python scripts/translate.py --model outputs/en-fr --device cpu --int8 "I lost."     # int8 CPU decoding

One output line per input line: an empty input line gives an empty output line. With learned positions, sources
longer than the model's `max_position_embeddings` are truncated (a warning on stderr says how many).
"""

import argparse
import sys

from vaswani.cli import (
    add_decoding_arguments,
    decode_lines,
    generation_limits,
    load_translator,
    read_lines,
    user_errors_exit,
)
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
    add_decoding_arguments(parser)
    parser.add_argument("--do_sample", action="store_true", help="sample instead of beam search")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    args = parser.parse_args(argv)
    for name in ("num_beams", "batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")

    if args.input_file:
        sentences = read_lines(args.input_file)
    elif args.sentences:
        sentences = args.sentences
    else:
        sentences = decode_lines(sys.stdin.buffer.read(), "stdin")
    model, tokenizer = load_translator(args.model, args.device, int8=args.int8, decoding=args.decoding)
    nonempty = [i for i, sentence in enumerate(sentences) if sentence.strip()]
    max_source_length, max_new_tokens = generation_limits(model, args.max_new_tokens)
    if max_source_length is not None:
        lengths = [len(ids) for ids in tokenizer([sentences[i] for i in nonempty])["input_ids"]] if nonempty else []
        truncated = sum(length > max_source_length for length in lengths)
        if truncated:
            print(f"warning: {truncated} sentence(s) longer than the model's {max_source_length} learned positions "
                  "were truncated.", file=sys.stderr)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    translations = translate(
        model,
        tokenizer,
        [sentences[i] for i in nonempty],
        batch_size=args.batch_size,
        num_beams=1 if args.do_sample else args.num_beams,
        max_new_tokens=max_new_tokens,
        max_source_length=max_source_length,
        **(sampling if args.do_sample else {}),
    )
    output = [""] * len(sentences)
    for index, translation in zip(nonempty, translations):
        output[index] = translation
    for line in output:
        print(line)


if __name__ == "__main__":
    main()
