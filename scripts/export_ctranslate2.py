#!/usr/bin/env python
"""Export a trained checkpoint to CTranslate2 (pip install ctranslate2), for fast CPU deployment.

    python scripts/export_ctranslate2.py --model outputs/en-fr --output_dir outputs/en-fr-ct2 --quantization int8

The directory holds the CTranslate2 model, the tokenizer and the checkpoint's generation config (its beam count and
output length). Score it, or translate with it from Python, as a checkpoint:

    python scripts/evaluate_bleu.py --model outputs/en-fr-ct2 --compute_type int8

    engine = vaswani.loading.load_engine("outputs/en-fr-ct2", compute_type="int8")
    vaswani.translation.translate(engine, ["I lost.", "I'm calm."]).texts

or with CTranslate2 alone: `ctranslate2.Translator(dir).translate_batch(sources)`, where a source is the tokenizer's
tokens, </s> included.
"""

import argparse

from vaswani.cli import positive_int, user_errors_exit
from vaswani.export import export_to_ctranslate2


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory or Hub id")
    parser.add_argument("--output_dir", required=True, help="the CTranslate2 model directory to write")
    parser.add_argument("--quantization", default=None,
                        help="weights on disk: int8, int8_float32, int16, float16, bfloat16 (default: float32)")
    parser.add_argument("--max_positions", type=positive_int, default=None,
                        help="longest source or output the exported position table covers (default: the config's "
                             "max_position_embeddings)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --output_dir whole (never --model "
                        "itself, nor a training run's checkpoint or run directory)")
    parser.add_argument("--measure_on", default=None,
                        help="a file of source sentences, one a line: the model card states how many of them the "
                             "export translates otherwise than the checkpoint (a beam-search stopping rule "
                             "CTranslate2 cannot follow)")
    args = parser.parse_args(argv)
    sources = None
    if args.measure_on:
        with open(args.measure_on, encoding="utf-8") as file:
            sources = [line.rstrip("\n") for line in file if line.strip()]
    print(export_to_ctranslate2(args.model, args.output_dir, quantization=args.quantization,
                                max_positions=args.max_positions, force=args.force, measure_on=sources))


if __name__ == "__main__":
    main()
