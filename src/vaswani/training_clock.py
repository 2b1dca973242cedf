"""The run's one clock, which every time budget, rate and elapsed time reads (the same on every DDP rank, recorded in
each checkpoint and carried over a resume), and what the trainer's own step reports beside it: the graphs
torch.compile has built (`compiled_graphs`) and the steps far slower than the rest (`SlowSteps`)."""

import json
import logging
import os
import statistics
import time
from collections import deque

from .preemption import StepLateMaximum

logger = logging.getLogger(__name__)


class TrainingClock:
    """The run's one clock: seconds of training, counted from the end of the training step's compilation
    (`StartTheClockCallback` starts it) to the end of training, plus the seconds of the run's earlier parts where a
    run resumes from a checkpoint (`carried`, read from the checkpoint's `CLOCK_FILE`). The time budget, the interval
    checkpoints, the schedule over the budget, the progress bar, the logged `elapsed_seconds` and the final metrics'
    runtimes and rates all read it, so a resumed run trains for what is left of `--max_train_time`, as `--max_steps`
    counts the steps of the whole run.

    Decisions (stop at the budget, write an interval checkpoint) read `seconds`, the slowest DDP rank's, agreed once
    per step however many callbacks read it, so that every rank decides alike after the same step; under DDP it is
    the slowest rank's time at the end of the step before (`StepLateMaximum`: no wait, no read from the device).
    Reports read `elapsed`, this process' own, which costs no communication."""

    now = staticmethod(time.monotonic)  # the time source (a test may put a controllable one here)

    def __init__(self):
        self.carried = 0.0
        self._start = self._stop = None
        self._step, self._seconds = None, 0.0
        self.start_tokens = 0
        self._slowest = StepLateMaximum()

    def resume(self, seconds: float) -> None:
        """Count the run's `seconds` before this call of `train()` (0 for a run that starts from scratch)."""
        self.carried = seconds

    def start(self, state) -> None:
        """Start counting now; `state`'s input-token count (the Trainer's, at the start) is where this call's begins."""
        self._slowest.start()
        self._start, self._stop = self.now(), None
        self._step, self._seconds = None, self.carried
        self.start_tokens = state.num_input_tokens_seen

    def stop(self) -> None:
        """Stop counting (training has ended): the evaluation and save that follow are not training time."""
        if self._start is not None and self._stop is None:
            self._stop = self.now()
        self._slowest.finish()

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
        """The slowest rank's `elapsed`, measured once per global step: in a lone process its own now; under DDP
        the slowest rank's at the end of the step before (at the first step of this call: the seconds carried over,
        which every rank read from the same checkpoint)."""
        if state.global_step != self._step:
            self._seconds = self._slowest.exchange(self.elapsed(), first=self.carried)
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
    torch.compile built during it, which tell the causes apart; `count` and `seconds` sum them all, `recompiling`
    counts those during which torch.compile built a graph (the others waited on a kernel's set-up or the host), and
    `named` keeps the logged ones' step, seconds and graphs for the run's metrics. Host clocks only: nothing is read
    back from the device."""

    def __init__(self, factor: float = 10.0, floor: float = 1.0, window: int = 100, first: int = 5,
                 warnings: int = 20):
        self.factor, self.floor, self.first, self.warnings = factor, floor, first, warnings
        self.recent = deque(maxlen=window)
        self.pending = []
        self.count, self.seconds, self.recompiling = 0, 0.0, 0
        self.named = []

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
        self.recompiling += graphs > 0
        if self.count <= self.warnings:
            self.named.append({"step": step, "seconds": round(seconds, 2), "graphs": graphs})
            logger.warning("Training step %d took %.2f s in its forward and backward, %.0f× the median step's %.3f s "
                           "(batch %s; %d graph%s compiled during it)%s.", step, seconds, seconds / usual, usual,
                           ", ".join(f"{name} {'×'.join(map(str, shape))}" for name, shape in shapes.items()), graphs,
                           "" if graphs == 1 else "s",
                           "; later slow steps are only counted" if self.count == self.warnings else "")
