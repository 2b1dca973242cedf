"""`--preset auto`: the size of a new model, chosen for the machine it trains on and the time it has.

A CPU trains the main job's model at the pace of its matrix products: in 600 s a fast one takes 3,300 steps and a
slow one 650, and BLEU follows the steps. A smaller model takes more steps in the same time and learns less from
each. Which wins depends on the steps the budget buys, so `--preset auto`:

1. times a few training steps of each size in `SIZES` on the run's own first batches, under its precision (this
   counts inside the time budget), once per machine: the step times are recorded in `cache_dir()/model-sizes.json`
   under this machine's key, the run's precision, batch shapes and model fields (`timing_key`), and every later run
   with that key reads them, so that one command on one machine always trains the same size;
2. predicts the steps each size would take in what is left of the budget;
3. reads the validation BLEU that size reached after that many steps (`BLEU_AFTER_STEPS`, measured by
   benchmarks/main_job_sizes.py: benchmarks/results/main-job-sizes.md);
4. trains the size with the best, keeping `DEFAULT_SIZE` (the main job's model before sizing) unless another is
   predicted to beat it by more than `MARGIN`, at that size's peak learning rate (`PEAK_LEARNING_RATE`) unless
   `--learning_rate` names one.

Every size is the `small` preset with the fields below changed; `--config_overrides` apply on top of each, so a field
the user names always wins. The choice, its reason and the timings go into the metrics and the model card.
"""

import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .machine import cache_dir, machine, measured_once

# Each size's fields on top of the `small` preset, largest first; all keep its vocabulary and 4 heads. Two more sizes
# were measured and removed (main-job-sizes.md): d128-3x3 reached d128-2x2's BLEU after as many steps at 1.25 to 1.3
# times its step time, and d192-3x3 (d_ff 768) was predicted below one of these two at every step count.
SIZES: dict[str, dict[str, int]] = {
    "d256-3x3": {},  # the small preset itself: 256 wide, 3 encoder and 3 decoder layers, FFN 1,024
    "d128-2x2": {"d_model": 128, "d_ff": 512, "encoder_layers": 2, "decoder_layers": 2},
}
DEFAULT_SIZE = "d256-3x3"

# Each size's peak learning rate under the main job's schedule (400 warm-up steps, then the inverse square root), the
# best of those tried on the validation split (main-job-sizes.md): 1e-3 and 2e-3 for d256-3x3, 1e-3 to 4e-3 for
# d128-2x2. `BLEU_AFTER_STEPS` was measured at these peaks.
PEAK_LEARNING_RATE: dict[str, float] = {"d256-3x3": 1e-3, "d128-2x2": 3e-3}

# Validation BLEU (fra-eng, first 1,000 sentences, all references, beam 4, length penalty 0.6, float32) after so
# many steps of the main job's recipe (1,000-token batches, the size's peak learning rate after 400 warm-up steps,
# inverse square root, no dropout, seed 0): benchmarks/results/main-job-sizes.md, whose JSON rows a test compares
# with these. Each size runs as far as the fastest CPU measured takes it in 600 s. BLEU is read in between on a log
# scale of steps; beyond a size's last row it is held at that row's, which underrates it.
BLEU_AFTER_STEPS: dict[str, tuple[tuple[int, float], ...]] = {
    "d256-3x3": (
        (250, 5.95), (500, 15.62), (750, 26.91), (1000, 34.57), (1250, 39.58), (1500, 42.8), (2000, 46.25),
        (2500, 47.01), (3000, 50.82), (3500, 52.45), (4000, 53.42),
    ),
    "d128-2x2": (
        (250, 6.91), (500, 19.17), (750, 27.61), (1000, 34.15), (1250, 38.3), (1500, 42.08), (2000, 45.54),
        (2500, 47.81), (3000, 49.51), (3500, 49.86), (4000, 50.66), (5000, 53.12), (6000, 54.09), (7000, 53.83),
        (8000, 55.65), (9000, 55.62), (10000, 56.1),
    ),
}

