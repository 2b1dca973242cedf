"""Training a Vaswani translator with the `transformers` Seq2SeqTrainer, organised as transformers'
`run_translation.py`: `run_training` reads as its steps (check the output directory, read the corpus, build the
model and tokenizer, tokenize, train, evaluate on the test split, save), and each step's machinery lives in a
module of its own:

* `vaswani.training_arguments`: `ModelArguments`, `DataArguments`, `VaswaniTrainingArguments` and their checks;
* `vaswani.training_clock`: the run's one clock, carried over a resume, and the slow steps it spots;
* `vaswani.training_callbacks`: the time budget, interval checkpoints, weight average and progress bar;
* `vaswani.trainer`: `VaswaniSeq2SeqTrainer`, the Trainer subclass with token-budget batches;
* `vaswani.run_directory`: the output directory's life cycle, from resume checks to the final model's save.

`accelerate launch` / `torchrun` run the same script with DDP (or FSDP2 on GPUs, with `--fsdp`). The names that
users, scripts and tests import from `vaswani.training` stay importable from here.
"""

import itertools
import logging
import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from datasets import Dataset, DatasetDict
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerBase,
    ProgressCallback,
    set_seed,
)

from . import data as vdata
from . import files
from .batching import TokenBatchSampler, example_lengths
from .checkpoints import checkpoints_in, is_complete_checkpoint, load_average
from .configuration_vaswani import VaswaniConfig, check_tokenizer_fits, decoder_start_token_id, tokenizer_fingerprint
from .decoding_settings import write_decoding_defaults
from .modeling_vaswani import VaswaniForConditionalGeneration
from .peers import PeerLost, Peers, peer_lost
from .preemption import PreemptionCallback, catching_stop_signals
from .run_directory import (
    check_checkpoint_matches,
    check_resumed_weights,
    finished_run,
    holds_final_model,
    kept_after_a_full_disk,
    kept_after_a_lost_process,
    prepare_output_dir,
    remove_old_checkpoints,
    replace_pickled_arguments,
    save_final,
)
from .sizing import DEFAULT_SIZE, SIZES, TIMED_STEPS, WARM_UP_STEPS, SizeChoice, auto_size
from .tokenization import cached_corpus_tokenizer, tokenize_translation_dataset
from .trainer import ShapePaddedCollator, VaswaniSeq2SeqTrainer, decoding_model, score_split
from .training_arguments import (
    AUTO_PRESET,
    MAX_SHAPE_BUCKETS,
    DataArguments,
    ModelArguments,
    VaswaniTrainingArguments,
    apply_paper_recipe,
    parse_overrides,
)
from .training_callbacks import (
    IntervalCheckpointCallback,
    TimeBudgetCallback,
    TimeBudgetProgressCallback,
    WeightAverageCallback,
    callbacks_for,
)
from .training_clock import TrainingClock

__all__ = [
    "MAX_SHAPE_BUCKETS", "DataArguments", "IntervalCheckpointCallback", "ModelArguments", "PreparedData",
    "ShapePaddedCollator", "TimeBudgetCallback", "TrainingClock", "VaswaniSeq2SeqTrainer", "VaswaniTrainingArguments",
    "WeightAverageCallback", "apply_paper_recipe", "build_model_and_tokenizer", "check_checkpoint_matches",
    "check_resumed_weights", "finished_run", "holds_final_model", "load_splits",
    "parse_overrides", "prepare_data", "prepare_output_dir", "replace_pickled_arguments", "run_training",
    "save_final", "tokenize_splits",
]

logger = logging.getLogger(__name__)


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
    elif checkpoint and model_args.preset == AUTO_PRESET:
        # The size that `--preset auto` chose when the run began: the checkpoint's.
        model = model_of(VaswaniConfig.from_pretrained(checkpoint), model_args)
    else:
        model = new_model(model_args, tokenizer)
    if model.config.position_embedding_type == "learned":
        # `truncation=True` without a length then stops at the positions the model has.
        tokenizer.model_max_length = model.config.max_position_embeddings
    return model, tokenizer


