"""The decoding loops on a trained checkpoint: transformers' own `generate()` loop against `vaswani.decoding`'s lean
one, in fp32 and int8, on the real held-out test sentences with real end-of-sentence stopping. It reports how many
translations are identical between the two loops, BLEU for each, and the time `vaswani.evaluation.translate` takes
(best of `--repeats`, the loops interleaved), which is what `scripts/evaluate_bleu.py` spends decoding.

bench_translation.py measures speed on identical work (random weights, a fixed output length, against Marian and
CTranslate2); this measures what the lean loop changes on a real model, where sentences stop at different steps.

    python benchmarks/bench_decoding_loops.py --model outputs/en-fr-small --device cpu --threads 2
"""

import argparse
import sys
import time
from pathlib import Path

from vaswani.cli import load_translator
from vaswani.data import load_translation_dataset
from vaswani.evaluation import score_corpus, translate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Column, command_line, csv_of, pick_device, resolve_corpus, result_name, write_report  # noqa: E402

LOOPS = ("transformers", "lean")


def run(args: argparse.Namespace, argv) -> Path:
    device = pick_device(args.device, args.threads)
    test = load_translation_dataset(data_file=str(resolve_corpus(args.corpus)))["test"]
    test = test.select(range(min(args.max_samples, len(test))))
    sources, references = test["source"], test["references"]
    rows = []
    for precision in args.precisions:
        models = {}
        for loop in LOOPS:
            models[loop], tokenizer = load_translator(args.model, args.device, int8=precision == "int8", decoding=loop)
        hypotheses, seconds = {}, {loop: float("inf") for loop in LOOPS}
        for _ in range(args.repeats):
            for loop in LOOPS:
                start = time.perf_counter()
                hypotheses[loop] = translate(models[loop], tokenizer, sources, batch_size=args.batch_size,
                                             num_beams=args.num_beams)
                seconds[loop] = min(seconds[loop], time.perf_counter() - start)
        identical = sum(a == b for a, b in zip(hypotheses["transformers"], hypotheses["lean"]))
        for loop in LOOPS:
            rows.append({
                "precision": precision,
                "loop": loop,
                "sentences": len(sources),
                "seconds": seconds[loop],
                "sentences_per_s": len(sources) / seconds[loop],
                "speedup": seconds["transformers"] / seconds[loop],
                "identical_to_transformers": identical,
                "bleu": score_corpus(hypotheses[loop], references)["bleu"],
            })
            print(rows[-1], flush=True)
        del models
    columns = [
        Column("precision", "precision"),
        Column("loop", "decoding loop"),
        Column("sentences", "sentences"),
        Column("seconds", "seconds", "{:.2f}"),
        Column("sentences_per_s", "sentences/s", "{:.1f}"),
        Column("speedup", "× transformers' loop", "{:.2f}"),
        Column("identical_to_transformers", "identical translations"),
        Column("bleu", "BLEU", "{:.2f}"),
    ]
    notes = [
        f"Checkpoint {args.model}; the first {len(sources)} sentences of the held-out test split, all references; "
        f"beam {args.num_beams}, batch {args.batch_size}, sentences batched longest first and stopped at their "
        "end-of-sentence token, as scripts/evaluate_bleu.py does.",
        "seconds: vaswani.evaluation.translate over all sentences (tokenizing, generate(), detokenizing), best of "
        f"{args.repeats}, the two loops interleaved in one process.",
        "int8: vaswani.inference.quantize_for_cpu, whose activations are quantized with one scale per tensor and "
        "call; a last-bit difference anywhere upstream (the lean loop's cross-attention runs one source row per "
        "sentence, so its matrix products are shaped differently) can move that scale and round a whole tensor "
        "differently, so in int8 a few translations may differ between two numerically equivalent loops.",
    ]
    json_path, _ = write_report(result_name(args, "decoding-loops", device), "Decoding loops on a trained model",
                                command_line(__file__, argv), device, vars(args) | {"model": args.model}, rows,
                                columns, notes, args.results_dir)
    return json_path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a trained Vaswani translation checkpoint")
    parser.add_argument("--corpus", default=None, help="the corpus the checkpoint's test split comes from")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--precisions", type=csv_of(str), default=["fp32", "int8"], help="fp32, int8 (CPU only)")
    parser.add_argument("--max_samples", type=int, default=1000)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=64, help="scripts/evaluate_bleu.py's default")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--results_dir", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--output_name", default=None, help="result file stem, in which {device} stands for the device "
                        "tag; default decoding-loops-{device}")
    return parser


def main(argv=None) -> Path:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    main()
