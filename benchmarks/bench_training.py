"""Training throughput: non-padding tokens/s of full training steps (forward, backward, Adam step), Vaswani vs
`MarianMTModel` at identical sizes, on identical length-bucketed batches of the real corpus, at identical precision
(bf16 autocast on CUDA, fp32 on CPU); peak memory; on CUDA the model-FLOPs utilisation.

    python benchmarks/bench_training.py                                   # GPU: tiny, base, big; 25k-token batches
    python benchmarks/bench_training.py --device cpu --sizes tiny,base --batch_tokens 2048 --steps 4

Model FLOPs of a step, counted on non-padding tokens with the PaLM convention (Chowdhery et al., 2022, App. B):
6 × (the weights each token is multiplied by) + 12·d_model per layer per attended (query, key) pair, i.e.
6·N·tokens for an encoder-decoder, where a source token passes the encoder (and the decoder's cross-attention
key/value projections) and a target token the decoder and the output projection; MFU = FLOPs/s over the
device's dense bf16 peak.
"""

import argparse
import contextlib
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ENGINE_LABELS,
    Column,
    PeakMemory,
    add_common_arguments,
    build_seq2seq,
    command_line,
    corpus_and_tokenizer,
    count_parameters,
    csv_of,
    pick_device,
    result_name,
    timed,
    vaswani_config,
    sdpa_backend,
    settings_of,
    write_report,
)

ENGINES = ("vaswani", "vaswani-compiled", "marian")
# `<engine>-compiled`: the same model under `torch.compile` (inductor, automatic dynamic shapes), which is what
# `TrainingArguments(torch_compile=True)` / `train_translation.py --torch_compile` does; it fuses the elementwise
# work (residual dropout + add + LayerNorm, the label-smoothed cross-entropy over the vocabulary) and drops the
# host syncs of the eager path. `marian-compiled` is offered so that the comparison can be made compiled vs compiled.
ENGINE_LABELS = {**ENGINE_LABELS, "vaswani-compiled": "Vaswani compiled", "marian-compiled": "Marian compiled"}


def bucket_batches(source_ids, target_ids, batch_tokens: int, seed: int) -> list[list[int]]:
    """Length-bucketed batches (as fairseq/tensor2tensor build them): pairs sorted by length, cut so that each
    batch holds at most `batch_tokens` tokens on each side *including padding*, then shuffled."""
    rng = random.Random(seed)
    longest = [max(len(s), len(t)) for s, t in zip(source_ids, target_ids)]
    order = sorted(range(len(longest)), key=lambda i: (longest[i], rng.random()))
    batches, current, width = [], [], 0
    for i in order:
        if longest[i] > batch_tokens:
            continue  # a pair longer than a whole batch would not fit any
        if current and max(width, longest[i]) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, longest[i])
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def model_flops(config, source_lengths: list[int], target_lengths: list[int]) -> float:
    """Training FLOPs of one step (forward + backward = 3 × forward), see the module docstring."""
    d, ff, vocab = config.d_model, config.d_ff, config.vocab_size
    kv_width = config.num_key_value_heads * config.head_dim
    attention = 2 * d * d + 2 * d * kv_width  # q, o and k, v projections
    ffn = (3 if config.ffn_activation in ("swiglu", "geglu") else 2) * d * ff
    per_source = config.encoder_layers * (attention + ffn) + config.decoder_layers * 2 * d * kv_width
    per_target = config.decoder_layers * (attention + 2 * d * d + ffn) + d * vocab
    weights = 6 * (sum(source_lengths) * per_source + sum(target_lengths) * per_target)
    pairs = sum(
        config.encoder_layers * s * s + config.decoder_layers * (t * t + t * s)
        for s, t in zip(source_lengths, target_lengths)
    )
    return weights + 12 * d * pairs


