#!/usr/bin/env python
"""Convert a Marian / OPUS-MT translator (`MarianMTModel`, from the Hub or a local directory) into a Vaswani
checkpoint that translates exactly alike (see vaswani.convert):

    python scripts/convert_marian.py --model Helsinki-NLP/opus-mt-en-fr --output_dir outputs/opus-mt-en-fr

The directory is a normal Vaswani checkpoint with Marian's own tokenizer (needs `pip install sentencepiece`):

    python scripts/translate.py --model outputs/opus-mt-en-fr --ctranslate2 --compute_type int8 "How are you?"
    python scripts/train_translation.py --model_name_or_path outputs/opus-mt-en-fr ...   # fine-tuning
"""

import argparse

from vaswani.cli import user_errors_exit
from vaswani.convert import convert_marian_checkpoint


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hub id or local directory of a MarianMTModel")
    parser.add_argument("--output_dir", required=True, help="the Vaswani checkpoint directory to write")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --output_dir whole (never an input, "
                        "nor a training run's checkpoint or run directory)")
    parser.add_argument("--no_check", action="store_true",
                        help="skip comparing the two models' logits and greedy output before saving")
    args = parser.parse_args(argv)
    convert_marian_checkpoint(args.model, args.output_dir, force=args.force, check=not args.no_check)
    print(args.output_dir)


if __name__ == "__main__":
    main()
