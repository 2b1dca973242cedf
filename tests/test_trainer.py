"""The Trainer of a training run (`vaswani.trainer.VaswaniSeq2SeqTrainer`): token-budget batches, shape buckets,
a training step that reads nothing back from the device, and the step compiled before the clock starts."""

import collections
import functools
import json
import os
import traceback
from pathlib import Path

import pytest
import torch
import transformers
from packaging import version
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, TrainerCallback

import vaswani.inference
import vaswani.trainer
import vaswani.training
from vaswani.training_clock import SlowSteps
from conftest import script_main
from host_reads import PythonReads
from training_script import distinct_corpus, synthetic_corpus, train_args

VaswaniSeq2SeqTrainer = vaswani.training.VaswaniSeq2SeqTrainer  # as imported, whatever a test patches


def test_no_training_batch_exceeds_the_token_budget_once_padded(tmp_path):
    """The Trainer's batches, as its collator pads them (to multiples of 8, as --pad_to_multiple_of 8 asks), hold at
    most --max_tokens_per_batch tokens on each side: the budget counts what the device computes."""
    from transformers import DataCollatorForSeq2Seq, HfArgumentParser

    from vaswani import training

    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    parser = HfArgumentParser((training.ModelArguments, training.DataArguments, training.VaswaniTrainingArguments))
    model_args, data_args, args = parser.parse_args_into_dataclasses(
        args=train_args(corpus, tmp_path / "out", "--max_tokens_per_batch", "100", "--use_cpu"))
    data = training.prepare_data(model_args, data_args, args)
    model, tokenizer = training.build_model_and_tokenizer(model_args, data.tokenizer)
    features, _ = training.tokenize_splits(data, tokenizer, data_args, args)
    trainer = training.VaswaniSeq2SeqTrainer(
        model=model, args=args, train_dataset=features, processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8), max_tokens_per_batch=100)
    batches = list(trainer.get_train_dataloader())
    assert sum(len(batch["input_ids"]) for batch in batches) == len(features)
    assert {batch["input_ids"].shape[1] % 8 for batch in batches} == {0}
    assert max(max(batch["input_ids"].numel(), batch["labels"].numel()) for batch in batches) <= 100
    # Short sentences padded to 8 or 16: the budget allows fewer of them than their own lengths would.
    assert max(len(batch["input_ids"]) for batch in batches) <= 100 // 8
    # With loader workers: the same batches, from workers kept for the next epoch instead of started again.
    args.dataloader_num_workers = 1
    loader = trainer.get_train_dataloader()
    assert loader.persistent_workers
    assert [batch["input_ids"].tolist() for batch in loader] == [batch["input_ids"].tolist() for batch in batches]
    # Padded up to declared shapes, rows included, the batches stay within the budget too (padded to multiples of 2
    # here: multiples of 8 leave these sentences a single length).
    args.dataloader_num_workers = 0
    trainer = training.VaswaniSeq2SeqTrainer(
        model=model, args=args, train_dataset=features, processing_class=tokenizer, shape_buckets=3,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=2), max_tokens_per_batch=100)
    batches = list(trainer.get_train_dataloader())
    declared = set(trainer.batch_sampler.shape_buckets.shapes)
    assert len(declared) == 3 and all(length % 2 == 0 for _, length in declared)
    assert {tuple(batch[name].shape) for batch in batches for name in batch} == declared
    assert max(rows * length for rows, length in declared) <= 100
    examples = [batch["labels"][(batch["labels"] != -100).any(dim=1)] for batch in batches]
    assert sum(len(rows) for rows in examples) == len(features)


