"""`--preset auto` (vaswani.sizing): the table it reads, the rule it chooses by, the timing inside the budget, and the
training run it shapes."""

import json
import multiprocessing
import re
import shlex
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DataCollatorForSeq2Seq, HfArgumentParser

from training_script import REPO, synthetic_corpus, train_args

import vaswani.inference
import vaswani.sizing as sizing
import vaswani.training
from vaswani import VaswaniConfig
from vaswani.training import DataArguments, ModelArguments, VaswaniTrainingArguments, run_training

RESULTS = REPO / "benchmarks" / "results" / "main-job-sizes.json"


@pytest.fixture(autouse=True)
def _malloc_left_alone(monkeypatch):
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)


def parse(argv):
    return HfArgumentParser((ModelArguments, DataArguments, VaswaniTrainingArguments)).parse_args_into_dataclasses(
        args=argv)


# The table --------------------------------------------------------------------------------------------------------


def test_the_table_is_the_measured_one():
    """Every row of BLEU_AFTER_STEPS is a row of the committed measurement, at the size's peak learning rate, and every
    size has rows."""
    measured = {}
    for row in json.loads(RESULTS.read_text())["rows"]:
        if not row.get("variant"):  # rows of another recipe for a size (main_job_sizes.py --variant) are apart
            measured.setdefault(row["size"], []).append((row["steps"], row["validation_bleu"]))
            if row["size"] in sizing.SIZES:  # measured at the peak that --preset auto trains the size at
                assert row["learning_rate"] == sizing.PEAK_LEARNING_RATE[row["size"]], row
    # A size measured and then removed (main-job-sizes.md says why) keeps its rows in the measurement.
    assert {size: tuple(sorted(measured[size])) for size in sizing.SIZES} == sizing.BLEU_AFTER_STEPS
    assert set(sizing.BLEU_AFTER_STEPS) == set(sizing.SIZES) == set(sizing.PEAK_LEARNING_RATE)


def test_the_benchmark_trains_with_the_main_jobs_recipe():
    """benchmarks/main_job_sizes.py measures the recipe that scripts/main_job.sh trains with."""
    script = (REPO / "scripts" / "main_job.sh").read_text()
    call = re.search(r"python3 scripts/train_translation.py(.*?)\"\$@\"", script, re.S).group(1)
    words = shlex.split(call.replace("\\\n", " "), comments=False)
    import sys
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from main_job_sizes import RECIPE
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    pairs = dict(zip(RECIPE[::2], RECIPE[1::2]))
    for flag, value in pairs.items():
        assert flag in words and words[words.index(flag) + 1] == value, (flag, value)
    assert "--learning_rate" not in words  # each size's own peak (PEAK_LEARNING_RATE), as the benchmark trains it


def test_bleu_is_read_between_rows_on_a_log_scale_and_held_beyond_the_last(monkeypatch):
    monkeypatch.setattr(sizing, "BLEU_AFTER_STEPS", {"s": ((100, 10.0), (400, 30.0))})
    assert sizing.bleu_after("s", 100) == 10.0
    assert sizing.bleu_after("s", 200) == pytest.approx(20.0)  # halfway between 100 and 400 on a log scale
    assert sizing.bleu_after("s", 400) == 30.0
    assert sizing.bleu_after("s", 10_000) == 30.0
    assert sizing.bleu_after("s", 10) == pytest.approx(5.0)  # from 0 at step 1
    assert sizing.bleu_after("s", 0) == 0.0


@pytest.fixture
def two_sizes(monkeypatch):
    monkeypatch.setattr(sizing, "SIZES", {"big": {}, "small": {"d_model": 64}})
    monkeypatch.setattr(sizing, "DEFAULT_SIZE", "big")
    monkeypatch.setattr(sizing, "BLEU_AFTER_STEPS", {"big": ((100, 20.0), (1000, 40.0)),
                                                     "small": ((100, 18.0), (1000, 33.0), (4000, 40.0))})
    monkeypatch.setattr(sizing, "MARGIN", 1.0)


def test_the_size_with_the_best_predicted_bleu_wins_by_more_than_the_margin(two_sizes):
    # 1,000 s: big takes 1,000 steps (40), small 4,000 (40): level, the default stays.
    assert sizing.choose({"big": 1.0, "small": 0.25}, 1000).size == "big"
    # 100 s: big takes 100 steps (20), small 400 (27.0): small.
    choice = sizing.choose({"big": 1.0, "small": 0.25}, 100)
    assert choice.size == "small"
    assert choice.predicted_steps == {"big": 100, "small": 400}
    assert "400 steps in 100 s predict validation BLEU 27.0, against 20.0 for big (100 steps)" in choice.reason
    # Better, but by no more than the margin: big at 20.0, small at 20.6 (150 steps).
    assert sizing.choose({"big": 1.0, "small": 100 / 150}, 100).size == "big"
    # Without a time budget, the steps asked for.
    assert sizing.choose({}, None, max_steps=100).size == "big"


