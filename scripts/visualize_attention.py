#!/usr/bin/env python
"""Write attention heatmaps (PNG) of a trained translator: encoder self-attention, decoder masked
self-attention and cross-attention, one image per layer with every head.

    python scripts/visualize_attention.py --model outputs/en-fr --source "I'm calm." --output_dir outputs/attention
"""

import argparse

from vaswani.cli import user_errors_exit
from vaswani.loading import load_translator
from vaswani.visualize import attention_maps, plot_attention


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--source", action="append", required=True, help="may be repeated")
    parser.add_argument("--target", action="append", help="reference translation(s); default: the model's own")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.target and len(args.target) != len(args.source):
        raise ValueError("give one --target per --source, or none")

    # The translation is greedy (vaswani.visualize), so the precision is chosen for one beam.
    model, tokenizer = load_translator(args.model, args.device, attn_implementation="eager", num_beams=1)
    for i, source in enumerate(args.source):
        target = args.target[i] if args.target else None
        maps = attention_maps(model, tokenizer, source, target)
        for path in plot_attention(maps, args.output_dir, prefix=f"sentence{i}"):
            print(path)


if __name__ == "__main__":
    main()