def test_validation_scores_the_translations_of_the_one_translation_path(tmp_path, monkeypatch):
    """With --predict_with_generate, each evaluation during training logs the Trainer's eval_loss beside eval_bleu,
    eval_chrf and eval_ter of the package's translation path (`trainer.score_split`, which the test evaluation takes
    too), and the best model is picked by them: the last evaluation's scores, at the last step, are those of the
    saved model scored again. The Trainer's own generation never runs."""
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    trainers, loss_only = [], set()

    class Trainer(VaswaniSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
            loss_only.add(prediction_loss_only)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, **gen_kwargs)

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", Trainer)
    corpus = distinct_corpus(tmp_path / "corpus.tsv")
    script_main("train_translation")(train_args(
        corpus, tmp_path / "out", "--max_steps", "10", "--eval_strategy", "steps", "--eval_steps", "5",
        "--predict_with_generate", "--max_eval_samples", "12", "--use_cpu", "--metric_for_best_model", "bleu"))
    trainer = trainers[-1]
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluations] == [5, 10] and loss_only == {True}
    assert all({"eval_bleu", "eval_chrf", "eval_ter"} <= entry.keys() for entry in evaluations)
    assert trainer.state.best_metric == max(entry["eval_bleu"] for entry in evaluations)
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert len(trainer.eval_texts) == 12
    scores = vaswani.trainer.score_split(model, tokenizer, trainer.eval_texts, batch_size=8)
    assert {name: evaluations[-1][f"eval_{name}"] for name in ("bleu", "chrf", "ter")} == {
        name: scores[name] for name in ("bleu", "chrf", "ter")}


@pytest.mark.parametrize("compiled", [(), ("--torch_compile", "--torch_compile_backend", "eager")],
                         ids=["eager", "compiled"])
def test_bf16_training_decodes_through_transformers_loop_and_trains_on_under_its_autocast(tmp_path, monkeypatch,
                                                                                          compiled):
    """--bf16 wraps the model's forward in Accelerate's autocast. Validation and the test score decode the model
    without it (`trainer.decoding_model`) through transformers' own loop, generate()'s default on an accelerator,
    which calls forward with return_dict=True: that must reach transformers' `can_return_tuple`, not the bare forward
    (on the 2026-11-28 H200 the quality run trained 300 s and then failed so). After each validation the training
    model has its autocast back."""
    import vaswani.generation_vaswani

    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    monkeypatch.setattr(vaswani.generation_vaswani, "_lean_by_default", lambda model: False)  # as on a GPU
    trainers, autocast_after_validation = [], []

    class Trainer(VaswaniSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

        def evaluation_loop(self, *args, **kwargs):
            output = super().evaluation_loop(*args, **kwargs)
            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            autocast_after_validation.append(model.forward != type(model).forward.__get__(model))
            return output

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", Trainer)
    corpus = distinct_corpus(tmp_path / "corpus.tsv")
    script_main("train_translation")(train_args(
        corpus, tmp_path / "out", "--max_steps", "4", "--eval_strategy", "steps", "--eval_steps", "2",
        "--predict_with_generate", "--max_eval_samples", "4", "--max_test_samples", "4", "--use_cpu", "--bf16",
        *compiled))
    assert autocast_after_validation == [True, True]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert "test_bleu" in metrics and metrics["train_steps"] == 4
    # The run's training steps went on under the autocast: its steps' losses are those of bf16.
    assert trainers[-1].accelerator.mixed_precision == "bf16"


# Ops that hand a tensor's value to the host: on an accelerator each makes the host wait for the device.
READ_BACK_OPS = {"_local_scalar_dense", "is_nonzero", "nonzero", "item", "equal"}


class HostReads(TorchDispatchMode):
    """Counts the ops that read a value back, and the tensors made from host data (`lift_fresh`: `torch.tensor`,
    on an accelerator a blocking copy to it) while `in_step`, each with the code that asked for it."""

    def __init__(self):
        super().__init__()
        self.reads, self.lifted, self.in_step = collections.Counter(), collections.Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READ_BACK_OPS or (name == "lift_fresh" and self.in_step):
            caller = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()[-8:-1])
            (self.reads if name in READ_BACK_OPS else self.lifted)[f"{name} at {caller}"] += 1
        return func(*args, **(kwargs or {}))


