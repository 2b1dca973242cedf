"""The Trainer of a training run: `Seq2SeqTrainer` with token-budget batches (optionally padded up to a few declared
shapes), a non-finite loss check that adds no host synchronisation, crash-safe checkpoints, a learning-rate schedule
over a time budget, and the training step compiled before any clock starts."""

import contextlib
import logging
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import Seq2SeqTrainer
from transformers.trainer_utils import get_last_checkpoint

from .batching import ShapeBuckets, TokenBatchSampler, example_lengths, pad_to_shape
from .evaluation import evaluate_model
from .files import write_atomically
from .packing import PackedBatchSampler, PackedSeq2SeqCollator
from .run_directory import replace_pickled_arguments
from .trainer_internals import StagedCheckpoints, prepare_uneven_loader
from .training_arguments import check_batching, scheduler_name
from .training_callbacks import StartTheClockCallback, TimeBudgetCallback, time_budget_schedule
from .training_clock import (
    SlowSteps,
    TrainingClock,
    compile_cache_hits,
    compiled_graphs,
    read_clock,
    write_clock,
)

logger = logging.getLogger(__name__)


def mark_sizes_dynamic(batch: dict) -> None:
    """Mark the batch and length dimensions of a batch's tensors dynamic, so that the step torch.compile builds on
    it is one graph for every batch shape, not a static graph for this shape and then another. The marks stay on
    these tensors only: mark them where they are on the device the step runs on."""
    for tensor in batch.values():
        for dim in range(min(tensor.dim(), 2)):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


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
      (`shape_buckets`, a count: `TokenBatchSampler`, `ShapePaddedCollator`), or with `packing` several pairs a
      row, every batch of one shape (`PackedBatchSampler`, `PackedSeq2SeqCollator`; the model keeps each pair to
      itself). Every logged training line carries `padding_fraction`: the share of the positions computed so far,
      both sides, that were padding, summed on the device and read at logging time only;
    * a check that stops on a non-finite loss and names the step, instead of training through NaNs. The first bad
      step is kept on the device, so the check adds no host synchronisation per step; it is read at each logging
      step and before each checkpoint, so that no checkpoint holds weights a NaN has reached;
    * checkpoints that are never visible half-written (`trainer_internals.StagedCheckpoints`), resumable and rotated
      as the Trainer's own. The pickled `training_args.bin` is replaced by `training_args.json`;
    * the run's one clock (`clock`, a `TrainingClock`), started once the training step is compiled (under
      `--torch_compile`, `compile_before_the_clock`, its seconds kept in `compile_seconds`, the graphs compiled
      after it in the final metrics' `train_graphs_compiled_on_the_clock`), recorded in every
      checkpoint and carried on by a run that resumes from one; every logged line carries the seconds of training
      so far (`elapsed_seconds`). A step whose forward and backward took far longer than the median step is logged
      with its batch's shape and the graphs compiled during it (`training_clock.SlowSteps`), and counted in the
      final metrics' `train_slow_steps` and `train_slow_steps_seconds`, those that compiled a graph in
      `train_slow_steps_recompiling`, the first ones by step in `train_slow_steps_named` (a list: in `metrics.json`
      only, not logged, since the Trainer's loggers take scalars);
    * with `eval_texts` (the evaluation split's text, in `eval_dataset`'s order) and `predict_with_generate`,
      `evaluate()` scores the translations of the package's one translation path (`score_split`), as the final
      test evaluation does, beside the Trainer's own evaluation loss (`evaluation_loop`).
    """

    def __init__(self, *args, max_tokens_per_batch: int | None = None, shape_buckets: int | None = None,
                 packing: bool = False, time_budget: TimeBudgetCallback | None = None,
                 eval_texts: Dataset | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.eval_texts = eval_texts
        self._score_translations = False
        check_batching(max_tokens_per_batch, shape_buckets or None, packing)
        self.max_tokens_per_batch = max_tokens_per_batch
        self.shape_buckets = shape_buckets
        self.packing = packing
        self._real_positions = None  # on the device: the non-padding positions trained on so far, both sides
        self._computed_positions = 0
        self._train_collate = self.data_collator
        self.time_budget = time_budget
        self.time_budget_schedule = None
        self._first_bad_step = None
        self._non_embedding_parameters = None
        self._train_features = None
        self.compile_seconds = 0.0
        self.compile_cache_hits = 0
        self.graphs_before_the_clock = 0  # torch.compile's graphs when the clock started (`StartTheClockCallback`)
        self.slow_steps = SlowSteps()
        self.clock = TrainingClock()
        # First, so that the compilation ends before any other callback starts a clock.
        self.callback_handler.callbacks.insert(0, StartTheClockCallback(self))
        # The Trainer's own NaN/inf filter reads every step's loss back to the host (`isnan(loss) or isinf(loss)`),
        # which makes the host wait for the device once a step. The device-side check below replaces it, and stops
        # the run where the filter would have trained on.
        self.args.logging_nan_inf_filter = False

    # Seconds of the run spent before training that its time budget counts (timing `--preset auto`'s sizes).
    seconds_before_training = 0.0

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """The Trainer's `train`, with the run's clock carried on from the checkpoint it resumes from (for a run
        that starts, from `seconds_before_training`)."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        self.clock.resume(read_clock(checkpoint) if checkpoint else self.seconds_before_training)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        if not self.max_tokens_per_batch:
            return super().get_train_dataloader()
        dataset = self._train_features = self.unused_columns_removed(self.train_dataset, description="training")
        # The budget counts what the device computes: the collator's padding to a multiple included.
        pad_to = getattr(self.data_collator, "pad_to_multiple_of", None)
        if self.packing:
            self.batch_sampler = PackedBatchSampler(
                *example_lengths(dataset, sides=True), self.max_tokens_per_batch, shuffle=True, seed=self.args.seed,
                num_replicas=self.args.world_size, pad_to_multiple_of=pad_to)
            tokenizer = getattr(self.data_collator, "tokenizer", None) or self.processing_class
            self._train_collate = PackedSeq2SeqCollator(self.batch_sampler.shape, tokenizer.pad_token_id)
            logger.info("Packed batches of %s: %.1f%% of their positions are padding.", self.batch_sampler.shape,
                        100 * self.batch_sampler.padding_fraction())
            return self._train_loader(dataset)
        self.batch_sampler = TokenBatchSampler(example_lengths(dataset), self.max_tokens_per_batch,
                                               shuffle=True, seed=self.args.seed, num_replicas=self.args.world_size,
                                               pad_to_multiple_of=pad_to, shape_buckets=self.shape_buckets)
        self._train_collate = self.data_collator
        if self.batch_sampler.shape_buckets is not None:
            tokenizer = getattr(self.data_collator, "tokenizer", None) or self.processing_class
            self._train_collate = ShapePaddedCollator(self.data_collator, self.batch_sampler.shape_buckets, {
                "input_ids": tokenizer.pad_token_id, "attention_mask": 0, "labels": -100,  # the loss ignores -100
                "decoder_input_ids": self.model.config.pad_token_id, "decoder_attention_mask": 0})
        return self._train_loader(dataset)

    def _train_loader(self, dataset: Dataset) -> DataLoader:
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
                optimizer or self.optimizer, scheduler_name(self.args),
                self.args.get_warmup_steps(num_training_steps), self.time_budget,
            )
        return super().create_scheduler(num_training_steps, optimizer)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if "labels" in inputs:
            # Counted on the device (a sum read now would make the host wait for it); the shapes are host numbers.
            source = inputs.get("attention_mask")
            real = (inputs["labels"] != -100).sum() + (
                source.sum() if source is not None else inputs["input_ids"].numel())
            self._real_positions = real if self._real_positions is None else self._real_positions + real
            self._computed_positions += inputs["input_ids"].numel() + inputs["labels"].numel()
        graphs, start = compiled_graphs(), time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.clock.started:  # the warm-up's steps, which compile by design, are not judged
            shapes = {name: tuple(inputs[name].shape) for name in ("input_ids", "labels") if name in inputs}
            self.slow_steps.add(self.state.global_step + 1, time.perf_counter() - start, shapes,
                                compiled_graphs() - graphs)
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
        if isinstance(sampler, PackedBatchSampler) and self._train_features is not None:
            return sampler.batches(epoch=0)[:1]  # every packed batch has the one shape
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
        bucketed = self.packing or self.batch_sampler.shape_buckets is not None  # declared shapes, static graphs
        graphed = bucketed and self.args.device.type == "cuda" and self.args.torch_compile_mode == "reduce-overhead"
        start = time.monotonic()
        model = self.model_wrapped
        devices = [self.args.device] if self.args.device.type == "cuda" else []
        # With buckets, one static graph per declared shape: under automatic dynamic shapes the second shape would
        # bring a graph with dynamic sizes instead, made for no size in particular. Every declared shape is compiled
        # here, so training then finds its graph without compiling.
        static = torch._dynamo.config.patch(automatic_dynamic_shapes=False) if bucketed else contextlib.nullcontext()
        cache = Path(self.args.compile_cache) if self.args.compile_cache else None
        hits, carried = compile_cache_hits(), cache is not None and cache.is_file()
        if carried:
            torch.compiler.load_cache_artifacts(cache.read_bytes())
        with static, torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
            for indices in batches:
                collated = self._train_collate([self._train_features[i] for i in indices])
                # On the device already, where the marks stay (a copy made later would not carry them).
                batch = {name: tensor.to(self.args.device) for name, tensor in collated.items()}
                if not bucketed:
                    mark_sizes_dynamic(batch)
                for _ in range(2 if graphed else 1):
                    samples, items = self.get_batch_samples(iter([batch]), 1, self.args.device)
                    self.training_step(model, samples[0], items)
                    model.zero_grad()
        self._first_bad_step = self._real_positions = None  # a warm-up step is no training step
        self._computed_positions = 0
        self.compile_seconds = time.monotonic() - start
        self.compile_cache_hits = compile_cache_hits() - hits
        # Written where none was carried, or where the one carried served nothing (another torch, another model):
        # a run that compiled from the cache records only what it compiled itself, less than the cache it read.
        if cache is not None and not (carried and self.compile_cache_hits) and self.is_world_process_zero():
            artifacts = torch.compiler.save_cache_artifacts()
            if artifacts is not None:  # None where nothing was compiled
                write_atomically(cache, artifacts[0])
        logger.info("Compiled the training step on %d batch shapes%s in %.1f s, before training started.",
                    len(batches), " (declared shapes)" if bucketed else "", self.compile_seconds)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **gen_kwargs) -> dict:
        # Only the evaluation split whose text the trainer holds is scored by translating it.
        self._score_translations = (eval_dataset is None and self.eval_texts is not None
                                    and self.args.predict_with_generate and not self.args.prediction_loss_only)
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)
        finally:
            self._score_translations = False

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """The Trainer's loop for the loss alone, and BLEU, chrF and TER (`eval_bleu`...) of `score_split`'s
        translations, in the metrics the Trainer then logs and picks the best model by. Every process translates
        the whole split, so that all of them decide on the same scores."""
        if not self._score_translations:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)
        output = super().evaluation_loop(dataloader, description, True, ignore_keys, metric_key_prefix)
        model, restore = decoding_model(self)
        try:
            scores = score_split(model, self.processing_class, self.eval_texts, self.args.per_device_eval_batch_size)
        finally:
            restore()
        output.metrics.update({f"{metric_key_prefix}_{name}": scores[name] for name in ("bleu", "chrf", "ter")})
        return output

    def floating_point_ops(self, inputs: dict) -> int:
        """The Trainer's estimate (6 × tokens × non-embedding parameters), with the parameters counted once: the
        Trainer counts them again at every step, a walk over the whole module tree."""
        if self._non_embedding_parameters is None:
            self._non_embedding_parameters = self.model.num_parameters(exclude_embeddings=True)
        main_input = getattr(self.model, "main_input_name", "input_ids")
        return 6 * inputs[main_input].numel() * self._non_embedding_parameters if main_input in inputs else 0

    def log(self, logs: dict, *args, **kwargs) -> None:
        self.raise_on_nonfinite_loss()
        if "train_runtime" in logs:
            logs = self.clocked_metrics(logs)
        if self.clock.started:
            logs = {**logs, "elapsed_seconds": round(self.clock.elapsed(), 2)}
        if "loss" in logs and self._computed_positions:
            logs = {**logs, "padding_fraction": round(self.padding_fraction(), 4)}
        super().log(logs, *args, **kwargs)

    def clocked_metrics(self, metrics: dict) -> dict:
        """The Trainer's final training metrics with the runtime and every rate read from the run's clock: the
        training of this call after the step's compilation (the Trainer times its call from before it). Training
        has ended when the Trainer makes them, so the clock stops there. `train_source_tokens_per_second` counts the
        source tokens of this call (with --include_num_input_tokens_seen); `train_wall_seconds` is the
        whole run's time on the clock, a resumed run's earlier parts included: what `--max_train_time` bounds."""
        self.clock.stop()
        runtime, metrics = self.clock.this_call(), dict(metrics)
        if runtime > 0:
            for name in ("train_samples_per_second", "train_steps_per_second"):
                if name in metrics:
                    # The Trainer's rate is a count (of samples or steps) over its own runtime, both rounded: the
                    # count, an integer, is recovered whole, so that the rounding's error does not grow with how far
                    # that runtime is from the clock's (4 steps in 4 s on the clock stay 1.0 a second).
                    count = round(metrics[name] * metrics["train_runtime"])
                    metrics[name] = round(count / runtime, 3)
            tokens = self.state.num_input_tokens_seen - self.clock.start_tokens
            if tokens:
                metrics["train_source_tokens_per_second"] = round(tokens / runtime, 3)
        metrics["train_runtime"] = round(runtime, 4)
        metrics["train_compile_seconds"] = round(self.compile_seconds, 2)
        if self.args.torch_compile:  # 0 where compile_before_the_clock built every graph the steps needed
            metrics["train_graphs_compiled_on_the_clock"] = compiled_graphs() - self.graphs_before_the_clock
        if self.args.compile_cache:  # the compiled code found in the cache instead of generated
            metrics["train_compile_cache_hits"] = self.compile_cache_hits
        metrics["train_wall_seconds"] = round(self.clock.elapsed(), 4)
        self.slow_steps.flush()
        metrics["train_slow_steps"] = self.slow_steps.count
        metrics["train_slow_steps_seconds"] = round(self.slow_steps.seconds, 2)
        metrics["train_slow_steps_recompiling"] = self.slow_steps.recompiling
        return metrics

    def padding_fraction(self) -> float | None:
        """The share of the positions trained on so far (both sides) that were padding; None before any step. Reads
        the device's count of real positions, which the training step never does."""
        if not self._computed_positions:
            return None
        return 1.0 - int(self._real_positions) / self._computed_positions

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
        write_clock(directory, self.clock)


