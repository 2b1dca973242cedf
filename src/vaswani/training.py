"""Training a Vaswani translator with the `transformers` Seq2SeqTrainer.

Arguments follow transformers' `run_translation.py`: a `ModelArguments`, a `DataArguments` and the Trainer's own
`Seq2SeqTrainingArguments` (extended with a time budget, token-budget batches and the paper's recipe), parsed by
`HfArgumentParser`, so every Trainer flag (bf16, gradient accumulation, FSDP on GPUs, `--push_to_hub`, `--report_to`)
works unchanged, and `accelerate launch` / `torchrun` run the same script with DDP (or FSDP2 on GPUs, with `--fsdp`).
"""

import contextlib
import json
import logging
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from datasets import Dataset, DatasetDict
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerBase,
    ProgressCallback,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    TrainerCallback,
    set_seed,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.trainer import FSDP_MODEL_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME

from . import data as vdata
from .batching import ShapeBuckets, TokenBatchSampler, example_lengths, pad_to_shape
from .checkpoints import check_weights, checkpoints_in, is_complete_checkpoint, load_average
from .configuration_vaswani import VaswaniConfig, check_tokenizer_fits, tokenizer_fingerprint
from .corpus import CORPUS_ENV_VAR
from .evaluation import build_compute_metrics, evaluate_model
from .files import STAGING_PREFIX, staged_directory
from .modeling_vaswani import VaswaniForConditionalGeneration
from .tokenization import cached_corpus_tokenizer, tokenize_translation_dataset
from .trainer_internals import StagedCheckpoints, prepare_uneven_loader

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    preset: str = field(default="small", metadata={"help": f"Config preset for a new model: {VaswaniConfig.PRESETS}."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Fine-tune this checkpoint (directory or Hub id) instead of a new model."}
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "Comma-separated config fields for a new model, e.g. 'd_model=256,norm_first=true'."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to use; default: the checkpoint's, or a new one trained on the data."}
    )
    vocab_size: int = field(default=8000, metadata={"help": "Vocabulary size of a newly trained tokenizer."})
    tokenizer_train_pairs: int | None = field(
        default=500_000,
        metadata={"help": "A newly trained tokenizer learns from at most this many train pairs (a million sentences "
                          "by default), a random sample drawn with --seed, or all of a smaller corpus; metrics.json "
                          "and the model card record how many sentences it saw."},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "Attention kernel (eager, sdpa, flash_attention_2, flex_attention); default: transformers' "
                          "choice (sdpa). On CPU with --bf16, eager is faster: sdpa's CPU kernel is slower in bf16."},
    )

    def __post_init__(self):
        # Checked at parse time, before any data is read or anything is written.
        if self.preset not in VaswaniConfig.PRESETS:
            raise ValueError(f"Unknown --preset {self.preset!r}; choose one of {', '.join(VaswaniConfig.PRESETS)}.")
        if self.vocab_size < 1:
            raise ValueError(f"--vocab_size must be positive, got {self.vocab_size}.")
        for flag in ("model_name_or_path", "tokenizer_name_or_path"):
            path = getattr(self, flag)
            if path and os.path.isfile(path):
                raise NotADirectoryError(f"--{flag} {path} is a file; give the checkpoint directory (or a Hub id).")
        if self.tokenizer_train_pairs is not None and self.tokenizer_train_pairs < 1:
            raise ValueError(f"--tokenizer_train_pairs must be positive, got {self.tokenizer_train_pairs}.")
        VaswaniConfig.from_preset(self.preset, **parse_overrides(self.config_overrides))  # raises on a bad value
        known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
        if self.attn_implementation and "/" not in self.attn_implementation and self.attn_implementation not in known:
            # A Hub kernel ("org/repo") is checked by transformers when the model is built.
            raise ValueError(f"Unknown --attn_implementation {self.attn_implementation!r}; choose one of "
                             f"{', '.join(known)}, or a Hub kernel repository.")


@dataclass
class DataArguments:
    corpus: str | None = field(
        default=None,
        metadata={"help": "Local parallel corpus (tsv[.gz] English-first, csv, jsonl). Default: the fra-eng corpus "
                          f"from ${CORPUS_ENV_VAR}, the caller's copy, or its public download."},
    )
    # Not an option: the fra-eng file to read when neither --corpus nor the environment names one, set by the
    # calling script (the package does not know where a repository keeps its data); None downloads it.
    default_corpus: str | None = field(default=None, init=False)
    dataset_name: str | None = field(default=None, metadata={"help": "A Hugging Face dataset instead of a file."})
    dataset_config: str | None = field(default=None, metadata={"help": "Its configuration name, e.g. 'fr-en'."})
    source_lang: str = "en"
    target_lang: str = "fr"
    max_length: int = field(default=128, metadata={"help": "Truncate sources and targets to this many tokens."})
    max_train_samples: int | None = None
    max_eval_samples: int | None = field(default=None, metadata={"help": "Validation sentences used while training."})
    max_test_samples: int | None = field(default=None, metadata={"help": "Test sentences for the final evaluation."})
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes that tokenize the corpus in parallel (default: one)."}
    )
    data_cache_dir: str | None = field(
        default=None,
        metadata={"help": "Where a tsv corpus read into Arrow, the tokenizer trained on it and the tokenized splits "
                          "are kept for later runs (default: $HF_DATASETS_CACHE/vaswani)."},
    )
    overwrite_cache: bool = field(
        default=False, metadata={"help": "Read, train the tokenizer and tokenize again instead of reusing the cache."}
    )

    def __post_init__(self):
        for name in ("max_length", "max_train_samples", "max_eval_samples", "max_test_samples",
                     "preprocessing_num_workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be a positive number, got {value}.")