# A size other than the default must be predicted this much better: the spread of test BLEU over three runs of one
# recipe on one machine (46.96, 47.53 and 48.30: benchmarks/results/main-job-cpu.md, runs 21-23) is 1.3.
MARGIN = 1.3

# Steps timed per size after the first ones, which warm the allocator and caches up.
WARM_UP_STEPS, TIMED_STEPS = 2, 5

RECORD = "model-sizes.json"  # in cache_dir(): the step times measured on this machine, by key


def bleu_after(size: str, steps: float) -> float:
    """The validation BLEU `size` reached after `steps` steps, read from `BLEU_AFTER_STEPS` between its rows on a
    log scale of steps (from 0 at step 1 up to the first row), and as the last row's beyond it."""
    rows = BLEU_AFTER_STEPS[size]
    if steps >= rows[-1][0]:
        return rows[-1][1]
    below = (1, 0.0)
    for row in rows:
        if steps <= row[0]:
            (s0, b0), (s1, b1) = below, row
            where = (math.log(max(steps, 1)) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return b0 + where * (b1 - b0)
        below = row
    raise AssertionError("unreachable: steps beyond the last row returned above")


@dataclass(frozen=True)
class SizeChoice:
    size: str
    reason: str
    seconds: float  # spent timing the sizes, counted in the time budget
    seconds_per_step: dict[str, float]
    predicted_steps: dict[str, int]
    predicted_bleu: dict[str, float]
    named_learning_rate: float | None = None  # --learning_rate, where the run names one

    @property
    def learning_rate(self) -> float:
        """The peak learning rate the run trains at: the one named, else the size's."""
        return self.named_learning_rate or PEAK_LEARNING_RATE[self.size]

    @property
    def line(self) -> str:
        fields = ", ".join(f"{name}={value}" for name, value in SIZES[self.size].items()) or "the small preset"
        peak = f"--learning_rate {self.learning_rate:g}" if self.named_learning_rate else \
            f"peak learning rate {self.learning_rate:g}"
        return f"--preset auto: {self.size} ({fields}; {peak}): {self.reason}"

    def metrics(self) -> dict:
        """The choice as metrics.json and the model card record it."""
        return {"model_size": self.size, "model_size_choice": self.reason,
                "model_size_learning_rate": self.learning_rate, "model_size_timing_seconds":
                round(self.seconds, 2), "model_size_seconds_per_step": dict(self.seconds_per_step),
                "model_size_predicted_steps": dict(self.predicted_steps),
                "model_size_predicted_validation_bleu": dict(self.predicted_bleu)}


def choose(seconds_per_step: Mapping[str, float], seconds_left: float | None, max_steps: int | None = None,
           seconds: float = 0.0, timed: str = "", named_learning_rate: float | None = None) -> SizeChoice:
    """The size predicted to reach the best validation BLEU: each takes `seconds_left` / its seconds a step (or
    `max_steps`, whichever is fewer); without a time budget every size takes `max_steps`. The table was measured at
    each size's `PEAK_LEARNING_RATE`; a `named_learning_rate` trains the size chosen at that rate instead."""
    steps = {}
    for size in SIZES:
        bound = [max_steps] if max_steps and max_steps > 0 else []
        if seconds_left is not None:
            bound.append(int(seconds_left / seconds_per_step[size]))
        steps[size] = max(min(bound), 0)
    bleu = {size: round(bleu_after(size, steps[size]), 2) for size in SIZES}
    best = max(SIZES, key=lambda size: bleu[size])
    default = DEFAULT_SIZE
    if best != default and bleu[best] <= bleu[default] + MARGIN:
        best = default
    paced = "" if seconds_left is None else f" in {seconds_left:.0f} s"
    reason = (f"{steps[best]:,} steps{paced} predict validation BLEU {bleu[best]:.1f}, against "
              + ", ".join(f"{bleu[s]:.1f} for {s} ({steps[s]:,} steps)" for s in SIZES if s != best)
              + (f" (another size must be {MARGIN} better)" if best == default else "")
              + ("; the table's BLEU is each size's at its own peak learning rate, not at the one named"
                 if named_learning_rate else "")
              + (f"; {timed}" if timed else ""))
    return SizeChoice(best, reason, seconds, dict(seconds_per_step), steps, bleu, named_learning_rate)


def seconds_per_step(build: Callable[[str], torch.nn.Module], batches: Sequence[Mapping[str, torch.Tensor]],
                     device: torch.device, autocast_dtype: torch.dtype | None) -> dict[str, float]:
    """Each size's seconds a training step (forward, backward and an Adam update) on `batches`, the run's first:
    `WARM_UP_STEPS` untimed, then the mean of the rest. `build(size)` makes the model; torch's random state is
    restored afterwards, so the run's own model starts as it would have."""
    paces = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                               device_type="cuda" if device.type == "cuda" else "cpu"):
        for size in SIZES:
            model = build(size).to(device).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            start = None
            for index, batch in enumerate(batches):
                if index == WARM_UP_STEPS:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    start = time.perf_counter()
                with torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                                    enabled=autocast_dtype is not None):
                    loss = model(**{name: tensor.to(device) for name, tensor in batch.items()}).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            paces[size] = (time.perf_counter() - start) / (len(batches) - WARM_UP_STEPS)
            del model, optimizer
    return paces