def test_the_choice_line_names_the_peak_learning_rate_the_size_trains_at(monkeypatch):
    """The size's own peak, or the one the run names."""
    monkeypatch.setattr(sizing, "PEAK_LEARNING_RATE", {"d256-3x3": 1e-3, "d128-2x2": 2e-3})
    paces = {"d256-3x3": 1.0, "d128-2x2": 0.01}
    assert sizing.choose(paces, 600).line.startswith(
        "--preset auto: d128-2x2 (d_model=128, d_ff=512, encoder_layers=2, decoder_layers=2; peak learning rate "
        "0.002): ")
    named = sizing.choose(paces, 600, named_learning_rate=4e-4)
    assert "decoder_layers=2; --learning_rate 0.0004): " in named.line and named.learning_rate == 4e-4
    assert "the table's BLEU is each size's at its own peak learning rate, not at the one named" in named.line
    assert "not at the one named" not in sizing.choose(paces, 600).line
    assert sizing.choose({"d256-3x3": 0.1, "d128-2x2": 10.0}, 600).line.startswith(
        "--preset auto: d256-3x3 (the small preset; peak learning rate 0.001): ")


# The CPU kinds of main-job-sizes.md's predictions: the `small` preset's steps in the main job's 600 s there
# (main-job-cpu.md), the precision the main job trains in, and the size the file says the table chooses.
PREDICTED = [("AMD Zen 5", 3331, "bf16", "d128-2x2"), ("Intel Xeon with AMX", 3328, "bf16", "d128-2x2"),
             ("Intel Xeon without AMX", 2101, "fp32", "d128-2x2"), ("AMD Zen 3", 1360, "fp32", "d128-2x2"),
             ("AMD Zen 1", 647, "fp32", "d128-2x2")]


@pytest.mark.parametrize("cpu, steps, precision, size", PREDICTED, ids=[row[0] for row in PREDICTED])
def test_the_choices_main_job_sizes_md_predicts(cpu, steps, precision, size):
    """The table and the rule choose for each CPU kind what the results file says, at the step-time ratios measured
    there; a change of either that changes a documented choice fails here."""
    ratios = json.loads(RESULTS.read_text())["seconds_per_step_ratio"][precision]
    assert sizing.choose({name: ratios[name] * 600 / steps for name in sizing.SIZES}, 600).size == size


# The step times that runs 39 and 40 (main-job-cpu.md) timed and recorded, the seconds left of their budget after
# timing, and the size each trained: the 2-core Zen 4 and one of its cores.
MEASURED = [("2 cores", {"d256-3x3": 0.19675, "d128-2x2": 0.08380}, 597.82, "d128-2x2"),
            ("1 core", {"d256-3x3": 0.36335, "d128-2x2": 0.13720}, 596.24, "d128-2x2")]


@pytest.mark.parametrize("machine, paces, seconds_left, size", MEASURED, ids=[row[0] for row in MEASURED])
def test_the_measured_runs_choose_as_they_did(machine, paces, seconds_left, size):
    assert sizing.choose(paces, seconds_left).size == size


# Timing the sizes ---------------------------------------------------------------------------------------------------


def tiny_batches(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(4, 300, (4, 6), generator=generator),
             "attention_mask": torch.ones(4, 6, dtype=torch.long),
             "labels": torch.randint(4, 300, (4, 5), generator=generator)} for _ in range(count)]


def test_timing_every_size_leaves_the_random_state_as_it_was():
    def build(size):
        return vaswani.VaswaniForConditionalGeneration(VaswaniConfig.small(vocab_size=300, dropout=0.1,
                                                                           **sizing.SIZES[size]))

    before = torch.random.get_rng_state()
    paces = sizing.seconds_per_step(build, tiny_batches(sizing.WARM_UP_STEPS + 2), torch.device("cpu"),
                                    torch.bfloat16)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert set(paces) == set(sizing.SIZES) and all(seconds > 0 for seconds in paces.values())


# The training run ---------------------------------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path):
    return synthetic_corpus(tmp_path / "corpus.tsv", pairs=200)


def auto_args(corpus: Path, output_dir: Path, *extra: str) -> list[str]:
    argv = train_args(corpus, output_dir, "--max_steps", "3", "--max_test_samples", "4", "--generation_num_beams",
                      "1", "--generation_max_length", "8", "--disable_tqdm", "true", "--max_tokens_per_batch", "200",
                      *extra)
    argv[argv.index("--preset") + 1] = "auto"
    return argv