# torch.compile's default `recompile_limit`: the graphs it keeps of one function, beyond which it runs it uncompiled.
MAX_SHAPE_BUCKETS = 8


@dataclass
class VaswaniTrainingArguments(Seq2SeqTrainingArguments):
    max_train_time: float | None = field(
        default=None, metadata={"help": "Stop training after this many seconds (then evaluate and save)."}
    )
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={"help": "Length-bucketed batches of at most this many (padded) tokens per device, as in §5.1 of "
                          "the paper (about 25,000 source + 25,000 target tokens per batch there)."},
    )
    shape_buckets: int | None = field(
        default=None,
        metadata={"help": "With --max_tokens_per_batch: every training batch padded up to one of at most this many "
                          "(rows, length) shapes, chosen from the data before training (both sides padded to the "
                          "shape's length, rows filled with examples the loss ignores), so that a compiled step has "
                          "that many static graphs, all compiled before the clock starts; under --torch_compile_mode "
                          "reduce-overhead on CUDA each is recorded once as a CUDA graph and replayed. The padding "
                          "costs work: off by default (the GPU step-rate probe's result, "
                          "benchmarks/results/training-graphs-cuda-*.md, says whether it pays). At most "
                          f"{MAX_SHAPE_BUCKETS}."},
    )
    paper_recipe: bool = field(
        default=False,
        metadata={"help": "§5.3: Adam β=(0.9, 0.98), ε=1e-9, lr = d_model^-0.5 · min(step^-0.5, step · warmup^-1.5) "
                          "(inverse square root after linear warm-up; --warmup_steps, default 4000)."},
    )
    lr_decay_over_time_budget: bool = field(
        default=False,
        metadata={"help": "With --max_train_time and --lr_scheduler_type linear or cosine: the schedule decays over "
                          "the time budget (to zero when it runs out) instead of over --max_steps / the epochs, "
                          "which a time-limited run never reaches. Warm-up stays in steps."},
    )
    ema_decay: float | None = field(
        default=None,
        metadata={"help": "Keep an exponential moving average of the weights (decay per step, e.g. 0.99; the "
                          "effective decay ramps up as min(decay, (1 + step) / (10 + step))) and make it the final "
                          "model. Off by default, as in the paper (which averages its last checkpoints instead)."},
    )
    generation_length_penalty: float = field(
        default=0.6,
        metadata={"help": "Beam search's length penalty, used by the evaluations and saved in generation_config.json "
                          "(generate() divides a hypothesis' log-probability by length**penalty). 0.6 is the paper's "
                          "α (§6.1, with GNMT's penalty ((5 + length) / 6)**α); it also won on the main job's "
                          "validation split (benchmarks/results/main-job-recipes.md). 1.0 is transformers' default."},
    )
    save_interval_seconds: float | None = field(
        default=None,
        metadata={"help": "Also write a checkpoint every this many seconds of training (the paper's 10 minutes: 600), "
                          "and at the last step; with --save_strategy no, only these."},
    )
    average_last_checkpoints: int | None = field(
        default=None,
        metadata={"help": "Make the element-wise mean of the last N checkpoints the final model (§6.1: the last 5 "
                          "for the base models, written at 10-minute intervals; 20 for the big ones), evaluated and "
                          "saved as the final model is. Needs checkpoints (--save_interval_seconds or "
                          "--save_strategy) and --save_total_limit of at least N, if set."},
    )
    resume: bool = field(default=False, metadata={"help": "Continue from the last complete checkpoint in output_dir."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train a new model in an output_dir that already holds one: its checkpoints are deleted at "
                          "the start, its final model is replaced at the end. Without this flag (or --resume), such "
                          "an output_dir is refused."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.dataloader_pin_memory:
            # Training batches come from pinned memory on CUDA: copying them to the device need not make the host
            # wait (a blocking copy would, four times a step). Elsewhere the flag changes nothing.
            self.accelerator_config.non_blocking = True
        if self.resume and self.overwrite_output_dir:
            raise ValueError("--resume continues the model in output_dir and --overwrite_output_dir replaces it; "
                             "pass one of them.")
        if self.fsdp and not self.fsdp_config.get("xla") and self.device.type == "cpu":
            # accelerate keeps an FSDP plugin only for GPUs and other accelerators: on CPUs the Trainer would train
            # with DDP instead, without a word (tests/test_fsdp.py runs FSDP2 itself on CPUs, outside the Trainer).
            raise ValueError("--fsdp: transformers' Trainer shards with FSDP only on GPUs (and other accelerators); "
                             "on CPUs it would train with DDP instead. Drop --fsdp to train with DDP over gloo "
                             "(torchrun ... --ddp_backend gloo), or run on GPUs.")
        for name in ("max_train_time", "max_tokens_per_batch", "shape_buckets", "save_interval_seconds",
                     "average_last_checkpoints"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name} must be positive, got {value}.")
        if self.shape_buckets is not None:
            if not self.max_tokens_per_batch:
                raise ValueError("--shape_buckets pads token-budget batches; it needs --max_tokens_per_batch.")
            if self.shape_buckets > MAX_SHAPE_BUCKETS:
                raise ValueError(f"--shape_buckets {self.shape_buckets}: torch.compile keeps at most "
                                 f"{MAX_SHAPE_BUCKETS} graphs of a step and runs any further shape uncompiled; give "
                                 f"at most {MAX_SHAPE_BUCKETS}.")
        if self.average_last_checkpoints:
            if self.save_strategy == "no" and not self.save_interval_seconds:
                raise ValueError("--average_last_checkpoints averages checkpoints; write some with "
                                 "--save_interval_seconds or --save_strategy steps/epoch.")
            if self.save_total_limit is not None and self.save_total_limit < self.average_last_checkpoints:
                raise ValueError(f"--save_total_limit {self.save_total_limit} keeps fewer checkpoints than the "
                                 f"--average_last_checkpoints {self.average_last_checkpoints} to average.")
            for other in ("ema_decay", "load_best_model_at_end"):
                if getattr(self, other):
                    raise ValueError(f"--average_last_checkpoints makes the averaged weights the final model; "
                                     f"--{other} makes another one. Pass one of them.")
        if self.lr_decay_over_time_budget:
            if not self.max_train_time:
                raise ValueError("--lr_decay_over_time_budget needs --max_train_time, the budget it decays over.")
            if self.paper_recipe:
                raise ValueError("--paper_recipe sets the paper's inverse-square-root schedule; "
                                 "--lr_decay_over_time_budget replaces it. Pass one of them.")
            if str(self.lr_scheduler_type).split(".")[-1].lower() not in TIME_SCHEDULES:
                raise ValueError(f"--lr_decay_over_time_budget decays as --lr_scheduler_type "
                                 f"{' or '.join(TIME_SCHEDULES)}; got {self.lr_scheduler_type}.")
        if self.ema_decay is not None:
            if not 0 < self.ema_decay < 1:
                raise ValueError(f"--ema_decay must be between 0 and 1 (e.g. 0.99), got {self.ema_decay}.")
            if self.load_best_model_at_end:
                raise ValueError("--ema_decay makes the averaged weights the final model; --load_best_model_at_end "
                                 "would replace them. Pass one of them.")


def apply_paper_recipe(args: VaswaniTrainingArguments, d_model: int) -> None:
    """Set the optimiser and schedule of §5.3. The peak rate d_model^-0.5 · warmup^-0.5 is reached at the end of the
    warm-up; transformers' `inverse_sqrt` schedule is exactly the paper's curve scaled to that peak."""
    warmup = args.warmup_steps if args.warmup_steps and args.warmup_steps >= 1 else 4000
    args.warmup_steps = int(warmup)
    args.adam_beta1, args.adam_beta2, args.adam_epsilon = 0.9, 0.98, 1e-9
    args.lr_scheduler_type = "inverse_sqrt"
    args.learning_rate = d_model**-0.5 * warmup**-0.5


# Shapes of the decay over the time budget (--lr_decay_over_time_budget), from 1 at the start to 0 at the end.
TIME_SCHEDULES = {"linear": lambda done: 1.0 - done, "cosine": lambda done: 0.5 * (1.0 + math.cos(math.pi * done))}


class TrainingClock:
    """Seconds of training so far, the same on every rank: under DDP each decision taken on elapsed time (stop at the
    budget, write an interval checkpoint) must agree on every rank, so the time is the slowest rank's, all-reduced.
    One clock serves every callback that reads it, so a step costs one all-reduce however many read it."""

    def __init__(self):
        self._start = None
        self._step, self._seconds = None, 0.0

    def restart(self) -> None:
        """Count from now (each callback that reads the clock calls this in `on_train_begin`)."""
        self._start = time.monotonic()
        self._step, self._seconds = None, 0.0

    def seconds(self, args, state) -> float:
        """The slowest rank's seconds since `restart`, measured once per global step."""
        if state.global_step != self._step:
            self._seconds = slowest_rank(time.monotonic() - self._start, args)
            self._step = state.global_step
        return self._seconds


def slowest_rank(seconds: float, args) -> float:
    """The largest of every DDP rank's `seconds`."""
    if dist.is_available() and dist.is_initialized():
        shared = torch.tensor(seconds, dtype=torch.float64, device=args.device if args.device.type == "cuda" else "cpu")
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        seconds = float(shared.item())
    return seconds


class ClockCallback(TrainerCallback):
    """A callback that decides on `TrainingClock` time, `seconds` at a time; the clock (shared by every such
    callback of a run) restarts with each (resumed) run."""

    def __init__(self, seconds: float, clock: TrainingClock | None = None):
        self.seconds = seconds
        self.clock = clock or TrainingClock()

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.restart()


class TimeBudgetCallback(ClockCallback):
    """Stops training once `max_train_time` seconds have passed; the final evaluation and save follow.
    `fraction` is the part of the budget spent at the last step's end (what a schedule over the budget reads).
    Under DDP every rank stops at the same step and uses the same learning rate (the clock is the slowest rank's)."""

    fraction = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self.fraction = 0.0

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
    An interval counts from the step of the last checkpoint, on the clock every rank agrees on."""

    last = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self.last = 0.0

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


class StartTheClockCallback(TrainerCallback):
    """The first callback of a `VaswaniSeq2SeqTrainer`: at the start of training it compiles the training step
    (`VaswaniSeq2SeqTrainer.compile_before_the_clock`) and then marks the start of training, before every callback
    that reads a clock starts it. Compilation is then not part of a time budget, nor of the elapsed seconds logged."""

    def __init__(self, trainer: "VaswaniSeq2SeqTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.compile_before_the_clock()
        self.trainer.training_started = time.monotonic()


class TimeBudgetProgressCallback(ProgressCallback):
    """The training progress bar under a time budget: it counts the budget's seconds, with the step beside them.
    The stock bar counts `max_steps`, which under a budget is only the epochs' step count (with an ETA far beyond
    the budget), not where training will stop."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.start = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=round(self.seconds), bar_format="{l_bar}{bar}| {n}/{total} s [{elapsed}{postfix}]",
                                     dynamic_ncols=True)
        self.current_step = 0
        self.start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            elapsed = min(round(time.monotonic() - self.start), self.training_bar.total)
            self.training_bar.set_postfix_str(f"step {state.global_step}", refresh=False)
            self.training_bar.update(elapsed - self.training_bar.n)


