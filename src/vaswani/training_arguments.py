"""The training script's arguments, as transformers' `run_translation.py` has them: a `ModelArguments`, a
`DataArguments` and the Trainer's own `Seq2SeqTrainingArguments` extended with a time budget, token-budget batches
and the paper's recipe, parsed by `HfArgumentParser`, so every Trainer flag (bf16, gradient accumulation, FSDP on
GPUs, `--push_to_hub`, `--report_to`) works unchanged. Each dataclass checks its values when it is made, before any
data is read or anything is written; `apply_paper_recipe` and the time-budget schedules' shapes live here too.
"""

import json
import math
import os
from dataclasses import dataclass, field

import torch
from transformers import Seq2SeqTrainingArguments
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_vaswani import VaswaniConfig
from .corpus import CORPUS_ENV_VAR
from .tokenization import TRUNCATION_TOKENS


# The Trainer's default peak learning rate, where none is named: read from its field, not written again here.
TRAINER_LEARNING_RATE = Seq2SeqTrainingArguments.__dataclass_fields__["learning_rate"].default

# `--preset auto`: a `small`-preset model sized to the machine and the time budget by timing steps (vaswani.sizing).
AUTO_PRESET = "auto"


@dataclass
class ModelArguments:
    preset: str = field(default="small", metadata={
        "help": f"Config preset for a new model: {VaswaniConfig.PRESETS}, or {AUTO_PRESET!r}: a small model whose "
                "width and depth are chosen for this machine and --max_train_time (or --max_steps), by timing a few "
                "steps of each size at the start (counted in the budget) and the validation BLEU each size reached "
                "after so many steps (vaswani.sizing). --config_overrides apply on top of the size chosen."})
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
        if self.preset not in (*VaswaniConfig.PRESETS, AUTO_PRESET):
            raise ValueError(f"Unknown --preset {self.preset!r}; choose one of "
                             f"{', '.join((*VaswaniConfig.PRESETS, AUTO_PRESET))}.")
        if self.vocab_size < 1:
            raise ValueError(f"--vocab_size must be positive, got {self.vocab_size}.")
        for flag in ("model_name_or_path", "tokenizer_name_or_path"):
            path = getattr(self, flag)
            if path and os.path.isfile(path):
                raise NotADirectoryError(f"--{flag} {path} is a file; give the checkpoint directory (or a Hub id).")
        if self.tokenizer_train_pairs is not None and self.tokenizer_train_pairs < 1:
            raise ValueError(f"--tokenizer_train_pairs must be positive, got {self.tokenizer_train_pairs}.")
        # Raises on a bad value; every size of `auto` is the small preset with some fields changed.
        VaswaniConfig.from_preset("small" if self.preset == AUTO_PRESET else self.preset,
                                  **parse_overrides(self.config_overrides))
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
    max_length: int = field(default=TRUNCATION_TOKENS,
                            metadata={"help": "Truncate training sources and targets to this many tokens."})
    max_train_samples: int | None = None
    max_eval_samples: int | None = field(default=None, metadata={"help": "Validation sentences used while training."})
    max_test_samples: int | None = field(default=None, metadata={
        "help": "Test sentences for the final evaluation; 0: none, the saved model is scored elsewhere (in a process "
                "of its own, so that a failure of the scoring leaves the model and its training metrics)."})
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
            value, least = getattr(self, name), 0 if name == "max_test_samples" else 1
            if value is not None and value < least:
                raise ValueError(f"--{name} must be a {'non-negative' if least == 0 else 'positive'} number, "
                                 f"got {value}.")


# torch.compile's default `recompile_limit`: the graphs it keeps of one function, beyond which it runs it uncompiled.
MAX_SHAPE_BUCKETS = 8


def check_batching(max_tokens_per_batch: int | None, shape_buckets: int | None = None, packing: bool = False) -> None:
    """The batching options that go together, checked once for the command line and the trainer alike: shape
    buckets and packing shape token-budget batches, packing gives every batch one shape already, and torch.compile
    keeps at most `MAX_SHAPE_BUCKETS` graphs of a step."""
    if packing and not max_tokens_per_batch:
        raise ValueError("--packing packs token-budget batches; it needs --max_tokens_per_batch.")
    if packing and shape_buckets is not None:
        raise ValueError("--packing gives every batch one shape already; drop --shape_buckets.")
    if shape_buckets is not None:
        if not max_tokens_per_batch:
            raise ValueError("--shape_buckets pads token-budget batches; it needs --max_tokens_per_batch.")
        if shape_buckets > MAX_SHAPE_BUCKETS:
            raise ValueError(f"--shape_buckets {shape_buckets}: torch.compile keeps at most {MAX_SHAPE_BUCKETS} "
                             f"graphs of a step and runs any further shape uncompiled; give at most "
                             f"{MAX_SHAPE_BUCKETS}.")


