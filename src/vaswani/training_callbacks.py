"""The Trainer callbacks of a training run, each on the run's one clock (`training_clock.TrainingClock`): the time
budget, checkpoints at a time interval, the learning-rate schedule over a time budget, the weight average (EMA), the
start of the clock once the training step is compiled, and the progress bar under a time budget. Each reaches the
Trainer through `TrainerCallback`'s public hooks only."""

import logging

import torch
from tqdm.auto import tqdm
from transformers import ProgressCallback, TrainerCallback

from .training_arguments import TIME_SCHEDULES
from .training_clock import TrainingClock, compiled_graphs

logger = logging.getLogger(__name__)


class ClockCallback(TrainerCallback):
    """A callback that decides on `TrainingClock` time, `seconds` at a time. A `VaswaniSeq2SeqTrainer` hands it
    its own clock when training begins (`StartTheClockCallback`), so every such callback of a run reads one clock."""

    def __init__(self, seconds: float, clock: TrainingClock | None = None):
        self.seconds = seconds
        self.clock = clock or TrainingClock()


class TimeBudgetCallback(ClockCallback):
    """Stops training once `max_train_time` seconds have passed; the final evaluation and save follow.
    `fraction` is the part of the budget spent at the last step's end (what a schedule over the budget reads).
    Under DDP every rank stops at the same step and uses the same learning rate (the clock is the slowest rank's)."""

    fraction = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.fraction = min(self.clock.carried / self.seconds, 1.0)  # a resumed run has spent part of it

    def on_step_end(self, args, state, control, **kwargs):
        elapsed = self.clock.seconds(args, state)
        self.fraction = min(elapsed / self.seconds, 1.0)
        if elapsed >= self.seconds:
            logger.info("Time budget of %.0f s reached at step %d.", self.seconds, state.global_step)
            control.should_training_stop = True
            # A last checkpoint (for --resume) only where checkpoints were asked for; the final model is saved anyway.
            control.should_save = args.save_strategy != "no" or bool(args.save_interval_seconds)
        return control


class IntervalCheckpointCallback(ClockCallback):
    """Asks the Trainer for a checkpoint every `seconds` of training and at the last step (§6.1 writes
    checkpoints at 10-minute intervals and averages the last ones). The checkpoints are the Trainer's own, written by
    `VaswaniSeq2SeqTrainer` as every other: complete before they appear, resumable, rotated by --save_total_limit.
    An interval counts from the step of the last checkpoint (for a resumed run, the one it resumed from), on the
    clock every rank agrees on."""

    last = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = self.clock.carried

    def on_step_end(self, args, state, control, **kwargs):
        if self.clock.seconds(args, state) - self.last >= self.seconds or state.global_step >= state.max_steps:
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        self.last = self.clock.seconds(args, state)  # any checkpoint, also one of --save_steps, starts the next interval


def time_budget_schedule(optimizer, kind: str, warmup_steps: int, budget: TimeBudgetCallback):
    """A learning-rate schedule over a time budget: linear warm-up over `warmup_steps` steps, then the `kind` decay
    (`TIME_SCHEDULES`) of the part of the budget spent, read from the budget's callback. The step-based schedules
    of transformers decay over `max_steps`, which a run stopped by its budget never reaches: the epochs' step count
    can be many times the steps that fit in the budget, and the rate would end barely lowered."""
    decay = TIME_SCHEDULES[kind]

    def factor(step: int) -> float:
        warm = min(1.0, step / warmup_steps) if warmup_steps > 0 else 1.0
        return warm * max(0.0, decay(budget.fraction))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class WeightAverageCallback(TrainerCallback):
    """An exponential moving average of the weights, updated after every optimiser step and copied into the model
    when training ends, so the final evaluation, save and push use it. The decay ramps up as
    min(decay, (1 + step) / (10 + step)), so the random initial weights are forgotten quickly. The average lives
    beside the model (same device, fp32 for low-precision weights) and is not part of resumable checkpoints: a
    resumed run starts a new average from the resumed weights."""

    def __init__(self, decay: float):
        self.decay = decay
        self.average = self.parameters = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.average = [p.detach().float().clone() for p in self.parameters]
        self.updates = 0

    @torch.no_grad()
    def on_step_end(self, args, state, control, **kwargs):
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        current = [p.detach().float() if p.dtype != torch.float32 else p.detach() for p in self.parameters]
        torch._foreach_lerp_(self.average, current, 1.0 - decay)

    @torch.no_grad()
    def on_train_end(self, args, state, control, **kwargs):
        for parameter, average in zip(self.parameters, self.average):
            parameter.copy_(average)
        self.average = self.parameters = None


class StartTheClockCallback(TrainerCallback):
    """The first callback of a `VaswaniSeq2SeqTrainer`, the owner of its clock (`trainer.clock`): at the start of
    training it compiles the training step (`VaswaniSeq2SeqTrainer.compile_before_the_clock`), hands the clock to
    every callback that reads one, and starts it, before any of them runs; at the end of training it stops it.
    Compilation is then part of no time budget, rate or elapsed time."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.compile_before_the_clock()
        for callback in self.trainer.callback_handler.callbacks:
            if isinstance(callback, (ClockCallback, TimeBudgetProgressCallback)):
                callback.clock = self.trainer.clock
        self.trainer.graphs_before_the_clock = compiled_graphs()
        self.trainer.clock.start(state)

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.clock.stop()


class TimeBudgetProgressCallback(ProgressCallback):
    """The training progress bar under a time budget: it counts the budget's seconds, with the step beside them.
    The stock bar counts `max_steps`, which under a budget is only the epochs' step count (with an ETA far beyond
    the budget), not where training will stop."""

    def __init__(self, seconds: float, clock: TrainingClock | None = None):
        super().__init__()
        self.seconds = seconds
        self.clock = clock or TrainingClock()

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=round(self.seconds), bar_format="{l_bar}{bar}| {n}/{total} s [{elapsed}{postfix}]",
                                     dynamic_ncols=True)
        self.current_step = 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            elapsed = min(round(self.clock.elapsed()), self.training_bar.total)
            self.training_bar.set_postfix_str(f"step {state.global_step}", refresh=False)
            self.training_bar.update(elapsed - self.training_bar.n)

    @staticmethod
    def close_bars(trainer) -> None:
        """Close `trainer`'s open progress bar (this one or the stock one), which would otherwise redraw itself
        after an error message, at exit."""
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.close()


def callbacks_for(args) -> tuple[list[TrainerCallback], TimeBudgetCallback | None]:
    """The callbacks that a run's `VaswaniTrainingArguments` ask for (the clock-reading ones get the trainer's clock
    when training begins), and the time budget's (None without `max_train_time`), which a schedule over the budget
    reads."""
    time_budget = TimeBudgetCallback(args.max_train_time) if args.max_train_time else None
    callbacks = [time_budget] if time_budget else []
    if args.ema_decay is not None:
        callbacks.append(WeightAverageCallback(args.ema_decay))
    if args.save_interval_seconds:
        callbacks.append(IntervalCheckpointCallback(args.save_interval_seconds))
    return callbacks, time_budget
