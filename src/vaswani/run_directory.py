"""A training run's output directory, from start to end: what it may already hold and what a run does with it
(`prepare_output_dir`: train, resume, replace or refuse), whether the run that wrote it has finished
(`finished_run`), the checks on a checkpoint to resume from, and the final model published into it (`save_final`).
"""

import json
import logging
import os
import shlex
import shutil
from collections.abc import Sequence

from transformers.trainer import FSDP_MODEL_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME

from .checkpoints import RECOPY, check_checkpoint_files, checkpoints_in, is_complete_checkpoint
from .configuration_vaswani import VaswaniConfig
from .files import STAGING_PREFIX, read_json_object, staged_directory
from .preemption import resume_command
from .training_arguments import VaswaniTrainingArguments

logger = logging.getLogger(__name__)


def save_final(trainer, tokenizer, output_dir: str, metrics: dict, test_translations: Sequence[str] = (),
               averaged_checkpoints: list[str] = (), command: Sequence[str] = ()) -> None:
    """Write the final model into a staging directory that then replaces `output_dir` whole, with the checkpoints,
    logs and other files `output_dir` holds carried over as hard links (`files.staged_directory` with `last`, as
    checkpoints are published whole): a crash or a failure at any point leaves the old final model whole or the new
    one, never a truncated file, nor the weights of one model beside the config of another. Where `output_dir`
    cannot be replaced whole (a mount point, a symbolic link...), the files move in one by one with `config.json`,
    without which nothing loads, last. `test_translations`,
    the test split's hypotheses in its order, go to `test_translations.txt` (one a line), so that the reported
    scores can be recomputed against the split's references. `command`, the command line that trained the model
    (program name first) as its script received it, goes into the model card."""
    from .hub import attach_translation_pipeline, write_model_card

    with staged_directory(output_dir, last="config.json") as staging:
        # pipeline("translation", model=dir, trust_remote_code=True)
        attach_translation_pipeline(trainer.model, staging)
        trainer.save_model(staging)
        tokenizer.save_pretrained(staging)
        replace_pickled_arguments(staging, trainer.args)
        with open(os.path.join(staging, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        if test_translations:
            with open(os.path.join(staging, "test_translations.txt"), "w", encoding="utf-8") as f:
                f.writelines(line.replace("\n", " ") + "\n" for line in test_translations)
        write_model_card(staging, metrics=metrics, training_command=shlex.join(command) if command else None,
                         averaged_checkpoints=averaged_checkpoints)


def replace_pickled_arguments(directory: str, args) -> None:
    """The Trainer pickles its arguments (`training_args.bin`), and nothing reads them back; a model or checkpoint
    directory should hold no pickle that a user might load, so keep them as JSON instead."""
    pickled = os.path.join(directory, TRAINING_ARGS_NAME)
    if os.path.exists(pickled):
        os.remove(pickled)
    with open(os.path.join(directory, "training_args.json"), "w") as f:
        f.write(args.to_json_string())


# What output_dir may already hold -----------------------------------------------------------------------------------


def holds_final_model(output_dir: str) -> bool:
    return any(os.path.exists(os.path.join(output_dir, name)) for name in ("config.json", "model.safetensors"))


# What sets how long a run trains: a run asking for other values continues a finished one instead of stopping.
TRAINING_LENGTH = ("max_steps", "num_train_epochs", "max_train_time")


def finished_run(output_dir: str, args: VaswaniTrainingArguments | None = None) -> dict | None:
    """The final metrics of the run that ended in `output_dir` (empty where it has no `metrics.json`), or None where
    none did: a final model is complete once its `config.json` is there (`save_final` publishes it whole), and it is
    this run's end only if no complete checkpoint was written after it (an `--overwrite_output_dir` run that
    stopped leaves the old model beside its newer checkpoints). With `args`, also None where the finished run was
    of another length (`TRAINING_LENGTH`, read from its `training_args.json`): a longer run continues from the last
    checkpoint."""
    config = os.path.join(output_dir, "config.json")
    if not os.path.isfile(config):
        return None
    saved = os.path.getmtime(config)
    if any(os.path.getmtime(os.path.join(path, TRAINER_STATE_NAME)) > saved
           for path in checkpoints_in(output_dir) if is_complete_checkpoint(path)):
        return None
    fix = "restore it from a copy of the run, or delete it"
    recorded = os.path.join(output_dir, "training_args.json")
    if args is not None and os.path.isfile(recorded):
        trained = read_json_object(recorded, fix)
        if any(trained.get(name) != getattr(args, name) for name in TRAINING_LENGTH):
            return None
    metrics = os.path.join(output_dir, "metrics.json")
    if not os.path.isfile(metrics):
        return {}
    return read_json_object(metrics, fix)


def check_resumed_weights(checkpoint: str) -> None:
    """The files of the checkpoint to resume from (its config, tokenizer, resume record and weights), checked whole
    (`checkpoints.check_checkpoint_files`) before anything is read: a damaged checkpoint is named in one line, not
    in a traceback from inside the Trainer. FSDP's sharded checkpoints keep their weights in directories of their
    own, which the Trainer reads."""
    fsdp = any(name.startswith(FSDP_MODEL_NAME) for name in os.listdir(checkpoint))
    check_checkpoint_files(checkpoint, weights=not fsdp)


def prepare_output_dir(args: VaswaniTrainingArguments) -> str | None:
    """Decide, before anything is read or written, what to do with what `output_dir` already holds, and return the
    checkpoint to resume from (or None).

    * nothing there (or only other files, e.g. logs): train;
    * a model or checkpoints, and neither flag: refused, naming both flags;
    * `--resume`: the last complete checkpoint; incomplete ones and staging directories are skipped (the
      staging directories, remains of a crash, are deleted); none yet: train from the start. A finished run
      (`finished_run`) is not trained again: `run_training` returns before this. Model files without a
      checkpoint, and not a finished run, are refused;
    * `--resume_from_checkpoint PATH` (the Trainer's flag): that checkpoint, which must be complete;
    * `--overwrite_output_dir`: train; `remove_old_checkpoints` deletes the earlier checkpoints once the corpus is
      read and the model built (a mistyped corpus then loses nothing); the final model files are replaced when the
      new one is saved.
    """
    output_dir = args.output_dir
    if args.resume_from_checkpoint:
        if not os.path.isdir(args.resume_from_checkpoint) or not is_complete_checkpoint(args.resume_from_checkpoint):
            raise FileNotFoundError(f"--resume_from_checkpoint {args.resume_from_checkpoint} is not a complete "
                                    f"checkpoint directory (it needs {TRAINER_STATE_NAME}).")
        return args.resume_from_checkpoint
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise NotADirectoryError(f"--output_dir {output_dir} is a file; give a directory.")
    if not os.path.isdir(output_dir):
        if args.resume:
            logger.warning("--resume given but %s does not exist; starting from scratch.", output_dir)
        return None
    checkpoints = checkpoints_in(output_dir)
    staging = [os.path.join(output_dir, name) for name in os.listdir(output_dir) if name.startswith(STAGING_PREFIX)]
    if args.overwrite_output_dir:
        return None
    if args.resume:
        if args.should_save:
            for path in staging:
                logger.warning("Removing %s, a checkpoint that was being written when training stopped.", path)
                shutil.rmtree(path, ignore_errors=True)
        complete = [path for path in checkpoints if is_complete_checkpoint(path)]
        for path in sorted(set(checkpoints) - set(complete)):
            logger.warning("Ignoring %s: it has no %s, so it is incomplete.", path, TRAINER_STATE_NAME)
        if complete:
            logger.info("Resuming from %s.", complete[-1])
            return complete[-1]
        if holds_final_model(output_dir):
            raise FileExistsError(
                f"--resume: {output_dir} holds model files but no checkpoint to resume from. Pass "
                f"--model_name_or_path {output_dir} with another --output_dir to fine-tune it, or "
                "--overwrite_output_dir to train a new one there."
            )
        logger.warning("--resume given but %s holds no complete checkpoint; starting from scratch.", output_dir)
        return None
    if checkpoints or holds_final_model(output_dir):
        raise FileExistsError(
            f"--output_dir {output_dir} already holds a model or checkpoints. Pass --resume to continue its "
            "training, --overwrite_output_dir to replace it, or choose another --output_dir."
        )
    return None


def last_complete_checkpoint(output_dir: str) -> str | None:
    complete = [path for path in checkpoints_in(output_dir) if is_complete_checkpoint(path)]
    return complete[-1] if complete else None


def kept_after_a_full_disk(output_dir: str) -> str:
    """What a run that ran out of space while writing into `output_dir` keeps, and how to go on."""
    last = last_complete_checkpoint(output_dir)
    if last is None:
        return "it holds no complete checkpoint yet; free some space, then run the same command again"
    return (f"its complete checkpoints are kept (the last: {last}); free some space, then run the same "
            "command with --resume")


def kept_after_a_lost_process(output_dir: str, command: Sequence[str]) -> str:
    """What a run that lost one of its processes keeps, and how to go on (`command`: the script and its arguments)."""
    last = last_complete_checkpoint(output_dir)
    how = resume_command(command) if command else "the same command with --resume"
    if last is None:
        return f"it wrote no complete checkpoint; run it again ({how} starts from the beginning)"
    return f"the last complete checkpoint is {last}; resume it with: {how}"


def remove_old_checkpoints(args: VaswaniTrainingArguments) -> None:
    """`--overwrite_output_dir`: delete the checkpoints (and staging directories) an earlier run left in output_dir,
    which would mix with this run's in rotation and resumption. Called once the run has read its corpus and built
    its model, so that a run that cannot start deletes nothing."""
    output_dir = args.output_dir
    if not (args.overwrite_output_dir and args.should_save and os.path.isdir(output_dir)):
        return
    staging = [os.path.join(output_dir, name) for name in os.listdir(output_dir) if name.startswith(STAGING_PREFIX)]
    for path in checkpoints_in(output_dir) + staging:
        shutil.rmtree(path)


def check_checkpoint_matches(checkpoint: str, config: VaswaniConfig) -> None:
    """A resumed run must build the model its checkpoint holds; otherwise loading the weights fails deep inside
    torch (shape mismatch) or, worse, succeeds with a different configuration."""
    model_type = read_json_object(os.path.join(checkpoint, "config.json"), RECOPY).get("model_type")
    if model_type != config.model_type:
        raise ValueError(f"{checkpoint} holds a {model_type!r} model, not a Vaswani one; choose another "
                         "--output_dir or pass --overwrite_output_dir.")
    saved = VaswaniConfig.from_pretrained(checkpoint)
    # The Trainer turns use_cache off; a resumed run takes the checkpoint's own tokenizer, whose fingerprint older
    # checkpoints do not record.
    compared = [name for name in VaswaniConfig.__annotations__ if name not in ("use_cache", "tokenizer_fingerprint")]
    differences = [f"{name}={getattr(saved, name)!r} (this run: {getattr(config, name)!r})"
                   for name in compared if getattr(saved, name) != getattr(config, name)]
    if differences:
        raise ValueError(f"{checkpoint} was trained with {', '.join(differences)}; resume with the arguments of the "
                         "original run, or pass --overwrite_output_dir to start a new model.")
