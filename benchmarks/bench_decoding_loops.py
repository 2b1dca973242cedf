"""The decoding loops on a trained checkpoint: transformers' own `generate()` loop (`lean_decoding=False`) against
the lean one that `generate()` takes by default (`vaswani.generation_vaswani`), in fp32 and int8, on the real held-out
test sentences with real end-of-sentence stopping. It reports how many translations are identical between the two
loops, BLEU for each, and the time `vaswani.evaluation.translate` takes (best of `--repeats`, the loops interleaved),
which is what `scripts/evaluate_bleu.py` and the training script's final evaluation spend decoding. A second table
checks, in fp32, that every sentence's generated tokens are identical between the loops for each option of greedy
and beam search in `SEARCHES`.

bench_translation.py measures speed on identical work (random weights, a fixed output length, against Marian and
CTranslate2); this measures what the lean loop changes on a real model, where sentences stop at different steps.

    python benchmarks/bench_decoding_loops.py --model outputs/en-fr-small --device cpu --threads 2
"""

import argparse
import sys
import time
from pathlib import Path

from vaswani.data import load_translation_dataset
from vaswani.evaluation import score_corpus, translate
from vaswani.loading import load_translator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Column,
    add_result_arguments,
    command_line,
    csv_of,
    pick_device,
    resolve_corpus,
    result_name,
    write_report,
)

LOOPS = ("transformers", "lean")
# Frequent French words, whose token ids (as sentence-initial words) `bad_words_ids` bans in SEARCHES.
BAD_WORDS = ["le", "la", "est", "pas"]


def searches(bad_words_ids: list[list[int]], eos_token_id: int) -> dict[str, dict]:
    """Options of greedy and beam search that change which hypotheses are kept or when decoding stops: the tiny-model
    matrix of tests/test_decoding.py, here on a trained model and real sentences."""
    return {
        "greedy": dict(num_beams=1),
        "greedy, max_new_tokens=6": dict(num_beams=1, max_new_tokens=6),
        "greedy, max_length=8": dict(num_beams=1, max_length=8),
        "greedy, bad_words_ids": dict(num_beams=1, bad_words_ids=bad_words_ids),
        "greedy, forced_eos_token_id, max_new_tokens=8": dict(num_beams=1, forced_eos_token_id=eos_token_id,
                                                              max_new_tokens=8),
        "beam 4": dict(num_beams=4),
        "beam 5": dict(num_beams=5),
        "beam 4, length_penalty=0.6": dict(num_beams=4, length_penalty=0.6),
        "beam 4, early_stopping=True": dict(num_beams=4, early_stopping=True),
        "beam 4, early_stopping=never, length_penalty=1.5": dict(num_beams=4, early_stopping="never",
                                                                 length_penalty=1.5),
        "beam 5, num_return_sequences=3": dict(num_beams=5, num_return_sequences=3),
        "beam 4, max_new_tokens=6": dict(num_beams=4, max_new_tokens=6),
        "beam 4, max_length=8": dict(num_beams=4, max_length=8),
        "beam 4, bad_words_ids": dict(num_beams=4, bad_words_ids=bad_words_ids),
        "beam 4, forced_eos_token_id, max_new_tokens=8": dict(num_beams=4, forced_eos_token_id=eos_token_id,
                                                              max_new_tokens=8),
    }


PRECISIONS = ("fp32", "int8", "int8-torchao")


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
            if precision == "int8-torchao":
                quantize_with_torchao(models[loop])
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
    equality = identical_tokens(args, sources) if "fp32" in args.precisions else []
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
        "int8: vaswani.inference.quantize_for_cpu, whose activations are quantized with one scale per row (token) "
        "and whose integer products add up exactly: a row's numbers do not depend on the rows beside it, so int8 "
        "adds no difference between the two loops to fp32's.",
    ]
    if "int8-torchao" in args.precisions:
        import torchao

        notes.append(f"int8-torchao: torchao {torchao.__version__}'s quantize_(model, "
                     "Int8DynamicActivationInt8WeightConfig()) on the fp32 checkpoint, eager (no torch.compile).")
    equality_table = ("Token-identical outputs, fp32", equality, [
        Column("search", "generate() options"),
        Column("sentences", "sentences"),
        Column("identical", "identical token ids"),
    ])
    notes.append("Token-identical outputs: generate() of each loop on the same batches (batch_size sentences, longest "
                 "first), a sentence counted identical when all its returned sequences have the same token ids, padding "
                 f"aside; bad_words_ids bans {', '.join(BAD_WORDS)} (their token ids as sentence-initial words); "
                 "max_new_tokens=20 unless the row sets a length.")
    json_path, _ = write_report(result_name(args, "decoding-loops", device), "Decoding loops on a trained model",
                                command_line(__file__, argv), device, vars(args) | {"model": args.model}, rows,
                                columns, notes, args.results_dir, extra_tables=[equality_table] if equality else [])
    return json_path


def quantize_with_torchao(model) -> None:
    """torchao's int8 dynamic-activation / int8-weight quantization, in place: the maintained successor of
    `torch.ao.quantization.quantize_dynamic`, which `--int8` ran before, measured beside `--int8`."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantize_(model, Int8DynamicActivationInt8WeightConfig())


def identical_tokens(args: argparse.Namespace, sources) -> list[dict]:
    """For each of `searches`, how many sentences get the same token ids from both loops (fp32)."""
    model, tokenizer = load_translator(args.model, args.device)
    bad_words_ids = tokenizer(BAD_WORDS, add_special_tokens=False)["input_ids"]
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    batches = [[sources[i] for i in order[start:start + args.batch_size]]
               for start in range(0, len(order), args.batch_size)]
    rows = []
    for name, search in searches(bad_words_ids, model.config.eos_token_id).items():
        if "max_length" not in search:
            search = {"max_new_tokens": 20, **search}
        identical = 0
        for batch in batches:
            inputs = tokenizer(batch, return_tensors="pt", padding=True).to(model.device)
            reference, lean = (_rows(model.generate(**inputs, **search, lean_decoding=lean), len(batch),
                                     tokenizer.pad_token_id) for lean in (False, True))
            identical += sum(a == b for a, b in zip(reference, lean))
        rows.append({"search": name, "sentences": len(sources), "identical": identical})
        print(rows[-1], flush=True)
    return rows


def _rows(output, sentences: int, pad_token_id: int) -> list[list[list[int]]]:
    """generate()'s output (sentences × returned sequences, length) as each sentence's sequences without padding."""
    sequences = [[token for token in row if token != pad_token_id] for row in output.tolist()]
    per_sentence = len(sequences) // sentences
    return [sequences[i * per_sentence:(i + 1) * per_sentence] for i in range(sentences)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a trained Vaswani translation checkpoint")
    parser.add_argument("--corpus", default=None, help="the corpus the checkpoint's test split comes from")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--precisions", type=csv_of(str, PRECISIONS), default=["fp32", "int8"],
                        help="fp32, int8 (CPU only: vaswani.inference.quantize_for_cpu, what --int8 runs), "
                        "int8-torchao (torchao's int8 dynamic quantization; needs the torchao package)")
    parser.add_argument("--max_samples", type=int, default=1000)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=64, help="scripts/evaluate_bleu.py's default")
    parser.add_argument("--repeats", type=int, default=2)
    add_result_arguments(parser)
    return parser


def main(argv=None) -> Path:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    main()
