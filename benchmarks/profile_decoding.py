"""Where a CPU decoding step's time goes: the PyTorch engine's greedy and beam search split into the parts of a step,
beside CTranslate2's total on the same batches. The engines are `bench_translation.LocalEngine`s; the sentences the
first `--num_sentences` of the held-out test split, sorted by length, in batches of `--batch_size`, each stopping at
its end (`--forced N`, for random weights: exactly N tokens).

Each part's self time (its time less that of the parts it calls) comes from forward hooks on every module and
wrappers around the loop's functions. The instrumented pass is slower than a plain one (the hooks' cost lands mostly
in the loop's part); the plain totals (fastest of `--repeats`) are the ones to compare with CTranslate2's.

The instrumented pass also records every call of a linear layer (encoder, decoder and output layer: the layer and its
input's shape), which are then replayed alone, without hooks, in the same order on inputs of the same shapes: the time
the engine's linear layers (their kernels and their own Python) take by themselves, which no change elsewhere in the
step can shorten.

    python benchmarks/profile_decoding.py --model outputs/en-fr-small --threads 2
    python benchmarks/profile_decoding.py --size base --forced 16 --tokenizer outputs/en-fr-small --threads 2
"""

import collections
import contextlib
import tempfile
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicLayer

from vaswani import generation_vaswani, modeling_vaswani
from vaswani.tokenization_vaswani import VaswaniTokenizer

from bench_translation import LocalEngine
from common import Column, argument_parser, csv_of, pick_device, random_checkpoint, report, test_sources

# The parts of a step, in the table's order: what each is made of (module-path rules and wrapped functions below).
PARTS = ["encoder (once per batch)", "self-attention q/k/v/o projections", "cross-attention q/o projections",
         "cross-attention k/v projections (once per sentence)", "attention math (scores, softmax, weighted sum)",
         "attention glue (head reshapes, beam views)", "cache handling (append, reorder, drop rows)",
         "feed-forward (fc1, ReLU, fc2)", "layer norms", "residual adds, dropout calls (decoder layers)",
         "masks (causal, cross)", "embeddings and positions", "model forward glue (decoder, model, outputs)",
         "output layer (lm_head)", "top-k / argmax", "beam bookkeeping (rank, finished hypotheses)",
         "generate() and the loop (setup, log-softmax, tokens, stopping)"]


def module_part(path: str, module: torch.nn.Module) -> str:
    """The part a module's self time belongs to, from its path in the model."""
    leaf = path.rsplit(".", 1)[-1]
    if path.startswith("model.encoder"):
        return PARTS[0]
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return PARTS[1] if ".self_attn." in path else PARTS[3] if leaf in ("k_proj", "v_proj") else PARTS[2]
    if leaf in ("self_attn", "encoder_attn"):
        return PARTS[5]
    if ".mlp" in path:
        return PARTS[7]
    if "layer_norm" in leaf or leaf == "norm":
        return PARTS[8]
    if type(module).__name__ == "VaswaniDecoderLayer":
        return PARTS[9]
    if "embed" in leaf:
        return PARTS[11]
    if leaf == "lm_head":
        return PARTS[13]
    return PARTS[12]


