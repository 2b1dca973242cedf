"""benchmarks/gpu_plan.py, cheaply: its plans fit one call of a lent GPU each, a stage that fails or overruns its
limit costs only its own results, and a dry-run stage runs on this machine. The plans' whole dry runs take minutes,
so they are run by hand before a GPU call (benchmarks/README.md, "A lent GPU"), not here."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_plan  # noqa: E402

# A device call runs at most 10 minutes and a session has 15 of device time, the machine's start included: the
# first plan must leave room for the start and the second fit what is left after it.
FIRST_PLAN_SECONDS, SECOND_PLAN_SECONDS = 480, 300
# A machine's compile-cache key (gpu_plan.cache_key).
KEY = {"torch": "2.11.0+cu128", "cuda": "12.8", "triton": "3.5.0", "gpu": "NVIDIA H200", "code": "0123456789abcdef",
       "commit": "3cc5c8f"}


def test_each_plan_fits_one_call_and_the_compile_caches_let_the_probe_join_the_quality_run(tmp_path):
    (first_budget, first), (second_budget, second) = gpu_plan.plan([]), gpu_plan.plan(["second"])
    assert first == ["setup", "quality", "probe-4000"] and gpu_plan.plan(["first"]) == (first_budget, first)
    assert second == ["setup", "translation-trained", "probe-4000"]
    assert gpu_plan.plan(["third"])[1] == ["setup", "kernels", "tests"]
    assert first_budget <= FIRST_PLAN_SECONDS and second_budget <= SECOND_PLAN_SECONDS
    cold = {name: gpu_plan.stage_limit(name, tmp_path, KEY) for name in gpu_plan.STAGES}
    for name, stage in gpu_plan.STAGES.items():
        if stage.cache:
            (tmp_path / stage.cache).write_bytes(b"carried")
            gpu_plan.sign(name, tmp_path, KEY)
    warm = {name: gpu_plan.stage_limit(name, tmp_path, KEY) for name in gpu_plan.STAGES}
    # With the caches carried the whole first plan fits; without, the quality run still does (the probe is left out).
    assert sum(warm[name] for name in first) <= first_budget
    assert cold["setup"] + cold["quality"] <= first_budget < sum(cold[name] for name in first)
    # The second plan's × Marian figures: translation whole, then the probe with at least half its cold limit (its
    # timed steps are kept when it is cut), within the plan's budget.
    assert cold["setup"] + cold["translation-trained"] + cold["probe-4000"] / 2 <= second_budget
    # 300 s of training are the quality stage's core; the rest of its limit covers the compilation (about 115 s cold
    # on the 2026-11-27 H200), and the test split.
    assert cold["quality"] >= 300 + 115 + 25 and warm["quality"] >= 300 + 25


def test_a_compile_cache_gives_the_warm_limit_only_with_this_machines_key(tmp_path, capsys):
    """Carried without a key, or made on another GPU, torch or code, a cache runs its stage cold: set aside, the
    reason in one line; a stage's cache is signed with the key once it ran. Another commit of the same code serves."""
    quality, cache = gpu_plan.STAGES["quality"], tmp_path / "quality.bin"
    cache.write_bytes(b"compiled")
    assert gpu_plan.stage_limit("quality", tmp_path, KEY) == quality.cold
    gpu_plan.sign("quality", tmp_path, KEY)
    assert gpu_plan.stage_limit("quality", tmp_path, {**KEY, "commit": "0000000"}) == quality.limit
    h100 = {**KEY, "gpu": "NVIDIA H100 80GB HBM3"}
    assert gpu_plan.stage_limit("quality", tmp_path, h100) == quality.cold
    gpu_plan.set_aside("quality", tmp_path, h100, quality.cold)
    assert capsys.readouterr().out == (f"== quality: runs cold, limit {quality.cold} s: quality.bin was made by "
                                       "another gpu NVIDIA H200 ≠ NVIDIA H100 80GB HBM3\n")
    assert not cache.exists() and (tmp_path / "quality.bin.stale").read_bytes() == b"compiled"
    key = gpu_plan.cache_key([sys.executable])  # this machine's, as a dry run computes it
    assert key["gpu"] == "cpu" and key["torch"] == __import__("torch").__version__ and len(key["code"]) == 16


