"""`average_checkpoints`: the average of a run's last checkpoints, published as a complete checkpoint of its own
(the paper's §6.1 step; what an average is, and which checkpoints may be averaged, is `vaswani.checkpoints`'s).

It sits above both `vaswani.checkpoints` and `vaswani.hub`, whose model card and pipeline registration it writes."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from . import modeling_vaswani
from .checkpoints import TRAINER_STATE_NAME, check_checkpoint_files, check_output_dir, last_checkpoints, load_average
from .files import locking, staged_directory
from .hub import attach_translation_pipeline, write_model_card


@locking("output_dir")
def average_checkpoints(sources: Sequence[str | Path], output_dir: str | Path, last: int | None = None,
                        force: bool = False):
    """Average the last `last` checkpoints of a run directory (or the given checkpoint directories) and write a
    complete checkpoint to `output_dir`, which is refused where it is one of the inputs or a run's and replaced whole
    otherwise (`check_output_dir`, `files.staged_directory`): float32 weights, the newest checkpoint's config,
    generation config, tokenizer and module files, the translation pipeline for a translation model, and a model
    card that lists what was averaged (and reports no scores: evaluate the average itself). Every checkpoint's
    files are checked whole before any is read (`check_checkpoint_files`). Returns the averaged model."""
    checkpoints = last_checkpoints(sources, last)
    check_output_dir(output_dir, [*sources, *checkpoints], force)
    for checkpoint in checkpoints:
        check_checkpoint_files(checkpoint)
    newest = checkpoints[-1]
    architectures = AutoConfig.from_pretrained(newest).architectures or []
    model_class = getattr(modeling_vaswani, architectures[0], None) if architectures else None
    if model_class is None:
        raise ValueError(f"{newest}/config.json names no Vaswani model class (architectures={architectures}).")
    model = model_class.from_pretrained(newest, dtype=torch.float32)
    load_average(model, checkpoints)
    model.eval()

    with staged_directory(output_dir, f"-{os.getpid()}") as staging:
        if model.config.is_encoder_decoder:
            attach_translation_pipeline(model, staging)
        model.save_pretrained(staging)
        if os.path.isfile(os.path.join(newest, "tokenizer_config.json")):
            AutoTokenizer.from_pretrained(newest).save_pretrained(staging)
        # No scores: those of any checkpoint averaged are not the average's.
        write_model_card(staging, averaged_checkpoints=[_checkpoint_summary(path) for path in checkpoints])
    return model


def _checkpoint_summary(checkpoint: str) -> str:
    """`checkpoint-N` (step N, epoch E) for the model card."""
    state_file = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.isfile(state_file):
        return str(checkpoint)
    with open(state_file) as f:
        state = json.load(f)
    return f"{os.path.basename(os.path.normpath(checkpoint))} (step {state.get('global_step')}, epoch " \
           f"{state.get('epoch', 0):.2f})"
