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
def catching_stop_signals(handler: Callable[[int], None]):
    """Call `handler(signum)` on SIGTERM and SIGINT during the block, then put the previous handlers back. Python
    runs signal handlers in the main thread only; elsewhere the block runs with the handlers as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, lambda signum, frame: handler(signum)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


class PreemptionCallback(TrainerCallback):
    """On SIGTERM or SIGINT (`request`, the handler, only records it), the Trainer writes a checkpoint at the next
    step's end and stops; `stopped_by` then holds the signal.

    Under several processes the signal reaches each at its own moment, yet all must stop after the same step (the
    checkpoint is a collective). Each therefore posts its flag to an all-reduce at every step's end, on a CPU (gloo)
    group of its own, without waiting, and reads at the next step's end the result of the one before, long complete
    by then: every process reads the same value after the same step, with no read from the device and no wait on
    the other processes beyond the step's own. A lone process reads its flag, a Python attribute."""

    def __init__(self):
        self.signum = 0
        self.stopped_by = 0
        self._group = self._flag = self._posted = None

    def request(self, signum: int) -> None:
        self.signum = self.signum or signum

    def on_train_begin(self, args, state, control, **kwargs):
        self.stopped_by = 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")

    def on_step_end(self, args, state, control, **kwargs):
        signum = self._agreed() if self._group is not None else self.signum
        if signum:
            self.stopped_by = signum
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._posted is not None:  # every process posted after the last step, so this completes at once
            self._posted.wait()
            self._posted = None

    def _agreed(self) -> int:
        """The largest signal any process had recorded by the previous step's end (0: none), and post this one's."""
        agreed = 0
        if self._posted is not None:
            self._posted.wait()
            agreed = int(self._flag.item())  # a CPU tensor: no device read
        self._flag = torch.tensor([self.signum], dtype=torch.int64)
        self._posted = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def stopped(self, output_dir: str, step: int, command: Sequence[str]) -> Preempted:
        """The error that ends a run this callback stopped: where its checkpoint is and how to resume."""
        how = f"with: {resume_command(command)}" if command else "with the same arguments and --resume"
        return Preempted(self.stopped_by, f"Training stopped by {signal_name(self.stopped_by)} after step {step}; "
                         f"its checkpoint is {output_dir}/checkpoint-{step}. Resume it {how}")
