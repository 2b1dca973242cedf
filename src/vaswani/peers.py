"""The other processes of a launch (torchrun, accelerate launch), and how a run ends when one of them dies: killed
by the out-of-memory killer, a lost node, a crash.

A gloo collective whose peer has gone raises at once ("Connection closed by peer"), and torchrun then stops the
rest of the launch; left alone, every survivor would print that collective's traceback, and nothing would say which
process died or what is kept. Instead each process learns its peers' host and process id when the run starts
(`Peers.gather`, one collective); on an error (or a stop signal: torchrun's agent sends SIGTERM to the survivors) it
looks for the one that has ended (`Peers.lost`), and the run ends with `PeerLost`, whose one line names it and says
what is kept. A process on another machine cannot be looked at; its end is told by gloo's message.

The group's start and end are one place too (`ending_process_group`, around a run: training, where the Trainer
starts the group, and file translation, which starts its own). It ends after a barrier where the run ended normally,
so that no process tears its group down while another still uses it, and none leaves before the others are done: a
process that has finished its share waits there, running, instead of exiting, so that a peer that looks for ended
processes never takes a finished one for a lost one. Then `destroy_process_group`, never left to the
interpreter's exit, where gloo's threads can abort a process whose work is done ("terminate called without an
active exception"). `destroy_process_group` only forgets the group: whatever else holds it keeps it, with its
threads, alive. The finished Trainer is such a holder (its DDP wrapper's reducer holds the group), and it lives in
reference cycles that only the garbage collector frees, which left alone it does at the interpreter's exit; so the
group's end collects them first.

A process that has found a lost peer is ending: its run holds the stop signals from then on (`catching_stop_signals`'
`holding_after`), since the launcher's SIGTERM to the survivors would otherwise end it before its line is printed.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from .preemption import Preempted

# What gloo's TCP transport says when the other end of a connection has gone.
LOST_CONNECTION = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class PeerLost(Exception):
    """Another process of the launch ended while this one needed it; the message names it and what is kept."""

    exit_status = 1


def peer_lost(ended: str, run: str, rank: int, kept: str) -> PeerLost:
    """The error that ends process `rank` of a `run` ("run", "translation", "evaluation") that lost the process
    `ended` describes (`Peers.lost`): one line naming it, then what is kept and how to go on (`kept`)."""
    return PeerLost(f"{ended} of this {run} ended (killed or crashed), so process {rank} stops too; {kept}")


def is_running(pid: int) -> bool:
    """Whether process `pid` (on this machine) runs: neither gone nor a zombie its parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel whether the process exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@dataclass(frozen=True)
class Peers:
    """Every process of the launch, by rank: its host and process id; `rank` is this one's."""

    rank: int
    processes: tuple[tuple[str, int], ...]

    @classmethod
    def gather(cls) -> Peers | None:
        """The launch's processes (a collective: every process calls it), or None for a single process."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        processes = [None] * dist.get_world_size()
        dist.all_gather_object(processes, (socket.gethostname(), os.getpid()))
        return cls(dist.get_rank(), tuple(map(tuple, processes)))

    def ended(self) -> str | None:
        """The first process of this machine that has ended, described ("process 1 of 2 (pid 9074)"), or None."""
        host = socket.gethostname()
        for rank, (peer_host, pid) in enumerate(self.processes):
            if rank != self.rank and peer_host == host and not is_running(pid):
                return f"process {rank} of {len(self.processes)} (pid {pid})"
        return None

    def lost(self, error: BaseException | None = None, wait: float = 5.0) -> str | None:
        """The process whose end explains `error` (None: a stop signal), described, or None where every process
        still runs. A killed process closes its connections as it exits, a moment before it is seen to have ended:
        wait up to `wait` seconds for that."""
        if error is not None and not isinstance(error, RuntimeError):  # not what a failed collective raises
            return self.ended()
        deadline = time.monotonic() + wait
        while (ended := self.ended()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if ended is None and error is not None and any(text in str(error) for text in LOST_CONNECTION):
            return f"a process of the {len(self.processes)} on another machine"
        return ended


@contextmanager
def ending_process_group(rank: int = 0, world_size: int = 1):
    """Run the block, then end the process group (`end_process_group`): after a barrier where the block returned or
    was preempted (every process stops after the same step, or at the end of its share), at once where it failed.
    Where `world_size` is above 1 and no group is started yet, the block runs in a gloo group started here (file
    translation: the Trainer starts its own)."""
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        # Long: slow chunks may keep a process busy for hours between two collectives (the start and the end).
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(hours=24))
    try:
        yield
    except Preempted:
        end_process_group(completed=True)
        raise
    except BaseException:
        end_process_group(completed=False)
        raise
    end_process_group(completed=True)


def end_process_group(completed: bool) -> None:
    """Destroy the process group, if one was started: where the run `completed` (every process got here the same
    way) after a barrier, so that none tears the group down while another still uses it; after an error at once,
    since the others may be gone or elsewhere."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if completed:
        barrier()
    gc.collect()  # the run's cycles that hold the group (a finished Trainer's DDP wrapper), freed while Python is whole
    dist.destroy_process_group()


def barrier() -> None:
    """Wait for every process of the launch (nothing to wait for in a single process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gathered(share: list, world_size: int) -> list:
    """One list, in order, from every process's `share`, where process r holds the items r, r + world_size, …
    (a collective: every process calls it, and every process gets the whole list)."""
    if world_size == 1:
        return share
    parts = [None] * world_size
    dist.all_gather_object(parts, share)
    return [parts[i % world_size][i // world_size] for i in range(sum(map(len, parts)))]
