#!/usr/bin/env python
"""Average the last N checkpoints of a training run into one complete checkpoint, as the paper reports its results
(§6.1: the last 5 checkpoints, written at 10-minute intervals, for the base models; the last 20 for the big ones).
See vaswani.checkpoints:

    python scripts/average_checkpoints.py --inputs outputs/en-fr --last 5 --output_dir outputs/en-fr-avg5
    python scripts/average_checkpoints.py --inputs run/checkpoint-800 run/checkpoint-900 --output_dir avg

The output is a normal checkpoint (float32 weights, config, tokenizer, generation config, module files, a model card
that lists what was averaged). Checkpoints of different shapes, configs or tokenizers are refused.
"""

import argparse

from vaswani.averaging import average_checkpoints
from vaswani.cli import positive_int, user_errors_exit


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", nargs="+", required=True,
                        help="a run directory (its complete checkpoint-N directories) or checkpoint directories")
    parser.add_argument("--last", type=positive_int, default=None,
                        help="average only the last N of them (default: all)")
    parser.add_argument("--output_dir", required=True, help="the averaged checkpoint directory to write")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --output_dir whole (never an input, "
                        "nor a training run's checkpoint or run directory)")
    args = parser.parse_args(argv)
    average_checkpoints(args.inputs, args.output_dir, last=args.last, force=args.force)
    print(args.output_dir)


if __name__ == "__main__":
    main()