def timing_key(batches: Sequence[Mapping[str, torch.Tensor]], device: torch.device,
               autocast_dtype: torch.dtype | None, recipe: Mapping) -> dict:
    """What a size's step time depends on: the machine (its CPU or GPU, kernels, versions and torch's threads), the
    precision, the timed batches' shapes, the sizes and `recipe` (the model fields the run sets on top of them)."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    shapes = [{name: list(tensor.shape) for name, tensor in sorted(batch.items())} for batch in batches]
    key = {"machine": machine(threads=torch.get_num_threads()), "device": device.type, "gpu": gpu,
           "precision": str(autocast_dtype or torch.float32), "batches": shapes, "sizes": SIZES, "recipe": recipe}
    return json.loads(json.dumps(key, default=str))  # as a record reads back: lists, not tuples


def recorded_seconds_per_step(key: dict, measure: Callable[[], dict[str, float]]) -> tuple[dict[str, float], bool]:
    """The step times recorded under `key` in `cache_dir()/RECORD`, else `measure()`d and recorded; and whether
    they were measured now. A cache that cannot be written: measured for this run alone, and said so."""
    record, measured, error = measured_once(RECORD, key, lambda: {"seconds_per_step": measure()})
    if error is not None:
        print(f"--preset auto: step times not recorded, {cache_dir(RECORD)} cannot be written ({error}).",
              file=sys.stderr, flush=True)
    return record["seconds_per_step"], measured


def auto_size(build: Callable[[str], torch.nn.Module], batches: Sequence[Mapping[str, torch.Tensor]], *,
              device: torch.device, autocast_dtype: torch.dtype | None, max_train_time: float | None,
              max_steps: int | None, recipe: Mapping | None = None,
              named_learning_rate: float | None = None) -> SizeChoice:
    """Time the sizes where there is a time budget (or read the step times recorded for this machine and run
    shape), choose, and say so in one line on stderr."""
    if not max_train_time and not (max_steps and max_steps > 0):
        choice = SizeChoice(DEFAULT_SIZE, "no time budget or step count to size the model to", 0.0, {}, {}, {},
                            named_learning_rate)
    elif not max_train_time:
        choice = choose({}, None, max_steps, named_learning_rate=named_learning_rate)
    else:
        start = time.monotonic()
        key = timing_key(batches, device, autocast_dtype, recipe or {})
        paces, timed = recorded_seconds_per_step(key, lambda: seconds_per_step(build, batches, device,
                                                                               autocast_dtype))
        spent = time.monotonic() - start
        how = (f"timing the sizes took {spent:.1f} s of the budget" if timed else
               f"the step times recorded for this machine in {cache_dir(RECORD)} (delete it to time them again)")
        choice = choose(paces, max_train_time - spent, max_steps, spent, how, named_learning_rate)
    print(choice.line, file=sys.stderr, flush=True)
    return choice