@dataclass
class VaswaniTrainingArguments(Seq2SeqTrainingArguments):
    learning_rate: float | None = field(
        default=None,
        metadata={"help": "The peak learning rate. Default: under --preset auto, the chosen size's "
                          "(vaswani.sizing.PEAK_LEARNING_RATE, measured with the main job's recipe); otherwise the "
                          f"Trainer's {TRAINER_LEARNING_RATE:g}."},
    )
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
                          "(rows, length) shapes, chosen from the data before training, so that a compiled step has "
                          "that many static graphs, all compiled before the clock starts; under --torch_compile_mode "
                          "reduce-overhead on CUDA each is recorded once as a CUDA graph and replayed. Off by default "
                          "until a GPU decides: the padding costs work, and the GPU plan's probe-4000-graphs and "
                          f"probe-25000 stages measure whether the graphs repay it. At most {MAX_SHAPE_BUCKETS}."},
    )
    pad_to_multiple_of: int | None = field(
        default=None,
        metadata={"help": "Pad each side of a training batch to a multiple of this many positions (8 is the habit "
                          "for GPUs' tensor cores in 16-bit precision); --max_tokens_per_batch counts that padding. "
                          "None by default: on a CPU a multiple of 8 trained 0.78x the real tokens a second "
                          "(benchmarks/results/training-cpu-packing.md); on a GPU the plan's probe-4000-packed stage "
                          "decides."},
    )
    packing: bool = field(
        default=False,
        metadata={"help": "With --max_tokens_per_batch: several sentence pairs per row, one after another on both "
                          "sides, positions restarting at each pair and attention kept within it, every batch of one "
                          "shape (1-3%% of the positions padding on fra-eng); the loss and its gradients are those of "
                          "the same pairs unpacked. Needs sdpa or eager attention. Off by default: on a CPU it "
                          "trained 1.02x the real tokens a second of the bucketed batches "
                          "(benchmarks/results/training-cpu-packing.md); on a GPU the plan's probe-4000-packed stage "
                          "decides."},
    )
    compile_cache: str | None = field(
        default=None,
        metadata={"help": "With --torch_compile: a file of torch.compile's portable cache "
                          "(torch.compiler.save_cache_artifacts), loaded before the step compiles where it exists and "
                          "written once the step has compiled, so that a repeated or resumed run on the same kind of "
                          "device, with the same torch, skips most of the compilation "
                          "(benchmarks/results/compile-cache-cpu.md)."},
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
    generation_num_beams: int | None = field(
        default=4,
        metadata={"help": "Beam size saved in generation_config.json, with which the evaluations during and after "
                          "training and every later decoding of the model translate (4 is the paper's, §6.1). None: "
                          "the fine-tuned checkpoint's own."},
    )
    generation_max_length: int | None = field(
        default=None,
        metadata={"help": "At most this many new tokens per translation, saved in generation_config.json. Default: "
                          "each source's length plus 50 (§6.1), up to where learned positions end."},
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
        # Whether the run names its learning rate: under --preset auto, the size chosen brings its own otherwise.
        self.learning_rate_named = self.learning_rate is not None
        if self.learning_rate is None:
            self.learning_rate = TRAINER_LEARNING_RATE
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available():
            # Several processes (torchrun) on a machine without an accelerator: accelerate makes them a DDP run over
            # gloo only when told `cpu`. Without it, it starts the process group yet leaves every process on its
            # own: no gradient all-reduce (each trains a model of its own), no barrier in `wait_for_everyone` (a
            # checkpoint is published before the other processes wrote their random state into it).
            self.use_cpu = True
        if self.ddp_find_unused_parameters is None:
            # Every parameter takes part in every step. Left unset, the Trainer would ask DDP to search the autograd
            # graph for unused ones at every step, and read values back to the host to do it.
            self.ddp_find_unused_parameters = False
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
        for name in ("max_train_time", "max_tokens_per_batch", "shape_buckets", "pad_to_multiple_of",
                     "save_interval_seconds", "average_last_checkpoints", "generation_num_beams",
                     "generation_max_length"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name} must be positive, got {value}.")
        check_batching(self.max_tokens_per_batch, self.shape_buckets, self.packing)
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
            if scheduler_name(self) not in TIME_SCHEDULES:
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


def scheduler_name(args: Seq2SeqTrainingArguments) -> str:
    """`--lr_scheduler_type` as a plain name ("linear"): the Trainer turns the flag into a `SchedulerType` member."""
    return str(args.lr_scheduler_type).split(".")[-1].lower()


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

