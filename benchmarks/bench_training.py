"""Training throughput: non-padding tokens/s of full training steps (forward, backward, Adam step), Vaswani vs
`MarianMTModel` at identical sizes, on identical batches of the real corpus (as `--batchings` cuts them), at identical
precision (bf16 autocast on CUDA, fp32 on CPU unless an engine's name asks for bf16); peak memory; on CUDA, MFU.

    python benchmarks/bench_training.py                          # GPU: tiny, base, big; 4k, 12k, 25k-token batches
    python benchmarks/bench_training.py --device cpu --sizes tiny,base --batch_tokens 2048 --steps 4

Model FLOPs of a step, on non-padding tokens with the PaLM convention (Chowdhery et al., 2022, App. B): 6 × the
weights each token is multiplied by (a source token: the encoder and the cross-attention keys/values; a target token:
the decoder and the output projection) + 12·d_model per layer per attended (query, key) pair; MFU = FLOPs/s over the
device's dense bf16 peak.
"""

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DataCollatorForSeq2Seq

from vaswani import VaswaniConfig
from vaswani.batching import ShapeBuckets, TokenBatchSampler, pad_to_shape
from vaswani.files import write_atomically
from vaswani.inference import keep_freed_cpu_memory
from vaswani.packing import PackedBatchSampler, PackedSeq2SeqCollator
from vaswani.trainer import mark_sizes_dynamic
from vaswani.training import MAX_SHAPE_BUCKETS
from vaswani.training_clock import compile_cache_hits, compiled_graphs

from common import (
    SDPA_BACKENDS, Column, PeakMemory, Stopped, WrongKernel, argument_parser, attention_ran, build_seq2seq,
    check_ran, corpus_and_tokenizer, engine_label, csv_of, pick_device, report, sdpa_backend, stopping, timed,
)

ENGINES = ("vaswani", "vaswani-compiled", "marian")
# Options after the model's name (`vaswani-bf16-eager`): `compiled`, torch.compile as `--torch_compile` runs it;
# `bf16`, bf16 autocast on a CPU too (`--bf16 --use_cpu`; CUDA runs every engine under it); `eager`, the eager
# attention; `graphs` (with `compiled`, CUDA only), mode="reduce-overhead": a CUDA graph per shape, on batches padded
# up to their `--shape_buckets`; an SDPA kernel's name, pinned for this engine alone, so that one process compares
# kernels step by step on the same batches.
OPTIONS = ("compiled", "bf16", "eager", "graphs", *SDPA_BACKENDS)
# How the batches are cut (`--batchings`): `bucketed`, as train_translation.py --max_tokens_per_batch cuts them;
# `packed`, several pairs a row as --packing packs them (Vaswani only); `-8`, padded to multiples of 8
# (--pad_to_multiple_of 8).
BATCHINGS = ("bucketed", "bucketed-8", "packed", "packed-8")


def token_batches(source_ids, target_ids, batch_tokens: int, seed: int, shape_buckets: int | None = None,
                  batching: str = "bucketed"):
    """The batches (indices) `train_translation.py` trains on, cut as `batching` says (`vaswani.batching.
    TokenBatchSampler`, or `vaswani.packing.PackedBatchSampler` for packed rows), and the sampler that cut them;
    pairs longer than a whole batch are left out."""
    multiple = 8 if batching.endswith("-8") else None
    keep = [i for i, (s, t) in enumerate(zip(source_ids, target_ids)) if max(len(s), len(t)) <= batch_tokens]
    sources, targets = [len(source_ids[i]) for i in keep], [len(target_ids[i]) for i in keep]
    if batching.startswith("packed"):
        sampler = PackedBatchSampler(sources, targets, batch_tokens, seed=seed, pad_to_multiple_of=multiple)
    else:
        sampler = TokenBatchSampler(np.maximum(sources, targets), batch_tokens, seed=seed,
                                    shape_buckets=shape_buckets, pad_to_multiple_of=multiple)
    return [[keep[j] for j in batch] for batch in sampler], sampler


