"""Stopping on SIGTERM or SIGINT without losing work: what Slurm and Kubernetes send a job they preempt (some seconds
before SIGKILL), and Ctrl-C.

A signal handler here only records the signal. Training (`PreemptionCallback`) then writes a checkpoint at the next
step boundary and stops; file translation finishes or drops the chunk in flight, its output and resume record
agreeing either way. Both then raise `Preempted`, whose message says what is kept and the command that resumes the
run, and the scripts exit with the status a shell gives a process the signal ended (128 + the signal: 143, 130).
"""

from __future__ import annotations

import shlex
import signal
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from transformers import TrainerCallback

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """A run stopped by a signal at a point from which it resumes; the message says how."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def resume_command(command: Sequence[str]) -> str:
    """`command` (the script and its arguments) as it resumes: with --resume, without --overwrite_output_dir."""
    kept = [part for part in command if part not in ("--resume", "--overwrite_output_dir")]
    return shlex.join(["python", *kept, "--resume"])


@contextmanager
def catching_stop_signals(handler: Callable[[int], bool | None],
                          holding_after: tuple[type[BaseException], ...] = ()):
    """Call `handler(signum)` on SIGTERM and SIGINT during the block, then put the previous handlers back. Where the
    handler returns False it declines the signal, which then acts as it would have without the block (the previous
    handler, or the default action: the process ends). Where the block raises one of `holding_after` (a run that is
    over, with a line still to print: one that lost a process, whose launcher sends the survivors SIGTERM), the
    signals are ignored instead, until the process exits. Python runs signal handlers in the main thread only;
    elsewhere the block runs with the handlers as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def on_signal(signum, frame):
        if handler(signum) is not False:
            return
        before = previous[signum]
        if callable(before):
            before(signum, frame)
        elif before != signal.SIG_IGN:  # the default action (or one set outside Python): end as it would
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            signal.signal(signum, on_signal)

    previous.update({signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS})
    held = False
    try:
        yield
    except holding_after:
        held = True
        raise
    finally:
        for signum, old in previous.items():
            signal.signal(signum, signal.SIG_IGN if held else old)


class StepLateMaximum:
    """The largest of a value every process posts at every step's end, read at the next step's end, without a wait:
    what several processes must agree on to act after the same step (stop, save) when each sees the value at its
    own moment (a signal's arrival, its clock). Each posts its value to an all-reduce on a CPU (gloo) group of its
    own, without waiting, and reads the result of the one before, long complete by then: every process reads the same
    value after the same step, with no read from the device and no wait on the others beyond the step's own. A lone
    process reads its own value at once."""

    def __init__(self):
        self._group = self._value = self._shared = self._posted = None

    def start(self) -> None:
        """Called by every process at the start of training (making the group is a collective)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")
            # What the all-reduce reads and writes: one tensor, read and refilled through a NumPy view of its memory
            # (no tensor is read or made at a step). The tensor owns the memory, not the view: a tensor over NumPy's
            # memory holds a Python object, which gloo's threads would have to release, at the interpreter's exit too.
            self._shared = torch.zeros(1, dtype=torch.float64)
            self._value = self._shared.numpy()

    def exchange(self, value: float, first: float) -> float:
        """Post `value`; the largest value posted at the previous exchange (`first` at the first), or `value`
        itself in a lone process."""
        if self._group is None:
            return value
        agreed = first
        if self._posted is not None:
            self._posted.wait()
            agreed = float(self._value[0])
        self._value[0] = value
        self._posted = dist.all_reduce(self._shared, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def finish(self) -> None:
        """Wait for the last exchange (every process posted it after the last step, so this completes at once):
        no collective is left in flight when training ends."""
        if self._posted is not None:
            self._posted.wait()
            self._posted = None


class PreemptionCallback(TrainerCallback):
    """On SIGTERM or SIGINT (`request`, the handler, only records it), the Trainer writes a checkpoint at the next
    step's end and stops; `stopped_by` then holds the signal.

    Under several processes the signal reaches each at its own moment, yet all must stop after the same step (the
    checkpoint is a collective): they agree on the largest signal recorded by the step before (`StepLateMaximum`)."""

    def __init__(self):
        self.signum = 0
        self.stopped_by = 0
        self.listening = False
        self._agreement = StepLateMaximum()

    def request(self, signum: int) -> bool:
        """The handler: records the signal while `listening` (training, and a failed training's way out, where a
        peer's end is being worked out), else declines it (False), so that it acts as it would without this."""
        if self.listening:
            self.signum = self.signum or signum
        return self.listening

    def on_train_begin(self, args, state, control, **kwargs):
        self.stopped_by = 0
        self._agreement.start()

    def on_step_end(self, args, state, control, **kwargs):
        signum = int(self._agreement.exchange(self.signum, first=0))
        if signum:
            self.stopped_by = signum
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._agreement.finish()

    def stopped(self, output_dir: str, step: int, command: Sequence[str]) -> Preempted:
        """The error that ends a run this callback stopped: where its checkpoint is and how to resume."""
        how = f"with: {resume_command(command)}" if command else "with the same arguments and --resume"
        return Preempted(self.stopped_by, f"Training stopped by {signal_name(self.stopped_by)} after step {step}; "
                         f"its checkpoint is {output_dir}/checkpoint-{step}. Resume it {how}")
