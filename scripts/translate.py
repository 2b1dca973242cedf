#!/usr/bin/env python
"""Translate English to French with a trained checkpoint: sentences from arguments, a file, or stdin, streamed.

    python scripts/translate.py --model outputs/en-fr "I lost." "I'm calm."
    python scripts/translate.py --model outputs/en-fr --input_file english.txt --output_file french.txt
    python scripts/translate.py --model outputs/en-fr --input_file english.txt --output_file french.txt --resume
    cat english.txt | python scripts/translate.py --model outputs/en-fr --num_beams 4 > french.txt
    python scripts/translate.py --model outputs/en-fr --ctranslate2 --compute_type int8 "I lost."  # int8 on a CPU
    python scripts/translate.py --model outputs/en-fr-ct2 --input_file english.txt  # an exported CTranslate2 model
    accelerate launch --num_processes 2 scripts/translate.py --model outputs/en-fr --input_file english.txt \\
        --output_file french.txt     # one GPU each (or torchrun --nproc_per_node 2; on CPUs: accelerate --multi_gpu)

The input is read --chunk_lines lines at a time; each chunk is sorted by length into batches of at most
--max_tokens_per_batch padded source tokens, and its translations are written in input order as soon as it is
done (vaswani.file_translation). With --output_file, a run killed at any point continues with --resume from its
last complete chunk, and gives the same file as an uninterrupted run (an input edited since is refused); unless
--ctranslate2 or --no-ctranslate2 says otherwise, it decodes with the engine the run began with. An
--output_file that is the --input_file, by any name, is refused, and so is a second run on an --output_file another
run is writing. SIGTERM or SIGINT stops the run at a chunk boundary (status 143 or 130) and --resume goes on from
there; on a full disk it says how many lines are complete. A progress bar goes to stderr when it is a terminal
(--progress: always).

One output line per input line: an empty input line gives an empty output line. Sources longer than the model's
positions are truncated (a warning on stderr counts them). --dtype auto translates in bf16 where the hardware
multiplies it natively and that is faster (see vaswani.loading.choose_dtype), fp32 elsewhere. A decoding setting
not given (--num_beams, --max_new_tokens, --length_penalty, the sampling ones) is the checkpoint's, from its
generation_config.json; without a max_new_tokens there, each output may run to its source's length plus 50 tokens.
The engine is chosen by vaswani.engine_choice, as evaluate_bleu.py's is, and the same for every run on one machine:
on a CPU, the one that scripts/choose_engine.py timed fastest on your sentences and recorded beside the checkpoint
for this machine (the PyTorch engine, with its linear layers laid out for oneDNN or not, or the checkpoint's
CTranslate2 float32 export, made once and cached); without such a record, the PyTorch engine. --ctranslate2 and
--no-ctranslate2 decide it. A line "engine: …; chosen: …" on stderr names the engine that runs and why.
"""

import argparse
import io
from contextlib import nullcontext

from vaswani.cli import (
    add_decoding_arguments,
    engine_from_args,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
    user_errors_exit,
)
from vaswani.file_translation import DEFAULT_CHUNK_LINES, DEFAULT_MAX_TOKENS, check_run, translate_file
from vaswani.files import exclusive


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sentences", nargs="*", help="sentences to translate")
    parser.add_argument("--model", required=True, help="checkpoint directory, Hub id or CTranslate2 directory")
    parser.add_argument("--input_file", help="one sentence per line (default: stdin)")
    parser.add_argument("--output_file", help="one translation per line (default: stdout)")
    parser.add_argument("--resume", action="store_true",
                        help="continue a killed run into the same --output_file from its last complete chunk "
                        "(safe on every run: one that wrote nothing starts again, a complete file is left as it is)")
    parser.add_argument("--progress", action="store_true", help="show the progress bar on stderr even when it is "
                        "not a terminal (it is shown on a terminal anyway)")
    parser.add_argument("--chunk_lines", type=positive_int, default=DEFAULT_CHUNK_LINES,
                        help="lines read, sorted and written together (what a resume can lose at most)")
    parser.add_argument("--max_tokens_per_batch", type=positive_int, default=DEFAULT_MAX_TOKENS,
                        help="padded source tokens per batch (batch size × its longest source)")
    parser.add_argument("--batch_size", type=positive_int, default=None,
                        help="at most this many sentences per batch too")
    add_decoding_arguments(parser)
    parser.add_argument("--do_sample", action="store_true", default=None, help="sample instead of beam search")
    parser.add_argument("--temperature", type=positive_float, default=None,
                        help="with --do_sample (default: the checkpoint's)")
    parser.add_argument("--top_k", type=non_negative_int, default=None,
                        help="with --do_sample; 0: no limit (default: the checkpoint's)")
    parser.add_argument("--top_p", type=probability, default=None, help="with --do_sample (default: the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0, help="with --do_sample, chunk i samples with seed + i")
    args = parser.parse_args(argv)
    if args.sentences and (args.input_file or args.resume):
        parser.error("give sentences as arguments or --input_file, not both (--resume needs --input_file)")

    # Refused before the model loads: an output that cannot be written or resumed, a damaged resume record.
    processes, resumable, resumed = check_run(args.output_file, args.input_file, resume=args.resume)
    # Another run writing the same output is refused before the model loads too (process 0 holds the lock).
    with exclusive(args.output_file) if resumable and processes.rank == 0 else nullcontext():
        sampling = {"do_sample": args.do_sample, "temperature": args.temperature, "top_k": args.top_k,
                    "top_p": args.top_p}
        engine = engine_from_args(args, processes.local_rank, resumed, **sampling)
        settings = {key: getattr(args, key) for key in ("model", "decoding", "slots", "ctranslate2",
                                                        "compute_type", *sampling)} | engine.settings
        stdin = io.BytesIO("".join(f"{sentence}\n" for sentence in args.sentences).encode()) if args.sentences else None
        translate_file(engine, args.input_file, args.output_file, chunk_lines=args.chunk_lines,
                       max_tokens=args.max_tokens_per_batch, max_sentences=args.batch_size, resume=args.resume,
                       progress=True if args.progress else None, seed=args.seed if args.do_sample else None,
                       settings=settings, processes=processes, stdin=stdin)


if __name__ == "__main__":
    main()