def new_model(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase,
              size: str | None = None) -> VaswaniForConditionalGeneration:
    """A new model of `--preset` with `--config_overrides`, its vocabulary and special tokens those of `tokenizer`.
    Under `--preset auto`, of `size` (one of `vaswani.sizing.SIZES`, the `small` preset's fields changed; by default
    the first), the overrides applied on top."""
    preset, fields = model_args.preset, {}
    if preset == AUTO_PRESET:
        preset, fields = "small", SIZES[size or next(iter(SIZES))]
    config = VaswaniConfig.from_preset(
        preset,
        **{
            **fields,
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "decoder_start_token_id": decoder_start_token_id(tokenizer),
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            **parse_overrides(model_args.config_overrides),
        },
    )
    return model_of(config, model_args)


def model_of(config: VaswaniConfig, model_args: ModelArguments) -> VaswaniForConditionalGeneration:
    """A new model of `config`, with `--attn_implementation` where one is named."""
    model = VaswaniForConditionalGeneration(config)
    if model_args.attn_implementation:
        model.set_attn_implementation(model_args.attn_implementation)
    return model


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


def run_training(model_args: ModelArguments, data_args: DataArguments, args: VaswaniTrainingArguments, *,
                 command: Sequence[str] = ()) -> dict:
    """Train (or fine-tune), evaluate on the test split with sacreBLEU/chrF/TER, save a complete checkpoint
    (weights, tokenizer, generation config, module files, model card) and optionally push it to the Hub.
    `command` is the command line that started the run, program name first, for the model card (the script passes
    it down: the package never reads the process' arguments). Returns the final metrics. A run that fails leaves no
    output_dir behind unless it got as far as a checkpoint.

    The main process holds `output_dir`'s lock (`files.exclusive`) for the whole run: a second run on it is refused
    in one line. On SIGTERM or SIGINT the run writes a checkpoint at the next step boundary and raises
    `vaswani.preemption.Preempted`, which names the command that resumes it. Where another process of the launch
    dies, the others raise `vaswani.peers.PeerLost`, which names it, the last complete checkpoint and the command
    that resumes from it."""
    created = not os.path.exists(args.output_dir)
    peers = Peers.gather()
    # The stop signals' handler outlives a failed training until its end is told: torchrun's agent sends SIGTERM to
    # the survivors of a process that died, which must not end one while it works out which process that was, nor
    # (held from then on) before it has said so.
    preemption = PreemptionCallback()
    with catching_stop_signals(preemption.request, holding_after=(PeerLost,)):
        try:
            with files.exclusive(args.output_dir) if args.process_index == 0 else nullcontext():
                return _run_training(model_args, data_args, args, command, preemption)
        except BaseException as error:
            if created and args.should_save and os.path.isdir(args.output_dir) and not os.listdir(args.output_dir):
                os.rmdir(args.output_dir)  # the Trainer creates it on start
            lost = peers.lost(error) if peers and isinstance(error, Exception) else None
            if lost:
                raise peer_lost(lost, "run", args.process_index,
                                f"{kept_after_a_lost_process(args.output_dir, command)}.") from None
            raise


