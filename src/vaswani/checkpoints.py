"""Checkpoint directories: which are complete, which may be written over, and the average of their weights.

§6.1 of the paper reports single models "obtained by averaging the last 5 checkpoints, which were written at
10-minute intervals" (the last 20 for the big models); fairseq ships the same step as `average_checkpoints.py`.
`vaswani.averaging.average_checkpoints` writes that average as a complete checkpoint: the element-wise mean of the
weights in float32, with the config, tokenizer, generation config, module files and a model card of the newest
checkpoint averaged.
Checkpoints of different shapes, configs or tokenizers are refused, naming the difference. Weights that a model
ties (the shared embeddings and the output projection) are stored once, so their average is tied too.

Training writes checkpoints at a fixed wall-clock interval with `--save_interval_seconds` and makes the average of
the last N its final model with `--average_last_checkpoints N` (see `vaswani.training`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoTokenizer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from .configuration_vaswani import tokenizer_fingerprint
from .files import check_not_an_input, read_json_object

# The file the Trainer writes last into a checkpoint: `transformers.trainer.TRAINER_STATE_NAME`, named here because
# importing transformers.trainer also imports datasets and pandas, which the tools that only read checkpoints
# (translation, export, averaging, the Hub) never need. tests/test_imports.py holds the two names equal.
TRAINER_STATE_NAME = "trainer_state.json"

# Checkpoints are written under `STAGING_PREFIX` (the staging names of `vaswani.files`) and renamed into place when
# complete. Such names never match `checkpoint-*`, which the Trainer's own checkpoint rotation globs for.
# Config fields that say how a checkpoint was saved or is run, not which model it holds.
CONFIG_FIELDS_NOT_COMPARED = {"transformers_version", "dtype", "torch_dtype", "use_cache", "_name_or_path",
                              "architectures"}


def checkpoints_in(output_dir: str | Path) -> list[str]:
    """The `checkpoint-N` directories of `output_dir`, oldest step first."""
    steps = []
    for name in os.listdir(output_dir):
        prefix, _, step = name.partition("-")
        if prefix == PREFIX_CHECKPOINT_DIR and step.isdigit() and os.path.isdir(os.path.join(output_dir, name)):
            steps.append(int(step))
    return [os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}") for step in sorted(steps)]


def is_complete_checkpoint(path: str | Path) -> bool:
    """The Trainer writes `trainer_state.json` last. Our checkpoints appear only complete (see
    `VaswaniSeq2SeqTrainer`); this also rejects a directory cut short by another writer."""
    return os.path.isfile(os.path.join(path, TRAINER_STATE_NAME))


def is_run_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a training run's: a checkpoint (it has the Trainer's state, or the name `checkpoint-N`) or a
    run directory that holds checkpoints. Replacing one would lose the run, or let a resumed run continue from
    weights it never trained."""
    if not os.path.isdir(path):
        return False
    prefix, _, step = os.path.basename(os.path.normpath(path)).partition("-")
    named_checkpoint = prefix == PREFIX_CHECKPOINT_DIR and step.isdigit()
    return named_checkpoint or os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)) or bool(checkpoints_in(path))


def check_output_dir(output_dir: str | Path, inputs: Sequence[str | Path | None], force: bool = False) -> None:
    """Refuse, before anything is read or written, a directory that a tool writing a model must not replace: one of
    its `inputs` or a directory that holds one (by identity: `files.check_not_an_input`), or a checkpoint or run
    directory of a training run (`is_run_checkpoint`), whatever `force` says; and without `force`, any other
    directory that is not empty. The tools then replace `output_dir` whole (`files.staged_directory`)."""
    check_not_an_input(output_dir, inputs)
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"{output_dir} is a file; give a directory to write.")
    if is_run_checkpoint(output_dir):
        raise FileExistsError(f"{output_dir} is a checkpoint or run directory of a training run; replacing it would "
                              "lose the run. Choose another directory.")
    if output_dir.exists() and any(output_dir.iterdir()) and not force:
        raise FileExistsError(f"{output_dir} already exists and is not empty; choose another directory or pass "
                              "force=True (--force) to replace it.")


# Averaging ----------------------------------------------------------------------------------------------------------


