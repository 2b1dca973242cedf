"""The training run's callbacks (`vaswani.training_callbacks`) on their shared clock (`vaswani.training_clock`): the
time budget and its learning-rate schedule, interval checkpoints and the weight average."""

import re

import pytest
import torch

from training_script import run_script, synthetic_corpus, train_args


def test_the_learning_rate_decays_over_the_time_budget(tmp_path):
    """--lr_decay_over_time_budget: warm-up in steps, then linear (or cosine) decay of the budget's spent part,
    reaching zero as the budget runs out, instead of decaying over --max_steps, which a timed run never reaches."""
    from vaswani import VaswaniForConditionalGeneration
    from vaswani.trainer import VaswaniSeq2SeqTrainer
    from vaswani.training_arguments import VaswaniTrainingArguments
    from vaswani.training_callbacks import TimeBudgetCallback

    from conftest import tiny_config

    for kind, halfway in (("linear", 0.5), ("cosine", 0.5), ("linear", 0.25)):
        args = VaswaniTrainingArguments(output_dir=str(tmp_path), max_train_time=100, lr_scheduler_type=kind,
                                        lr_decay_over_time_budget=True, warmup_steps=4, learning_rate=1.0,
                                        max_steps=100000, report_to="none", use_cpu=True)
        budget = TimeBudgetCallback(args.max_train_time)
        trainer = VaswaniSeq2SeqTrainer(model=VaswaniForConditionalGeneration(tiny_config()), args=args,
                                        time_budget=budget)
        trainer.create_optimizer()
        scheduler = trainer.create_scheduler(num_training_steps=100000)
        rates = []
        for step in range(1, 7):
            trainer.optimizer.step()
            scheduler.step()
            rates.append(scheduler.get_last_lr()[0])
        assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and rates[4:] == pytest.approx([1.0, 1.0])
        budget.fraction = halfway
        trainer.optimizer.step()
        scheduler.step()
        expected = 1 - halfway if kind == "linear" else 0.5 * (1 + torch.cos(torch.tensor(torch.pi * halfway))).item()
        assert scheduler.get_last_lr()[0] == pytest.approx(expected)
        budget.fraction = 1.0
        trainer.optimizer.step()
        scheduler.step()
        assert scheduler.get_last_lr()[0] == 0.0


def timed_run(clock, budget, interval, now: list, seconds_per_step: float, steps: range):
    """The budget and interval callbacks over `steps`, each taking `seconds_per_step` on `now`, the clock's time
    source: (the budget's spent share and the interval's start when training begins, the steps that saved, the step
    that stopped training)."""
    from transformers import TrainerControl, TrainerState

    from vaswani.training_arguments import VaswaniTrainingArguments

    args, state = VaswaniTrainingArguments(output_dir="unused", use_cpu=True, report_to="none"), TrainerState()
    state.max_steps, state.global_step = 100, steps.start - 1
    clock.start(state)  # the trainer's StartTheClockCallback, before every callback that reads the clock
    for callback in (budget, interval):
        callback.on_train_begin(args, state, TrainerControl())
    begun, saved = (budget.fraction, interval.last), []
    for step in steps:
        now[0] += seconds_per_step
        state.global_step, control = step, TrainerControl()
        for callback in (budget, interval):
            control = callback.on_step_end(args, state, control)
        if control.should_save:
            saved.append(step)
            interval.on_save(args, state, control)
        if control.should_training_stop:
            return begun, saved, step
    return begun, saved, None


def test_the_time_callbacks_share_one_clock_reading_per_step(monkeypatch):
    """The time budget and the interval checkpoints decide on the same agreed clock (one exchange per step under
    DDP, whichever callbacks read it), and an interval counts from the step of the last checkpoint."""
    import vaswani.training_callbacks as callbacks
    import vaswani.training_clock

    now, reductions = [100.0], []
    monkeypatch.setattr(callbacks.TrainingClock, "now", staticmethod(lambda: now[0]))

    def exchange(self, seconds, first):
        reductions.append(seconds)
        return seconds

    monkeypatch.setattr(vaswani.training_clock.StepLateMaximum, "exchange", exchange)
    clock = callbacks.TrainingClock()
    budget, interval = callbacks.TimeBudgetCallback(10, clock), callbacks.IntervalCheckpointCallback(3, clock)
    _, saved, stopped = timed_run(clock, budget, interval, now, 2.0, range(1, 8))
    assert len(reductions) == stopped == 5  # one reading per step, shared by both callbacks
    assert saved == [2, 4, 5] and budget.fraction == 1.0  # 4 s, 8 s, then the budget's last step (10 s)