class ShapePaddedCollator:
    """A data collator whose batches are padded up to their declared shape (`batching.ShapeBuckets`, by the width
    of their longer side, `batching.pad_to_shape`), with `pad_values` per input. A class rather than a closure, so
    that loader workers can be handed it."""

    def __init__(self, collator, buckets: ShapeBuckets, pad_values: dict[str, int]):
        self.collator, self.buckets, self.pad_values = collator, buckets, pad_values

    def __call__(self, features: list[dict]) -> dict:
        batch = self.collator(features)
        width = max(tensor.shape[1] for tensor in batch.values())
        return pad_to_shape(batch, *self.buckets.shape(width), self.pad_values)


class VaswaniSeq2SeqTrainer(StagedCheckpoints, Seq2SeqTrainer):
    """Seq2SeqTrainer with these additions:

    * token-budget batches (`max_tokens_per_batch`), optionally padded up to a few declared shapes
      (`shape_buckets`, a count: `TokenBatchSampler`, `ShapePaddedCollator`);
    * a check that stops on a non-finite loss and names the step, instead of training through NaNs. The first bad
      step is kept on the device, so the check adds no host synchronisation per step; it is read at each logging
      step and before each checkpoint, so that no checkpoint holds weights a NaN has reached;
    * checkpoints that are never visible half-written (`trainer_internals.StagedCheckpoints`), resumable and rotated
      as the Trainer's own. The pickled `training_args.bin` is replaced by `training_args.json`;
    * under `--torch_compile`, the training step compiled before any clock starts (`compile_before_the_clock`),
      its seconds kept in `compile_seconds`; every logged line carries the seconds of training so far
      (`elapsed_seconds`).
    """

    def __init__(self, *args, max_tokens_per_batch: int | None = None, shape_buckets: int | None = None,
                 time_budget: TimeBudgetCallback | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if shape_buckets and not max_tokens_per_batch:
            raise ValueError("shape_buckets pads token-budget batches; it needs max_tokens_per_batch.")
        self.max_tokens_per_batch = max_tokens_per_batch
        self.shape_buckets = shape_buckets
        self._train_collate = self.data_collator
        self.time_budget = time_budget
        self.time_budget_schedule = None
        self._first_bad_step = None
        self._non_embedding_parameters = None
        self._train_features = None
        self.compile_seconds = 0.0
        self.training_started = None
        # First, so that the compilation ends before any other callback starts a clock.
        self.callback_handler.callbacks.insert(0, StartTheClockCallback(self))
        # The Trainer's own NaN/inf filter reads every step's loss back to the host (`isnan(loss) or isinf(loss)`),
        # which makes the host wait for the device once a step. The device-side check below replaces it, and stops
        # the run where the filter would have trained on.
        self.args.logging_nan_inf_filter = False

    def get_train_dataloader(self) -> DataLoader:
        if not self.max_tokens_per_batch:
            return super().get_train_dataloader()
        dataset = self._train_features = self.unused_columns_removed(self.train_dataset, description="training")
        # The budget counts what the device computes: the collator's padding to a multiple included.
        pad_to = getattr(self.data_collator, "pad_to_multiple_of", None)
        self.batch_sampler = TokenBatchSampler(example_lengths(dataset), self.max_tokens_per_batch, shuffle=True,
                                               seed=self.args.seed, num_replicas=self.args.world_size,
                                               pad_to_multiple_of=pad_to, shape_buckets=self.shape_buckets)
        self._train_collate = self.data_collator
        if self.batch_sampler.shape_buckets is not None:
            tokenizer = getattr(self.data_collator, "tokenizer", None) or self.processing_class
            self._train_collate = ShapePaddedCollator(self.data_collator, self.batch_sampler.shape_buckets, {
                "input_ids": tokenizer.pad_token_id, "attention_mask": 0, "labels": -100,  # the loss ignores -100
                "decoder_input_ids": self.model.config.pad_token_id, "decoder_attention_mask": 0})
        loader = DataLoader(
            dataset,
            batch_sampler=self.batch_sampler,
            collate_fn=self._train_collate,
            num_workers=self.args.dataloader_num_workers,
            # Workers kept from one epoch to the next rather than started again (the batches' order is decided in
            # this process, by the sampler, so they need nothing new per epoch).
            persistent_workers=self.args.dataloader_num_workers > 0,
            # Pinned host memory, from which the batches are copied without the host waiting (non_blocking, set in
            # `VaswaniTrainingArguments`), exists only for CUDA.
            pin_memory=self.args.dataloader_pin_memory and self.args.device.type == "cuda",
        )
        return prepare_uneven_loader(self.accelerator, loader)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        # A schedule made here is made again by the next `train()`, whose optimiser may be another, as the Trainer
        # does with its own; one passed in through `optimizers` is kept.
        if (self.args.lr_decay_over_time_budget and self.time_budget is not None
                and (self.lr_scheduler is None or self.lr_scheduler is self.time_budget_schedule)):
            self.lr_scheduler = self.time_budget_schedule = time_budget_schedule(
                optimizer or self.optimizer, str(self.args.lr_scheduler_type).split(".")[-1].lower(),
                self.args.get_warmup_steps(num_training_steps), self.time_budget,
            )
        return super().create_scheduler(num_training_steps, optimizer)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        # Filled on the device: a tensor made from host data would be a blocking copy to it.
        step = torch.full((), self.state.global_step + 1, dtype=torch.long, device=loss.device)
        bad = ~torch.isfinite(loss)
        if self._first_bad_step is None:
            self._first_bad_step = torch.full_like(step, -1)
        self._first_bad_step = torch.where(bad & (self._first_bad_step < 0), step, self._first_bad_step)
        return loss

    def warm_up_batches(self) -> list[list[int]]:
        """The batches whose shapes the compiled step is first made for: with shape buckets, the largest batch of
        each (padded up to its shape, it stands for all); otherwise the one with the most rows, the longest, the
        shortest, and one of a single row if there is one (a size of 1 is a shape torch.compile specializes for).
        Taken from the token-budget sampler's batches, the same on every process."""
        sampler = getattr(self, "batch_sampler", None)
        if not isinstance(sampler, TokenBatchSampler) or self._train_features is None:
            return []
        batches = sampler.batches_by_length()
        if sampler.shape_buckets is not None:
            largest = {}
            for batch in batches:  # shortest first: a batch's bucket is that of its last example
                width = int(sampler.lengths[batch[-1]])
                key = sampler.shape_buckets.shape(width)
                if len(batch) > len(largest.get(key, ())):
                    largest[key] = batch
            return list(largest.values())
        longest = [int(sampler.lengths[batch].max()) for batch in batches]
        chosen = [max(range(len(batches)), key=lambda i: len(batches[i])), int(np.argmax(longest)),
                  int(np.argmin(longest))]
        chosen += [i for i, batch in enumerate(batches) if len(batch) == 1][:1]
        return [batches[i] for i in dict.fromkeys(chosen)]

    def compile_before_the_clock(self) -> None:
        """Under `--torch_compile`, run the training step's forward and backward on `warm_up_batches` before the
        time budget's clock starts, so that torch.compile builds its graphs then rather than in the first timed
        steps (on a GPU a whole forward and backward compile takes tens of seconds). Without shape buckets the
        batches' sizes are marked dynamic first, so that one graph serves every later shape instead of a static
        graph followed by a dynamic one; with them, each declared shape gets its static graph. The gradients are
        dropped and the random state restored: training then starts as it would have.

        The Trainer's `--torch_compile_mode reduce-overhead` replays the compiled step as CUDA graphs, one recording
        per batch shape: with `--shape_buckets` each shape's is recorded here too (its second run; the first warms
        up). Both stay off by default until the GPU step-rate probe (`bench_training.py --shape_buckets`, engine
        `vaswani-compiled-graphs`, in benchmarks/results/training-graphs-cuda-*.md) measures them faster."""
        if not self.args.torch_compile:
            return
        batches = self.warm_up_batches()
        if not batches:
            logger.warning("--torch_compile without --max_tokens_per_batch: the step compiles within the first "
                           "timed steps.")
            return
        bucketed = self.batch_sampler.shape_buckets is not None
        graphed = bucketed and self.args.device.type == "cuda" and self.args.torch_compile_mode == "reduce-overhead"
        start = time.monotonic()
        model = self.model_wrapped
        devices = [self.args.device] if self.args.device.type == "cuda" else []
        # With buckets, one static graph per declared shape: under automatic dynamic shapes the second shape would
        # bring a graph with dynamic sizes instead, made for no size in particular. Every declared shape is compiled
        # here, so training then finds its graph without compiling.
        static = torch._dynamo.config.patch(automatic_dynamic_shapes=False) if bucketed else contextlib.nullcontext()
        with static, torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
            for indices in batches:
                collated = self._train_collate([self._train_features[i] for i in indices])
                # On the device already, where the marks stay (a copy made later would not carry them).
                batch = {name: tensor.to(self.args.device) for name, tensor in collated.items()}
                for tensor in batch.values() if not bucketed else ():
                    for dim in range(min(tensor.dim(), 2)):
                        torch._dynamo.maybe_mark_dynamic(tensor, dim)
                for _ in range(2 if graphed else 1):
                    samples, items = self.get_batch_samples(iter([batch]), 1, self.args.device)
                    self.training_step(model, samples[0], items)
                    model.zero_grad()
        self._first_bad_step = None  # a warm-up step is no training step
        self.compile_seconds = time.monotonic() - start
        logger.info("Compiled the training step on %d batch shapes%s in %.1f s, before training started.",
                    len(batches), " (shape buckets)" if bucketed else "", self.compile_seconds)

    def floating_point_ops(self, inputs: dict) -> int:
        """The Trainer's estimate (6 × tokens × non-embedding parameters), with the parameters counted once: the
        Trainer counts them again at every step, a walk over the whole module tree."""
        if self._non_embedding_parameters is None:
            self._non_embedding_parameters = self.model.num_parameters(exclude_embeddings=True)
        main_input = getattr(self.model, "main_input_name", "input_ids")
        return 6 * inputs[main_input].numel() * self._non_embedding_parameters if main_input in inputs else 0

    def log(self, logs: dict, *args, **kwargs) -> None:
        self.raise_on_nonfinite_loss()
        if self.training_started is not None:
            logs = {**logs, "elapsed_seconds": round(time.monotonic() - self.training_started, 2)}
        super().log(logs, *args, **kwargs)

    def raise_on_nonfinite_loss(self) -> None:
        if self._first_bad_step is not None and int(self._first_bad_step) >= 0:
            raise FloatingPointError(
                f"Training loss became NaN/inf at step {int(self._first_bad_step)}. Lower the learning rate, "
                "use bf16 instead of fp16, or check the data for empty or corrupted examples."
            )

    def before_checkpoint(self) -> None:
        self.raise_on_nonfinite_loss()

    def finish_checkpoint(self, directory: str) -> None:
        replace_pickled_arguments(directory, self.args)


def parse_overrides(text: str | None) -> dict:
    """'d_model=256,norm_first=true' → {'d_model': 256, 'norm_first': True} (values parsed as JSON where possible).
    An unknown field is an error: `VaswaniConfig` would keep it as an unused attribute, silently."""
    overrides = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"Config override {item!r} is not of the form field=value.")
        if key.strip() not in VaswaniConfig.__annotations__:
            raise ValueError(f"Config override {key.strip()!r} is not a VaswaniConfig field; known fields: "
                             f"{', '.join(VaswaniConfig.__annotations__)}.")
        try:
            overrides[key.strip()] = json.loads(value.strip().lower() if value.strip().lower() in ("true", "false", "null") else value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value.strip()
    return overrides


def load_splits(data_args: DataArguments):
    """→ DatasetDict with train / validation / test in the data module's schema (source, target[, references])."""
    return vdata.load_translation_dataset(
        data_args.dataset_name,
        data_args.dataset_config,
        data_file=data_args.corpus,
        default_corpus=data_args.default_corpus,
        source_lang=data_args.source_lang,
        target_lang=data_args.target_lang,
        cache_dir=data_args.data_cache_dir,
        overwrite_cache=data_args.overwrite_cache,
    )


def build_model_and_tokenizer(model_args: ModelArguments, new_tokenizer: PreTrainedTokenizerBase | None,
                              checkpoint: str | None = None):
    """A resumed run takes the tokenizer its checkpoint was trained with; its weights are loaded by the Trainer.
    `new_tokenizer` (`prepare_data`'s) is the tokenizer where no checkpoint or tokenizer is named."""
    tokenizer_source = checkpoint or model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if tokenizer_source:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    else:
        tokenizer = new_tokenizer
    if model_args.model_name_or_path:
        model = AutoModelForSeq2SeqLM.from_pretrained(
            model_args.model_name_or_path, use_safetensors=True, attn_implementation=model_args.attn_implementation
        )
        if model.config.vocab_size < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
        # Fine-tuning may give the model another tokenizer (grown by resizing): the new model records it.
        model.config.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        check_tokenizer_fits(model, tokenizer)
        return model, tokenizer
    config = VaswaniConfig.from_preset(
        model_args.preset,
        **{
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "decoder_start_token_id": tokenizer.bos_token_id,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            **parse_overrides(model_args.config_overrides),
        },
    )
    model = VaswaniForConditionalGeneration(config)
    if model_args.attn_implementation:
        model.set_attn_implementation(model_args.attn_implementation)
    return model, tokenizer


@dataclass
class PreparedData:
    splits: DatasetDict  # train / validation / test as read
    train: Dataset  # the splits used, after --max_train_samples / --max_eval_samples
    validation: Dataset
    tokenizer: PreTrainedTokenizerBase | None  # newly trained; None where a checkpoint's or a named one is used
    tokenizer_sentences: int | None  # how many sentences the new tokenizer learned from


def prepare_data(model_args: ModelArguments, data_args: DataArguments, args: VaswaniTrainingArguments,
                 checkpoint: str | None = None) -> PreparedData:
    """Read the corpus into its splits and train the tokenizer (unless one is given or resumed).

    Both leave their results in caches (see `vaswani.data` and `vaswani.tokenization`); under N processes the main
    one does the work first and the others then load its results instead of repeating it. A first run on a very
    large corpus can keep the others waiting longer than the process group's default 30 minutes: raise
    --ddp_timeout then.
    """
    with args.main_process_first(desc="reading the corpus"):
        splits = load_splits(data_args)
    train = splits["train"]
    if data_args.max_train_samples:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    validation = splits["validation"]
    if data_args.max_eval_samples:
        validation = validation.select(range(min(data_args.max_eval_samples, len(validation))))
    # Found now rather than as an obscure error at the first evaluation, or after training.
    for name, split, needed in (("train", train, True), ("validation", validation, args.eval_strategy != "no"),
                                ("test", splits["test"], True)):
        if needed and len(split) == 0:
            raise ValueError(f"The {name} split of the corpus is empty; use a larger corpus"
                             f"{' or --eval_strategy no' if name == 'validation' else ''}.")
    tokenizer = sentences = None
    if not (checkpoint or model_args.tokenizer_name_or_path or model_args.model_name_or_path):
        with args.main_process_first(desc="training the tokenizer"):
            tokenizer, sentences = cached_corpus_tokenizer(
                train, model_args.vocab_size, model_args.tokenizer_train_pairs, args.seed, data_args.overwrite_cache)
    return PreparedData(splits, train, validation, tokenizer, sentences)


def tokenize_splits(data: PreparedData, tokenizer, data_args: DataArguments, args: VaswaniTrainingArguments):
    """(train, validation) features, tokenized by the main process first and loaded from its cache by the others."""
    with args.main_process_first(desc="tokenizing"):
        return tuple(
            tokenize_translation_dataset(split, tokenizer, data_args.max_length, data_args.preprocessing_num_workers,
                                         data_args.overwrite_cache)
            for split in (data.train, data.validation))


def run_training(model_args: ModelArguments, data_args: DataArguments, args: VaswaniTrainingArguments) -> dict:
    """Train (or fine-tune), evaluate on the test split with sacreBLEU/chrF/TER, save a complete checkpoint
    (weights, tokenizer, generation config, module files, model card) and optionally push it to the Hub.
    Returns the final metrics. A run that fails leaves no output_dir behind unless it got as far as a checkpoint."""
    created = not os.path.exists(args.output_dir)
    try:
        return _run_training(model_args, data_args, args)
    except BaseException:
        if created and args.should_save and os.path.isdir(args.output_dir) and not os.listdir(args.output_dir):
            os.rmdir(args.output_dir)  # the Trainer creates it on start
        raise


def _run_training(model_args: ModelArguments, data_args: DataArguments, args: VaswaniTrainingArguments) -> dict:
    finished = finished_run(args.output_dir, args) if args.resume and not args.resume_from_checkpoint else None
    if finished is not None:
        # A requeued `--resume` of a run that has ended: nothing to train, and the final model stays as it is.
        logger.warning("--resume: %s holds the finished model of this run (newer than any checkpoint); nothing to "
                       "train. Ask for more steps, epochs or time to continue it from its last checkpoint.",
                       args.output_dir)
        return finished
    last_checkpoint = prepare_output_dir(args)  # refuses a bad output_dir before anything is read or written
    if last_checkpoint:
        check_resumed_weights(last_checkpoint)
    set_seed(args.seed)
    data = prepare_data(model_args, data_args, args, last_checkpoint)
    splits, validation = data.splits, data.validation
    model, tokenizer = build_model_and_tokenizer(model_args, data.tokenizer, last_checkpoint)
    if model.config.position_embedding_type == "learned":
        # `truncation=True` without a length then stops at the positions the model has.
        tokenizer.model_max_length = model.config.max_position_embeddings
    if last_checkpoint:
        check_checkpoint_matches(last_checkpoint, model.config)
    if args.paper_recipe:
        apply_paper_recipe(args, model.config.d_model)
    # Generation settings used for evaluation during training and saved as generation_config.json.
    model.generation_config.num_beams = args.generation_num_beams or 4
    if model.generation_config.num_beams > 1:  # a beam-search setting, which transformers refuses beside greedy
        model.generation_config.length_penalty = args.generation_length_penalty
    model.generation_config.max_new_tokens = args.generation_max_length or data_args.max_length
    model.generation_config.max_length = None

    train_features, validation_features = tokenize_splits(data, tokenizer, data_args, args)
    references = validation["references"] if "references" in validation.column_names else None

    clock = TrainingClock()
    time_budget = TimeBudgetCallback(args.max_train_time, clock) if args.max_train_time else None
    callbacks = [time_budget] if time_budget else []
    if args.ema_decay is not None:
        callbacks.append(WeightAverageCallback(args.ema_decay))
    if args.save_interval_seconds:
        callbacks.append(IntervalCheckpointCallback(args.save_interval_seconds, clock))
    # The final model is pushed once, complete, by `push_to_hub` below; the Trainer's own pushes (a repo set up at
    # the start and an upload at every save) would publish intermediate states.
    push, args.push_to_hub = args.push_to_hub, False
    # Tensor-core friendly shapes on GPUs; on a CPU the padding would only add work to short-sentence batches.
    pad_to = 8 if (args.bf16 or args.fp16) and args.device.type != "cpu" else None
    trainer = VaswaniSeq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=train_features,
        eval_dataset=validation_features if args.eval_strategy != "no" else None,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=pad_to),
        processing_class=tokenizer,
        compute_metrics=build_compute_metrics(tokenizer, references) if args.predict_with_generate else None,
        callbacks=callbacks,
        max_tokens_per_batch=args.max_tokens_per_batch,
        shape_buckets=args.shape_buckets,
        time_budget=time_budget,
    )
    if args.max_train_time and trainer.pop_callback(ProgressCallback) is not None:  # None: no bar (--disable_tqdm)
        trainer.add_callback(TimeBudgetProgressCallback(args.max_train_time))
    start = time.monotonic()
    try:
        train_result = trainer.train(resume_from_checkpoint=last_checkpoint)
    except BaseException:
        # An open progress bar would redraw itself after the error message, at exit; close it first.
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.close()
        raise
    train_seconds = time.monotonic() - start
    metrics = {f"train_{k}" if not k.startswith("train") else k: v for k, v in train_result.metrics.items()}
    if trainer.compile_seconds:
        # The Trainer's runtime counts from before the compilation; the rates are of the training after it.
        runtime = metrics["train_runtime"] - trainer.compile_seconds
        for name in ("train_samples_per_second", "train_steps_per_second"):
            if name in metrics:
                metrics[name] = round(metrics[name] * metrics["train_runtime"] / runtime, 3)
        metrics["train_runtime"] = round(runtime, 4)
    metrics["train_compile_seconds"] = round(trainer.compile_seconds, 2)
    metrics["train_wall_seconds"] = train_seconds
    metrics["train_steps"] = trainer.state.global_step
    metrics["train_world_size"] = args.world_size
    if data.tokenizer_sentences is not None:
        metrics["tokenizer_training_sentences"] = data.tokenizer_sentences
    if trainer.state.num_input_tokens_seen:  # with --include_num_input_tokens_seen non_padding
        metrics["train_source_tokens_per_second"] = trainer.state.num_input_tokens_seen / train_seconds

    if trainer.is_world_process_zero():
        test = splits["test"]
        if data_args.max_test_samples:
            test = test.select(range(min(data_args.max_test_samples, len(test))))
        references = test["references"] if "references" in test.column_names else [[t] for t in test["target"]]
        # Without the autocast that --bf16/--fp16 wrapped around forward: the report is what the saved weights give.
        model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False).eval()
        averaged = []
        if args.average_last_checkpoints:
            averaged = [path for path in checkpoints_in(args.output_dir) if is_complete_checkpoint(path)]
            averaged = averaged[-args.average_last_checkpoints:]
            if len(averaged) < args.average_last_checkpoints:
                logger.warning("--average_last_checkpoints %d: training wrote only %d checkpoints; averaging those.",
                               args.average_last_checkpoints, len(averaged))
            load_average(model, averaged)
            metrics["averaged_checkpoints"] = len(averaged)
        test_metrics = evaluate_model(
            model,
            tokenizer,
            test["source"],
            references,
            num_beams=model.generation_config.num_beams,
            max_new_tokens=model.generation_config.max_new_tokens,
            batch_size=args.per_device_eval_batch_size,
        )
        metrics.update({f"test_{k}": v for k, v in test_metrics.items() if k != "hypotheses"})
        metrics["test_sentences"] = len(test)
        save_final(trainer, tokenizer, args.output_dir, metrics, test_metrics["hypotheses"],
                   [os.path.basename(path) for path in averaged])
        if push:
            from .hub import push_to_hub

            push_to_hub(args.output_dir, args.hub_model_id or os.path.basename(args.output_dir.rstrip("/")),
                        token=args.hub_token, private=bool(args.hub_private_repo))
    return metrics