def test_auto_times_the_sizes_in_the_budget_and_records_its_choice(corpus, tmp_path, single_thread, capsys,
                                                                   monkeypatch):
    """The first run times the sizes and records the step times; a second run of the same command reads them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    metrics = run_training(*parse(auto_args(corpus, tmp_path / "run", "--max_train_time", "600")))
    chosen = metrics["model_size"]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    for field, value in {**VaswaniConfig.small().to_dict(), **sizing.SIZES[chosen]}.items():
        if field in ("d_model", "d_ff", "encoder_layers", "decoder_layers", "num_attention_heads"):
            assert config[field] == value, field
    assert set(metrics["model_size_seconds_per_step"]) == set(sizing.SIZES)
    assert 0 < metrics["model_size_timing_seconds"] < 600
    assert metrics["model_size_predicted_steps"] == {size: 3 for size in sizing.SIZES}  # --max_steps bounds them
    line = [line for line in capsys.readouterr().err.splitlines() if line.startswith("--preset auto:")]
    assert len(line) == 1 and chosen in line[0] and "timing the sizes took" in line[0]
    card = (tmp_path / "run" / "README.md").read_text()
    assert f"The model's size, {chosen}, was chosen" in card
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["model_size_choice"] == metrics[
        "model_size_choice"]
    again = run_training(*parse(auto_args(corpus, tmp_path / "again", "--max_train_time", "600", "--max_steps", "1")))
    assert again["model_size_seconds_per_step"] == metrics["model_size_seconds_per_step"]
    line = [line for line in capsys.readouterr().err.splitlines() if line.startswith("--preset auto:")]
    assert len(line) == 1 and "the step times recorded for this machine" in line[0]


def test_step_times_are_measured_once_per_key_by_concurrent_runs(tmp_path, monkeypatch):
    """Two processes sizing at once: one measures, the other waits and reads its record; another key (here a
    changed model field) is measured anew."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    measured = tmp_path / "measured"

    def measure():
        with open(measured, "a") as f:
            f.write("x")
        time.sleep(0.5)
        return {"d256-3x3": 0.5}

    def size(queue):
        queue.put(sizing.recorded_seconds_per_step({"recipe": 1}, measure))

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=size, args=(queue,)) for _ in range(2)]
    for process in processes:
        process.start()
    results = sorted((queue.get(timeout=60) for _ in processes), key=lambda result: result[1])
    for process in processes:
        process.join(timeout=60)
    assert results == [({"d256-3x3": 0.5}, False), ({"d256-3x3": 0.5}, True)] and measured.read_text() == "x"
    assert sizing.recorded_seconds_per_step({"recipe": 2}, measure) == ({"d256-3x3": 0.5}, True)
    assert measured.read_text() == "xx"


def test_step_times_that_cannot_be_recorded_are_measured_and_said(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache directory cannot be made under a file
    assert sizing.recorded_seconds_per_step({"recipe": 1}, lambda: {"d256-3x3": 0.5}) == ({"d256-3x3": 0.5}, True)
    assert "step times not recorded" in capsys.readouterr().err


def test_timing_the_sizes_is_spent_from_the_time_budget(corpus, tmp_path, single_thread, monkeypatch):
    """Where timing took the whole budget, training stops after its first step."""
    def whole_budget(build, batches, *, device, autocast_dtype, max_train_time, max_steps, recipe,
                     named_learning_rate):
        return sizing.SizeChoice(sizing.DEFAULT_SIZE, "timed", max_train_time, {}, {}, {})

    monkeypatch.setattr(vaswani.training, "auto_size", whole_budget)
    metrics = run_training(*parse(auto_args(corpus, tmp_path / "run", "--max_train_time", "30", "--max_steps",
                                            "20")))
    assert metrics["train_steps"] == 1


def chosen(size):
    """auto_size, choosing `size` without timing, at the learning rate the run names (if any)."""
    return lambda build, batches, **kwargs: sizing.SizeChoice(size, "chosen", 0.0, {}, {}, {},
                                                              kwargs["named_learning_rate"])


def test_the_size_chosen_trains_the_model_its_explicit_flags_train(corpus, tmp_path, single_thread, monkeypatch):
    """auto choosing a size gives the weights that `--preset small --config_overrides <its fields>` gives: the same
    random start, as if no size had been timed."""
    size = "d128-2x2"
    monkeypatch.setattr(vaswani.training, "auto_size", chosen(size))
    run_training(*parse(auto_args(corpus, tmp_path / "auto")))
    fields = ",".join(f"{name}={value}" for name, value in sizing.SIZES[size].items())
    explicit = auto_args(corpus, tmp_path / "explicit", "--config_overrides", fields)
    explicit[explicit.index("--preset") + 1] = "small"
    run_training(*parse(explicit))
    auto, named = (load_file(tmp_path / run / "model.safetensors") for run in ("auto", "explicit"))
    assert auto.keys() == named.keys() and all(torch.equal(auto[name], named[name]) for name in auto)


def test_a_resumed_auto_run_trains_on_the_size_it_chose_without_timing(corpus, tmp_path, single_thread,
                                                                       monkeypatch):
    """`--resume` of an auto run builds its checkpoint's size, not a new choice (here another size would be chosen)."""
    monkeypatch.setattr(vaswani.training, "auto_size", chosen("d128-2x2"))
    saving = ("--save_strategy", "steps", "--save_steps", "1")
    run_training(*parse(auto_args(corpus, tmp_path / "run", "--max_steps", "2", *saving)))
    monkeypatch.setattr(vaswani.training, "auto_size", lambda *args, **kwargs: pytest.fail("sized a resumed run"))
    metrics = run_training(*parse(auto_args(corpus, tmp_path / "run", "--max_steps", "3", "--resume", *saving)))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["d_model"], config["encoder_layers"]) == (128, 2) and metrics["train_steps"] == 3
    assert "model_size" not in metrics