def test_the_compile_caches_come_back_as_their_own_file_checked_against_a_calls_limits(tmp_path, monkeypatch,
                                                                                        capsys):
    out, results, cache = tmp_path / "out", tmp_path / "results", tmp_path / "cache"
    for folder in (out, results, cache):
        folder.mkdir()
    (results / "training.json").write_text("{}")
    (cache / "quality.bin").write_bytes(os.urandom(4096))
    gpu_plan.sign("quality", cache, KEY)
    (cache / "probe.bin.stale").write_bytes(b"another machine's")
    run = gpu_plan.Run(False, results, cache, {})
    gpu_plan.publish(run, str(out / "results.tar.gz"))
    with tarfile.open(out / "results.tar.gz") as packed:
        assert "./training.json" in packed.getnames() and not any("quality" in n for n in packed.getnames())
    with tarfile.open(out / "compile-cache.tar.gz") as packed:
        assert sorted(packed.getnames()) == ["quality.bin", "quality.bin.key.json"]
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(gpu_plan, "RETURNED_FILE_MIB", 2 / 1024)  # a 2 KiB limit: the random 4 KiB cache exceeds it
    gpu_plan.publish(run, str(out / "results.tar.gz"))
    assert not (out / "compile-cache.tar.gz").exists()
    assert capsys.readouterr().out.startswith("compile cache left out: 0.0 MiB, over the 0.001953125 MiB")


