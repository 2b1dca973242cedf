"""Smoke runs of every benchmark script at the tiny size on a small synthetic corpus: each must finish in seconds
and write its JSON and Markdown reports with the fields the issue asks for (device, versions, exact command)."""

import argparse
import collections
import dataclasses
import gzip
import importlib.util
import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # importable by name, as engine processes (multiprocessing's spawn) need
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = random.Random(0)
    english = "the a cat dog sees likes small big red house tree runs".split()
    french = "le la chat chien voit aime petit grand rouge maison arbre court".split()
    path = tmp_path_factory.mktemp("corpus") / "pairs.tsv.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for _ in range(400):
            words = rng.choices(range(len(english)), k=rng.randint(2, 9))
            f.write(" ".join(english[w] for w in words) + ".\t" + " ".join(french[w] for w in words) + " .\n")
    return path


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """The benchmarks set torch's thread count (here to 1, which is fastest for tiny models on a busy machine)."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def common_args(corpus: Path, tmp_path: Path) -> list[str]:
    return ["--device", "cpu", "--threads", "1", "--corpus", str(corpus), "--vocab_size", "300", "--cache_dir", str(tmp_path / "cache"),
            "--results_dir", str(tmp_path / "results")]


def check_report(json_path: Path, script: str, row_fields: set[str]) -> dict:
    from common import KERNEL_ISA_VARIABLES

    report = json.loads(json_path.read_text())
    # The command as run, preceded by the kernel-limiting variables that are set (as in CI's AVX2 suite).
    limits = "".join(f"{name}={os.environ[name]} " for name in KERNEL_ISA_VARIABLES if os.environ.get(name))
    assert report["command"].startswith(f"{limits}python benchmarks/{script}.py ")
    assert report["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["environment"]["device"] == "cpu"
    assert report["environment"]["dtype"] == "float32"
    assert {"torch", "transformers"} <= set(report["environment"]["versions"])
    assert report["results"], "no result rows"
    for row in report["results"]:
        assert row_fields <= set(row), f"missing {row_fields - set(row)}"
    markdown = json_path.with_suffix(".md").read_text()
    assert report["command"] in markdown and "|---|" in markdown
    return report


@pytest.mark.parametrize("same_process", [False, True], ids=["process-per-engine", "same-process"])
def test_translation_benchmark(corpus, tmp_path, same_process):
    """Every engine in a process of its own (a PyTorch one, Marian and CT2: each process takes about 5 s to start),
    or all in one. The trained-checkpoint test below runs the other engines."""
    engines = "vaswani-int8,vaswani-graphs,marian" if same_process else "vaswani,marian"
    if importlib.util.find_spec("ctranslate2"):
        engines += ",ct2-int8"
    path = load("bench_translation").main(
        common_args(corpus, tmp_path)
        + ["--sizes", "tiny", "--engines", engines, "--batch_sizes", "4", "--beams", "1,2", "--num_sentences", "8",
           "--new_tokens", "3"] + (["--same_process"] if same_process else [])
    )
    report = check_report(path, "bench_translation", {"engine", "batch_size", "beams", "sentences_per_s", "tokens_per_s"})
    assert len(report["results"]) == 2 * len(engines.split(","))
    assert all(row["sentences"] == 8 for row in report["results"])
    assert {row["vs_marian"] is None for row in report["results"] if row["engine"] == "marian"} == {True}
    assert all(row["load_mib"] is not None for row in report["results"])  # measured in the engine's process
    # What each PyTorch engine's encoder really ran (int8 and CTranslate2 have no such record).
    assert {(row["engine"], row.get("attention"), row.get("dtype")) for row in report["results"]
            if row["engine"] in ("vaswani", "vaswani-graphs", "marian")} == {
        (name, "flash", "float32") for name in engines.split(",") if name in ("vaswani", "vaswani-graphs", "marian")}


def test_translation_benchmark_names_a_failing_engine(corpus, tmp_path):
    """An engine process that fails reports its error through the parent, which does not hang."""
    with pytest.raises(ValueError, match="Unknown engine 'vaswani-fast'"):
        load("bench_translation").main(
            common_args(corpus, tmp_path) + ["--sizes", "tiny", "--engines", "vaswani-fast", "--num_sentences", "4"]
        )


def test_translation_benchmark_keep_going_drops_a_failing_engine(corpus, tmp_path, monkeypatch):
    """--keep_going: an engine that fails mid-run is left out and named in the notes; the others are measured."""
    module = load("bench_translation")
    timed_translate, calls = module.LocalEngine.timed_translate, iter(range(100))

    def failing_on_second_call(engine, *args):
        if engine.name == "vaswani-hfloop" and next(calls) >= 1:
            raise ZeroDivisionError("division by zero")
        return timed_translate(engine, *args)

    monkeypatch.setattr(module.LocalEngine, "timed_translate", failing_on_second_call)
    path = module.main(
        common_args(corpus, tmp_path)
        + ["--sizes", "tiny", "--engines", "vaswani,vaswani-hfloop,marian", "--batch_sizes", "4", "--beams", "1,2",
           "--num_sentences", "8", "--new_tokens", "3", "--same_process", "--keep_going"]
    )
    report = check_report(path, "bench_translation", {"engine", "tokens_per_s"})
    assert [(row["engine"], row["beams"]) for row in report["results"]] == [
        ("vaswani", 1), ("marian", 1), ("vaswani", 2), ("marian", 2)]
    assert "Vaswani transformers' loop failed and was left out from then on (--keep_going): ZeroDivisionError in timed_translate" \
        in path.with_suffix(".md").read_text()


def test_translation_benchmark_on_a_trained_checkpoint(corpus, tmp_path):
    """--model: the checkpoint's held-out sentences, stopping at their end of sentence beside forced-length rows;
    Marian is the same function (vaswani.convert.to_marian), so its translations are Vaswani's, token for token, as
    are those of the slots (all sentences in one call). In one process (a process per engine and setting, tested
    above, started 28 here: a minute of start-ups for what takes a second)."""
    engines = "vaswani,vaswani-hfloop,vaswani-slots,vaswani-int8,marian"
    if importlib.util.find_spec("ctranslate2"):
        engines += ",ct2-float32,ct2-int8"
    path = load("bench_translation").main(
        common_args(corpus, tmp_path)
        + ["--model", _tiny_checkpoint(tmp_path), "--engines", engines, "--batch_sizes", "4", "--beams", "1,2",
           "--num_sentences", "8", "--new_tokens", "3", "--max_new_tokens", "12", "--same_process"]
    )
    report = check_report(path, "bench_translation", {"engine", "stopping", "identical_to_vaswani", "output_tokens"})
    rows = report["results"]
    assert [(row["stopping"], row["beams"]) for row in rows[:: len(engines.split(","))]] == [
        ("eos", 1), ("eos", 2), ("forced", 1), ("forced", 2)]
    assert all(row["sentences"] == 8 and row["size"] == "model" for row in rows)
    for row in rows:
        if row["engine"] in ("vaswani", "vaswani-hfloop", "vaswani-slots", "marian"):  # the same function and searches
            assert row["identical_to_vaswani"] == 8, row
        if row["stopping"] == "forced":
            assert row["output_tokens"] == 8 * 3
    eos_rows = [row for row in rows if row["stopping"] == "eos"]
    assert all(0 < row["output_tokens"] < 8 * 12 for row in eos_rows if row["engine"] == "vaswani")
    assert all(row["vs_marian"] is not None for row in rows if row["engine"] != "marian")
    assert "held-out test split" in path.with_suffix(".md").read_text()


def test_translation_benchmark_batches_by_token_budget_as_translate_does(corpus, tmp_path):
    """--max_tokens: rows whose batches are cut as `vaswani.translation.translate` cuts them, beside the fixed sizes:
    the same sentences, each batch within the budget, and the same translations as in batches of 4."""
    module = load("bench_translation")
    path = module.main(common_args(corpus, tmp_path) + [
        "--model", _tiny_checkpoint(tmp_path), "--engines", "vaswani,marian", "--batch_sizes", "4", "--max_tokens",
        "24,1000", "--beams", "1", "--stopping", "eos", "--num_sentences", "8", "--max_new_tokens", "12",
        "--same_process"])
    rows = check_report(path, "bench_translation", {"engine", "batch_size", "batches"})["results"]
    assert [(row["batch_size"], row["engine"]) for row in rows] == [
        (4, "vaswani"), (4, "marian"), ("24 tokens", "vaswani"), ("24 tokens", "marian"), ("1000 tokens", "vaswani"),
        ("1000 tokens", "marian")]
    assert [row["batches"] for row in rows[::2]] == [2, rows[2]["batches"], 1] and rows[2]["batches"] > 2
    assert all(row["sentences"] == 8 for row in rows)
    assert all(row["identical_to_vaswani"] == 8 for row in rows if row["engine"] == "marian")
    ids = [[5] * length for length in (3, 9, 4, 7, 8)]
    cut = list(module.batchings(SimpleNamespace(batch_sizes=[], max_tokens=[16], batch1_sentences=None), ids, ids))
    assert cut == [("16 tokens", [[ids[1]], [ids[4], ids[3]], [ids[2], ids[0]]])]
    assert "padded source tokens" in path.with_suffix(".md").read_text()


def test_translation_benchmark_refuses_eos_stopping_without_a_model(corpus, tmp_path):
    with pytest.raises(SystemExit, match="--stopping eos needs a trained model"):
        load("bench_translation").main(common_args(corpus, tmp_path) + ["--sizes", "tiny", "--stopping", "eos"])


def test_training_benchmark(corpus, tmp_path, monkeypatch):
    """About a minute: the compiled engines compile the tiny step (with and without CUDA graphs' static shapes) in
    this process, which no smaller run can skip; every engine's row and what it ran are read from one report."""
    module = load("bench_training")
    kept = []  # the real call would change this test process' malloc for good
    monkeypatch.setattr(module, "keep_freed_cpu_memory",
                        lambda largest_block_mib: kept.append(largest_block_mib) or True)
    # The compilation count below is the benchmark's own: an earlier test in this process may have compiled the same
    # tiny step, whose graph Dynamo would then reuse.
    torch._dynamo.reset()
    path = module.main(
        common_args(corpus, tmp_path) + ["--sizes", "tiny", "--batch_tokens", "64", "--steps", "1", "--warmup_steps",
                                         "0", "--engines", "vaswani,vaswani-compiled,vaswani-compiled-graphs,marian",
                                         "--keep_freed_memory"]
    )
    report = check_report(path, "bench_training", {"engine", "batch_tokens", "steps_per_s", "tokens_per_s",
                                                   "model_tflops_per_s", "peak_mib", "mfu", "compilations_while_timed"})
    # Every engine beside Marian on the same batches; CUDA graphs skipped on a CPU.
    assert sorted(row["engine"] for row in report["results"]) == ["marian", "vaswani", "vaswani-compiled"]
    assert all(row["vs_marian"] > 0 for row in report["results"] if row["engine"] != "marian")
    assert all(row["mfu"] is None for row in report["results"])  # no MFU without a GPU peak
    # Without warm-up the compiled engine compiles in its memory step, before the clock: its batch dimensions marked
    # dynamic there, that one graph serves the timed step's other shape (a graph per shape would compile on the clock).
    assert {row["compilations_while_timed"] for row in report["results"]} == {0}
    assert kept == [None] and any("keep_freed_cpu_memory(None)" in note for note in report["notes"])
    # Every engine at every budget (eager ones here: a compiled engine's second budget is a second minute of C++
    # compilation on a CPU, and its rows are built as the first budget's).
    path = module.main(common_args(corpus, tmp_path) + ["--sizes", "tiny", "--batch_tokens", "64,96", "--steps", "1",
                                                        "--warmup_steps", "0", "--engines", "vaswani,marian"])
    assert sorted((row["batch_tokens"], row["engine"]) for row in json.loads(path.read_text())["results"]) == [
        (budget, engine) for budget in (64, 96) for engine in ("marian", "vaswani")]


def test_training_benchmark_pins_a_kernel_per_engine_and_times_first_and_later_passes(corpus, tmp_path, monkeypatch):
    """An SDPA kernel's name after an engine's pins that engine's attention to it, so one process compares kernels on
    the same batches; with --warmup_steps 0 and --passes, each row times the first pass over the timed batches (their
    shapes new to the process) apart from the later ones."""
    from vaswani import VaswaniConfig

    module = load("bench_training")
    pinned = collections.Counter()
    real = module.sdpa_backend
    monkeypatch.setattr(module, "sdpa_backend", lambda name: pinned.update([name]) or real(name))
    path = module.main(common_args(corpus, tmp_path) + [
        "--sizes", "tiny", "--batch_tokens", "96", "--steps", "2", "--warmup_steps", "0", "--passes", "2",
        "--engines", "vaswani-math,vaswani-flash"])
    report = check_report(path, "bench_training", {"engine", "first_round_ms", "later_rounds_ms"})
    assert [row["engine"] for row in report["results"]] == ["vaswani-math", "vaswani-flash"]
    assert all(row["steps"] == 4 and row["first_round_ms"] > 0 and row["later_rounds_ms"] > 0
               for row in report["results"])
    # 4 timed steps, 1 for memory, 1 forward that records what ran
    assert set(pinned) == {"math", "flash"} and pinned["math"] == pinned["flash"] == 6
    config, device = VaswaniConfig.tiny(vocab_size=64), module.pick_device("cpu")
    for name in ("vaswani-eager-math", "vaswani-math-flash"):
        with pytest.raises(ValueError, match="at most one SDPA kernel"):
            module.Trainee(name, config, device, [], seed=0, lr=1e-4)


def test_training_benchmark_records_what_each_engine_ran_and_drops_a_refused_one(corpus, tmp_path):
    """Engines of one size in one process run each its own attention (each model has its own config: one engine's
    `set_attn_implementation("eager")` once made every engine beside it eager), and the row says which kernel and
    dtype ran; a kernel this CPU lacks (efficient) costs that engine's row, not the run's."""
    module = load("bench_training")
    path = module.main(common_args(corpus, tmp_path) + [
        "--sizes", "tiny", "--batch_tokens", "96", "--steps", "1", "--warmup_steps", "0",
        "--engines", "vaswani-eager,vaswani-math,vaswani-efficient,vaswani-flash,marian-bf16"])
    report = check_report(path, "bench_training", {"engine", "attention", "dtype"})
    assert {row["engine"]: (row["attention"], row["dtype"]) for row in report["results"]} == {
        "vaswani-eager": ("eager", "float32"), "vaswani-math": ("math", "float32"),
        "vaswani-flash": ("flash", "float32"), "marian-bf16": ("flash", "bfloat16")}
    assert any(note.startswith("Refused, no row: tiny vaswani-efficient") for note in report["notes"])


def test_training_benchmark_stops_where_an_engine_runs_another_kernel(corpus, tmp_path, monkeypatch):
    module = load("bench_training")
    real = module.sdpa_backend
    monkeypatch.setattr(module, "sdpa_backend", lambda name: real("math"))  # a kernel pinned, another one run
    with pytest.raises(module.WrongKernel, match="vaswani-flash ran attention math in float32, not flash"):
        module.main(common_args(corpus, tmp_path) + [
            "--sizes", "tiny", "--batch_tokens", "96", "--steps", "1", "--warmup_steps", "0",
            "--engines", "vaswani-flash"])


def test_training_benchmark_on_shape_bucketed_batches(corpus, tmp_path):
    """--shape_buckets: every engine trains on the batches train_translation.py --shape_buckets cuts, each declared
    shape warmed up twice; a -graphs engine (built here, stepped only on CUDA) pads each batch up to its shape."""
    from vaswani import VaswaniConfig

    module = load("bench_training")
    path = module.main(common_args(corpus, tmp_path) + [
        "--sizes", "tiny", "--batch_tokens", "96", "--steps", "1", "--shape_buckets", "2", "--engines", "vaswani,marian"])
    report = check_report(path, "bench_training", {"engine", "batch_tokens", "tokens_per_s"})
    shapes = report["settings"]["shapes_rows_length"]["96"]
    assert len(shapes) == 2 and all(rows * length <= 96 for rows, length in shapes)
    assert report["settings"]["warmup_steps"]["96"] == 4
    sources = [[5] * n for n in (3, 4, 9, 10, 10)]
    batches, sampler = module.token_batches(sources, sources, 20, seed=0, shape_buckets=2)
    buckets = sampler.shape_buckets
    assert sorted(i for b in batches for i in b) == list(range(5)) and buckets.lengths == (4, 10)
    assert buckets.shapes == [(2, 4), (2, 10)]  # [3, 4] padded to 4 columns; [9, 10] and [10] to 2 × 10
    device = module.pick_device("cpu")
    from transformers import DataCollatorForSeq2Seq
    from tiny_translation_model import build_tokenizer

    collate = DataCollatorForSeq2Seq(build_tokenizer(), return_tensors="pt")
    collated = [collate([{"input_ids": sources[i], "labels": sources[i]} for i in b]) for b in batches]
    trainee = module.Trainee("vaswani-compiled-graphs", VaswaniConfig.tiny(vocab_size=64), device, collated, seed=0,
                             lr=1e-4, shape_buckets=buckets)
    assert {tuple(b[name].shape) for b in trainee.batches for name in b} == set(buckets.shapes)
    plain = module.Trainee("vaswani-compiled", VaswaniConfig.tiny(vocab_size=64), device, collated, seed=0, lr=1e-4,
                           shape_buckets=buckets)
    assert [b["input_ids"].shape[1] for b in plain.batches] == [max(len(sources[i]) for i in b) for b in batches]


def test_training_benchmark_compares_packed_and_bucketed_batches(corpus, tmp_path):
    """--batchings: every engine on bucketed batches padded to multiples of 1 and 8, the Vaswani engines on packed
    ones too (Marian's model takes no packed rows), with each batching's padding over the timed batches and the ratio
    to the trainer's default batches."""
    module = load("bench_training")
    path = module.main(common_args(corpus, tmp_path) + [
        "--sizes", "tiny", "--batch_tokens", "128", "--steps", "1", "--warmup_steps", "0", "--engines", "vaswani,marian",
        "--batchings", "bucketed,bucketed-8,packed"])
    report = check_report(path, "bench_training", {"engine", "batching", "tokens_per_s", "vs_bucketed"})
    assert sorted((row["batching"], row["engine"]) for row in report["results"]) == [
        ("bucketed", "marian"), ("bucketed", "vaswani"), ("bucketed-8", "marian"), ("bucketed-8", "vaswani"),
        ("packed", "vaswani")]
    padding = report["settings"]["padding_fraction"]
    assert padding["128 packed"] < padding["128"] and set(padding) == {"128", "128 bucketed-8", "128 packed"}
    rows, source_width, target_width = report["settings"]["shapes_rows_length"]["128 packed"][0]
    assert rows * max(source_width, target_width) <= 128
    assert all((row["vs_bucketed"] is None) == (row["batching"] == "bucketed") for row in report["results"])
    with pytest.raises(SystemExit, match="--batchings"):
        module.main(common_args(corpus, tmp_path) + ["--batchings", "packed,sides"])


def test_scaling_benchmark(corpus, tmp_path):
    path = load("bench_scaling").main(
        common_args(corpus, tmp_path)
        + ["--preset", "tiny", "--kv_heads", "4,2", "--cache_kv_heads", "4,2,1", "--lengths", "16,32", "--steps", "1",
           "--batch_tokens", "64", "--decode_tokens", "2"]
    )
    report = check_report(path, "bench_scaling", {"mode", "attention", "length", "tokens_per_s", "peak_mib"})
    assert len(report["results"]) == 2 * 3 * 2  # attention variants × modes × lengths
    cache = {row["kv_heads"]: row["bytes_per_token"] for row in report["KV cache per token"]}
    assert cache[4] == 2 * cache[2] == 4 * cache[1]


def test_model_flops_counts_both_stacks():
    from vaswani import VaswaniConfig

    training = load("bench_training")
    config = VaswaniConfig.tiny()
    one = training.model_flops(config, [5], [7])
    assert training.model_flops(config, [5, 5], [7, 7]) == 2 * one
    assert training.model_flops(config, [6], [7]) > one and training.model_flops(config, [5], [8]) > one


def test_training_batches_are_train_translations_and_respect_the_token_budget():
    training = load("bench_training")
    rng = random.Random(1)
    sources = [[1] * rng.randint(1, 30) for _ in range(500)] + [[1] * 101]
    targets = [[1] * rng.randint(1, 30) for _ in range(500)] + [[1]]
    batches, sampler = training.token_batches(sources, targets, 100, seed=0)
    assert sampler.shape_buckets is None and sorted(i for b in batches for i in b) == list(range(500))  # the 101-token pair left out
    for batch in batches:
        width = max(max(len(sources[i]), len(targets[i])) for i in batch)
        assert width * len(batch) <= 100
    assert batches == training.token_batches(sources, targets, 100, seed=0)[0] != training.token_batches(
        sources, targets, 100, seed=1)[0]


def _tiny_checkpoint(tmp_path) -> str:
    from tiny_translation_model import build_model_and_tokenizer

    model, tokenizer = build_model_and_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def test_decoding_profile_splits_a_step_and_replays_its_linear_layers(corpus, tmp_path):
    """profile_decoding.py on the tiny checkpoint, greedy: every part of a step timed, the plain and CTranslate2
    totals, and the pass's linear-layer calls replayed alone: every one the pass made, taking less time than the whole
    plain pass."""
    if not importlib.util.find_spec("ctranslate2"):
        pytest.skip("compares with CTranslate2")
    module = load("profile_decoding")
    path = module.main(["--model", _tiny_checkpoint(tmp_path), "--corpus", str(corpus), "--threads", "1",
                        "--num_sentences", "8", "--batch_size", "4", "--beams", "1", "--repeats", "1",
                        "--results_dir", str(tmp_path / "results")])
    check_report(path, "profile_decoding", {"part"})
    [search] = json.loads(path.read_text())["settings"]["searches"]
    assert set(search["parts_seconds"]) == set(module.PARTS)
    assert 0 < search["linear_alone_seconds"] < search["plain_seconds"]
    from vaswani import VaswaniForConditionalGeneration

    config = VaswaniForConditionalGeneration.from_pretrained(tmp_path / "model").config
    # A batch's encoder (q/k/v/o, fc1, fc2 a layer) and first decoder call, which also projects the cross-attention
    # keys and values; then each step: self q/k/v/o, cross q/o, fc1, fc2 a layer, and the output layer.
    batches, step = 2, 8 * config.decoder_layers + 1
    first = 6 * config.encoder_layers + step + 2 * config.decoder_layers
    assert search["linear_calls"] == batches * first + search["decoding_steps"] * step
    assert "linear layers alone (the pass's calls replayed, no hooks)" in path.with_suffix(".md").read_text()


def test_translation_benchmark_refuses_an_unknown_stopping_mode(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load("bench_translation").main(["--stopping", "eos,never"])
    assert "argument --stopping: unknown never; choose from eos, forced" in capsys.readouterr().err


def test_training_engine_names():
    """`-bf16` trains under bf16 autocast on a CPU too, `-eager` with the eager attention, `-compiled` through
    torch.compile; other names fail."""
    from vaswani import VaswaniConfig

    module = load("bench_training")
    device = module.pick_device("cpu")
    trainee = module.Trainee("vaswani-compiled", VaswaniConfig.tiny(vocab_size=64), device, [], seed=0, lr=1e-4)
    assert trainee.forward is not trainee.model
    trainee = module.Trainee("vaswani-bf16-eager", VaswaniConfig.tiny(vocab_size=64), device, [], seed=0, lr=1e-4)
    assert trainee.model.config._attn_implementation == "eager"
    assert module.engine_label(trainee.name) == "Vaswani bf16 eager"
    assert module.engine_label("vaswani-int8-hfloop") == "Vaswani int8 transformers' loop"
    with trainee.autocast:
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert module.engine_label("marian") == "Marian (HF)"
    assert module.engine_label("marian-compiled") == "Marian (HF) compiled"
    for name in ("vaswani-flex", "vaswani-fast", "vaswani-math-eager", "vaswani-bf16-bf16", "t5-bf16"):
        with pytest.raises(ValueError, match="Unknown engine"):
            module.Trainee(name, VaswaniConfig.tiny(vocab_size=64), device, [], seed=0, lr=1e-4)


def test_translation_benchmark_bf16_engines(corpus, tmp_path):
    path = load("bench_translation").main(
        common_args(corpus, tmp_path)
        + ["--sizes", "tiny", "--engines", "vaswani,vaswani-bf16,marian,marian-bf16", "--batch_sizes", "4",
           "--beams", "1", "--num_sentences", "8", "--new_tokens", "3", "--same_process"]
    )
    report = check_report(path, "bench_translation", {"engine", "vs_marian"})
    assert [row["engine"] for row in report["results"]] == ["vaswani", "vaswani-bf16", "marian", "marian-bf16"]
    assert report["results"][1]["vs_marian"] is not None  # against Marian fp32, in the same run


def test_streaming_benchmark(corpus, tmp_path):
    path = load("bench_streaming").main(
        ["--model", _tiny_checkpoint(tmp_path), "--corpus", str(corpus), "--threads", "1", "--stand_in", "tiny",
         "--lines", "30,60", "--max_new_tokens", "3", "--results_dir", str(tmp_path / "results")]
    )
    report = check_report(path, "bench_streaming", {"lines", "seconds", "lines_per_s", "peak_rss_mib"})
    assert [row["lines"] for row in report["results"]] == [30, 60]
    assert report["results"][0]["rss_vs_smallest"] == 1 and report["results"][1]["peak_rss_mib"] > 0


def test_data_benchmark(corpus, tmp_path):
    """Stand-in corpora built from a corpus, then a first and a cached run of the training script, measured to its
    first step: the cached run reads nothing again."""
    bench = load("bench_data")
    bench.main(["--build", "300", "--source", str(corpus), "--corpus_dir", str(tmp_path / "corpora")])
    stand_in = tmp_path / "corpora" / "standin-300.tsv.gz"
    with gzip.open(stand_in, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == 300 and all(line.count("\t") == 1 for line in lines)
    bench.main(["--corpora", str(stand_in), "--processes", "1", "--preset", "tiny", "--vocab_size", "300",
                "--workers", "1", "--work_dir", str(tmp_path / "work"), "--results_dir", str(tmp_path / "results")])
    report = check_report(tmp_path / "results" / "data-cpu.json", "bench_data",
                          {"pairs", "processes", "run", "first_step_s", "cpu_s", "peak_anon_gib", "peak_file_gib"})
    first, cached = report["results"]
    assert (first["run"], cached["run"], first["pairs"]) == ("first", "cached", 300)
    assert 0 < first["read_s"] <= first["first_step_s"] and cached["peak_anon_gib"] > 0
    # Every stage is found in the script's log (a renamed logger or message would leave it out), in order.
    assert 0 < first["read_s"] <= first["tokenizer_s"] <= first["tokenized_s"] <= first["first_step_s"]
    assert first["cache_gib"] > 0 and first["load_during"] >= 0
    assert len(first["peak_anon_by_stage_gib"].split(" / ")) == 4


def test_gpu_quality_gives_train_translation_arguments_it_parses():
    """gpu_quality.py's train_translation.py command lines (built here, run only on a lent GPU) parse: a wrong flag or
    value would otherwise surface only after the device's start-up had been paid for."""
    from transformers import HfArgumentParser

    from vaswani.training import DataArguments, ModelArguments, VaswaniTrainingArguments

    quality = load("gpu_quality")
    parser = HfArgumentParser((ModelArguments, DataArguments, VaswaniTrainingArguments))
    gpu, rehearsal, cpu = (argparse.Namespace(is_cuda=real, as_cuda=like) for real, like in
                           ((True, True), (False, True), (False, False)))
    for dry_run, device in ((False, gpu), (True, rehearsal), (True, cpu), (False, None)):
        args = argparse.Namespace(dry_run=dry_run, preset="base", vocab_size=16000, train_seconds=300, max_tokens=4000,
                                  lr=7e-4, warmup=400, eval_batch_size=256, data_cache_dir=Path("cache"),
                                  logging_steps=100)
        namespace = parser.parse_args(quality.shared_arguments(args, Path("out"), device))  # exits on error
        assert namespace.max_train_time == 300 and namespace.data_cache_dir == "cache"
        assert namespace.config_overrides == "dropout=0.1"
        # The GPU's flags where a GPU runs it or a CPU rehearses it (there on the CPU backend, without TF32);
        # none to fill the caches (device None), which runs beforehand on any machine.
        assert namespace.bf16 is namespace.torch_compile is (device in (gpu, rehearsal))
        assert namespace.tf32 is (True if device is gpu else None) and namespace.use_cpu is (device is rehearsal)


@pytest.mark.slow
def test_the_quality_runs_gpu_arguments_train_compile_and_score_on_a_cpu_rehearsing_cuda(tmp_path, monkeypatch):
    """The quality run's own train_translation.py arguments as a GPU gets them (bf16 autocast, torch.compile),
    rehearsed on the CPU at the tiny size, with the test split scored in the training process (the quality run
    scores it in another, `--max_test_samples 0`) by generate()'s CUDA default, transformers' loop, the quality
    run's second loop: paths that otherwise first run on a lent GPU (where a TypeError in that loop once cost a run
    its score)."""
    from training_script import run_script, synthetic_corpus

    import vaswani.generation_vaswani

    quality = load("gpu_quality")
    monkeypatch.setattr(vaswani.generation_vaswani, "rehearsing_cuda", True)
    device = quality.Device(torch.device("cpu"))
    assert device.as_cuda and not device.is_cuda and device.dtype_name == "bfloat16"
    args = argparse.Namespace(dry_run=False, preset="tiny", vocab_size=300, train_seconds=120, max_tokens=300, lr=3e-3,
                              warmup=5, eval_batch_size=16, data_cache_dir=tmp_path / "cache", logging_steps=100)
    arguments = quality.shared_arguments(args, tmp_path / "out", device)
    assert {"--bf16", "--torch_compile"} <= set(arguments) and "--tf32" not in arguments
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    env = {**os.environ, "VASWANI_REHEARSE_CUDA": "1", "OMP_NUM_THREADS": "1"}
    run = run_script("train_translation.py", *arguments, "--corpus", str(corpus), "--max_steps", "3",
                     "--max_test_samples", "8", "--dataloader_num_workers", "0", env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["train_steps"] == 3 and metrics["train_compile_seconds"] > 0
    assert metrics["test_sentences"] > 0 and metrics["test_bleu"] is not None


@pytest.mark.parametrize("name", ["vaswani", "vaswani-slots", "marian", "ct2-float32"])
def test_benchmark_times_what_the_package_engine_translates(tmp_path, name):
    """The benchmark times the factory's engine below the text: its token ids, decoded, are the translations that the
    same engine gives through `vaswani.translation.translate`, greedy and beam, stopping at eos; forced, every row
    has exactly the asked length."""
    if name.startswith("ct2-"):
        pytest.importorskip("ctranslate2")
    from tiny_translation_model import SOURCES

    from vaswani.translation import translate

    bench = load("bench_translation")
    engine = bench.LocalEngine(name, _tiny_checkpoint(tmp_path), "cpu", 1, tmp_path / "ct2")
    tokenizer = engine.engine.tokenizer
    encoded = tokenizer(SOURCES)["input_ids"]
    batch = [encoded[i] for i in sorted(range(len(encoded)), key=lambda i: len(encoded[i]), reverse=True)]
    sources = [SOURCES[encoded.index(ids)] for ids in batch]  # translate()'s order: longest first
    for beams in (1, 3):
        ids = engine.translate(batch, beams, 7, stop_at_eos=True)
        engine.engine.decoding = dataclasses.replace(engine.engine.decoding, num_beams=beams, max_new_tokens=7,
                                                     min_new_tokens=0)
        texts = translate(engine.engine, sources).texts
        assert [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)] == texts, beams
        assert min(map(len, ids)) < 7  # a trained model: some sentences end before the limit
        assert {len(row) for row in engine.translate(batch, beams, 7, stop_at_eos=False)} == {7}


def test_benchmark_int8_engine_is_the_loaders_int8_path(tmp_path):
    """The benchmark's `vaswani-int8` engine is what `load_engine(int8=True)` loads: every linear layer int8, the
    output projection included."""
    from tiny_translation_model import SOURCES

    from vaswani.inference import Int8Linear

    engine = load("bench_translation").LocalEngine("vaswani-int8", _tiny_checkpoint(tmp_path), "cpu", 1,
                                                   tmp_path / "ct2")
    model = engine.engine.model
    assert [name for name, module in model.named_modules() if type(module) is torch.nn.Linear] == []
    assert isinstance(model.lm_head, Int8Linear)
    translations = engine.translate(engine.engine.tokenizer(SOURCES[:2])["input_ids"], 2, 3, stop_at_eos=False)
    assert list(map(len, translations)) == [3, 3]