def without_learning_rate(argv: list[str]) -> list[str]:
    at = argv.index("--learning_rate")
    return argv[:at] + argv[at + 2:]


@pytest.fixture
def trainers(monkeypatch):
    """The Trainers that run_training builds, in order."""
    built = []

    def build(*args, **kwargs):
        built.append(build_trainer(*args, **kwargs))
        return built[-1]

    build_trainer = vaswani.training.build_trainer
    monkeypatch.setattr(vaswani.training, "build_trainer", build)
    return built


@pytest.mark.parametrize("size", ["d128-2x2", "d256-3x3"])
def test_auto_trains_the_chosen_size_at_its_peak_learning_rate_and_a_resumed_run_keeps_it(
        corpus, tmp_path, single_thread, monkeypatch, trainers, size):
    """Without --learning_rate, the size chosen trains at its PEAK_LEARNING_RATE (the table was measured there), says
    so in its metrics, and its resumed run continues at that peak."""
    monkeypatch.setattr(vaswani.training, "auto_size", chosen(size))
    saving = ("--save_strategy", "steps", "--save_steps", "1")
    metrics = run_training(*parse(without_learning_rate(auto_args(corpus, tmp_path / "run", "--max_steps", "2",
                                                                  *saving))))
    peak = sizing.PEAK_LEARNING_RATE[size]
    assert trainers[0].lr_scheduler.base_lrs == [peak] * 2 and trainers[0].args.learning_rate == peak
    assert metrics["model_size_learning_rate"] == peak
    assert f"It trained at a peak learning rate of {peak:g}." in (tmp_path / "run" / "README.md").read_text()
    run_training(*parse(without_learning_rate(auto_args(corpus, tmp_path / "run", "--max_steps", "3", "--resume",
                                                        *saving))))
    assert trainers[1].lr_scheduler.base_lrs == [peak] * 2


def test_a_learning_rate_named_wins_over_the_sizes(corpus, tmp_path, single_thread, monkeypatch, trainers):
    monkeypatch.setattr(vaswani.training, "auto_size", chosen("d128-2x2"))
    metrics = run_training(*parse(auto_args(corpus, tmp_path / "run", "--learning_rate", "4e-4")))
    assert trainers[0].lr_scheduler.base_lrs == [4e-4] * 2 and metrics["model_size_learning_rate"] == 4e-4


def test_a_named_preset_keeps_the_trainers_default_learning_rate(corpus, tmp_path, single_thread, trainers):
    argv = without_learning_rate(auto_args(corpus, tmp_path / "run", "--max_steps", "1"))
    argv[argv.index("--preset") + 1] = "small"
    run_training(*parse(argv))
    assert trainers[0].lr_scheduler.base_lrs == [5e-5] * 2


def test_config_overrides_of_a_size_field_win_without_timing(corpus, tmp_path, single_thread, monkeypatch, capsys):
    monkeypatch.setattr(sizing, "seconds_per_step", lambda *args: pytest.fail("timed the sizes"))
    metrics = run_training(*parse(auto_args(corpus, tmp_path / "run", "--max_train_time", "600", "--config_overrides",
                                            "d_model=64,d_ff=128")))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["d_model"], config["d_ff"]) == (64, 128) and metrics["model_size"] == sizing.DEFAULT_SIZE
    assert "--config_overrides sets d_ff, d_model, which the sizes differ in" in capsys.readouterr().err


def test_auto_is_refused_under_several_processes(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(VaswaniTrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="--preset auto sizes the model by timing steps in one process"):
        run_training(*parse(auto_args(corpus, tmp_path / "run")))
