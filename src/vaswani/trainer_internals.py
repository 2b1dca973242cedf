"""Every use of transformers' and accelerate's private or undocumented behaviour, in one place.

The rest of the package uses the Trainer through its public extension points (callbacks, `create_scheduler`,
`get_train_dataloader`, `training_step`, `log`, arguments). Three things have no public way:

* crash-safe checkpoints. The Trainer writes `checkpoint-N` file by file, where a crash leaves a directory that
  looks like a checkpoint. `StagedCheckpoints` points the Trainer's `_save_checkpoint` at a staging directory
  (through `_get_output_dir`) and publishes the finished checkpoint with `files.staged_directory`;
* dropping the columns the model does not take from a dataset we batch ourselves (`_remove_unused_columns`);
* a prepared data loader over our own batch sampler: Accelerate must not even the batches out (the sampler already
  gives every process as many), and accelerate 1.6 does not hand the epoch on to a batch sampler it wraps.

`UPSTREAM_CONTRACT` lists each private name relied on with the signature it must have, and `check_upstream_contract`
names any that an installed release has changed (tests/test_trainer_internals.py runs it), so an upgrade that
breaks one fails loudly instead of writing checkpoints that are no longer staged.
"""

from __future__ import annotations

import inspect
import os
from contextlib import nullcontext

from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from .files import staged_directory, staging_path
from .run_directory import kept_after_a_full_disk

# (owner, name) → the parameters it must take; None for a property that must be settable.
UPSTREAM_CONTRACT = {
    (Trainer, "_get_output_dir"): ("self", "trial"),
    (Trainer, "_save_checkpoint"): ("self", "model", "trial"),
    (Trainer, "_remove_unused_columns"): ("self", "dataset", "description"),
    (Accelerator, "even_batches"): None,
}


def check_upstream_contract(contract: dict = UPSTREAM_CONTRACT, trainer: type = Trainer) -> list[str]:
    """What an installed release no longer offers of `contract`, one line per name (empty where all holds), and
    whether `trainer`'s `_save_checkpoint` still writes into `_get_output_dir`, which the staging relies on."""
    problems = []
    for (owner, name), parameters in contract.items():
        where = f"{owner.__module__}.{owner.__name__}.{name}"
        member = inspect.getattr_static(owner, name, None)
        if member is None:
            problems.append(f"{where} no longer exists")
        elif parameters is None:
            if not isinstance(member, property) or member.fset is None:
                problems.append(f"{where} is no longer a settable property")
        elif not callable(member):
            problems.append(f"{where} is no longer a method")
        elif tuple(inspect.signature(member).parameters) != parameters:
            problems.append(f"{where} now takes {tuple(inspect.signature(member).parameters)}, not {parameters}")
    save = inspect.getattr_static(trainer, "_save_checkpoint", None)
    if callable(save) and "self._get_output_dir(" not in inspect.getsource(save):
        problems.append(f"{trainer.__module__}.{trainer.__name__}._save_checkpoint no longer writes into "
                        "self._get_output_dir(trial)")
    return problems


class StagedCheckpoints(Trainer):
    """A Trainer whose checkpoints are never visible half-written: each is written into a hidden staging directory
    beside it (`.tmp-checkpoint-N/checkpoint-N`) and renamed to `checkpoint-N` once complete, then the old ones are
    rotated. A crash leaves only the staging directory, which `--resume` ignores and removes. Subclasses say what
    else a checkpoint needs through `before_checkpoint` and `finish_checkpoint` (both public)."""

    _staging_run_dir = None

    def before_checkpoint(self) -> None:
        """Called on every process before a checkpoint is written."""

    def finish_checkpoint(self, directory: str) -> None:
        """Called on the saving process with the complete staged checkpoint, before it is published."""

    def unused_columns_removed(self, dataset, description: str):
        """`dataset` without the columns the model's forward does not take (as the Trainer's own loaders have it)."""
        return self._remove_unused_columns(dataset, description=description)

    def _get_output_dir(self, trial) -> str:
        return self._staging_run_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        self.before_checkpoint()
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        # Every process writes its part (its RNG state) into the staging directory; the saving one creates it and
        # publishes the checkpoint when the block ends, over one left by an earlier run at this step (see
        # prepare_output_dir). A failure leaves it, as a crash would, for `--resume` to remove: other processes may
        # still be writing into it.
        staged = staged_directory(final, nested=True, remove_on_error=False,
                                  kept=lambda: kept_after_a_full_disk(run_dir)) if self.args.should_save else \
            nullcontext(staging_path(final))
        with staged as staging_root:
            self.accelerator.wait_for_everyone()
            # The Trainer writes `<run_dir>/checkpoint-N`; pointing it at the staging root makes that the staged copy.
            self._staging_run_dir = str(staging_root)
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging_run_dir = None
            # The Trainer looked for the best checkpoint among the staged ones, where only this step's can be.
            if self.state.best_global_step:
                best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
                if self.state.best_global_step == self.state.global_step or os.path.isdir(best):
                    self.state.best_model_checkpoint = best
            self.accelerator.wait_for_everyone()  # every process has written its RNG state
            if self.args.should_save:
                staged_checkpoint = os.path.join(staging_root, name)
                self.finish_checkpoint(staged_checkpoint)
                self.state.save_to_json(os.path.join(staged_checkpoint, TRAINER_STATE_NAME))  # the corrected best
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()


def prepare_uneven_loader(accelerator: Accelerator, loader: DataLoader):
    """`accelerator.prepare(loader)` for a loader whose batch sampler already gives every process the same number
    of batches, so Accelerate must not even them out by repeating batches (accelerate 1.6, the oldest supported,
    refuses to try without a batch size). The prepared loader hands its epoch to that batch sampler too: accelerate
    1.6 hands it only to the sampler it shards with, so without this every epoch would have the same batch order."""
    even_batches, accelerator.even_batches = accelerator.even_batches, False
    try:
        prepared = accelerator.prepare(loader)
    finally:
        accelerator.even_batches = even_batches
    set_epoch, batches = prepared.set_epoch, loader.batch_sampler

    def set_epoch_everywhere(epoch: int) -> None:
        set_epoch(epoch)
        batches.set_epoch(epoch)

    prepared.set_epoch = set_epoch_everywhere
    return prepared