def test_a_plan_is_cut_to_the_budget_the_session_has_left(capsys):
    assert gpu_plan.main(["second", "--budget", "200", "--limits"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "budget 200"
    assert gpu_plan.main(["second", "--budget", "900", "--limits"]) == 0  # never over the plan's own
    assert capsys.readouterr().out.splitlines()[-1] == f"budget {gpu_plan.PLANS['second'][0]}"


def test_named_stages_run_after_setup_and_an_unknown_one_is_refused():
    assert gpu_plan.plan(["probe-4000", "tests"])[1] == ["setup", "probe-4000", "tests"]
    with pytest.raises(SystemExit, match="unknown stage nonsense"):
        gpu_plan.plan(["quality", "nonsense"])


def test_a_failing_or_overrunning_stage_costs_only_its_own_results(tmp_path, monkeypatch):
    """Real processes: a stage that fails, then one that outlives its limit (its whole process group stopped by
    signal at the limit, a child included), then one that succeeds; each stage's files are packed before the next
    starts, and the plan's exit status says one failed."""
    results, archive = tmp_path / "results", tmp_path / "results.tar.gz"

    def writes(name, code=0, sleep=0):
        script = (f"import pathlib, subprocess, sys, time; pathlib.Path(sys.argv[1], '{name}.txt').write_text('x'); "
                  f"subprocess.Popen(['sleep', '{sleep}']); time.sleep({sleep}); sys.exit({code})")
        return lambda run: [[sys.executable, "-c", script, str(run.results)]]

    def packed(run):  # the earlier stages' files are in the archive already
        names = {Path(name).name for name in tarfile.open(archive).getnames()}
        code = 0 if {"fails.txt", "overruns.txt", "gpu-fails.log"} <= names else 9
        return [[sys.executable, "-c", f"import sys; sys.exit({code})"]]

    monkeypatch.setattr(gpu_plan, "STAGES", {"setup": gpu_plan.Stage(writes("setup"), 30),
                                             "fails": gpu_plan.Stage(writes("fails", code=3), 30),
                                             "overruns": gpu_plan.Stage(writes("overruns", sleep=60), 8),
                                             "packed": gpu_plan.Stage(packed, 30)})
    monkeypatch.setenv("RESULTS_DIR", str(results))
    monkeypatch.setenv("ARCHIVE", str(archive))
    monkeypatch.setenv("COMPILE_CACHE", str(tmp_path / "cache"))
    started = time.monotonic()
    assert gpu_plan.main(["fails", "overruns", "packed"]) == 1
    assert time.monotonic() - started < 40  # the overrunning stage was stopped at its limit
    logs = {name: (results / f"gpu-{name}.log").read_text() for name in ("fails", "overruns", "packed")}
    assert "stopped at the stage's limit of 8 s" in logs["overruns"]
    with tarfile.open(archive) as pack:
        names = {Path(name).name for name in pack.getnames()}
    assert {"setup.txt", "fails.txt", "overruns.txt", "gpu-setup.log", "gpu-packed.log"} <= names


def test_dry_run_of_the_setup_stage(tmp_path):
    """The cheapest stage for real, as a dry run runs it here: the packages every stage imports, the torch range
    check, and the pack."""
    results, archive = tmp_path / "results", tmp_path / "results.tar.gz"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_plan.py"), "--dry_run", "setup"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RESULTS_DIR": str(results), "ARCHIVE": str(archive),
                              "COMPILE_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "device: cpu" in run.stdout and "== setup: ok" in run.stdout
    assert not (tmp_path / "cache").exists()  # a dry run writes nothing into the carried caches' folder
    with tarfile.open(archive) as packed:
        assert "./gpu-setup.log" in packed.getnames()


def test_setup_installs_the_carried_wheels_ahead_of_the_installed_packages(tmp_path, monkeypatch):
    """INSTALL_WHEELS=1, as on a lent GPU: a carried wheel of a package the Python already has (here a stand-in
    sacrebleu 0.0.1) is the one every later stage imports, and the versions the stage prints are the carried ones."""
    wheel = tmp_path / ".whl" / "sacrebleu-0.0.1-py3-none-any.whl"
    wheel.parent.mkdir()
    files = {"sacrebleu/__init__.py": '__version__ = "0.0.1"\n',
             "sacrebleu-0.0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: sacrebleu\nVersion: 0.0.1\n",
             "sacrebleu-0.0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n"}
    files["sacrebleu-0.0.1.dist-info/RECORD"] = "".join(f"{name},,\n" for name in files) + \
        "sacrebleu-0.0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as packed:
        for name, text in files.items():
            packed.writestr(name, text)
    monkeypatch.setattr(gpu_plan, "REPO", tmp_path)
    monkeypatch.setattr(gpu_plan.tempfile, "tempdir", str(tmp_path))  # the scratch folder setup installs into
    # A lent GPU has no pip constraints; CI's oldest suite sets PIP_CONSTRAINT (.ci/oldest.txt pins sacrebleu), which
    # would refuse the stand-in's version.
    env = {name: value for name, value in os.environ.items() if name != "PIP_CONSTRAINT"}
    run = gpu_plan.Run(dry=True, results=tmp_path, cache=tmp_path,
                       env={**env, "INSTALL_WHEELS": "1", "PYTHONPATH": str(REPO / "src")})
    *install, check = gpu_plan.setup(run)
    for command in install:
        subprocess.run(command, check=True, env=run.env, timeout=120)
    printed = subprocess.run(check, cwd=REPO, env=run.env, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stdout + printed.stderr
    assert "sacrebleu 0.0.1\n" in printed.stdout and "python 3." in printed.stdout


def load_benchmark(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_quality():
    return load_benchmark("gpu_quality")


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


def test_quality_report_says_why_the_training_failed(tmp_path):
    """A training that stopped (as the 2026-11-27 H200 run's NaN loss did) is named with the error its log ends on."""
    quality = load_quality()
    log = tmp_path / "train.log"
    log.write_text("$ python3 scripts/train_translation.py ...\n{'loss': '3.685'}\n"
                   "error: Training loss became NaN/inf at step 1869. Lower the learning rate.\n\n"
                   "[W] a data loader worker's warning, printed after the error\n")
    assert quality.failure_line(log) == "error: Training loss became NaN/inf at step 1869. Lower the learning rate."
    assert quality.how_it_ended(1, None, log) == ("stopped by a non-finite loss: error: Training loss became NaN/inf "
                                                  "at step 1869. Lower the learning rate.")
    log.write_text("starting\nKilled\n")
    assert quality.failure_line(log) == "Killed"
    assert quality.how_it_ended(137, None, log) == "crashed (exit 137): Killed"
    assert quality.failure_line(tmp_path / "missing.log") is None


# Loaded by the scoring process (scripts/evaluate_bleu.py) from a PYTHONPATH entry, before the package: with the
# decoding loops named in `broken`, a TypeError where that loop decodes, as a path only CUDA takes once raised one on
# a lent H200 after 4,532 steps of training. Every other process of the run ignores it.
BROKEN_LOOPS = '''
import sys

decoding = sys.argv[sys.argv.index("--decoding") + 1] if "--decoding" in sys.argv else "auto"
if sys.argv[0].endswith("evaluate_bleu.py") and decoding in {broken!r}:
    from transformers import GenerationMixin

    import vaswani.generation_vaswani

    def broken(*args, **kwargs):
        raise TypeError(f"an injected fault in the {{decoding}} loop")

    if decoding == "auto":  # on a CPU, the lean loop
        vaswani.generation_vaswani.decode = broken
    else:  # transformers' own loop, for beams
        GenerationMixin._beam_search = broken
'''


def quality_dry_run(tmp_path, monkeypatch, broken: tuple[str, ...] = ()) -> tuple[int, dict, str]:
    """gpu_quality.py --dry_run for real on a small synthetic corpus for 2 s of training: its `main` in this process,
    which starts the training and each scoring in processes of their own, as on a GPU; `broken` names the decoding
    loops that fail in the scoring process (`BROKEN_LOOPS`). Returns the exit status, the report, and the tails of
    the processes' logs (for a failure's message)."""
    from training_script import synthetic_corpus

    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "sitecustomize.py").write_text(BROKEN_LOOPS.format(broken=broken))
    # What the processes it starts inherit.
    for name, value in {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                        "VASWANI_FRA_ENG": str(synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)),
                        "PYTHONPATH": os.pathsep.join([str(faults), str(REPO / "src"),
                                                       os.environ.get("PYTHONPATH", "")])}.items():
        monkeypatch.setenv(name, value)
    results = tmp_path / "results"
    status = load_quality().main(["--dry_run", "--train_seconds", "2", "--vocab_size", "300", "--output_root",
                                  str(tmp_path / "out"), "--results_dir", str(results), "--data_cache_dir",
                                  str(tmp_path / "cache")])
    logs = "".join(f"{log.name}:\n{log.read_text()[-2000:]}\n" for log in sorted(results.glob("*.log")))
    return status, json.loads((results / "gpu-quality-cpu.json").read_text()), logs


def assert_training_figures(row: dict) -> None:
    assert row["train_steps"] > 0 and row["ms_per_step"] > 0 and row["real_tokens_per_second"] > 0
    assert row["padded_tokens_per_second"] >= row["real_tokens_per_second"]
    assert row["train_compile_seconds"] is not None and row["train_slow_steps"] is not None


def test_quality_run_scores_with_transformers_loop_where_the_default_loop_fails(tmp_path, monkeypatch):
    """About half a minute: the quality run trains in a process of its own, then scores the saved model in others
    (as on the GPU): the default loop, which the injected fault breaks, then transformers' loop, whose score is the
    result, its translations kept beside the report."""
    status, report, logs = quality_dry_run(tmp_path, monkeypatch, broken=("auto",))
    assert status == 0, logs
    [row] = report["results"]
    assert_training_figures(row)
    assert (row["test_score"], row["test_decoding"]) == ("scored", "transformers") and row["test_bleu"] is not None
    assert row["test_failures"] == {"auto": "TypeError: an injected fault in the auto loop"}
    assert report["notes"][0].startswith("Result: test BLEU ")
    assert ("Scored with --decoding transformers after the default failed (--decoding auto failed: "
            "TypeError: an injected fault in the auto loop).") in report["notes"]
    assert (tmp_path / "results" / "gpu-quality-cpu-test-translations.txt").exists()


def test_quality_run_keeps_the_training_figures_where_every_loop_fails_to_score(tmp_path, monkeypatch):
    status, report, logs = quality_dry_run(tmp_path, monkeypatch, broken=("auto", "transformers"))
    assert status == 1, logs
    [row] = report["results"]
    assert_training_figures(row)
    assert (row["test_score"], row["test_decoding"], row["test_bleu"]) == ("failed", None, None)
    assert row["test_failures"] == {loop: f"TypeError: an injected fault in the {loop} loop"
                                    for loop in ("auto", "transformers")}
    assert any(note.startswith("The test score failed with every loop") for note in report["notes"])
    markdown = (tmp_path / "results" / "gpu-quality-cpu.md").read_text()
    assert "| failed |" in markdown and f"| {row['train_steps']} |" in markdown


def test_quality_report_names_each_slow_step_recompiled_or_kernel_set_up():
    quality = load_quality()
    row = {"train_slow_steps": 3, "metrics": {"train_slow_steps_named": [
        {"step": 1, "seconds": 2.5, "graphs": 1}, {"step": 40, "seconds": 1.25, "graphs": 0}]}}
    assert quality.slow_steps_note(row) == ("Slow steps: step 1 (2.50 s, recompiled: 1 graph), "
                                            "step 40 (1.25 s, kernel set-up: no graph built), and 1 more.")
    assert quality.slow_steps_note({**row, "metrics": {"train_slow_steps_named": []}}) is None


def test_quality_run_measures_its_steady_step_from_the_logged_intervals(tmp_path):
    """A log with a slow start (a compilation left to the first interval, then a shape's kernels), one recompile
    later, and a last line cut mid-write: each figure of the steady step, by hand."""
    quality = load_quality()
    elapsed = [50.0, 60.0, 64.0, 68.0, 72.2, 76.2, 86.2, 90.2, 94.2]  # ms a step: 500 100 40 40 42 40 100 40 40
    log = tmp_path / "train.log"
    log.write_text("$ python scripts/train_translation.py ...\nwarming up\n" + "".join(
        f"{{'loss': '{6 - i / 4:.3g}', 'grad_norm': '1.2', 'elapsed_seconds': '{seconds}', 'epoch': '{i / 9:.3g}'}}\n"
        for i, seconds in enumerate(elapsed)) + "{'loss': '3.9', 'elapsed_sec")
    entries = quality.training_log(log, 100)
    assert [entry["step"] for entry in entries] == list(range(100, 1000, 100))
    assert entries[0]["loss"] == 6 and entries[-1]["loss"] == 4
    tokens = {"batches": 50, "real_per_batch": 3000.0, "padded_per_batch": 3600.0, "flops_per_batch": 1e12}
    steady = quality.steady_step(entries, 10.0, tokens, 989.0)
    expected = {"steady_ms_per_step": 40, "steady_from_step": 200, "steady_intervals": 7,
                "steady_real_tokens_per_second": 75_000, "steady_padded_tokens_per_second": 90_000,
                "steady_mfu": 25 / 989, "warmup_seconds": 10 + 46 + 6, "recompile_seconds": 6}
    assert steady == {key: pytest.approx(value, rel=1e-9) for key, value in expected.items()}
    # No peak (a CPU), no FLOPs: no MFU; under three timed intervals: no steady step yet.
    assert quality.steady_step(entries, None, {**tokens, "flops_per_batch": None}, None)["steady_mfu"] is None
    assert quality.steady_step(entries[:2], 10.0, tokens, 989.0) == {}


def test_quality_run_cut_by_its_stage_limit_leaves_its_report(tmp_path):
    """A real quality run (--dry_run, tiny, on a small synthetic corpus), its process group sent SIGTERM as the plan
    stops a stage at its limit, once its report shows logged intervals: the report then says the run was cut, with
    its steps and loss curve. One launch: the report rewritten at each interval is also what a SIGKILL leaves."""
    from training_script import synthetic_corpus

    results = tmp_path / "results"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "VASWANI_FRA_ENG": str(synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)),
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "benchmarks"),
                                          os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "gpu_quality.py"), "--dry_run", "--train_seconds", "120",
         "--vocab_size", "300", "--output_root", str(tmp_path / "out"), "--results_dir", str(results),
         "--data_cache_dir", str(tmp_path / "cache")], cwd=REPO, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    report_path, deadline = results / "gpu-quality-cpu.json", time.monotonic() + 240
    try:
        while time.monotonic() < deadline and process.poll() is None:
            running = json.loads(report_path.read_text())["results"][0] if report_path.exists() else None
            if running and len(running["loss_curve"]) >= 2:
                break
            time.sleep(1)
        assert running and running["ended"].startswith("running"), (results / "gpu-quality-cpu-train.log").read_text()
        os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    [row] = json.loads(report_path.read_text())["results"]
    assert row["ended"].startswith("cut by SIGTERM") and row["train_steps"] == row["loss_curve"][-1][0] >= 4
    assert len(row["loss_curve"]) >= 2 and row["loss_curve"][0][0] == 2
    assert "Training cut by SIGTERM" in (results / "gpu-quality-cpu.md").read_text()


