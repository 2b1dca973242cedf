#!/usr/bin/env python
"""BLEU, chrF and TER (sacreBLEU, multi-reference) of a checkpoint on a held-out split or on files.

    python scripts/evaluate_bleu.py --model outputs/en-fr                      # fra-eng test split
    python scripts/evaluate_bleu.py --model outputs/en-fr --ctranslate2 --compute_type int8  # int8 on a CPU
    python scripts/evaluate_bleu.py --model outputs/en-fr-ct2 --ctranslate2 --compute_type int8  # an exported model
    python scripts/evaluate_bleu.py --model outputs/en-fr --source_file src.en --reference_file ref1.fr --reference_file ref2.fr

Whichever engine decodes, the sources go through `vaswani.translation.translate`, as in scripts/translate.py:
batches of --batch_size sentences, longest first; sources longer than the model takes are truncated (a warning on
stderr counts them). A decoding setting not given (--num_beams, --max_new_tokens, --length_penalty) is the
checkpoint's, from its generation_config.json, as training evaluated it. The engine is chosen as in
scripts/translate.py (vaswani.engine_choice: on a CPU the one scripts/choose_engine.py recorded beside the
checkpoint for this machine, else PyTorch; --ctranslate2 / --no-ctranslate2 decide it), named with why on stderr
and in the report's "engine" and "engine_choice".

Under torchrun or `accelerate launch` each process translates every N-th source and process 0 scores them all, prints
and writes the report; a process that is lost ends the others with one line naming it (vaswani.peers).
"""

import argparse
import json
from contextlib import nullcontext

from vaswani.cli import add_decoding_arguments, engine_from_args, positive_int, user_errors_exit
from vaswani.data import load_translation_dataset
from vaswani.evaluation import score_corpus
from vaswani.file_translation import Processes
from vaswani.files import check_output_file, exclusive, read_lines, write_atomically
from vaswani.peers import Peers, ending_process_group, gathered, peer_lost
from vaswani.translation import translate

from shared_corpus import SHARED_CORPUS, SHARED_CORPUS_RELATIVE  # beside this script


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory, Hub id or CTranslate2 directory")
    parser.add_argument("--corpus", help="parallel corpus file (default: the fra-eng corpus from $VASWANI_FRA_ENG, "
                                         f"{SHARED_CORPUS_RELATIVE} or its download)")
    parser.add_argument("--dataset_name", help="a Hugging Face dataset instead")
    parser.add_argument("--dataset_config")
    parser.add_argument("--split", default="test", choices=["test", "validation"])
    parser.add_argument("--source_file", help="one source sentence per line (instead of a corpus split)")
    parser.add_argument("--reference_file", action="append", help="references, line-aligned; repeat for more")
    parser.add_argument("--max_samples", type=positive_int)
    parser.add_argument("--batch_size", type=positive_int, default=64)
    add_decoding_arguments(parser)
    parser.add_argument("--output_file", help="write metrics and hypotheses as JSON here")
    args = parser.parse_args(argv)

    if args.output_file:  # refused before anything is read: never one of the inputs
        check_output_file(args.output_file, [args.source_file, *(args.reference_file or []), args.corpus])
    processes = Processes.from_environment()
    # One run writes the report at a time (process 0 writes it).
    with exclusive(args.output_file) if args.output_file and processes.rank == 0 else nullcontext():
        evaluate(args, processes)


def evaluate(args: argparse.Namespace, processes: Processes) -> None:
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

    engine = engine_from_args(args, processes.local_rank)
    sources, rank, world_size = list(sources), processes.rank, processes.world_size
    # Every process ends at the group's barrier, so a process that is done is never taken for a lost one.
    with ending_process_group(rank, world_size):
        peers = Peers.gather()
        try:
            share = translate(engine, sources[rank::world_size], max_sentences=args.batch_size).texts
            hypotheses = gathered(share, world_size)
        except RuntimeError as error:  # what a collective raises when it lost a process
            if peers and (ended := peers.lost(error)):
                raise peer_lost(ended, "evaluation", rank, "nothing was scored: run the same command again.") from None
            raise
    if rank != 0:
        return
    result = {**score_corpus(hypotheses, references), "hypotheses": hypotheses}
    settings = engine.settings
    summary = {k: result[k] for k in ("bleu", "chrf", "ter")} | {"sentences": len(sources)} | settings | {
        "engine": f"{settings['engine']} {settings['precision']}",
        "signatures": result.get("signatures")}
    print(json.dumps(summary, indent=2))
    if args.output_file:
        report = {**summary, "sources": list(sources), "hypotheses": result["hypotheses"]}
        write_atomically(args.output_file, json.dumps(report, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