def end_distributed() -> None:
    """Destroy the process group, if one was started, before the process exits. Left for the interpreter's exit,
    gloo's threads can abort a process whose work is done ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def save_final(trainer, tokenizer, output_dir: str, metrics: dict, test_translations: Sequence[str] = (),
               averaged_checkpoints: list[str] = ()) -> None:
    """Write the final model through a staging directory whose files are moved into `output_dir` (which keeps its
    checkpoints and logs) with `config.json`, without which nothing loads, last (`files.staged_directory`): a crash
    never leaves a truncated file, nor the weights of one model beside the config of another. `test_translations`,
    the test split's hypotheses in its order, go to `test_translations.txt` (one a line), so that the reported
    scores can be recomputed against the split's references."""
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
        command = shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
        write_model_card(staging, metrics=metrics, training_command=command, averaged_checkpoints=averaged_checkpoints)


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
    none did: a final model is complete once its `config.json` is there (`save_final` moves it in last), and it is
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
    recorded = os.path.join(output_dir, "training_args.json")
    if args is not None and os.path.isfile(recorded):
        with open(recorded, encoding="utf-8") as f:
            trained = json.load(f)
        if any(trained.get(name) != getattr(args, name) for name in TRAINING_LENGTH):
            return None
    metrics = os.path.join(output_dir, "metrics.json")
    if not os.path.isfile(metrics):
        return {}
    with open(metrics, encoding="utf-8") as f:
        return json.load(f)


def check_resumed_weights(checkpoint: str) -> None:
    """The weights of the checkpoint to resume from, checked complete (`checkpoints.check_weights`) before anything
    is read: a damaged checkpoint is named in one line, not in a traceback from inside the Trainer. FSDP's sharded
    checkpoints keep their weights in directories of their own, which the Trainer reads."""
    if not any(name.startswith(FSDP_MODEL_NAME) for name in os.listdir(checkpoint)):
        check_weights(checkpoint)


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
    * `--overwrite_output_dir`: earlier checkpoints are deleted (they would mix with the new run's in rotation
      and resumption); the final model files are replaced when the new one is saved.
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
        if args.should_save:
            for path in checkpoints + staging:
                shutil.rmtree(path)
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


def check_checkpoint_matches(checkpoint: str, config: VaswaniConfig) -> None:
    """A resumed run must build the model its checkpoint holds; otherwise loading the weights fails deep inside
    torch (shape mismatch) or, worse, succeeds with a different configuration."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        model_type = json.load(f).get("model_type")
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
