"""train_translation.py --compile_cache: the step's compiled code saved after one run's compilation and loaded by the
next, which then compiles from the cache (counted hits) and trains to the same losses."""

import json
import os
import shutil

import pytest

from training_script import run_script, synthetic_corpus, train_args


@pytest.mark.slow
def test_a_second_run_compiles_from_the_first_ones_cache_and_trains_the_same(tmp_path):
    """About two minutes on a slow CPU: two fresh processes (in one interpreter the second run's graphs would come
    from memory, not the file) and the first one's C++ compilation of the step's kernels."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    cache = tmp_path / "compile-cache.bin"
    metrics = []
    for run in ("cold", "warm"):
        # Inductor's own on-disk cache apart for each run, so that only the file carries compiled graphs across.
        # The warm run gets the cold run's C++ kernel builds alone (its hash-named folders, not `fxgraph` or
        # `aotautograd`, the graph caches the file fills): a hit there is not a compiled graph, and rebuilding each
        # kernel would double the test's minute of C++ compilation.
        inductor = tmp_path / f"inductor-{run}"
        if run == "warm":
            for built in (tmp_path / "inductor-cold").iterdir():
                if built.is_dir() and len(built.name) == 2:
                    shutil.copytree(built, inductor / built.name)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor), "OMP_NUM_THREADS": "1"}
        # One layer each side: the cache is the point, not the kernels. No test translations: the runs are compared
        # by their training alone.
        result = run_script("train_translation.py", *train_args(corpus, tmp_path / run), "--max_steps", "4",
                            "--logging_steps", "1", "--per_device_train_batch_size", "8", "--max_tokens_per_batch",
                            "150", "--torch_compile", "--compile_cache", str(cache), "--max_test_samples", "0",
                            "--config_overrides", "encoder_layers=1,decoder_layers=1", "--use_cpu", env=env,
                            timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        metrics.append(json.loads((tmp_path / run / "metrics.json").read_text()))
        assert cache.is_file() and cache.stat().st_size > 0
        if run == "cold":
            written = cache.read_bytes()
    # The warm run leaves the cache it compiled from as it was (what it would save holds only what it compiled).
    assert cache.read_bytes() == written
    cold, warm = metrics
    assert cold["train_compile_cache_hits"] == 0 and warm["train_compile_cache_hits"] > 0
    assert warm["train_graphs_compiled_on_the_clock"] == cold["train_graphs_compiled_on_the_clock"]
    assert warm["train_loss"] == cold["train_loss"]