def decoding_model(trainer: Seq2SeqTrainer):
    """The trained model as its saved weights decode, and a function that undoes what this changed: without the
    wrappers of distributed training or compilation, and without the autocast that --bf16/--fp16 put around its
    forward, so that validation (in the middle of training, which then needs the autocast back) and the test score
    (`training.final_model`) decode the same weights at the same precision.

    The autocast is Accelerate's wrapper in the model's own `forward` attribute (the original in `_original_forward`):
    both are taken out of the instance, which leaves the class's `forward`, decorators included. Accelerate's
    `unwrap_model(keep_fp32_wrapper=False)` unwraps every `__wrapped__` instead, down through transformers'
    `can_return_tuple`, and transformers' own decoding loop (`generate()` on an accelerator) then failed with "got
    multiple values for keyword argument 'return_dict'"."""
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    wrapped = {name: model.__dict__.pop(name) for name in ("forward", "_original_forward") if name in model.__dict__}
    return model, lambda: model.__dict__.update(wrapped)


def score_split(model, tokenizer, split: Dataset, batch_size: int) -> dict:
    """`split`'s sources translated with the model's own decoding settings (its `generation_config`), at most
    `batch_size` sentences a batch, and scored against its references (every accepted one, where the corpus has
    several): `evaluation.evaluate_model`'s scores and hypotheses, through the package's one translation path
    (`loading.engine_for_model`, `translation.translate`). Validation during training and the final test evaluation
    both score through this."""
    references = split["references"] if "references" in split.column_names else [[t] for t in split["target"]]
    return evaluate_model(model, tokenizer, split["source"], references, batch_size=batch_size)