def test_training_probe_cut_by_its_stage_limit_keeps_its_rows_and_its_compile_cache(tmp_path):
    """bench_training.py as the probe stage runs it (a compiled engine against Marian, --seconds_per_setting, a
    compile cache), tiny, its process group sent SIGTERM during the timed steps, once the cache saved after the
    compiled engine's warm-up is there: the report holds both engines' rows of the steps done, marked cut.
    About 60 s on 2 busy cores: the tiny step's compilation on a CPU is most of it."""
    from training_script import synthetic_corpus

    results, cache = tmp_path / "results", tmp_path / "probe.bin"
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "benchmarks"),
                                          os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "bench_training.py"), "--device", "cpu", "--threads", "1",
         "--corpus", str(corpus), "--vocab_size", "300", "--cache_dir", str(tmp_path / "cache"), "--results_dir",
         str(results), "--sizes", "tiny", "--batch_tokens", "128", "--steps", "2", "--warmup_steps", "1",
         "--seconds_per_setting", "600", "--engines", "vaswani-compiled,marian", "--compile_cache", str(cache),
         "--output_name", "training-probe-{device}"], cwd=REPO, env=env, start_new_session=True, text=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    watchdog = threading.Timer(240, os.killpg, (process.pid, signal.SIGKILL))  # a hang fails instead of blocking
    watchdog.start()
    try:
        for line in process.stderr:  # the warm-up lines on stderr: both engines warm, the timed steps begun
            if line.startswith("tiny Marian"):
                break
        time.sleep(2)
        assert cache.is_file() and not (results / "training-probe-cpu.json").exists()
        os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        watchdog.cancel()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    report = json.loads((results / "training-probe-cpu.json").read_text())
    rows = {row["engine"]: row for row in report["results"]}
    assert sorted(rows) == ["marian", "vaswani-compiled"] and rows["vaswani-compiled"]["vs_marian"] > 0
    assert all(row["cut"] == f"by SIGTERM after {row['steps']} timed steps" and row["steps"] >= 1
               for row in rows.values())
    assert report["notes"][0].startswith("Cut by SIGTERM after")


