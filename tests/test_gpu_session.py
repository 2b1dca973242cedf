"""benchmarks/gpu_session.sh, cheaply: its plans fit one call of a lent GPU each, a stage that fails costs only its own
results, and a dry-run stage runs on this machine. The plans' whole dry runs take minutes, so they are run by hand
before a GPU call (benchmarks/README.md, "A lent GPU"), not here."""

import importlib.util
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SESSION = REPO / "benchmarks" / "gpu_session.sh"
# A device call runs at most 10 minutes and a session has 15 of device time, the machine's start included: the
# first plan must leave room for the start and the second fit what is left after it.
FIRST_PLAN_SECONDS, SECOND_PLAN_SECONDS = 480, 300


def session(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SESSION), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def limits(*args: str) -> dict[str, int]:
    result = session("--limits", *args)
    assert result.returncode == 0, result.stderr
    return {name: int(seconds) for name, seconds in (line.split() for line in result.stdout.splitlines())}


def test_each_plan_fits_one_call_with_its_stage_limits_adding_up():
    first, second = limits(), limits("second")
    assert list(first) == ["setup", "quality", "total"]
    assert list(second) == ["setup", "translation-trained", "kernels", "total"]
    for plan, most in ((first, FIRST_PLAN_SECONDS), (second, SECOND_PLAN_SECONDS)):
        total = plan.pop("total")
        assert total == sum(plan.values()) <= most
        assert all(seconds > 0 for seconds in plan.values())
    assert limits("first") == {**first, "total": sum(first.values())}
    # 300 s of training are the quality stage's core; the rest of its limit covers the compilation (about 115 s with
    # the start-up on the 2026-11-27 H200) and the test split.
    assert first["quality"] >= 300 + 115 + 25


def test_named_stages_run_after_setup_and_an_unknown_one_is_refused():
    assert list(limits("probe-25000", "tests")) == ["setup", "probe-25000", "tests", "total"]
    refused = session("--limits", "quality", "nonsense")
    assert refused.returncode == 2 and "unknown stage nonsense" in refused.stderr


