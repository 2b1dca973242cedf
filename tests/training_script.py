"""The training script on a small synthetic corpus, as the training tests run it: the corpus, the arguments of a
short run, and the script run in this process or in a fresh one."""

import contextlib
import io
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"

NUMBERS = [("one", "un"), ("two", "deux"), ("three", "trois"), ("four", "quatre"), ("five", "cinq")]
NOUNS = [("cat", "chat", "chats"), ("dog", "chien", "chiens"), ("book", "livre", "livres"), ("car", "voiture", "voitures")]


def synthetic_corpus(path: Path, pairs: int = 600, seed: int = 0) -> Path:
    """English<TAB>French lines from templates: enough structure for a tiny model to learn something."""
    rng = random.Random(seed)
    lines = []
    for _ in range(pairs):
        (en_n, fr_n), (en_s, fr_s, fr_p) = rng.choice(NUMBERS), rng.choice(NOUNS)
        if en_n == "one":
            lines.append(f"I have one {en_s}.\tJ'ai un {fr_s}.")
        else:
            lines.append(f"I have {en_n} {en_s}s.\tJ'ai {fr_n} {fr_p}.")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def distinct_corpus(path: Path, pairs: int = 1000) -> Path:
    """A corpus whose sentences all differ, so that deduplication leaves a validation split."""
    path.write_text("".join(f"I have {n} {noun}s.\tJ'ai {n} {plural}.\n"
                            for n in range(pairs) for noun, _, plural in [NOUNS[n % len(NOUNS)]]), encoding="utf-8")
    return path


def train_args(corpus: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        "--preset", "tiny", "--vocab_size", "300", "--corpus", str(corpus), "--output_dir", str(output_dir),
        "--max_steps", "30", "--per_device_train_batch_size", "16", "--learning_rate", "3e-3",
        "--warmup_steps", "5", "--eval_strategy", "no", "--save_strategy", "no", "--logging_steps", "10",
        "--report_to", "none", "--max_test_samples", "20", "--generation_num_beams", "2", "--seed", "0",
        "--dataloader_pin_memory", "false", *extra,
    ]


def run_script(name: str, *args: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def train_in_this_process(*args: str) -> str:
    """scripts/train_translation.py's `main`, run in this process; returns what it printed. On one intra-op thread, as
    the scripts the tests start, and with glibc's malloc left as it is: the script's keep_freed_cpu_memory would
    change it for the rest of the test process."""
    import vaswani.inference
    from conftest import script_main

    stdout, threads = io.StringIO(), torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        patch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
        torch.set_num_threads(1)
        try:
            script_main("train_translation")(list(args))
        finally:
            torch.set_num_threads(threads)
    return stdout.getvalue()