class StepTimer(contextlib.ExitStack):
    """Self times per part: module hooks and wrapped functions start and stop frames on one stack, as long as the
    context lasts."""

    def __init__(self, model):
        super().__init__()
        self.seconds, self.frames, self.decoder_calls, self.linear_calls = collections.Counter(), [], 0, []
        for path, module in model.named_modules():
            if module is not model:
                part = module_part(path, module)
                if hasattr(module, "in_features"):  # nn.Linear and the engine's replacements for it
                    self.callback(module.register_forward_pre_hook(
                        lambda layer, inputs: self.linear_calls.append((layer, tuple(inputs[0].shape)))).remove)
                self.callback(module.register_forward_pre_hook(lambda *_, part=part: self.start(part)).remove)
                self.callback(module.register_forward_hook(lambda *_: self.stop()).remove)
        self.callback(model.model.decoder.register_forward_pre_hook(lambda *_: self.count()).remove)
        self.wrap(modeling_vaswani, "eager_attention_forward", PARTS[4])
        self.wrap(modeling_vaswani, "create_causal_mask", PARTS[10])
        self.wrap(modeling_vaswani, "create_bidirectional_mask", PARTS[10])
        for name in ("update", "reorder_cache", "batch_select_indices"):
            self.wrap(DynamicLayer, name, PARTS[6])
        self.wrap(generation_vaswani, "_keep_rows", PARTS[6])
        self.wrap(generation_vaswani, "top_k", PARTS[14])
        self.wrap(generation_vaswani, "_advance", PARTS[15])

    def count(self):
        self.decoder_calls += 1

    def start(self, part):
        self.frames.append([part, time.perf_counter(), 0.0])

    def stop(self):
        part, start, children = self.frames.pop()
        elapsed = time.perf_counter() - start
        self.seconds[part] += elapsed - children
        if self.frames:
            self.frames[-1][2] += elapsed

    def wrap(self, owner, name, part):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self.start(part)
            try:
                return original(*args, **kwargs)
            finally:
                self.stop()

        setattr(owner, name, timed)
        self.callback(setattr, owner, name, original)


def replay_seconds(calls: list, repeats: int) -> float:
    """The fastest of `repeats` replays of `calls` ((layer, input shape) in the order the pass made them), without
    hooks or anything between them, as a decoding step calls them (no autograd)."""
    inputs = {shape: torch.randn(shape) for shape in {shape for _, shape in calls}}
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer, shape in calls:
                layer(inputs[shape])
            best = min(best, time.perf_counter() - start)
    return best


def run_batches(engine, batches, beams, new_tokens, stop_at_eos) -> float:
    """The seconds `engine` takes to translate `batches`, one after another."""
    return sum(engine.timed_translate(batch, beams, new_tokens, stop_at_eos)[1] for batch in batches)


