"""File translation at scale: `scripts/translate.py --input_file --output_file` (streamed in chunks by
`vaswani.file_translation`) on 100k and 1M lines, and the streamed path against the whole-file sort it replaced.

* `scale`: `--model`'s test sentences repeated to `--lines` lines, translated by translate.py in a process of its own:
  wall time (loading included), lines/s, peak RSS. `--stand_in tiny`: a random-weight tiny model with `--model`'s
  tokenizer instead (every sentence decodes `--max_new_tokens` tokens), where the trained model would take hours.
* `whole_file`: the first `--compare_sentences` test sentences through one `load_engine` engine in this process:
  `translate` over the whole file sorted by length in batches of 64 against `translate_file` with translate.py's
  defaults, interleaved, fastest of `--repeats`; lines/s and identical lines.

    python benchmarks/bench_streaming.py --model outputs/en-fr-small --stand_in tiny --threads 2
    python benchmarks/bench_streaming.py --model outputs/en-fr-small --stages whole_file --threads 2
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vaswani.file_translation import DEFAULT_CHUNK_LINES, DEFAULT_MAX_TOKENS, translate_file
from vaswani.loading import load_engine
from vaswani.tokenization_vaswani import VaswaniTokenizer
from vaswani.translation import translate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Column, add_common_arguments, csv_of, pick_device, random_checkpoint, report, test_sources,
)

STAGES = ("scale", "whole_file")
TRANSLATE = Path(__file__).resolve().parent.parent / "scripts" / "translate.py"
# What scripts/translate.py did before it streamed: the whole input sorted by length, batches of 64 sentences.
WHOLE_FILE_BATCH = 64


def repeat_to(sentences: list[str], lines: int, path: Path) -> None:
    """Write `lines` lines to `path`, cycling through `sentences`."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            f.write(sentences[i % len(sentences)] + "\n")


