#!/usr/bin/env python
"""Export a trained checkpoint to CTranslate2 (pip install ctranslate2), for fast CPU deployment.

    python scripts/export_ctranslate2.py --model outputs/en-fr --output_dir outputs/en-fr-ct2 --quantization int8

Then, in Python (sources as the tokenizer's tokens, </s> included):

    translator = ctranslate2.Translator("outputs/en-fr-ct2", device="cpu", compute_type="int8")
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("I lost.")["input_ids"])
    result = translator.translate_batch([tokens], beam_size=4)
    print(tokenizer.convert_tokens_to_string(result[0].hypotheses[0]))
"""

import argparse

from vaswani.cli import user_errors_exit
from vaswani.export import export_to_ctranslate2


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory or Hub id")
    parser.add_argument("--output_dir", required=True, help="the CTranslate2 model directory to write")
    parser.add_argument("--quantization", default=None,
                        help="weights on disk: int8, int8_float32, int16, float16, bfloat16 (default: float32)")
    parser.add_argument("--max_positions", type=int, default=None,
                        help="longest source or output the exported position table covers (default: the config's "
                             "max_position_embeddings)")
    parser.add_argument("--force", action="store_true", help="overwrite --output_dir")
    args = parser.parse_args(argv)
    print(export_to_ctranslate2(args.model, args.output_dir, quantization=args.quantization,
                                max_positions=args.max_positions, force=args.force))


if __name__ == "__main__":
    main()