def profile(args) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        tokenizer = VaswaniTokenizer.from_pretrained(args.model or args.tokenizer)
        sentences = test_sources(args.corpus)[1]
        if args.model:
            model_dir, label = args.model, Path(args.model).name
        else:  # the same sentences and tokenizer as a trained checkpoint's, random weights at another size
            model_dir = random_checkpoint(args.size, tokenizer, 0, Path(workdir) / args.size)
            label = f"{args.size} preset, random weights, {len(tokenizer)}-token vocabulary of {args.tokenizer}"
        ids = sorted(tokenizer(sentences[: args.num_sentences])["input_ids"], key=len)
        batches = [ids[i: i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
        stop_at_eos, new_tokens = args.forced is None, args.forced or args.max_new_tokens
        spec = dict(model_dir=model_dir, device_name="cpu", threads=args.threads, ct2_dir=Path(workdir) / "ct2")
        torch_engine = LocalEngine(name="vaswani", **spec)
        ct2_engine = LocalEngine(name="ct2-float32", **spec)
        results = {"model": label, "sentences": len(ids), "batch_size": args.batch_size,
                   "stopping": "eos" if stop_at_eos else f"forced {new_tokens}", "searches": []}
        for beams in args.beams:
            for engine in (torch_engine, ct2_engine):  # warm-up
                run_batches(engine, batches[:1] + batches[-1:], beams, new_tokens, stop_at_eos)
            plain, ct2 = [], []
            for _ in range(args.repeats):  # interleaved, so that both see the same load
                plain.append(run_batches(torch_engine, batches, beams, new_tokens, stop_at_eos))
                ct2.append(run_batches(ct2_engine, batches, beams, new_tokens, stop_at_eos))
            timers = []
            for _ in range(args.repeats):  # the fastest instrumented pass counts, as the plain ones
                with StepTimer(torch_engine.engine.model) as timer:
                    timers.append((run_batches(torch_engine, batches, beams, new_tokens, stop_at_eos), timer))
            instrumented, timer = min(timers, key=lambda pair: pair[0])
            timer.seconds[PARTS[-1]] += instrumented - sum(timer.seconds.values())
            steps = timer.decoder_calls - len(batches)  # the first call of a batch reads the prompt
            linear_alone = replay_seconds(timer.linear_calls, args.repeats)
            results["searches"].append({"beams": beams, "plain_seconds": min(plain), "ct2_float32_seconds": min(ct2),
                                        "instrumented_seconds": instrumented, "decoding_steps": steps,
                                        "linear_calls": len(timer.linear_calls), "linear_alone_seconds": linear_alone,
                                        "parts_seconds": {part: timer.seconds[part] for part in PARTS}})
            print(f"beams {beams}: vaswani {min(plain):.2f} s, ct2-float32 {min(ct2):.2f} s, instrumented "
                  f"{instrumented:.2f} s over {steps} steps", flush=True)
    return results


def table(searches: list[dict]) -> tuple[list[dict], list[Column]]:
    """One row per part, then the totals; per search, ms, % of the instrumented pass and µs per decoding step."""
    totals = {"total, instrumented": "instrumented_seconds", "**total, plain (no hooks)**": "plain_seconds",
              "linear layers alone (the pass's calls replayed, no hooks)": "linear_alone_seconds",
              "**CTranslate2 float32, same batches**": "ct2_float32_seconds"}
    rows = [{"part": part} for part in [*PARTS, *totals, "decoding steps (batch calls after the first)",
                                        "**Vaswani ÷ CTranslate2 float32 time**"]]
    columns = [Column("part", "part")]
    for s in searches:
        name, steps = "greedy" if s["beams"] == 1 else f"beam {s['beams']}", max(s["decoding_steps"], 1)
        columns += [Column(f"{name} ms", f"{name} ms", "{:.0f}"), Column(f"{name} %", "%", "{:.1f}"),
                    Column(f"{name} µs", "µs/step", "{:.0f}")]
        seconds = [*(s["parts_seconds"][part] for part in PARTS), *(s[key] for key in totals.values())]
        for row, part_seconds in zip(rows, seconds):
            row.update({f"{name} ms": part_seconds * 1e3, f"{name} µs": part_seconds * 1e6 / steps})
        for row in rows[: len(PARTS)]:
            row[f"{name} %"] = 100 * row[f"{name} ms"] / 1e3 / s["instrumented_seconds"]
        rows[-2][f"{name} ms"] = s["decoding_steps"]
        rows[-1][f"{name} ms"] = f"{s['plain_seconds'] / s['ct2_float32_seconds']:.2f}"
    return rows, columns


def main(argv=None):
    parser, add = argument_parser(__doc__, corpus=False)
    add("--model", default=None, help="a trained checkpoint; else random weights at --size (needs --forced)")
    add("--size", default="base")
    add("--tokenizer", default=None, help="with --size: the checkpoint whose tokenizer (and test split) to use")
    add("--corpus", default=None)
    add("--threads", type=int, default=2)
    add("--batch_size", type=int, default=32)
    add("--num_sentences", type=int, default=320)
    add("--beams", type=csv_of(int), default=[1, 4])
    add("--forced", type=int, default=None, help="exactly this many tokens per sentence (random weights)")
    add("--max_new_tokens", type=int, default=128)
    add("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.model is None and (args.forced is None or args.tokenizer is None):
        parser.error("random weights stop at arbitrary points: give --forced N and --tokenizer DIR (or a --model)")
    results = profile(args)
    rows, columns = table(results["searches"])
    notes = [f"Model {results['model']}; {results['sentences']} held-out sentences in batches of "
             f"{results['batch_size']}, stopping: {results['stopping']}. A shared machine: compare within a run only."]
    return report(__file__, argv, args, pick_device("cpu", args.threads), "profile-decoding",
                  "Where a CPU decoding step's time goes", rows, columns, notes, results)


if __name__ == "__main__":
    main()