def run_translate(model: str, input_path: Path, output_path: Path, args) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of scripts/translate.py translating `input_path`, in a process of its own."""
    command = [sys.executable, str(TRANSLATE), "--model", model, "--device", "cpu", "--input_file", str(input_path),
               "--output_file", str(output_path), "--num_beams", str(args.scale_beams), "--max_new_tokens",
               str(args.max_new_tokens)]
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads or os.cpu_count())}
    start = time.perf_counter()
    process = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    error = process.stderr.read().decode(errors="replace")
    if status != 0:
        raise RuntimeError(f"translate.py failed ({status}):\n{error[-3000:]}")
    return seconds, usage.ru_maxrss / 1024  # Linux reports KiB


def scale_rows(args, sentences: list[str], workdir: Path) -> list[dict]:
    tokenizer = VaswaniTokenizer.from_pretrained(args.model)
    model = random_checkpoint("tiny", tokenizer, args.seed, workdir / "tiny") if args.stand_in else args.model
    rows = []
    for lines in args.lines:
        input_path, output_path = workdir / f"in-{lines}.en", workdir / f"out-{lines}.fr"
        repeat_to(sentences, lines, input_path)
        seconds, peak_mib = run_translate(model, input_path, output_path, args)
        with open(output_path, "rb") as f:
            written = sum(1 for _ in f)
        if written != lines:
            raise RuntimeError(f"{lines} lines in, {written} out")
        rows.append({"model": "tiny (random weights)" if args.stand_in else Path(args.model).name, "lines": lines,
                     "beams": args.scale_beams, "seconds": seconds, "lines_per_s": lines / seconds,
                     "peak_rss_mib": peak_mib})
        print(f"{lines:>9} lines: {seconds:8.1f} s, {lines / seconds:8.1f} lines/s, peak RSS {peak_mib:.0f} MiB",
              flush=True)
        input_path.unlink()
        output_path.unlink()
    smallest = rows[0]["peak_rss_mib"]
    for row in rows:
        row["rss_vs_smallest"] = row["peak_rss_mib"] / smallest
    return rows


def whole_file_rows(args, sentences: list[str], workdir: Path) -> list[dict]:
    input_path, output_path = workdir / "compare.en", workdir / "compare.fr"
    repeat_to(sentences, len(sentences), input_path)
    rows = []
    for beams in args.beams:
        engine = load_engine(args.model, device="cpu", dtype="float32", num_beams=beams)

        def whole_file():
            return translate(engine, sentences, max_sentences=WHOLE_FILE_BATCH).texts

        def streamed():
            translate_file(engine, str(input_path), str(output_path), progress=False)
            return output_path.read_text(encoding="utf-8").split("\n")[:-1]

        best, outputs = {}, {}
        for _ in range(args.repeats):
            for name, run in (("whole-file sort, batch 64", whole_file), ("streamed (translate.py defaults)",
                                                                          streamed)):
                start = time.perf_counter()
                outputs[name] = run()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
        reference = outputs["whole-file sort, batch 64"]
        for name, seconds in best.items():
            rows.append({"method": name, "beams": beams, "sentences": len(sentences), "seconds": seconds,
                         "lines_per_s": len(sentences) / seconds,
                         "vs_whole_file": best["whole-file sort, batch 64"] / seconds,
                         "identical": sum(a == b for a, b in zip(outputs[name], reference))})
            print(f"beams {beams} {name:>34}: {seconds:7.2f} s, {len(sentences) / seconds:7.1f} lines/s", flush=True)
    return rows


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--model", required=True, help="a trained checkpoint (its tokenizer and corpus test split)")
    parser.add_argument("--stages", type=csv_of(str, STAGES), default=list(STAGES))
    parser.add_argument("--stand_in", choices=["tiny"], default=None,
                        help="scale stage: a random-weight tiny model with --model's tokenizer instead of --model")
    parser.add_argument("--lines", type=csv_of(int), default=[100_000, 1_000_000])
    parser.add_argument("--scale_beams", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=16,
                        help="scale stage's limit (a random-weight stand-in always reaches it); the whole_file stage "
                        "decodes as translate.py does by default, with the checkpoint's limit")
    parser.add_argument("--beams", type=csv_of(int), default=[1, 4], help="whole_file stage")
    parser.add_argument("--compare_sentences", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    device = pick_device("cpu", args.threads)
    corpus, test = test_sources(args.corpus)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as workdir:
        rows = scale_rows(args, test, Path(workdir)) if "scale" in args.stages else []
        compared = whole_file_rows(args, test[: args.compare_sentences], Path(workdir)) \
            if "whole_file" in args.stages else []
    notes = [
        f"Input: the {len(test)} held-out test sentences of {corpus.name} (the checkpoint's split), repeated to each "
        f"line count. The machine's load average when the rows were done: {os.getloadavg()[0]:.1f} (1 minute); compare "
        "rows of one run, not runs.",
    ]
    if rows:
        notes.append(
            f"scale: scripts/translate.py with its defaults (chunks of {DEFAULT_CHUNK_LINES} lines, at most "
            f"{DEFAULT_MAX_TOKENS} padded source tokens per batch), --device cpu, --num_beams {args.scale_beams}, "
            f"--max_new_tokens {args.max_new_tokens}, OMP_NUM_THREADS={args.threads or os.cpu_count()}; seconds = "
            "wall time of the process (loading included); peak RSS = its ru_maxrss; RSS × smallest = peak RSS over "
            "the smallest line count's.")
    if rows and args.stand_in:
        notes.append(f"scale rows ran a stand-in: the tiny preset with random weights and {Path(args.model).name}'s "
                     f"tokenizer, so every sentence decodes {args.max_new_tokens} tokens.")
    if compared:
        notes.append(
            f"whole_file: {Path(args.model).name} in fp32 in this process, the first {args.compare_sentences} test "
            "sentences, one engine from vaswani.loading.load_engine (the checkpoint's decoding settings but the "
            "beams); whole-file sort = vaswani.translation.translate in batches of 64 sentences (translate.py before "
            "it streamed); streamed = vaswani.file_translation.translate_file with translate.py's defaults, writing a "
            f"file; interleaved, fastest of {args.repeats}; identical = lines equal to the whole-file sort's.")
    columns = [Column("model", "model"), Column("lines", "lines"), Column("beams", "beams"),
               Column("seconds", "wall s", "{:.1f}"), Column("lines_per_s", "lines/s", "{:.0f}"),
               Column("peak_rss_mib", "peak RSS MiB", "{:.0f}"), Column("rss_vs_smallest", "RSS × smallest", "{:.2f}")]
    compare_columns = [Column("method", "method"), Column("beams", "beams"), Column("sentences", "sentences"),
                       Column("seconds", "seconds", "{:.2f}"), Column("lines_per_s", "lines/s", "{:.1f}"),
                       Column("vs_whole_file", "× whole-file", "{:.2f}"), Column("identical", "identical")]
    main_rows, main_columns = (rows, columns) if rows else (compared, compare_columns)
    extra = [("Streamed against the whole-file sort", compared, compare_columns)] if rows and compared else []
    return report(__file__, argv, args, device, "streaming", "File translation at scale", main_rows, main_columns,
                  notes, {"corpus": str(corpus)}, extra_tables=extra)


if __name__ == "__main__":
    main()