def test_translation_stage_stopped_by_sigterm_keeps_the_settings_measured_before(tmp_path, monkeypatch):
    """bench_translation.py in this process (--same_process, tiny), sent a real SIGTERM as its second setting (beam
    2) starts: the report holds beam 1's rows, says it was cut, and the run ends with 128 + SIGTERM."""
    from training_script import synthetic_corpus

    translation = load_benchmark("bench_translation")
    measure, calls = translation.measure, []

    def measure_then_stop(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return measure(*args, **kwargs)

    monkeypatch.setattr(translation, "measure", measure_then_stop)
    results = tmp_path / "results"
    with pytest.raises(SystemExit) as ended:
        translation.main(["--device", "cpu", "--threads", "1", "--corpus",
                          str(synthetic_corpus(tmp_path / "corpus.tsv", pairs=100)), "--vocab_size", "300",
                          "--cache_dir", str(tmp_path / "cache"), "--results_dir", str(results), "--sizes", "tiny",
                          "--engines", "vaswani,marian", "--batch_sizes", "4", "--beams", "1,2", "--num_sentences",
                          "8", "--new_tokens", "3", "--same_process"])
    assert ended.value.code == 128 + signal.SIGTERM and calls == [1, 2]
    report = json.loads((results / "translation-cpu.json").read_text())
    assert sorted((row["engine"], row["beams"]) for row in report["results"]) == [("marian", 1), ("vaswani", 1)]
    assert report["notes"][0].startswith("Cut by SIGTERM")


def fabricated_archive(folder: Path, tag: str, bleu: float, steady_ms: float) -> Path:
    """What a first and second plan return on the GPU `tag`: the quality report, the probe's and translation's, the
    stage logs, the quality model's path on that machine."""
    results = folder / "results"
    results.mkdir(parents=True)
    env = {"device": tag, "device_name": "NVIDIA H200", "git_commit": "abc1234"}

    def write(stem, rows):
        (results / f"{stem}.json").write_text(json.dumps(
            {"environment": env, "timestamp": "2026-12-08T10:00:00+0000", "results": rows}))
        (results / f"{stem}.md").write_text(f"# {stem}\n")

    write(f"gpu-quality-{tag}", [{"test_bleu": bleu, "test_bleu_first_1000": 63.5, "test_score": "scored",
                                  "train_steps": 9000, "steady_ms_per_step": steady_ms, "steady_mfu": 0.31,
                                  "ended": "trained"}])
    write(f"training-probe-{tag}-4000", [
        {"engine": "vaswani-compiled", "batching": "bucketed", "vs_marian": 3.4, "mfu": 0.3, "steps_per_s": 70.0},
        {"engine": "marian", "batching": "bucketed", "vs_marian": None, "mfu": 0.1, "steps_per_s": 20.0}])
    write(f"translation-trained-{tag}", [{"engine": "vaswani", "beams": 4, "batch_size": 256, "vs_marian": 2.5}])
    (results / "gpu-quality.log").write_text("quality\n")
    (results / "gpu-quality-selected.txt").write_text("/tmp/outputs/gpu-quality/model\n")
    archive = folder / "results.tar.gz"
    with tarfile.open(archive, "w:gz") as packed:
        packed.add(results, arcname=".")
    return archive


def test_landing_a_returned_archive_updates_the_gpu_rows_and_says_each_missed_target(tmp_path, capsys):
    """On copies of the README, the results index and gpu-notes.md: the files of one GPU kind land beside another
    kind's (stage logs tagged), the GPU rows' cells (and only theirs) are rewritten, and every target missed is said."""
    land = load_benchmark("gpu_land")
    results, readme = tmp_path / "results", tmp_path / "README.md"
    results.mkdir()
    shutil.copyfile(REPO / "README.md", readme)
    for name in ("README.md", "gpu-notes.md"):
        shutil.copyfile(REPO / "benchmarks" / "results" / name, results / name)
    (results / "gpu-quality-h100.log").write_text("the other kind's log\n")
    before = readme.read_text()
    archive = fabricated_archive(tmp_path / "device", "cuda-h200", bleu=44.0, steady_ms=16.0)
    status = land.main([str(archive), "--results_dir", str(results), "--readme", str(readme), "--compile_cache",
                        str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert status == 1
    assert {"gpu-quality-cuda-h200.json", "gpu-quality-cuda-h200.log", "training-probe-cuda-h200-4000.md",
            "translation-trained-cuda-h200.json", "gpu-quality-h100.log"} <= {p.name for p in results.iterdir()}
    assert not (results / "gpu-quality-selected.txt").exists()
    assert out.count("MISSED: ") == 3
    assert "MISSED: a steady 4,000-token base step ≤ 15 ms (got 16.00)" in out
    assert "MISSED: after 300 s, test BLEU ≥ 45 on the whole split (got 44.00)" in out
    assert "MISSED: translation at beam 4 in bf16 ≥ 5× Marian's sentences/s on the quality model (got 2.50)" in out
    after = readme.read_text()
    changed = [line for line in after.split("\n") if line not in before.split("\n")]
    assert len(changed) == 3 and all(line.startswith("| GPU ") for line in changed)
    assert ("| GPU training speed against Marian | base, compiled, 4,000-token batches: 3.40 × Marian's tokens/s, "
            "MFU 30.0%, 14.3 ms a step | [training-probe-cuda-h200-4000](benchmarks/results/training-probe-cuda-h200-4000.md) | "
            "H200, abc1234, 2026-12-08 |") in changed
    assert all(len(cell) < 200 for line in changed for cell in line.split("|"))
    index_before = (REPO / "benchmarks" / "results" / "README.md").read_text().split("\n")
    changed = [line for line in (results / "README.md").read_text().split("\n") if line not in index_before]
    assert len(changed) == 3 and all(line.startswith("| GPU ") for line in changed)
    assert ("| GPU training speed against Marian | base, compiled, 4,000-token batches: 3.40 × Marian's tokens/s, "
            "MFU 30.0%, 14.3 ms a step | [training-probe-cuda-h200-4000](training-probe-cuda-h200-4000.md) | "
            "abc1234, H200, 2026-12-08 |") in changed
    notes = (results / "gpu-notes.md").read_text()
    assert "| 2026-12-08 | H200 | abc1234 | base, 300 s: test BLEU 44.00" in notes
    assert "On the H200 of 2026-12-08 (abc1234): missed: a steady 4,000-token base step ≤ 15 ms (got 16.00);" in notes
    assert "No GPU has run the current code" not in notes  # the targets paragraph is rewritten, not added to
