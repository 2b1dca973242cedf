"""File translation at scale: `scripts/translate.py --input_file --output_file` (streamed in chunks by
`vaswani.file_translation`) on 100k and 1M lines.

`--model`'s test sentences repeated to `--lines` lines, translated by translate.py in a process of its own: wall time
(loading included), lines/s, peak RSS. `--stand_in tiny`: a random-weight tiny model with `--model`'s tokenizer
instead (every sentence decodes `--max_new_tokens` tokens), where the trained model would take hours.

    python benchmarks/bench_streaming.py --model outputs/en-fr-small --stand_in tiny --threads 2
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vaswani.file_translation import DEFAULT_CHUNK_LINES, DEFAULT_MAX_TOKENS, count_lines
from vaswani.tokenization_vaswani import VaswaniTokenizer

from common import Column, argument_parser, csv_of, pick_device, random_checkpoint, report, test_sources

TRANSLATE = Path(__file__).resolve().parent.parent / "scripts" / "translate.py"


def run_translate(model: str, input_path: Path, output_path: Path, args) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of scripts/translate.py translating `input_path`, in a process of its own."""
    command = [sys.executable, str(TRANSLATE), "--model", model, "--device", "cpu", "--input_file", str(input_path),
               "--output_file", str(output_path), "--num_beams", str(args.num_beams), "--max_new_tokens",
               str(args.max_new_tokens)]
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads or os.cpu_count())}
    start = time.perf_counter()
    process = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"translate.py failed ({status}):\n{process.stderr.read().decode(errors='replace')[-3000:]}")
    return seconds, usage.ru_maxrss / 1024  # Linux reports KiB


def scale_rows(args, sentences: list[str], workdir: Path) -> list[dict]:
    tokenizer = VaswaniTokenizer.from_pretrained(args.model)
    model = random_checkpoint("tiny", tokenizer, args.seed, workdir / "tiny") if args.stand_in else args.model
    rows = []
    for lines in args.lines:
        input_path, output_path = workdir / f"in-{lines}.en", workdir / f"out-{lines}.fr"
        input_path.write_text("".join(sentences[i % len(sentences)] + "\n" for i in range(lines)), encoding="utf-8")
        seconds, peak_mib = run_translate(model, input_path, output_path, args)
        if (written := count_lines(output_path)) != lines:
            raise RuntimeError(f"{lines} lines in, {written} out")
        rows.append({"model": "tiny (random weights)" if args.stand_in else Path(args.model).name, "lines": lines,
                     "beams": args.num_beams, "seconds": seconds, "lines_per_s": lines / seconds,
                     "peak_rss_mib": peak_mib})
        print(f"{lines:>9} lines: {seconds:8.1f} s, {lines / seconds:8.1f} lines/s, peak RSS {peak_mib:.0f} MiB",
              flush=True)
        input_path.unlink()
        output_path.unlink()
    for row in rows:
        row["rss_vs_smallest"] = row["peak_rss_mib"] / rows[0]["peak_rss_mib"]
    return rows


def main(argv=None) -> Path:
    parser, add = argument_parser(__doc__)
    add("--model", required=True, help="a trained checkpoint (its tokenizer and corpus test split)")
    add("--stand_in", choices=["tiny"], default=None, help="a random-weight tiny model with --model's tokenizer "
        "instead of --model")
    add("--lines", type=csv_of(int), default=[100_000, 1_000_000])
    add("--num_beams", type=int, default=1)
    add("--max_new_tokens", type=int, default=16, help="a random-weight stand-in always reaches it")
    args = parser.parse_args(argv)
    device = pick_device("cpu", args.threads)
    corpus, test = test_sources(args.corpus)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as workdir:
        rows = scale_rows(args, test, Path(workdir))
    notes = [
        f"Input: the {len(test)} held-out test sentences of {corpus.name} (the checkpoint's split), repeated to each "
        f"line count. The machine's load average when the rows were done: {os.getloadavg()[0]:.1f} (1 minute); compare "
        "rows of one run, not runs.",
        f"scripts/translate.py with its defaults (chunks of {DEFAULT_CHUNK_LINES} lines, at most {DEFAULT_MAX_TOKENS} "
        f"padded source tokens per batch), --device cpu, --num_beams {args.num_beams}, --max_new_tokens "
        f"{args.max_new_tokens}, OMP_NUM_THREADS={args.threads or os.cpu_count()}; seconds = wall time of the process "
        "(loading included); peak RSS = its ru_maxrss; RSS × smallest = peak RSS over the smallest line count's.",
        *([f"A stand-in ran: the tiny preset with random weights and {Path(args.model).name}'s tokenizer, so every "
           f"sentence decodes {args.max_new_tokens} tokens."] if args.stand_in else []),
    ]
    columns = [Column("model", "model"), Column("lines", "lines"), Column("beams", "beams"),
               Column("seconds", "wall s", "{:.1f}"), Column("lines_per_s", "lines/s", "{:.0f}"),
               Column("peak_rss_mib", "peak RSS MiB", "{:.0f}"), Column("rss_vs_smallest", "RSS × smallest", "{:.2f}")]
    return report(__file__, argv, args, device, "streaming", "File translation at scale", rows, columns, notes,
                  {"corpus": str(corpus)})


if __name__ == "__main__":
    main()