def test_a_resumed_clock_carries_the_budget_spent_and_the_last_checkpoint(monkeypatch):
    """Resumed at 6 s of a 10 s budget: the schedule starts at 60% of the budget, the next interval checkpoint (every
    3 s) counts from the checkpoint resumed from, and the budget stops training 4 s later."""
    import vaswani.training_callbacks as callbacks

    now = [50.0]
    monkeypatch.setattr(callbacks.TrainingClock, "now", staticmethod(lambda: now[0]))
    clock = callbacks.TrainingClock()
    budget, interval = callbacks.TimeBudgetCallback(10, clock), callbacks.IntervalCheckpointCallback(3, clock)
    clock.resume(6.0)
    (fraction, interval_start), saved, stopped = timed_run(clock, budget, interval, now, 1.0, range(7, 12))
    assert fraction == pytest.approx(0.6) and interval_start == 6.0
    assert stopped == 10 and saved == [9, 10] and clock.this_call() == 4.0


def test_the_weight_average_becomes_the_final_model():
    """--ema_decay: every step moves the average towards the weights by 1 − min(decay, (1 + n) / (10 + n)); at the
    end of training the model holds the average."""
    from vaswani import VaswaniForConditionalGeneration
    from vaswani.training_callbacks import WeightAverageCallback

    from conftest import tiny_config

    model = VaswaniForConditionalGeneration(tiny_config())
    callback = WeightAverageCallback(decay=0.9)
    callback.on_train_begin(None, None, None, model=model)
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    for n in range(1, 31):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        callback.on_step_end(None, None, None)
        weight = 1 - min(0.9, (1 + n) / (10 + n))
        for name, p in model.named_parameters():
            expected[name] += weight * (p.detach() - expected[name])
    last = {name: p.detach().clone() for name, p in model.named_parameters()}
    callback.on_train_end(None, None, None)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name])
        assert not torch.equal(p.detach(), last[name])