def last_checkpoints(sources: Sequence[str | Path], last: int | None = None) -> list[str]:
    """The checkpoints to average: the complete `checkpoint-N` directories of a run directory (one source that holds
    any, whether or not its final model is saved beside them), or the given checkpoint directories in the given
    order; the last `last` of them where `last` is set."""
    run_dir = str(sources[0]) if len(sources) == 1 else None
    if run_dir is not None and os.path.isdir(run_dir) and checkpoints_in(run_dir):
        checkpoints = [path for path in checkpoints_in(run_dir) if is_complete_checkpoint(path)]
        if not checkpoints:
            raise FileNotFoundError(f"{run_dir} holds no complete checkpoint-N directory (each lacks "
                                    f"{TRAINER_STATE_NAME}).")
    else:
        checkpoints = [str(path) for path in sources]
        for path in checkpoints:
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise FileNotFoundError(f"{path} is neither a checkpoint directory (it has no config.json) nor a run "
                                        "directory with checkpoint-N directories.")
    if last is not None:
        if last < 1:
            raise ValueError(f"The number of checkpoints to average must be positive, got {last}.")
        if len(checkpoints) < last:
            raise ValueError(f"{last} checkpoints asked for, but only {len(checkpoints)} found: "
                             f"{', '.join(checkpoints)}.")
        checkpoints = checkpoints[-last:]
    return checkpoints


# Checking a checkpoint's files -------------------------------------------------------------------------------------
# Every file of a checkpoint is checked whole before any is loaded, so that a damaged one (a copy cut short, an error
# page saved under its name) is one line naming it, never a traceback from the library that would parse it, nor a
# model half loaded. The JSON files a checkpoint may hold, each with the fields without which it is another file.
RECOPY = "copy or download the whole checkpoint directory again"
JSON_FILES = {
    "config.json": ("model_type",),
    "generation_config.json": (),
    "tokenizer_config.json": (),
    "tokenizer.json": ("model",),
    "special_tokens_map.json": (),
    "added_tokens.json": (),
    "vocab.json": (),
    SAFE_WEIGHTS_INDEX_NAME: ("weight_map",),
    TRAINER_STATE_NAME: ("global_step",),
}


