"""Reads of a tensor's value by Python, as the no-host-sync tests count them beside their dispatch-level counts.

A dispatch mode sees the ops a read dispatches (`_local_scalar_dense` for `.item()` and `bool()`), but on a CPU
`.tolist()`, `.numpy()` and `.cpu()` dispatch none: the values are in host memory already. On an accelerator each of
them makes the host wait for the device. A function mode sees the Tensor methods where Python calls them, on any
device, so a read put into a step fails the test on the CPU too."""

import collections
import traceback
from pathlib import Path

from torch.overrides import TorchFunctionMode

# Tensor methods that hand a value to the host. `.to()` is not among them: on a CPU run the batch's own move to the
# run's device is a `.to("cpu")`, indistinguishable from a read.
READ_BACK_METHODS = {"tolist", "numpy", "cpu", "item", "__bool__", "__int__", "__float__", "__index__"}


def caller(depth: int = 8) -> str:
    """The code that made the call being handled, innermost last: `file:line <- file:line ...`."""
    return " <- ".join(f"{Path(frame.filename).name}:{frame.lineno}" for frame in traceback.extract_stack()[-depth:-2])


class PythonReads(TorchFunctionMode):
    """Counts the calls of `READ_BACK_METHODS` (`reads`, each with its caller) while `active`."""

    def __init__(self):
        super().__init__()
        self.reads, self.active = collections.Counter(), True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.active and getattr(func, "__name__", None) in READ_BACK_METHODS:
            self.reads[f"{func.__name__} at {caller()}"] += 1
        return func(*args, **(kwargs or {}))