@pytest.fixture
def fake_python(tmp_path) -> Path:
    """A `python3` on PATH that stands in for the stages' programs in no time: each writes a result file named after
    its script; gpu_quality.py then fails, and bench_training.py fails unless the quality stage's files were packed
    before it started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "python3"
    script.write_text(
        "#!/usr/bin/env bash\n"
        'results=""; previous=""\n'
        'for arg in "$@"; do [ "$previous" = --results_dir ] && results=$arg; previous=$arg; done\n'
        'case "$1" in\n'
        '  benchmarks/gpu_quality.py) echo partial > "$results/quality.txt"; exit 3 ;;\n'
        '  benchmarks/bench_training.py) tar -tzf "$ARCHIVE" | grep -q quality.txt || exit 9\n'
        '    echo rows > "$results/probe.txt" ;;\n'
        '  -) cat > /dev/null; echo "device: fake" ;;\n'
        "esac\n")
    script.chmod(0o755)
    return bin_dir


def test_a_failing_stage_costs_only_its_own_results(fake_python, tmp_path):
    results, archive = tmp_path / "results", tmp_path / "results.tar.gz"
    run = session("quality", "probe-4000", env={"PATH": f"{fake_python}:{os.environ['PATH']}",
                                                "RESULTS_DIR": str(results), "ARCHIVE": str(archive),
                                                "INSTALL_WHEELS": "0"})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "== quality: exit 3" in run.stdout and "== probe-4000: exit 0" in run.stdout
    with tarfile.open(archive) as packed:  # the last pack holds every stage's files and logs
        names = {Path(name).name for name in packed.getnames()}
    assert {"quality.txt", "probe.txt", "gpu-setup.log", "gpu-quality.log", "gpu-probe-4000.log"} <= names


def test_dry_run_of_the_setup_stage(tmp_path):
    """The cheapest stage for real, as a dry run runs it here: the packages every stage imports, and the pack."""
    python_dir = str(Path(sys.executable).parent)
    results, archive = tmp_path / "results", tmp_path / "results.tar.gz"
    run = session("--dry_run", "setup", timeout=120,
                  env={"PATH": f"{python_dir}:{os.environ['PATH']}", "RESULTS_DIR": str(results),
                       "ARCHIVE": str(archive)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "device: cpu" in run.stdout and "== setup: exit 0" in run.stdout
    with tarfile.open(archive) as packed:
        assert "./gpu-setup.log" in packed.getnames()


def load_quality():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_quality", REPO / "benchmarks" / "gpu_quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quality_run_tokens_a_step_are_those_of_an_epochs_padded_batches():
    from datasets import Dataset

    quality = load_quality()
    # Lengths (source, target): the token-budget sampler cuts them, shortest first, into batches of at most 16 tokens
    # per side, padding included (each example padded to a multiple of 4 counts as 4 or 8).
    pairs = [(1, 3), (2, 2), (3, 1), (5, 2), (6, 7), (2, 6)]
    train = Dataset.from_dict({"input_ids": [[9] * s for s, _ in pairs], "labels": [[9] * t for _, t in pairs]})
    tokens = quality.epoch_tokens(train, 16, 4)
    batches = quality.TokenBatchSampler(quality.example_lengths(train), 16, shuffle=False,
                                        pad_to_multiple_of=4).batches_by_length()
    assert sorted(i for batch in batches for i in batch) == list(range(len(pairs))) and len(batches) > 1
    padded = sum(len(b) * (-(-max(pairs[i][side] for i in b) // 4) * 4) for b in batches for side in (0, 1))
    assert tokens == {"batches": len(batches), "real_per_batch": sum(map(sum, pairs)) / len(batches),
                      "padded_per_batch": padded / len(batches)}
    rates = quality.step_rates({"train_steps": 30, "train_runtime": 1.5}, tokens)
    assert rates["ms_per_step"] == 50 and rates["train_epochs"] == 30 / len(batches)
    assert rates["padded_tokens_per_second"] == padded / len(batches) * 20
    assert quality.step_rates({"train_steps": 0, "train_runtime": 0.0}, tokens) == {}


def test_quality_run_scores_the_test_splits_first_sentences(tmp_path):
    from vaswani.evaluation import score_corpus

    quality = load_quality()
    references = [["le petit chat noir dort ici"], ["un grand chien court vite", "le grand chien court vite"],
                  ["la maison rouge est belle"], ["il court dans le jardin"]]
    hypotheses = ["le petit chat noir dort ici", "le grand chien court vite", "la maison est belle",
                  "il court dans le parc"]
    translations = tmp_path / "test_translations.txt"
    translations.write_text("".join(line + "\n" for line in hypotheses), encoding="utf-8")
    assert quality.subset_bleu(translations, references, 2) == pytest.approx(100)
    assert quality.subset_bleu(translations, references, 3) == score_corpus(hypotheses[:3], references[:3])["bleu"]
    assert quality.subset_bleu(translations, references, 3) < 100
    assert quality.subset_bleu(translations, references, 1000) == score_corpus(hypotheses, references)["bleu"]
    assert quality.subset_bleu(tmp_path / "missing.txt", references, 2) is None


def test_quality_report_says_why_a_recipe_failed(tmp_path):
    """A recipe that stopped (as the 2026-11-27 H200 run's NaN loss did) is named with the error its log ends on."""
    quality = load_quality()
    log = tmp_path / "recipe.log"
    log.write_text("$ python3 scripts/train_translation.py ...\n{'loss': '3.685'}\n"
                   "error: Training loss became NaN/inf at step 1869. Lower the learning rate.\n\n"
                   "[W] a data loader worker's warning, printed after the error\n")
    assert quality.failure_line(log) == "error: Training loss became NaN/inf at step 1869. Lower the learning rate."
    log.write_text("starting\nKilled\n")
    assert quality.failure_line(log) == "Killed"
    assert quality.failure_line(tmp_path / "missing.log") is None