class SteadyStepReads(TrainerCallback):
    """Counts `HostReads`, and the reads Python makes (`host_reads.PythonReads`, which on a CPU dispatch nothing),
    over the steps after `first` up to `last` (their data loading, forward, backward, optimiser step and every
    callback); `in_step` covers the steps proper, without the loader's collation."""

    def __init__(self, first: int, last: int):
        self.first, self.last, self.mode, self.python = first, last, None, PythonReads()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.mode is not None:
            self.mode.in_step = True

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.first:
            self.mode = HostReads()
            self.mode.__enter__()
            self.python.__enter__()
        elif state.global_step == self.last:
            self.python.__exit__(None, None, None)
            self.mode.__exit__(None, None, None)
        if self.mode is not None:
            self.mode.in_step = False


@pytest.mark.parametrize("batches", [(), ("--packing",)], ids=["bucketed", "packed"])
def test_a_steady_training_step_reads_nothing_back_from_the_device(tmp_path, monkeypatch, batches):
    """Through the training script, with a time budget, interval checkpoints and a weight average (every
    per-step callback on), a steady step between logging steps reads no value back to the host (no reading op, and
    no `.tolist()`, `.cpu()`, `.item()`... called from Python, which on a CPU dispatch no op) and copies no host
    value to the device: nothing makes the host wait for the device, which can then run ahead of it. The counts
    hold on any device, so this CPU run stands for the GPU's."""
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    counter = SteadyStepReads(first=4, last=10)
    trainers = []

    class CountingTrainer(vaswani.training.VaswaniSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(counter)
            trainers.append(self)

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", CountingTrainer)
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    script_main("train_translation")(train_args(
        corpus, tmp_path / "out", "--max_steps", "12", "--max_test_samples", "2", "--generation_num_beams", "1",
        "--use_cpu", "--bf16", "--attn_implementation", "eager", "--max_tokens_per_batch", "200",
        "--max_train_time", "600", "--save_interval_seconds", "600", "--ema_decay", "0.99", "--logging_steps", "100",
        *batches))
    assert counter.mode is not None and not counter.mode.in_step
    lifted = dict(counter.mode.lifted)
    if version.parse(transformers.__version__) < version.parse("5.21"):
        # Before 5.21, transformers' eager attention mask (masking_utils.eager_mask) makes its zero from a host
        # scalar, once per mask; 5.21 makes it on the device. Upstream's copy, not the package's: only that one.
        lifted = {where: count for where, count in lifted.items() if "masking_utils.py" not in where}
    assert dict(counter.mode.reads) == {} and lifted == {} and dict(counter.python.reads) == {}
    assert not trainers[0].args.logging_nan_inf_filter
    # The batches are copied without waiting where they come from pinned memory (on CUDA).
    arguments = vaswani.training.VaswaniTrainingArguments
    assert arguments(output_dir=str(tmp_path / "a"), report_to="none").accelerator_config.non_blocking
    assert not arguments(output_dir=str(tmp_path / "b"), report_to="none",
                         dataloader_pin_memory=False).accelerator_config.non_blocking


# The training script under torchrun, counting each process' steady-step reads (`SteadyStepReads`) with a clock of
# its own: each step advances process r's clock by 1 + r seconds, so alone process 1 would spend a 20 s budget at
# step 10 and process 0 at step 20. Each writes its counts and last step to RESULTS/rank-R.json.
STEADY_STEPS_WORKER = """
import json, os, runpy, sys
from pathlib import Path
import vaswani.training, vaswani.training_callbacks
from transformers import TrainerCallback
from test_trainer import SteadyStepReads

rank, results, seconds = int(os.environ["RANK"]), Path(sys.argv[1]), [0.0]
vaswani.training_callbacks.TrainingClock.now = staticmethod(lambda: seconds[0])
counter = SteadyStepReads(first=4, last=9)

class Report(TrainerCallback):
    def on_train_end(self, args, state, control, **kwargs):
        (results / f"rank-{rank}.json").write_text(json.dumps({
            "reads": counter.mode.reads, "lifted": counter.mode.lifted, "python": counter.python.reads,
            "step": state.global_step}))

class CountingTrainer(vaswani.training.VaswaniSeq2SeqTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(counter)
        self.add_callback(Report())

    def training_step(self, *args, **kwargs):
        seconds[0] += 1 + rank
        return super().training_step(*args, **kwargs)

vaswani.training.VaswaniSeq2SeqTrainer = CountingTrainer
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_steady_step_of_two_processes_reads_nothing_and_the_budget_stops_both_at_one_step(tmp_path):
    """Under torchrun (two CPU processes, DDP over gloo), with a time budget, interval checkpoints and a weight
    average, a steady step reads nothing back in either process: the processes agree on the clock without a
    blocking all-reduce. Their clocks differ (process 1's runs twice as fast), yet the budget stops both after the
    same step: the first at whose end the slowest clock had passed the budget by the step before (step 11)."""
    import subprocess
    import sys

    from conftest import subprocess_env
    from training_script import SCRIPTS

    worker = tmp_path / "worker.py"
    worker.write_text(STEADY_STEPS_WORKER)
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    output_dir = tmp_path / "out"
    env = {**subprocess_env(), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                                os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
               str(tmp_path), str(SCRIPTS / "train_translation.py"),
               *train_args(corpus, output_dir, "--max_steps", "40", "--max_test_samples", "2",
                           "--generation_num_beams", "1", "--ddp_backend", "gloo", "--max_tokens_per_batch", "200",
                           "--max_train_time", "20", "--save_interval_seconds", "600", "--ema_decay", "0.99",
                           "--logging_steps", "100")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert counts == {"reads": {}, "lifted": {}, "python": {}, "step": 11}, (rank, counts)
    # The budget's last checkpoint holds both processes' random state.
    assert {p.name for p in (output_dir / "checkpoint-11").glob("rng_state*")} == {"rng_state_0.pth",
                                                                                  "rng_state_1.pth"}


def slow_step_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Training step ")]


def test_the_step_compiles_once_before_the_clock_for_every_batch_shape(tmp_path, monkeypatch, caplog):
    """--torch_compile with token-budget batches of many shapes: Dynamo builds one graph of the step, with no
    graph break, before the time budget's clock starts (a warm-up on the extreme shapes, sizes marked dynamic), and
    none while training. metrics.json reports the compilation apart from the runtime, every logged line carries the
    elapsed seconds, and the warm-up changes nothing in training: the losses are those of a run without it (whose
    graphs are compiled inside the timed steps, a static one and then a dynamic one)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    graphs, shapes, trainers = {}, set(), []

    class Graphs(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            graphs["begin"] = counters["stats"]["unique_graphs"]

        def on_train_end(self, args, state, control, **kwargs):
            graphs["end"], graphs["breaks"] = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    class CountingTrainer(vaswani.training.VaswaniSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(Graphs())
            trainers.append(self)

        def training_step(self, model, inputs, num_items_in_batch=None):
            shapes.add((tuple(inputs["input_ids"].shape), tuple(inputs["labels"].shape)))
            return super().training_step(model, inputs, num_items_in_batch)

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", CountingTrainer)
    # Every step over 10× the median is reported here, however short: a tiny model's compiling steps take well under
    # the second a real run's floor asks for.
    monkeypatch.setattr(vaswani.trainer, "SlowSteps", functools.partial(SlowSteps, floor=0.0))
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)

    def train(output_dir):
        torch._dynamo.reset()
        counters.clear()
        script_main("train_translation")(train_args(
            corpus, output_dir, "--max_steps", "20", "--max_test_samples", "2", "--generation_num_beams", "1",
            "--use_cpu", "--max_tokens_per_batch", "150", "--max_train_time", "600", "--logging_steps", "5",
            "--torch_compile", "--torch_compile_backend", "eager"))
        return [entry["loss"] for entry in trainers[-1].state.log_history if "loss" in entry]

    losses = train(tmp_path / "warm")
    assert len(shapes) >= 5  # many shapes, one graph
    assert graphs == {"begin": 1, "end": 1, "breaks": 0}
    metrics = warm = json.loads((tmp_path / "warm" / "metrics.json").read_text())
    # The run's clock starts after the compilation: the runtime, the whole run's time (one part here) and the
    # rates all leave it out.
    assert metrics["train_compile_seconds"] > 0 and metrics["train_runtime"] == metrics["train_wall_seconds"]
    assert metrics["train_graphs_compiled_on_the_clock"] == 0
    assert metrics["train_steps_per_second"] == pytest.approx(20 / metrics["train_runtime"], rel=1e-2)
    assert all("elapsed_seconds" in entry for entry in trainers[-1].state.log_history)
    assert len(losses) == 4
    # No step compiled on the clock, so none of the steps found slow (a loaded machine makes some) compiled either.
    assert not [r for r in slow_step_warnings(caplog) if "0 graphs compiled" not in r], slow_step_warnings(caplog)

    caplog.clear()
    monkeypatch.setattr(CountingTrainer, "compile_before_the_clock", lambda self: None)
    unwarmed = train(tmp_path / "cold")
    assert graphs["begin"] == 0 and graphs["end"] == 2
    # The report says so: a run whose graphs were built on the clock (a GPU run's first steps, if its warm-up missed
    # what a later batch needs, say) counts them, and names the steps that built them with their batches' shapes.
    cold = json.loads((tmp_path / "cold" / "metrics.json").read_text())
    assert cold["train_graphs_compiled_on_the_clock"] == 2
    compiling = [r for r in slow_step_warnings(caplog) if "1 graph compiled" in r]
    assert len(compiling) == 2 and all("input_ids " in r and ", labels " in r for r in compiling), compiling
    assert cold["train_slow_steps"] >= 2 and cold["train_slow_steps_seconds"] > 0
    # metrics.json names them too: the two that recompiled, apart from any a loaded machine made slow.
    assert cold["train_slow_steps_recompiling"] == 2 and warm["train_slow_steps_recompiling"] == 0
    assert sum(step["graphs"] for step in cold["train_slow_steps_named"]) == 2
    torch.testing.assert_close(losses, unwarmed, rtol=1e-5, atol=1e-6)


class ShapesSeen(TrainerCallback):
    """The (input_ids, labels) shapes of the batches trained on, and Dynamo's graphs at the start and end."""

    def __init__(self):
        self.shapes, self.graphs, self.padding_rows = set(), {}, 0

    def on_train_begin(self, args, state, control, **kwargs):
        from torch._dynamo.utils import counters

        self.graphs["begin"] = counters["stats"]["unique_graphs"]

    def on_train_end(self, args, state, control, **kwargs):
        from torch._dynamo.utils import counters

        self.graphs["end"], self.graphs["breaks"] = counters["stats"]["unique_graphs"], sum(
            counters["graph_break"].values())


def bucketed_run(monkeypatch, corpus, output_dir, *extra, batches=("--shape_buckets", "3")):
    """train_translation.py with shape buckets (or other `batches`): the trainer, and the `ShapesSeen` of its
    training steps."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    seen, trainers = ShapesSeen(), []

    class Trainer(VaswaniSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(seen)
            trainers.append(self)

        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.clock.started:  # not the warm-up's
                seen.shapes.add((tuple(inputs["input_ids"].shape), tuple(inputs["labels"].shape)))
                seen.padding_rows += int((inputs["labels"] == -100).all(dim=1).sum())
            return super().training_step(model, inputs, num_items_in_batch)

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", Trainer)
    torch._dynamo.reset()
    counters.clear()
    script_main("train_translation")(train_args(
        corpus, output_dir, "--max_test_samples", "2", "--generation_num_beams", "1", "--max_tokens_per_batch", "150",
        *batches, "--max_train_time", "600", "--config_overrides", "dropout=0", *extra))
    return trainers[-1], seen


def logged(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def test_shape_buckets_train_as_the_batches_unpadded_do(tmp_path, monkeypatch):
    """Batches padded up to their shape bucket (columns, and rows the loss ignores) give the losses and gradient
    norms of the same batches unpadded, step by step (fp32, no dropout: padding draws other dropout masks)."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    steps = ("--max_steps", "8", "--logging_steps", "1", "--use_cpu")
    trainer, seen = bucketed_run(monkeypatch, corpus, tmp_path / "bucketed", *steps)
    declared = set(trainer.batch_sampler.shape_buckets.shapes)
    assert {inputs for inputs, labels in seen.shapes} <= declared and all(a == b for a, b in seen.shapes)
    assert seen.padding_rows > 0  # rows of ignored labels were there, and left the loss as it was
    losses, norms = logged(trainer, "loss"), logged(trainer, "grad_norm")
    assert len(losses) == len(norms) == 8

    monkeypatch.setattr(vaswani.trainer.ShapePaddedCollator, "__call__", lambda self, features: self.collator(features))
    trainer, seen = bucketed_run(monkeypatch, corpus, tmp_path / "unpadded", *steps)
    assert not {inputs for inputs, labels in seen.shapes} <= declared  # the same batches, at their own widths
    torch.testing.assert_close(logged(trainer, "loss"), losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logged(trainer, "grad_norm"), norms, rtol=1e-4, atol=1e-6)


def test_shape_buckets_compile_one_graph_per_shape_before_the_clock(tmp_path, monkeypatch):
    """--torch_compile with shape buckets over batches of many lengths: every batch trained on takes a declared
    shape, and Dynamo builds one static graph per shape before the clock starts, none while training, no break."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    trainer, seen = bucketed_run(monkeypatch, corpus, tmp_path / "out", "--max_steps", "30", "--use_cpu",
                                 "--torch_compile", "--torch_compile_backend", "eager", "--logging_steps", "10")
    declared = trainer.batch_sampler.shape_buckets.shapes
    assert len(declared) == 3
    assert {inputs for inputs, labels in seen.shapes} == set(declared) and all(a == b for a, b in seen.shapes)
    assert seen.graphs == {"begin": 3, "end": 3, "breaks": 0}
    assert trainer.compile_seconds > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shape_buckets_as_cuda_graphs_train_as_eager_does(tmp_path, monkeypatch):
    """On CUDA, --torch_compile_mode reduce-overhead with shape buckets (each shape's step recorded as a CUDA graph
    before the clock, replayed while training) gives the losses of the uncompiled step on the same batches."""
    from torch._dynamo.utils import counters

    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    steps = ("--max_steps", "12", "--logging_steps", "1", "--dataloader_pin_memory", "true")
    trainer, seen = bucketed_run(monkeypatch, corpus, tmp_path / "graphs", *steps, "--torch_compile",
                                 "--torch_compile_mode", "reduce-overhead")
    assert trainer.args.device.type == "cuda"
    assert seen.graphs["begin"] == seen.graphs["end"] == len(trainer.batch_sampler.shape_buckets.shapes)
    assert counters["inductor"]["cudagraph_skips"] == 0
    graphed = logged(trainer, "loss")
    trainer, _ = bucketed_run(monkeypatch, corpus, tmp_path / "eager", *steps)
    torch.testing.assert_close(graphed, logged(trainer, "loss"), rtol=1e-3, atol=1e-4)


def test_a_run_logs_only_what_its_loggers_take(tmp_path, monkeypatch, caplog):
    """The Trainer's loggers (TensorBoard's, as the main job reports to) take numbers and strings; anything else
    they drop with a warning of their own. Every logged entry holds only those, and the list naming the slow steps
    is in metrics.json alone."""
    trainers = []

    class Trainer(VaswaniSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", Trainer)
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=100)
    arguments = train_args(corpus, tmp_path / "out", "--max_steps", "4", "--logging_steps", "2", "--use_cpu",
                           "--max_test_samples", "2", "--generation_num_beams", "1")
    arguments[arguments.index("--report_to") + 1] = "tensorboard"
    with caplog.at_level("WARNING"):
        script_main("train_translation")(arguments)
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("transformers")]
    logged = [(name, value) for entry in trainers[-1].state.log_history for name, value in entry.items()]
    assert any(name == "train_slow_steps" for name, _ in logged)
    assert [(name, value) for name, value in logged if not isinstance(value, (int, float, str))] == []
    assert isinstance(json.loads((tmp_path / "out" / "metrics.json").read_text())["train_slow_steps_named"], list)