def test_a_timed_run_with_decay_and_averaging_ends_near_a_zero_rate(tmp_path):
    corpus = synthetic_corpus(tmp_path / "corpus.tsv")
    output_dir = tmp_path / "decayed"
    args = train_args(corpus, output_dir, "--max_steps", "100000", "--max_train_time", "4", "--logging_steps", "1",
                      "--lr_scheduler_type", "cosine", "--lr_decay_over_time_budget", "--ema_decay", "0.9")
    result = run_script("train_translation.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    rates = [float(rate) for rate in re.findall(r"'learning_rate': '?([-+.e0-9]+)", result.stderr)]
    assert len(rates) > 10, result.stderr[-2000:]
    peak = max(rates)
    assert peak == pytest.approx(3e-3, rel=0.01)
    after_peak = rates[rates.index(peak):]
    assert all(b <= a for a, b in zip(after_peak, after_peak[1:])) and after_peak[-1] < 0.1 * peak, rates
    assert (output_dir / "model.safetensors").is_file()


def test_a_resumed_run_trains_for_what_is_left_of_its_budget_on_a_clock_that_leaves_compilation_out(
        tmp_path, monkeypatch):
    """The run's one clock, on a controllable time source: the compilation before training takes 100 s and every
    step 1 s. A run of 4 steps reports 4 s of runtime and rates over those 4 s (not 104), and its checkpoint records
    them; `--resume` with `--max_train_time 10` then trains the 6 s left (steps 5 to 10) and reports the whole run's
    10 s, as `--max_steps` counts the whole run's steps."""
    import json

    import vaswani.inference
    import vaswani.training
    from vaswani.training_clock import CLOCK_FILE, TrainingClock

    from conftest import script_main

    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    now, trainers = [0.0], []
    monkeypatch.setattr(TrainingClock, "now", staticmethod(lambda: now[0]))

    class Trainer(vaswani.training.VaswaniSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

        def compile_before_the_clock(self):
            now[0] += 100.0

        def training_step(self, model, inputs, num_items_in_batch=None):
            now[0] += 1.0
            return super().training_step(model, inputs, num_items_in_batch)

    monkeypatch.setattr(vaswani.training, "VaswaniSeq2SeqTrainer", Trainer)
    corpus, output_dir = synthetic_corpus(tmp_path / "corpus.tsv", pairs=200), tmp_path / "out"
    common = ("--max_test_samples", "2", "--generation_num_beams", "1", "--use_cpu", "--save_strategy", "steps",
              "--save_steps", "4", "--include_num_input_tokens_seen", "true")
    script_main("train_translation")(train_args(corpus, output_dir, *common, "--max_steps", "4"))
    first = json.loads((output_dir / "metrics.json").read_text())
    assert first["train_steps"] == 4 and first["train_runtime"] == first["train_wall_seconds"] == 4.0
    assert first["train_steps_per_second"] == 1.0
    tokens = trainers[-1].state.num_input_tokens_seen
    assert first["train_source_tokens_per_second"] == pytest.approx(tokens / 4, abs=1e-3)
    assert json.loads((output_dir / "checkpoint-4" / CLOCK_FILE).read_text()) == {"seconds": 4.0}

    script_main("train_translation")(train_args(corpus, output_dir, *common, "--resume", "--max_steps", "100000",
                                                "--max_train_time", "10"))
    resumed = json.loads((output_dir / "metrics.json").read_text())
    assert resumed["train_steps"] == 10  # 6 more steps: the 6 s left of the budget
    assert resumed["train_runtime"] == 6.0 and resumed["train_wall_seconds"] == 10.0
    assert resumed["train_steps_per_second"] == 1.0
    more = trainers[-1].state.num_input_tokens_seen - tokens
    assert resumed["train_source_tokens_per_second"] == pytest.approx(more / 6, abs=1e-3)
    assert [entry["elapsed_seconds"] for entry in trainers[-1].state.log_history if "loss" in entry] == [10.0]


@pytest.mark.parametrize("trainer_runtime", [3.1, 9.4, 57.3])
def test_rates_on_the_clock_do_not_inherit_the_trainers_rounding(trainer_runtime):
    """The Trainer reports 4 steps (and 64 samples) over its own runtime, each rounded; rescaled to the clock's 4 s
    they are exactly 1 and 16 a second, however far the Trainer's runtime was from the clock's (a loaded machine
    takes longer outside the clock: 4 / 9.4 rounds to 0.426, and 0.426 × 9.4 / 4 to 1.001)."""
    from types import SimpleNamespace

    from vaswani.trainer import VaswaniSeq2SeqTrainer
    from vaswani.training_clock import SlowSteps

    clock = SimpleNamespace(stop=lambda: None, this_call=lambda: 4.0, elapsed=lambda: 4.0, start_tokens=0)
    trainer = SimpleNamespace(clock=clock, state=SimpleNamespace(num_input_tokens_seen=0), compile_seconds=0.0,
                              args=SimpleNamespace(torch_compile=False, compile_cache=None), slow_steps=SlowSteps())
    metrics = {"train_runtime": round(trainer_runtime, 4), "train_steps_per_second": round(4 / trainer_runtime, 3),
               "train_samples_per_second": round(64 / trainer_runtime, 3)}
    rescaled = VaswaniSeq2SeqTrainer.clocked_metrics(trainer, metrics)
    assert rescaled["train_steps_per_second"] == 1.0 and rescaled["train_samples_per_second"] == 16.0
    assert rescaled["train_runtime"] == 4.0


def test_slow_steps_are_judged_against_the_median_step_before_them_and_a_floor(caplog):
    """A step over 10× the median and over the floor is slow; the first steps, which have none before them, are
    judged against their own median once five are timed, or when training ends before that."""
    from vaswani.training_clock import SlowSteps

    slow = SlowSteps(floor=0.15)
    # A compiling first step, four usual ones, one 5× the usual, one 20×, and one 12× that the floor lets pass.
    for step, seconds in enumerate([0.5, 0.01, 0.01, 0.01, 0.01, 0.05, 0.2, 0.12], start=1):
        slow.add(step, seconds, {"input_ids": (8, 5), "labels": (8, 6)}, graphs=int(step == 1))
    assert (slow.count, round(slow.seconds, 6)) == (2, 0.7)
    # Step 1 built a graph (a recompilation); step 7 built none (a kernel's set-up, or the host waiting).
    assert slow.recompiling == 1
    assert slow.named == [{"step": 1, "seconds": 0.5, "graphs": 1}, {"step": 7, "seconds": 0.2, "graphs": 0}]
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Training step ")]
    assert [m.split(" took")[0] for m in named] == ["Training step 1", "Training step 7"]
    assert "(batch input_ids 8×5, labels 8×6; 1 graph compiled during it)" in named[0]

    short = SlowSteps(floor=0.0)
    for step, seconds in enumerate([1.0, 0.01, 0.01], start=1):
        short.add(step, seconds, {"input_ids": (1, 2)}, graphs=0)
    assert short.count == 0
    short.flush()  # training ended after three steps
    assert (short.count, short.seconds) == (1, 1.0)
