#!/usr/bin/env python
"""Convert a decoder-only checkpoint between Vaswani and Llama, either way (by its config.json; see vaswani.convert):

    python scripts/convert_llama.py --model outputs/my-lm --output_dir outputs/my-lm-llama       # Vaswani → Llama
    python scripts/convert_llama.py --model some/llama-model --output_dir outputs/llama-vaswani  # Llama → Vaswani

A VaswaniForCausalLM becomes a stock `LlamaForCausalLM` checkpoint (config, safetensors, generation config, tokenizer
as a transformers class) with no code files, which vLLM, TGI, llama.cpp's converter and `AutoModelForCausalLM`
load without `trust_remote_code`. A config Llama cannot express (post-norm, learned or sinusoidal positions, an
ungated FFN, ...) is refused, naming the field; so is a Llama model the Vaswani one cannot express (RoPE scaling, ...).
"""

import argparse

from vaswani.cli import user_errors_exit
from vaswani.convert import convert_llama_checkpoint


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hub id or local directory of a VaswaniForCausalLM or a "
                                                       "LlamaForCausalLM checkpoint")
    parser.add_argument("--output_dir", required=True, help="the converted checkpoint directory to write")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --output_dir whole (never an input, "
                        "nor a training run's checkpoint or run directory)")
    parser.add_argument("--no_check", action="store_true",
                        help="skip comparing the two models' logits and greedy continuations before saving")
    args = parser.parse_args(argv)
    convert_llama_checkpoint(args.model, args.output_dir, force=args.force, check=not args.no_check)
    print(args.output_dir)


if __name__ == "__main__":
    main()
