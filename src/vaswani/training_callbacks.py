"""The Trainer callbacks of a training run: the run's one clock, which every time budget, rate and elapsed time
reads (the same on every DDP rank, carried over a resume), the time budget, checkpoints at a time interval, the
learning-rate schedule over a time budget, the weight average (EMA), the start of the clock once the training step
is compiled, and the progress bar under a time budget. Each reaches the Trainer through `TrainerCallback`'s public
hooks only. Beside them, what the trainer's own step reports: the graphs torch.compile has built (`compiled_graphs`)
and the steps far slower than the rest (`SlowSteps`)."""

import json
import logging
import os
import statistics
import time
from collections import deque

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import ProgressCallback, TrainerCallback

from .training_arguments import TIME_SCHEDULES

logger = logging.getLogger(__name__)


class TrainingClock:
    """The run's one clock: seconds of training, counted from the end of the training step's compilation
    (`StartTheClockCallback` starts it) to the end of training, plus the seconds of the run's earlier parts where a
    run resumes from a checkpoint (`carried`, read from the checkpoint's `CLOCK_FILE`). The time budget, the interval
    checkpoints, the schedule over the budget, the progress bar, the logged `elapsed_seconds` and the final metrics'
    runtimes and rates all read it, so a resumed run trains for what is left of `--max_train_time`, as `--max_steps`
    counts the steps of the whole run.

    Decisions (stop at the budget, write an interval checkpoint) read `seconds`, the slowest DDP rank's, all-reduced
    once per step however many callbacks read it, so that every rank decides alike; reports read `elapsed`, this
    process' own, which costs no communication."""

    now = staticmethod(time.monotonic)  # the time source (a test may put a controllable one here)

    def __init__(self):
        self.carried = 0.0
        self._start = self._stop = None
        self._step, self._seconds = None, 0.0
        self.start_tokens = 0

    def resume(self, seconds: float) -> None:
        """Count the run's `seconds` before this call of `train()` (0 for a run that starts from scratch)."""
        self.carried = seconds

    def start(self, state) -> None:
        """Start counting now; `state`'s input-token count (the Trainer's, at the start) is where this call's begins."""
        self._start, self._stop = self.now(), None
        self._step, self._seconds = None, self.carried
        self.start_tokens = state.num_input_tokens_seen

    def stop(self) -> None:
        """Stop counting (training has ended): the evaluation and save that follow are not training time."""
        if self._start is not None and self._stop is None:
            self._stop = self.now()

    @property
    def started(self) -> bool:
        return self._start is not None

    def elapsed(self) -> float:
        """This process' seconds of the whole run, the earlier parts of a resumed run included."""
        if self._start is None:
            return self.carried
        return self.carried + ((self._stop if self._stop is not None else self.now()) - self._start)

    def this_call(self) -> float:
        """The seconds of training in this call of `train()`."""
        return self.elapsed() - self.carried

    def seconds(self, args, state) -> float:
        """The slowest rank's `elapsed`, measured once per global step."""
        if state.global_step != self._step:
            self._seconds = slowest_rank(self.elapsed(), args)
            self._step = state.global_step
        return self._seconds


# The clock's seconds at a checkpoint, inside the checkpoint, read back by a run that resumes from it.
CLOCK_FILE = "run_clock.json"


def write_clock(directory: str, clock: TrainingClock) -> None:
    """Record `clock`'s seconds in the checkpoint being written in `directory` (a staged one: it is published
    whole, so this file is never seen without the rest)."""
    with open(os.path.join(directory, CLOCK_FILE), "w") as f:
        json.dump({"seconds": clock.elapsed()}, f)


def read_clock(checkpoint: str) -> float:
    """The run's seconds when `checkpoint` was written; 0 for a checkpoint that records none (written before the
    clock was recorded), whose run then gets its whole budget again."""
    path = os.path.join(checkpoint, CLOCK_FILE)
    if not os.path.isfile(path):
        logger.warning("%s records no training time; the resumed run counts its time budget from zero.", checkpoint)
        return 0.0
    with open(path, encoding="utf-8") as f:
        return float(json.load(f)["seconds"])


def slowest_rank(seconds: float, args) -> float:
    """The largest of every DDP rank's `seconds`."""
    if dist.is_available() and dist.is_initialized():
        shared = torch.tensor(seconds, dtype=torch.float64, device=args.device if args.device.type == "cuda" else "cpu")
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        seconds = float(shared.item())
    return seconds


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


def compiled_graphs() -> int:
    """The graphs torch.compile (Dynamo) has built in this process so far: a count kept on the host."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def compile_cache_hits() -> int:
    """The compiled graphs torch.compile has taken from its caches in this process so far instead of generating
    them: AOTAutograd's (a whole forward and backward) and Inductor's (one graph's code)."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]


class SlowSteps:
    """The training steps whose forward and backward took far longer than the steps before them: on a GPU a step
    waits on the host while torch.compile builds a graph, a kernel library builds a plan for a shape new to it, or
    an autotuner times its candidates, each a cost that a step rate averaged over minutes hides. A step is slow when
    it took over `factor` times the median of up to the `window` steps before it and at least `floor` seconds; the
    first `first` steps have no steps before them, so they are judged once that many are timed, against their own
    median. Each slow step is logged as it is found (the first `warnings`), with its batch's shape and the graphs
    torch.compile built during it, which tell the causes apart; `count` and `seconds` sum them all. Host clocks
    only: nothing is read back from the device."""

    def __init__(self, factor: float = 10.0, floor: float = 1.0, window: int = 100, first: int = 5,
                 warnings: int = 20):
        self.factor, self.floor, self.first, self.warnings = factor, floor, first, warnings
        self.recent = deque(maxlen=window)
        self.pending = []
        self.count, self.seconds = 0, 0.0

    def add(self, step: int, seconds: float, shapes: dict[str, tuple], graphs: int) -> None:
        """Times step `step` (1-based): `seconds` on the host, `shapes` its batch's (by input name), `graphs` built
        during it."""
        if len(self.recent) < self.first:
            self.pending.append((step, seconds, shapes, graphs))
            self.recent.append(seconds)
            if len(self.recent) == self.first:
                self.flush()
            return
        self._judge(step, seconds, shapes, graphs, statistics.median(self.recent))
        self.recent.append(seconds)

    def flush(self) -> None:
        """Judges the first steps, against their own median: when `first` are timed, or when training ends first."""
        if self.pending:
            usual = statistics.median(seconds for _, seconds, _, _ in self.pending)
            for entry in self.pending:
                self._judge(*entry, usual)
            self.pending = []

    def _judge(self, step: int, seconds: float, shapes: dict[str, tuple], graphs: int, usual: float) -> None:
        if seconds < self.floor or seconds <= self.factor * usual:
            return
        usual = max(usual, 1e-9)  # a clock too coarse for the usual step
        self.count += 1
        self.seconds += seconds
        if self.count <= self.warnings:
            logger.warning("Training step %d took %.2f s in its forward and backward, %.0f× the median step's %.3f s "
                           "(batch %s; %d graph%s compiled during it)%s.", step, seconds, seconds / usual, usual,
                           ", ".join(f"{name} {'×'.join(map(str, shape))}" for name, shape in shapes.items()), graphs,
                           "" if graphs == 1 else "s",
                           "; later slow steps are only counted" if self.count == self.warnings else "")


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