def _run_training(model_args: ModelArguments, data_args: DataArguments, args: VaswaniTrainingArguments,
                  command: Sequence[str], preemption: PreemptionCallback) -> dict:
    if model_args.preset == AUTO_PRESET and args.world_size > 1 and not model_args.model_name_or_path:
        raise ValueError(f"--preset auto sizes the model by timing steps in one process; under {args.world_size} "
                         "processes name the size instead: --preset small, with --config_overrides for the fields "
                         "of another size (vaswani.sizing.SIZES).")
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
    initial_random_state = torch.random.get_rng_state()
    model, tokenizer = build_model_and_tokenizer(model_args, data.tokenizer, last_checkpoint)
    if last_checkpoint:
        check_checkpoint_matches(last_checkpoint, model.config)
    remove_old_checkpoints(args)
    train_features, validation_features = tokenize_splits(data, tokenizer, data_args, args)
    sizing = None
    if model_args.preset == AUTO_PRESET and not (last_checkpoint or model_args.model_name_or_path):
        sizing = choose_size(model_args, tokenizer, train_features, args)
        # The chosen size starts from the random state a named preset's model starts from, so that it is the model
        # that `--preset small --config_overrides <its fields>` would train.
        torch.random.set_rng_state(initial_random_state)
        model = new_model(model_args, tokenizer, sizing.size)
        args.learning_rate = sizing.learning_rate  # the one named, else the size's own peak (its BLEU's)
    if args.paper_recipe:
        apply_paper_recipe(args, model.config.d_model)
    # The decoding settings of the evaluations, saved with the model for every later decoding of it.
    generation = model.generation_config
    write_decoding_defaults(generation, num_beams=args.generation_num_beams or generation.num_beams,
                            length_penalty=args.generation_length_penalty, max_new_tokens=args.generation_max_length,
                            max_length=model.config.max_position_embeddings)
    # The final model is pushed once, complete, at the end; the Trainer's own pushes (a repo set up at the start and
    # an upload at every save) would publish intermediate states.
    push, args.push_to_hub = args.push_to_hub, False
    trainer = build_trainer(model, tokenizer, args, train_features, validation_features, data.validation)
    if sizing is not None:
        trainer.seconds_before_training = sizing.seconds  # timing the sizes counts in the time budget
    trainer.add_callback(preemption)
    preemption.listening = True  # until training returns; where it raises, until the run's end is told
    metrics = train(trainer, last_checkpoint)
    preemption.listening = False
    if preemption.stopped_by:
        raise preemption.stopped(args.output_dir, trainer.state.global_step, command)
    if data.tokenizer_sentences is not None:
        metrics["tokenizer_training_sentences"] = data.tokenizer_sentences
    if sizing is not None:
        metrics.update(sizing.metrics())
    if trainer.is_world_process_zero():
        test = data.splits["test"]
        if data_args.max_test_samples:
            test = test.select(range(min(data_args.max_test_samples, len(test))))
        model, averaged = final_model(trainer)
        if args.average_last_checkpoints:
            metrics["averaged_checkpoints"] = len(averaged)
        hypotheses = ()
        if data_args.max_test_samples != 0:  # 0: the saved model is scored by another process
            test_metrics = score_split(model, tokenizer, test, args.per_device_eval_batch_size)
            hypotheses = test_metrics.pop("hypotheses")
            metrics.update({f"test_{k}": v for k, v in test_metrics.items()})
            metrics["test_sentences"] = len(test)
        with files.reporting_full_disk(args.output_dir, lambda: kept_after_a_full_disk(args.output_dir)):
            save_final(trainer, tokenizer, args.output_dir, metrics, hypotheses,
                       [os.path.basename(path) for path in averaged], command=command)
        if push:
            from .hub import push_to_hub

            push_to_hub(args.output_dir, args.hub_model_id or os.path.basename(args.output_dir.rstrip("/")),
                        token=args.hub_token, private=bool(args.hub_private_repo))
    return metrics


def choose_size(model_args: ModelArguments, tokenizer, train_features: Dataset,
                args: VaswaniTrainingArguments) -> SizeChoice:
    """`--preset auto`'s size (`vaswani.sizing`), timed on the run's first training batches (`timing_batches`),
    under its precision and on its device, or as recorded for this machine and these batches and model fields."""
    named = sorted(set(parse_overrides(model_args.config_overrides)) & {f for fields in SIZES.values() for f in fields})
    if named:  # the user's fields win over any size's: nothing to time
        choice = SizeChoice(DEFAULT_SIZE, f"--config_overrides sets {', '.join(named)}, which the sizes differ in",
                            0.0, {}, {}, {}, named_learning_rate(args))
        print(choice.line, file=sys.stderr, flush=True)
        return choice
    batches = timing_batches(tokenizer, train_features, args)
    recipe = {"config_overrides": model_args.config_overrides, "attn_implementation": model_args.attn_implementation,
              "vocab_size": len(tokenizer)}
    return auto_size(lambda size: new_model(model_args, tokenizer, size), batches, device=args.device,
                     autocast_dtype=autocast_dtype(args), max_train_time=args.max_train_time, max_steps=args.max_steps,
                     recipe=recipe, named_learning_rate=named_learning_rate(args))


def named_learning_rate(args: VaswaniTrainingArguments) -> float | None:
    """The run's --learning_rate where it names one."""
    return args.learning_rate if args.learning_rate_named else None