def check_checkpoint_files(directory: str | Path, weights: bool = True) -> None:
    """Every file the tools read from a checkpoint `directory` (or a CTranslate2 export, `weights=False`), checked
    whole before any is loaded: its config.json; each JSON file of `JSON_FILES` it holds; the vocabulary a Vaswani
    tokenizer's config points to; with `weights`, its safetensors weights (`check_weights`). Which other files must
    be there (the decoding settings, for one) is the caller's to say."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise FileNotFoundError(f"{directory} has no config.json, so it is not a (complete) checkpoint directory; give "
                                f"a checkpoint's directory, or {RECOPY}.")
    read = {}
    for name, fields in JSON_FILES.items():
        path = os.path.join(directory, name)
        if os.path.exists(path):
            # A CTranslate2 export's config.json is CTranslate2's own, without transformers' model_type.
            read[name] = read_json_object(path, RECOPY, fields if weights or name != "config.json" else ())
    tokenizer_class = read.get("tokenizer_config.json", {}).get("tokenizer_class")
    if tokenizer_class == "VaswaniTokenizer" and "tokenizer.json" not in read:
        raise FileNotFoundError(f"{directory} has no tokenizer.json, the vocabulary of the tokenizer its "
                                f"tokenizer_config.json names; {RECOPY}.")
    if weights:
        check_weights(directory)


def weight_files(checkpoint: str | Path) -> list[str]:
    """The safetensors files a checkpoint must hold, there or not: the shards its index lists, else the one file."""
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        weight_map = read_json_object(index, RECOPY, JSON_FILES[SAFE_WEIGHTS_INDEX_NAME])["weight_map"]
        return [os.path.join(checkpoint, name) for name in sorted(set(weight_map.values()))]
    return [os.path.join(checkpoint, SAFE_WEIGHTS_NAME)]


def missing_weight_files(checkpoint: str | Path) -> list[str]:
    """The names of the weight files of `checkpoint` (`weight_files`) that are not there."""
    return [os.path.basename(path) for path in weight_files(checkpoint) if not os.path.isfile(path)]


def check_weights(checkpoint: str | Path) -> list[str]:
    """The safetensors files of `checkpoint` (`weight_files`), each checked complete before any tensor is read: a
    missing file or shard, or one cut short or corrupted, is an error naming the directory and what is wrong.
    Opening a safetensors file reads its header only, and checks that the data it describes is all there."""
    paths, missing = weight_files(checkpoint), missing_weight_files(checkpoint)
    if missing and not os.path.isfile(os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)):
        raise FileNotFoundError(f"{checkpoint} has no {SAFE_WEIGHTS_NAME} (nor {SAFE_WEIGHTS_INDEX_NAME}); copy the "
                                "whole checkpoint directory again.")
    if missing:
        raise FileNotFoundError(f"{checkpoint} lacks {len(missing)} of the {len(paths)} weight shards that "
                                f"{SAFE_WEIGHTS_INDEX_NAME} lists ({', '.join(missing)}); copy the whole checkpoint "
                                "directory again.")
    for path in paths:
        try:
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as error:
            raise damaged_weights(checkpoint, error, path) from error
    return paths


def damaged_weights(checkpoint: str | Path, error: Exception, path: str | None = None) -> ValueError:
    """The error for a weights file of `checkpoint` that safetensors cannot read."""
    where = f"{os.path.basename(path)}: " if path else ""
    return ValueError(f"The weights in {checkpoint} are truncated or corrupted ({where}{error}); {RECOPY}.")


def check_same_model(checkpoints: Sequence[str]) -> None:
    """Refuse checkpoints that do not hold the same model with the same tokenizer, naming the first difference."""
    first = checkpoints[0]
    reference = _compared_config(first)
    reference_tokenizer = _tokenizer_fingerprint_of(first)
    for other in checkpoints[1:]:
        config = _compared_config(other)
        for name in sorted(set(reference) | set(config)):
            if reference.get(name) != config.get(name):
                raise ValueError(f"{other} has config {name}={config.get(name)!r}, {first} has "
                                 f"{reference.get(name)!r}: checkpoints of different models cannot be averaged.")
        if _tokenizer_fingerprint_of(other) != reference_tokenizer:
            raise ValueError(f"{other} has another tokenizer than {first} (tokenizer fingerprints "
                             f"{_tokenizer_fingerprint_of(other)} and {reference_tokenizer}): checkpoints trained with "
                             "different vocabularies cannot be averaged.")


def _compared_config(checkpoint: str) -> dict:
    config = read_json_object(os.path.join(checkpoint, "config.json"), RECOPY, JSON_FILES["config.json"])
    return {name: value for name, value in config.items() if name not in CONFIG_FIELDS_NOT_COMPARED}


def _tokenizer_fingerprint_of(checkpoint: str) -> str | None:
    """None for a checkpoint saved without a tokenizer: only the weights are then compared."""
    if not os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json")):
        return None
    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(checkpoint))


@torch.no_grad()
def average_state_dicts(checkpoints: Sequence[str]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the checkpoints' stored tensors, in float32. Each sum is accumulated in float64 (one
    model's worth of memory beside one checkpoint's tensors), so the result is the exact mean rounded once to
    float32, whatever the number of checkpoints. Different tensor names or shapes are refused, naming them."""
    total: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple] = {}
    for index, checkpoint in enumerate(checkpoints):
        seen = set()
        for file in check_weights(checkpoint):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    seen.add(name)
                    if index == 0:
                        total[name] = tensor.to(torch.float64)
                        shapes[name] = tuple(tensor.shape)
                        continue
                    if name not in total:
                        raise ValueError(f"{checkpoint} has a tensor {name} that {checkpoints[0]} lacks: checkpoints "
                                         "of different models cannot be averaged.")
                    if tuple(tensor.shape) != shapes[name]:
                        raise ValueError(f"{name} has shape {tuple(tensor.shape)} in {checkpoint} but {shapes[name]} "
                                         f"in {checkpoints[0]}: checkpoints of different shapes cannot be averaged.")
                    total[name] += tensor
        missing = sorted(set(total) - seen)
        if missing:
            raise ValueError(f"{checkpoint} lacks {', '.join(missing[:5])}, which {checkpoints[0]} has: checkpoints "
                             "of different models cannot be averaged.")
    return {name: (tensor / len(checkpoints)).to(torch.float32) for name, tensor in total.items()}


@torch.no_grad()
def load_average(model: torch.nn.Module, checkpoints: Sequence[str]) -> torch.nn.Module:
    """Put the average of `checkpoints` into `model` (in place; parameters keep their dtype and device). Every stored
    tensor must be one of the model's; a model tensor that no checkpoint stores must be tied to one that is (as
    save_pretrained leaves the output projection out when tied to the embedding)."""
    for checkpoint in checkpoints:
        check_checkpoint_files(checkpoint)
    check_same_model(checkpoints)
    average = average_state_dicts(checkpoints)
    state = model.state_dict()
    unknown = sorted(set(average) - set(state))
    if unknown:
        raise ValueError(f"{checkpoints[-1]} stores {', '.join(unknown[:5])}, which this model does not have.")
    stored = {state[name].data_ptr() for name in average}
    untied = sorted(name for name in set(state) - set(average) if state[name].data_ptr() not in stored)
    if untied:
        raise ValueError(f"The checkpoints do not store {', '.join(untied[:5])}, which this model has untied.")
    for name, tensor in average.items():
        state[name].copy_(tensor)
    return model


__all__ = ["average_state_dicts", "load_average", "last_checkpoints", "checkpoints_in",
           "is_complete_checkpoint", "check_checkpoint_files", "check_weights", "missing_weight_files",
           "check_output_dir", "is_run_checkpoint"]