def model_flops(config, source_lengths: list[int], target_lengths: list[int]) -> float:
    """Training FLOPs of one step (forward + backward = 3 × forward), see the module docstring."""
    d, ff, vocab = config.d_model, config.d_ff, config.vocab_size
    kv_width = config.num_key_value_heads * config.head_dim
    attention = 2 * d * d + 2 * d * kv_width  # q, o and k, v projections
    ffn = (3 if config.ffn_activation in ("swiglu", "geglu") else 2) * d * ff
    per_source = config.encoder_layers * (attention + ffn) + config.decoder_layers * 2 * d * kv_width
    per_target = config.decoder_layers * (attention + 2 * d * d + ffn) + d * vocab
    weights = 6 * (sum(source_lengths) * per_source + sum(target_lengths) * per_target)
    pairs = sum(config.encoder_layers * s * s + config.decoder_layers * (t * t + t * s)
                for s, t in zip(source_lengths, target_lengths))
    return weights + 12 * d * pairs


class Trainee:
    """One engine's model and optimizer, and the batches it steps through: the collated batches every engine shares
    (Marian's twin pads as Vaswani does), padded up to their shape buckets for a -graphs engine."""

    def __init__(self, name, config, device, batches, seed, lr, shape_buckets=None, batching="bucketed"):
        self.name, self.batching, self.device = name, batching, device
        base, *options = name.split("-")
        kernels = [option for option in options if option in SDPA_BACKENDS]
        if (base not in ("vaswani", "marian") or set(options) - set(OPTIONS) or len(set(options)) < len(options)
                or ("graphs" in options and "compiled" not in options)
                or (kernels and ("eager" in options or len(kernels) > 1))):
            raise ValueError(f"Unknown engine {name!r}: vaswani or marian, then any of -{', -'.join(OPTIONS)} "
                             "(-graphs with -compiled; at most one SDPA kernel, not with -eager).")
        self.model = build_seq2seq(base, config, device, torch.float32, seed).train()
        if "eager" in options:
            self.model.set_attn_implementation("eager")
        self.parameters = self.model.num_parameters(only_trainable=True)
        bucketed = shape_buckets is not None and "graphs" in options
        # Padded up to a few shapes, or packed into one, static ones: a graph each, not one with dynamic sizes.
        static = bucketed or batching.startswith("packed")
        self.forward = (torch.compile(self.model, mode="reduce-overhead" if "graphs" in options else None,
                                      dynamic=False if static else None) if "compiled" in options else self.model)
        # Otherwise the batch and length dimensions are marked dynamic, as VaswaniTrainer marks them before its first
        # step: one graph for every shape, compiled once, not a static graph for the first shape and then another.
        self.dynamic = "compiled" in options and not static
        # The paper's Adam (§5.3), fused as the Trainer's default (adamw_torch_fused); the schedule costs nothing.
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9, fused=True)
        pad_values = {"input_ids": self.model.config.pad_token_id, "attention_mask": 0, "labels": -100}
        self.batches = [pad_to_shape(b, *shape_buckets.shape(max(b["input_ids"].shape[1], b["labels"].shape[1])),
                                     pad_values) for b in batches] if bucketed else batches
        bf16 = device.as_cuda or "bf16" in options
        self.autocast = torch.autocast(device.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        self.dtype = "bfloat16" if bf16 else "float32"
        self.attention_kernel = kernels[0] if kernels else None
        # What the engine must run, which `check` holds it to.
        self.attention = {"eager"} if "eager" in options else set(kernels) or set(SDPA_BACKENDS)

    def check(self) -> dict:
        """What one uncompiled forward on the first batch ran (`common.check_ran`: stops if not the engine's)."""
        batch = {k: v.to(self.device.device) for k, v in self.batches[0].items()}
        with self.autocast, sdpa_backend(self.attention_kernel):
            ran = attention_ran(lambda: self.model(**batch))
        check_ran(self.name, ran, self.attention, self.dtype)
        return ran

    def step(self, index: int) -> None:
        batch = {k: v.to(self.device.device, non_blocking=True) for k, v in self.batches[index].items()}
        if self.dynamic:
            mark_sizes_dynamic(batch)
        with self.autocast, sdpa_backend(self.attention_kernel):
            loss = self.forward(**batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_mib(self) -> float:
        """Weights and optimizer state: what stays resident between steps."""
        states = [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *states]) / 2**20


@dataclass
class Batches:
    """One batching's batches at one budget: token ids (sources, targets) and collated; step 0 measures memory, then
    `warmup` warm up; the padding fraction of the timed ones, the shapes they are cut to."""

    batches: list
    collated: list
    warmup: int
    padding: dict
    shapes: list
    buckets: ShapeBuckets | None


def prepare(args, batching, source_ids, target_ids, tokenizer, batch_tokens, steps, warmup) -> Batches:
    warm, buckets, shapes = [], None, []
    order, sampler = token_batches(source_ids, target_ids, batch_tokens, args.seed, args.shape_buckets, batching)
    if batching.startswith("packed"):
        shape = sampler.shape
        collate = PackedSeq2SeqCollator(shape, tokenizer.pad_token_id)
        shapes = [(shape.rows, shape.source_length, shape.target_length)]
    else:
        buckets = sampler.shape_buckets  # labels padded with -100, which the loss skips
        collate = DataCollatorForSeq2Seq(tokenizer, return_tensors="pt",
                                         pad_to_multiple_of=8 if batching.endswith("-8") else None)
    if buckets is not None:
        # One batch of each shape, warmed up twice (a shape's CUDA graph is recorded at its second run), on
        # batches the timing does not use.
        last = {buckets.shape(max(max(len(source_ids[i]), len(target_ids[i])) for i in b)): b for b in order}
        warm = [b for b in last.values() for _ in range(2)]
        order = [b for b in order if not any(b is w for w in last.values())]
        shapes = buckets.shapes
    warm = (warm + order[1:])[: max(warmup, len(warm))]
    if len(order) < len(warm) + steps + 1:
        raise ValueError(f"The corpus gives {len(order)} {batching} batches of {batch_tokens} tokens; need "
                         f"{len(warm) + steps + 1}.")
    # Step 0 measures memory, then warm-up, then the timed steps: all on distinct batches (but a shape's two
    # warm-ups), the same for every engine.
    timed = [b for b in order[1:] if not any(b is w for w in warm)][:steps]
    batches = [([source_ids[i] for i in b], [target_ids[i] for i in b]) for b in order[:1] + warm + timed]
    collated = [collate([{"input_ids": s, "labels": t} for s, t in zip(*batch)]) for batch in batches]
    real = sum(len(x) for s, t in batches[1 + len(warm):] for x in s + t)
    computed = sum(c["input_ids"].numel() + c["labels"].numel() for c in collated[1 + len(warm):])
    padding = {"": round(1 - real / computed, 4)}
    if buckets is not None:  # what the -graphs engines compute: both sides padded up to the batch's shape
        padded = sum(2 * math.prod(buckets.shape(max(map(len, s + t)))) for s, t in batches[1 + len(warm):])
        padding[" in shape buckets"] = round(1 - real / padded, 4)
    return Batches(batches, collated, len(warm), padding, shapes, buckets)


def measure(args, device, engines, prepared: dict[str, Batches], batch_tokens, vocab_size, peak_tflops,
            started, refused: list[str], rows: list[dict], warmed, measured) -> None:
    """Every size × batching × engine: the rows of one batch budget, appended to `rows`. An engine whose first steps
    fail is left out, the reason added to `refused`. `warmed(trainee)` is called once an engine's warm-up is done
    (a compiled engine has compiled), `measured()` once a size's rows are in `rows`. A stop signal (`Stopped`)
    during the timed steps ends them: the rows of the steps done so far are added, marked `cut`, then it is
    raised again."""
    for size in args.sizes:
        dropout = {"dropout": args.dropout} if args.dropout is not None else {}
        config = VaswaniConfig.from_preset(size, vocab_size=vocab_size, **dropout)
        trainees = [Trainee(name, config, device, batches.collated, args.seed, 1e-4, batches.buckets, batching)
                    for batching, batches in prepared.items() for name in engines
                    if not (batching.startswith("packed") and name.split("-")[0] != "vaswani")]
        memory, ran = {}, {}
        for trainee in list(trainees):
            try:
                # Warm-up first: a compiled engine compiles there (a graph per shape if static, else one).
                warmup = prepared[trainee.batching].warmup
                for i in range(1, 1 + warmup):
                    trainee.step(i)
                print(f"{size} {engine_label(trainee.name)} ({trainee.batching}) at {batch_tokens}: {warmup} warm-up "
                      f"steps done after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
                with PeakMemory(device) as peak:
                    trainee.step(0)
                ran[trainee] = trainee.check()
                warmed(trainee)
            except WrongKernel:
                raise
            except Exception as error:  # the device refused the engine (a kernel it lacks): its row only is lost
                why = (str(error).strip().splitlines() or [""])[0][:200]
                refused.append(f"{size} {trainee.name} ({trainee.batching}) at {batch_tokens}: "
                               f"{type(error).__name__}: {why}")
                print(f"refused: {refused[-1]}", file=sys.stderr, flush=True)
                trainees.remove(trainee)
                continue
            memory[trainee] = (trainee.state_mib(), peak.added_mib)
        if not trainees:
            continue
        seconds, first_pass = {trainee: 0.0 for trainee in trainees}, {}
        done = {trainee: [] for trainee in trainees}
        compiles_before = compiled_graphs()  # any built in the timed steps count
        # Each timed batch once; with --seconds_per_setting, round after round over them until the slowest engine
        # has trained that long (every engine takes as many steps, each on its batching's batches).
        indices = {trainee: list(range(1 + prepared[trainee.batching].warmup, len(trainee.batches)))
                   for trainee in trainees}
        rounds, epoch, timing, stopped = 0, min(map(len, indices.values())), args.seconds_per_setting, None
        try:
            while rounds < epoch * args.passes or (timing and max(seconds.values()) < timing):
                rotation = rounds % len(trainees)  # interleaved, order rotating: load drifts hit every engine alike
                for trainee in trainees[rotation:] + trainees[:rotation]:
                    i = indices[trainee][rounds % len(indices[trainee])]
                    step_seconds = timed(device, lambda: trainee.step(i))[1]
                    seconds[trainee] += step_seconds
                    done[trainee].append(prepared[trainee.batching].batches[i])
                    if len(done[trainee]) == len(indices[trainee]):
                        first_pass[trainee] = seconds[trainee]
                rounds += 1
        except Stopped as error:
            stopped = error
            trainees = [trainee for trainee in trainees if done[trainee]]
        compiles_timed = compiled_graphs() - compiles_before
        if args.profile:
            for trainee in trainees:
                print_profile(trainee, indices[trainee], size, device)
        load_average = os.getloadavg()[0]
        for trainee in trainees:
            (state, added), elapsed, trained = memory[trainee], seconds[trainee], done[trainee]
            source_tokens = sum(len(s) for sources, _ in trained for s in sources)
            target_tokens = sum(len(t) for _, targets in trained for t in targets)
            flops = sum(model_flops(config, list(map(len, s)), list(map(len, t))) for s, t in trained)
            rows.append({
                "size": size, "batch_tokens": batch_tokens, "batching": trainee.batching, "engine": trainee.name,
                "engine_label": engine_label(trainee.name), "parameters": trainee.parameters,
                "parameters_m": trainee.parameters / 1e6, "steps": len(trained),
                "sentences": sum(len(s) for s, _ in trained), "source_tokens": source_tokens,
                "target_tokens": target_tokens, "seconds": elapsed, "steps_per_s": len(trained) / elapsed,
                "tokens_per_s": (source_tokens + target_tokens) / elapsed,
                "target_tokens_per_s": target_tokens / elapsed, "model_tflops_per_s": flops / elapsed / 1e12,
                "mfu": flops / elapsed / (peak_tflops * 1e12) if peak_tflops else None, "state_mib": state,
                "step_added_mib": added, "peak_mib": state + added if added is not None else None,
                "load_average": load_average, "compilations_while_timed": compiles_timed, **ran[trainee],
                "cut": f"by {stopped} after {len(trained)} timed steps" if stopped else None,
            })
            # ms a step of the first pass over the timed batches and of the later ones: with --warmup_steps 0, what
            # a new shape costs (a compilation, a kernel's plan).
            per_pass = len(indices[trainee])
            if trainee in first_pass and len(trained) > per_pass:
                rows[-1].update(first_round_ms=1000 * first_pass[trainee] / per_pass,
                                later_rounds_ms=1000 * (elapsed - first_pass[trainee]) / (len(trained) - per_pass))
            print(f"{size:>5} {batch_tokens:>6} {trainee.batching:>10} {rows[-1]['engine_label']:>12}: "
                  f"{rows[-1]['tokens_per_s']:9.0f} tokens/s {rows[-1]['model_tflops_per_s']:.3f} model TFLOP/s, "
                  f"peak {rows[-1]['peak_mib'] or 0:.0f} MiB", flush=True)
        measured()
        if stopped:
            raise stopped


def notes(args, device, budgets, steps, peak_tflops, corpus, pairs, tokenizer, refused, rows) -> list[str]:
    buckets = f", shape_buckets={args.shape_buckets}" if args.shape_buckets else ""
    cut = next((row["cut"] for row in rows if row.get("cut")), None)
    return [
        *([f"Cut {cut}: the rows are those measured before; any later setting has none."] if cut else []),
        *(f"Refused, no row: {why}" for why in refused),
        f"Batches: all {len(pairs)} pairs of {corpus.name} tokenized by the project's joint BPE ({len(tokenizer)} "
        f"tokens), cut as train_translation.py cuts them (vaswani.batching.TokenBatchSampler{buckets}) into batches of "
        f"at most {', '.join(map(str, budgets))} padded tokens per side, shuffled (seed {args.seed}), collated by "
        f"DataCollatorForSeq2Seq; at each budget the same {steps} timed batches for every engine (settings "
        "`batch_sizes_sentences`, `padding_fraction`: padded over computed positions, both sides), after the warm-up "
        "steps of settings `warmup_steps`.",
        *(["Batchings (column `batches`): `packed`, several pairs a row as --packing packs them (settings "
           "`shapes_rows_length`: rows, source and target widths; × Marian: against Marian's bucketed batches); `-8`: "
           "padded to multiples of 8 within the budget. × bucketed: against the same engine on `bucketed` batches."]
          if args.batchings != ["bucketed"] else []),
        *(["-graphs engines pad each batch up to its shape (settings `shapes_rows_length`), a graph per shape "
           "recorded in the warm-up; tokens/s counts non-padding tokens."] if args.shape_buckets else []),
        "tokens/s = non-padding source + target tokens per second of full steps: forward with the loss, backward, "
        "fused Adam (β = 0.9, 0.98, ε = 1e-9, §5.3), zero_grad. Vaswani's loss is label-smoothed (0.1), Marian's "
        "plain cross-entropy. Engines interleaved step by step, the order rotating.",
        *(["keep_freed_cpu_memory(None) for the whole process, as train_translation.py on a CPU."]
          if args.keep_freed_memory and not device.is_cuda else []),
        (f"bf16 autocast with fp32 weights; MFU against a dense bf16 peak of {peak_tflops} TFLOP/s." if device.as_cuda
         else "fp32 (-bf16 engines: bf16 autocast with fp32 weights, as `--bf16 --use_cpu` trains); MFU only on GPU."),
        "Memory: peak = weights + Adam state + the peak one extra untimed step adds (on CPU, a process RSS increment).",
        "Compiled engines: torch.compile(model) (-graphs: mode=\"reduce-overhead\"), compiled in the warm-up, "
        "batch and length dimensions marked dynamic as VaswaniTrainer marks them (static: a graph per shape, for "
        "-graphs with --shape_buckets and for packed batches); graphs built during the timed steps are counted "
        "(column `recompiles`).",
        f"Dropout {'the preset’s' if args.dropout is None else args.dropout}; attention: sdpa (-eager: eager). "
        "Columns `attention` and `dtype`: what one uncompiled forward of each engine ran (common.attention_ran).",
    ]


COLUMNS = [Column("size", "size"), Column("batch_tokens", "batch tokens"), Column("batching", "batches"),
           Column("engine_label", "engine"), Column("parameters_m", "params (M)", "{:.1f}"), Column("steps", "steps"),
           Column("seconds", "seconds", "{:.2f}"), Column("steps_per_s", "steps/s", "{:.2f}"),
           Column("tokens_per_s", "tokens/s", "{:.0f}"), Column("target_tokens_per_s", "target tokens/s", "{:.0f}"),
           Column("vs_marian", "× Marian", "{:.2f}"), Column("vs_bucketed", "× bucketed", "{:.3f}"),
           Column("model_tflops_per_s", "model TFLOP/s", "{:.3f}"), Column("mfu", "MFU", "{:.1%}"),
           Column("peak_mib", "peak MiB", "{:.0f}"), Column("load_average", "load avg", "{:.1f}"),
           Column("compilations_while_timed", "recompiles"), Column("attention", "attention"), Column("dtype", "dtype"),
           Column("first_round_ms", "ms a step, first pass", "{:.1f}"),
           Column("later_rounds_ms", "ms a step, later passes", "{:.1f}")]


def print_profile(trainee: Trainee, steps, size: str, device) -> None:
    """Print the top operators by self device time (CPU time on a CPU) over `steps`, after the timed run."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.is_cuda else [])
    with profile(activities=activities) as prof:
        for i in steps:
            trainee.step(i)
        device.sync()
    key = "self_cuda_time_total" if device.is_cuda else "self_cpu_time_total"
    print(f"\n## Profile: {size} {engine_label(trainee.name)}, {len(steps)} steps, by {key}")
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70), flush=True)


def add_ratios(rows: list[dict]) -> None:
    """Each row's real tokens/s over Marian's on the same (or, for packed rows, the same multiple's bucketed)
    batches, and over the same engine's on the trainer's default batches (`bucketed`)."""
    rate = {(r["size"], r["batch_tokens"], r["batching"], r["engine"]): r["tokens_per_s"] for r in rows}
    for r in rows:
        key = (r["size"], r["batch_tokens"])
        marian = rate.get((*key, r["batching"].replace("packed", "bucketed"), "marian"))
        r["vs_marian"] = r["tokens_per_s"] / marian if r["engine"] != "marian" and marian else None
        bucketed = rate.get((*key, "bucketed", r["engine"]))
        r["vs_bucketed"] = r["tokens_per_s"] / bucketed if r["batching"] != "bucketed" and bucketed else None


def main(argv=None) -> Path:
    parser, add = argument_parser(__doc__)
    add("--sizes", type=csv_of(str), default=["tiny", "base", "big"])
    add("--engines", type=csv_of(str), default=list(ENGINES))
    add("--batch_tokens", type=csv_of(int), default=None, help="padded tokens per side per batch, one or more budgets; "
        "default 4000,12000,25000 on CUDA (25,000: the paper's), 2048 on CPU")
    add("--steps", type=int, default=None, help="timed steps per engine; default 20 CUDA, 4 CPU")
    add("--warmup_steps", type=int, default=None, help="default 3 CUDA, 1 CPU")
    add("--seconds_per_setting", type=float, default=None, help="repeat the timed batches until the slowest engine "
        "has trained this long at each size and budget (a step-rate probe)")
    add("--passes", type=int, default=1, help="at least this many passes over the timed batches (with --warmup_steps "
        "0, the first meets each batch's shape for the first time: columns `ms a step, first pass` and `later passes`)")
    add("--batchings", type=csv_of(str), default=["bucketed"], help=f"one or more of {', '.join(BATCHINGS)} (see "
        "BATCHINGS); every engine steps on each, interleaved (packed: Vaswani only)")
    add("--shape_buckets", type=int, default=None, choices=range(1, MAX_SHAPE_BUCKETS + 1), metavar="K",
        help="cut the batches as train_translation.py --shape_buckets K; -graphs engines pad each up to its shape")
    add("--dropout", type=float, default=None, help="dropout of both models; default: the preset's")
    add("--keep_freed_memory", action="store_true", help="CPU: vaswani.inference.keep_freed_cpu_memory(None) for the "
        "whole process, as train_translation.py does on a CPU, Marian's steps included")
    add("--compile_cache", type=Path, default=None, help="torch.compile's portable cache (save_cache_artifacts): "
        "loaded before the engines compile where the file exists, saved after the run for the next of this device")
    add("--profile", action="store_true", help="after timing, print each engine's top operators over the timed steps")
    args = parser.parse_args(argv)
    if set(args.batchings) - set(BATCHINGS) or len(set(args.batchings)) < len(args.batchings):
        raise SystemExit(f"--batchings: each of {', '.join(BATCHINGS)} at most once; got {','.join(args.batchings)}.")
    device = pick_device(args.device, args.threads)
    budgets = args.batch_tokens or ([4000, 12000, 25000] if device.as_cuda else [2048])
    engines = [name for name in args.engines if device.is_cuda or "graphs" not in name.split("-")]
    if engines != args.engines:
        print(f"skipped without CUDA: {', '.join(sorted(set(args.engines) - set(engines)))}", file=sys.stderr)
    steps = args.steps or (20 if device.as_cuda else 4)
    warmup = args.warmup_steps if args.warmup_steps is not None else (3 if device.as_cuda else 1)
    peak_tflops = device.bf16_peak_tflops
    if args.keep_freed_memory and not device.is_cuda and not keep_freed_cpu_memory(largest_block_mib=None):
        raise RuntimeError("--keep_freed_memory needs glibc's mallopt, which this platform does not have.")
    started = time.monotonic()
    corpus, pairs, tokenizer = corpus_and_tokenizer(args.corpus, args.cache_dir, args.vocab_size)
    encoded = tokenizer([e for e, _ in pairs], text_target=[f for _, f in pairs])
    source_ids, target_ids = encoded["input_ids"], encoded["labels"]  # both end with </s>
    rows, refused = [], []
    settings = {"batch_tokens": budgets, "steps": steps, "warmup_steps": {}, "peak_tflops": peak_tflops,
                "corpus": str(corpus), "vocab_size_actual": len(tokenizer), "batch_sizes_sentences": {},
                "padding_fraction": {}}
    carried, hits = args.compile_cache and args.compile_cache.is_file(), compile_cache_hits()
    if carried:
        torch.compiler.load_cache_artifacts(args.compile_cache.read_bytes())

    def save_cache(trainee) -> None:
        """torch.compile's cache, saved as soon as a compiled engine has compiled, as train_translation.py does:
        where none was carried or the one carried served nothing."""
        if (args.compile_cache and "compiled" in trainee.name.split("-")
                and not (carried and compile_cache_hits() > hits)
                and (artifacts := torch.compiler.save_cache_artifacts()) is not None):
            write_atomically(args.compile_cache, artifacts[0])

    def write() -> Path:
        """The report of the rows so far, rewritten as each setting's rows are in."""
        add_ratios(rows)
        return report(__file__, argv, args, device, "training", "Training throughput", rows, COLUMNS,
                      notes(args, device, budgets, steps, peak_tflops, corpus, pairs, tokenizer, refused, rows),
                      settings)

    with stopping():
        try:
            measure_budgets(args, device, engines, budgets, steps, warmup, source_ids, target_ids, tokenizer,
                            peak_tflops, started, refused, rows, settings, save_cache, write)
        except Stopped as stopped:
            write()
            sys.exit(128 + stopped.signum)
    return write()


def measure_budgets(args, device, engines, budgets, steps, warmup, source_ids, target_ids, tokenizer, peak_tflops,
                    started, refused, rows, settings, warmed, measured) -> None:
    """`measure` at each batch budget, on the batches `prepare` cuts for it (their sizes and padding in
    `settings`)."""
    for batch_tokens in budgets:
        prepared = {}
        for batching in args.batchings:
            key = batch_tokens if batching == "bucketed" else f"{batch_tokens} {batching}"  # the default by budget
            prepared[batching] = batches = prepare(args, batching, source_ids, target_ids, tokenizer, batch_tokens,
                                                   steps, warmup)
            settings["warmup_steps"][key] = batches.warmup
            settings["batch_sizes_sentences"][key] = [len(s) for s, _ in batches.batches[1 + batches.warmup:]]
            settings["padding_fraction"].update({f"{key}{suffix}": share for suffix, share in batches.padding.items()})
            if batches.shapes:
                settings.setdefault("shapes_rows_length", {})[key] = batches.shapes
            # Progress on stderr as each phase ends: a GPU run cut short by its time limit still says how far it got.
            print(f"{len(batches.batches)} {batching} batches of {batch_tokens} tokens ready after "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        measure(args, device, engines, prepared, batch_tokens, len(tokenizer), peak_tflops, started, refused, rows,
                warmed, measured)


if __name__ == "__main__":
    main()
