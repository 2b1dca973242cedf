#!/usr/bin/env python
"""BLEU, chrF and TER (sacreBLEU, multi-reference) of a checkpoint on a held-out split or on files.

    python scripts/evaluate_bleu.py --model outputs/en-fr                      # fra-eng test split
    python scripts/evaluate_bleu.py --model outputs/en-fr --device cpu --int8          # int8 CPU decoding
    python scripts/evaluate_bleu.py --model outputs/en-fr-ct2 --ctranslate2 --compute_type int8  # an exported model
    python scripts/evaluate_bleu.py --model outputs/en-fr --source_file src.en --reference_file ref1.fr --reference_file ref2.fr

Whichever engine decodes, the sources go through `vaswani.translation.translate`, as in scripts/translate.py:
batches of --batch_size sentences, longest first; sources longer than the model takes are truncated (a warning on
stderr counts them).
"""

import argparse
import json

from vaswani.cli import add_decoding_arguments, user_errors_exit
from vaswani.data import load_translation_dataset
from vaswani.evaluation import score_corpus
from vaswani.export import load_ctranslate2
from vaswani.files import check_output_file, read_lines, write_atomically
from vaswani.loading import DTYPES, load_translator
from vaswani.translation import CTranslate2Engine, TorchEngine, translate

from shared_corpus import SHARED_CORPUS, SHARED_CORPUS_RELATIVE  # beside this script


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory or Hub id")
    parser.add_argument("--corpus", help="parallel corpus file (default: the fra-eng corpus from $VASWANI_FRA_ENG, "
                                         f"{SHARED_CORPUS_RELATIVE} or its download)")
    parser.add_argument("--dataset_name", help="a Hugging Face dataset instead")
    parser.add_argument("--dataset_config")
    parser.add_argument("--split", default="test", choices=["test", "validation"])
    parser.add_argument("--source_file", help="one source sentence per line (instead of a corpus split)")
    parser.add_argument("--reference_file", action="append", help="references, line-aligned; repeat for more")
    parser.add_argument("--max_samples", type=int)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--length_penalty", type=float, default=None,
                        help="beam search's length penalty (generate()'s: scores divided by length**penalty); "
                        "default: the checkpoint's generation config")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--device", default="auto")
    add_decoding_arguments(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="precision of the PyTorch model (default: bf16 on GPUs that have it, else fp32)")
    parser.add_argument("--ctranslate2", action="store_true",
                        help="--model is a CTranslate2 directory from scripts/export_ctranslate2.py; CTranslate2 decodes")
    parser.add_argument("--compute_type", default="default",
                        help="with --ctranslate2: int8, int8_float32, float32, … (default: the format on disk)")
    parser.add_argument("--output_file", help="write metrics and hypotheses as JSON here")
    args = parser.parse_args(argv)
    for name in ("max_samples", "num_beams", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")

    if args.output_file:  # refused before anything is read: never one of the inputs
        check_output_file(args.output_file, [args.source_file, *(args.reference_file or []), args.corpus])
    if args.source_file:
        if not args.reference_file:
            raise ValueError("--source_file needs at least one --reference_file")
        sources = read_lines(args.source_file)
        reference_sets = [read_lines(path) for path in args.reference_file]
        unequal = [f"{path} has {len(refs)}" for path, refs in zip(args.reference_file, reference_sets)
                   if len(refs) != len(sources)]
        if unequal:
            raise ValueError(f"every --reference_file must have as many lines as --source_file {args.source_file} "
                             f"({len(sources)}): {', '.join(unequal)}")
        # Empty lines mean "no such reference" for that sentence (a variable number of references).
        references = [[refs[i] for refs in reference_sets if refs[i]] for i in range(len(sources))]
    else:
        split = load_translation_dataset(args.dataset_name, args.dataset_config, data_file=args.corpus,
                                         default_corpus=SHARED_CORPUS)[args.split]
        if args.max_samples:
            split = split.select(range(min(args.max_samples, len(split))))
        sources, references = split["source"], split["references"]
    if args.max_samples:
        sources, references = sources[: args.max_samples], references[: args.max_samples]
    if not sources:
        raise ValueError("there is nothing to evaluate: the source file or split is empty")

    if args.ctranslate2:
        if args.int8:
            raise ValueError("--int8 is the PyTorch path; with --ctranslate2 use --compute_type int8")
        if args.length_penalty is not None:
            raise ValueError("--length_penalty is generate()'s; CTranslate2 decodes with its own defaults here")
        translator, tokenizer = load_ctranslate2(args.model, device=args.device, compute_type=args.compute_type)
        engine = CTranslate2Engine(translator, tokenizer, num_beams=args.num_beams)
    else:
        model, tokenizer = load_translator(args.model, args.device, int8=args.int8, decoding=args.decoding,
                                           dtype=DTYPES.get(args.dtype))
        options = {} if args.length_penalty is None else {"length_penalty": args.length_penalty}
        # the limits training's BLEU uses
        engine = TorchEngine(model, tokenizer, num_beams=args.num_beams, slots=args.slots, **options)
    hypotheses = translate(engine, sources, max_sentences=args.batch_size).texts
    result = {**score_corpus(hypotheses, references), "hypotheses": hypotheses}
    engine_name = f"ctranslate2 {args.compute_type}" if args.ctranslate2 else "pytorch int8" if args.int8 else \
        f"pytorch {args.dtype}" if args.dtype else "pytorch"
    summary = {k: result[k] for k in ("bleu", "chrf", "ter")} | {"sentences": len(sources), "num_beams": args.num_beams,
                                                                  "length_penalty": args.length_penalty,
                                                                  "int8": args.int8, "engine": engine_name,
                                                                  "signatures": result.get("signatures")}
    print(json.dumps(summary, indent=2))
    if args.output_file:
        report = {**summary, "sources": list(sources), "hypotheses": result["hypotheses"]}
        write_atomically(args.output_file, json.dumps(report, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