class Trainee:
    """One engine's model, optimizer and its copy of the batches (each model has its own padding id)."""

    def __init__(self, name, config, device, batches, seed, lr, attention_kernel=None):
        self.name = name
        self.model = build_seq2seq(name.removesuffix("-compiled"), config, device, torch.float32, seed).train()
        self.parameters = count_parameters(self.model)
        self.forward = torch.compile(self.model) if name.endswith("-compiled") else self.model
        # The paper's Adam (§5.3); the learning-rate schedule does not change the cost of a step.
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9)
        pad = self.model.config.pad_token_id
        self.batches = [_tensors(sources, targets, pad) for sources, targets in batches]
        self.device = device
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if device.is_cuda else contextlib.nullcontext()
        )
        self.attention_kernel = attention_kernel

    def step(self, index: int) -> None:
        batch = {k: v.to(self.device.device, non_blocking=True) for k, v in self.batches[index].items()}
        with self.autocast, sdpa_backend(self.attention_kernel):
            loss = self.forward(**batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_mib(self) -> float:
        """Weights and optimizer state: what stays resident between steps."""
        tensors = list(self.model.parameters()) + [
            value for state in self.optimizer.state.values() for value in state.values() if torch.is_tensor(value)
        ]
        return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def _tensors(sources: list[list[int]], targets: list[list[int]], pad: int) -> dict:
    def padded(rows, value):
        width = max(map(len, rows))
        return torch.tensor([row + [value] * (width - len(row)) for row in rows])

    input_ids = padded(sources, pad)
    return {"input_ids": input_ids, "attention_mask": input_ids != pad, "labels": padded(targets, -100)}


def run(args: argparse.Namespace, argv) -> Path:
    device = pick_device(args.device, args.threads)
    batch_tokens = args.batch_tokens or (25000 if device.is_cuda else 2048)
    steps = args.steps or (20 if device.is_cuda else 4)
    warmup = args.warmup_steps if args.warmup_steps is not None else (3 if device.is_cuda else 1)
    peak_tflops = device.bf16_peak_tflops(args.peak_tflops)
    corpus, pairs, tokenizer = corpus_and_tokenizer(args)
    encoded = tokenizer([e for e, _ in pairs], text_target=[f for _, f in pairs])
    source_ids, target_ids = encoded["input_ids"], encoded["labels"]  # both end with </s>
    order = bucket_batches(source_ids, target_ids, batch_tokens, args.seed)
    if len(order) < warmup + steps + 1:
        raise ValueError(f"The corpus gives {len(order)} batches of {batch_tokens} tokens; need {warmup + steps + 1}.")
    # Step 0 measures memory, then warm-up, then the timed steps: all on distinct batches, the same for every engine.
    chosen = order[: 1 + warmup + steps]
    batches = [([source_ids[i] for i in b], [target_ids[i] for i in b]) for b in chosen]
    timed_batches = batches[1 + warmup :]

    rows = []
    for size in args.sizes:
        config = vaswani_config(size, len(tokenizer))
        trainees = [
            Trainee(name, config, device, batches, args.seed, args.lr, args.sdpa_backend) for name in args.engines
        ]
        memory = {}
        for trainee in trainees:
            # Warm-up first: a compiled engine compiles there (once per new shape until shapes turn dynamic).
            for i in range(1, 1 + warmup):
                trainee.step(i)
            with PeakMemory(device) as peak:
                trainee.step(0)
            memory[trainee.name] = (trainee.state_mib(), peak.added_mib)
        seconds = {t.name: 0.0 for t in trainees}
        compiles_before = _compilations()
        for i in range(1 + warmup, len(batches)):
            rotation = i % len(trainees)  # interleaved, order rotating: machine-load drifts hit every engine alike
            for trainee in trainees[rotation:] + trainees[:rotation]:
                _, elapsed = timed(device, lambda: trainee.step(i))
                seconds[trainee.name] += elapsed
        compiles_timed = _compilations() - compiles_before
        if args.profile:
            for trainee in trainees:
                _profile(trainee, range(1 + warmup, len(batches)), size, device, args.profile_rows)
        load_average = os.getloadavg()[0]
        source_tokens = sum(len(s) for sources, _ in timed_batches for s in sources)
        target_tokens = sum(len(t) for _, targets in timed_batches for t in targets)
        flops = sum(model_flops(config, list(map(len, s)), list(map(len, t))) for s, t in timed_batches)
        for trainee in trainees:
            state, added = memory[trainee.name]
            elapsed = seconds[trainee.name]
            rows.append({
                "size": size,
                "engine": trainee.name,
                "engine_label": ENGINE_LABELS[trainee.name],
                "parameters": trainee.parameters,
                "parameters_m": trainee.parameters / 1e6,
                "steps": steps,
                "sentences": sum(len(s) for s, _ in timed_batches),
                "source_tokens": source_tokens,
                "target_tokens": target_tokens,
                "seconds": elapsed,
                "tokens_per_s": (source_tokens + target_tokens) / elapsed,
                "target_tokens_per_s": target_tokens / elapsed,
                "model_tflops_per_s": flops / elapsed / 1e12,
                "mfu": flops / elapsed / (peak_tflops * 1e12) if peak_tflops else None,
                "state_mib": state,
                "step_added_mib": added,
                "peak_mib": state + added if added is not None else None,
                "load_average": load_average,
                "compilations_while_timed": compiles_timed,
            })
            print(_progress(rows[-1]), flush=True)
        del trainees

    _add_ratios(rows)
    padded = sum(max(map(len, s)) * len(s) + max(map(len, t)) * len(t) for s, t in timed_batches)
    settings = settings_of(
        args,
        batch_tokens=batch_tokens,
        steps=steps,
        warmup_steps=warmup,
        peak_tflops=peak_tflops,
        corpus=str(corpus),
        vocab_size_actual=len(tokenizer),
        batch_sizes_sentences=[len(s) for s, _ in timed_batches],
        padding_fraction=1 - (source_tokens + target_tokens) / padded,
    )
    notes = [
        f"Batches: all {len(pairs)} pairs of {corpus.name} tokenized by the project's joint BPE ({len(tokenizer)} "
        f"tokens), bucketed by length into batches of at most {batch_tokens} padded tokens per side, shuffled "
        f"(seed {args.seed}); the same {steps} timed batches ({settings['batch_sizes_sentences']} sentences, "
        f"{settings['padding_fraction']:.1%} padding) for every engine, after {warmup} warm-up step(s).",
        "tokens/s = non-padding source + target tokens per second of full steps: forward with the loss, "
        "backward, Adam step (β = 0.9, 0.98, ε = 1e-9, §5.3), zero_grad. Each model computes its own loss from "
        "`labels` (Vaswani with label smoothing 0.1 as in the paper, Marian plain cross-entropy: the same cost).",
        "Engines are interleaved step by step (order rotating), so changes in machine load hit both alike.",
        (f"Precision: bf16 autocast with fp32 weights on CUDA; MFU against a dense bf16 peak of {peak_tflops} "
         "TFLOP/s." if device.is_cuda else "Precision fp32 on CPU; model TFLOP/s is reported, MFU only on GPU."),
        "Memory: peak = weights + Adam state (resident between steps) + the peak a step adds on top (measured on "
        "one extra untimed step after the warm-up; on CPU as a process RSS increment, which includes the gradients).",
        "Compiled engines: `torch.compile(model)` (inductor, default mode, automatic dynamic shapes) called like the "
        "eager model; compilation happens in the warm-up steps, and the "
        "graphs built during the timed steps (column `recompiles`).",
        "Dropout as configured (0.1; big: 0.3), attention implementation: the transformers default (sdpa), "
        + (f"restricted to torch's {args.sdpa_backend} kernel for every engine."
           if args.sdpa_backend else "with torch's own choice of kernel."),
    ]
    if args.notes:
        notes.append(args.notes)
    columns = [
        Column("size", "size"),
        Column("engine_label", "engine"),
        Column("parameters_m", "params (M)", "{:.1f}"),
        Column("steps", "steps"),
        Column("seconds", "seconds", "{:.2f}"),
        Column("tokens_per_s", "tokens/s", "{:.0f}"),
        Column("target_tokens_per_s", "target tokens/s", "{:.0f}"),
        Column("vs_marian", "× Marian", "{:.2f}"),
        Column("model_tflops_per_s", "model TFLOP/s", "{:.3f}"),
        Column("mfu", "MFU", "{:.1%}"),
        Column("peak_mib", "peak MiB", "{:.0f}"),
        Column("load_average", "load avg", "{:.1f}"),
        Column("compilations_while_timed", "recompiles"),
    ]
    name = result_name(args, "training", device)
    json_path, _ = write_report(
        name, "Training throughput", command_line(__file__, argv), device, settings, rows, columns, notes,
        args.results_dir,
    )
    return json_path


def _profile(trainee: Trainee, steps, size: str, device, rows: int) -> None:
    """Print where a step's time goes: operators and kernels by self device time (self CPU time on CPU) over the
    given steps, after the timed run (so nothing here changes the numbers above)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.is_cuda else [])
    with profile(activities=activities) as prof:
        for i in steps:
            trainee.step(i)
        device.sync()
    key = "self_cuda_time_total" if device.is_cuda else "self_cpu_time_total"
    print(f"\n## Profile: {size} {ENGINE_LABELS[trainee.name]}, {len(steps)} steps, by {key}")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70), flush=True)


def _compilations() -> int:
    """Graphs torch.compile has built so far in this process (any inside the timed steps would be counted in them)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _add_ratios(rows: list[dict]) -> None:
    marian = {r["size"]: r["tokens_per_s"] for r in rows if r["engine"] == "marian"}
    for r in rows:
        r["vs_marian"] = r["tokens_per_s"] / marian[r["size"]] if r["engine"] != "marian" and r["size"] in marian else None


def _progress(row: dict) -> str:
    return (
        f"{row['size']:>5} {row['engine_label']:>12}: {row['tokens_per_s']:9.0f} tokens/s "
        f"{row['model_tflops_per_s']:.3f} model TFLOP/s, peak {row['peak_mib'] or 0:.0f} MiB"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--sizes", type=csv_of(str), default=["tiny", "base", "big"])
    parser.add_argument("--engines", type=csv_of(str), default=list(ENGINES))
    parser.add_argument("--batch_tokens", type=int, default=None,
                        help="padded tokens per side per batch; default 25000 on CUDA (the paper's), 2048 on CPU")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per engine; default 20 CUDA, 4 CPU")
    parser.add_argument("--warmup_steps", type=int, default=None, help="default 3 CUDA, 1 CPU")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile the timed steps of each engine and print the top operators")
    parser.add_argument("--profile_rows", type=int, default=25)
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="the device's dense bf16 peak, for MFU on GPUs not in common.BF16_PEAK_TFLOPS")
    return parser


def main(argv=None) -> Path:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    main()