def autocast_dtype(args: VaswaniTrainingArguments) -> torch.dtype | None:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


def timing_batches(tokenizer, train_features: Dataset, args: VaswaniTrainingArguments) -> list[dict]:
    """The run's first training batches as the trainer will draw them (token-budget batches with
    --max_tokens_per_batch), collated: what `--preset auto` times its sizes on."""
    count = WARM_UP_STEPS + TIMED_STEPS
    if args.max_tokens_per_batch:
        sampler = TokenBatchSampler(example_lengths(train_features), args.max_tokens_per_batch, shuffle=True,
                                    seed=args.seed)
        indices = list(itertools.islice(iter(sampler), count))
    else:
        rows = args.per_device_train_batch_size
        indices = [list(range(start, min(start + rows, len(train_features))))
                   for start in range(0, min(len(train_features), count * rows), rows)]
    indices = (indices * count)[:count]  # a corpus of fewer batches repeats them
    features = train_features.select_columns(["input_ids", "attention_mask", "labels"])
    collate = DataCollatorForSeq2Seq(tokenizer)
    return [collate([features[int(i)] for i in batch]) for batch in indices]


def build_trainer(model, tokenizer, args: VaswaniTrainingArguments, train_features: Dataset,
                  validation_features: Dataset, validation: Dataset) -> VaswaniSeq2SeqTrainer:
    """The run's trainer, with the callbacks its arguments ask for and, under a time budget, a progress bar that
    counts the budget's seconds."""
    callbacks, time_budget = callbacks_for(args)
    trainer = VaswaniSeq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=train_features,
        eval_dataset=validation_features if args.eval_strategy != "no" else None,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=args.pad_to_multiple_of),
        processing_class=tokenizer,
        eval_texts=validation,
        callbacks=callbacks,
        max_tokens_per_batch=args.max_tokens_per_batch,
        shape_buckets=args.shape_buckets,
        packing=args.packing,
        time_budget=time_budget,
    )
    if args.max_train_time and trainer.pop_callback(ProgressCallback) is not None:  # None: no bar (--disable_tqdm)
        trainer.add_callback(TimeBudgetProgressCallback(args.max_train_time, trainer.clock))
    return trainer


def train(trainer: VaswaniSeq2SeqTrainer, last_checkpoint: str | None) -> dict:
    """Train (from `last_checkpoint`, if any) and return the Trainer's metrics, all named `train_*`, their runtime
    and rates read from the run's clock (`VaswaniSeq2SeqTrainer.clocked_metrics`)."""
    try:
        train_result = trainer.train(resume_from_checkpoint=last_checkpoint)
    except BaseException:
        TimeBudgetProgressCallback.close_bars(trainer)
        raise
    metrics = trainer.clocked_metrics(train_result.metrics)
    metrics = {f"train_{k}" if not k.startswith("train") else k: v for k, v in metrics.items()}
    metrics["train_steps"] = trainer.state.global_step
    metrics["train_world_size"] = trainer.args.world_size
    metrics["train_padding_fraction"] = trainer.padding_fraction()
    # A list, so not among the logged metrics: the Trainer's loggers (TensorBoard's) take scalars and strings only.
    metrics["train_slow_steps_named"] = trainer.slow_steps.named
    return metrics


def final_model(trainer: VaswaniSeq2SeqTrainer):
    """The model to evaluate and save, in eval mode, and the checkpoints averaged into it (`--average_last_checkpoints`;
    otherwise none): without the autocast that --bf16/--fp16 wrapped around forward, so that the report is what
    the saved weights give."""
    args = trainer.args
    model = decoding_model(trainer)[0].eval()
    averaged = []
    if args.average_last_checkpoints:
        averaged = [path for path in checkpoints_in(args.output_dir) if is_complete_checkpoint(path)]
        averaged = averaged[-args.average_last_checkpoints:]
        if len(averaged) < args.average_last_checkpoints:
            logger.warning("--average_last_checkpoints %d: training wrote only %d checkpoints; averaging those.",
                           args.average_last_checkpoints, len(averaged))
        load_average(model, averaged)
    return model, averaged
