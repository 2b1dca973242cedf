"""Where the CPU time goes: greedy and beam-search translation of one batch, and one training step, at one size.

    python benchmarks/profile_cpu.py --threads 1               # base size, batch 32, 16 new tokens, beams 1 and 4

For each PyTorch engine (Vaswani, Marian) and beam width it reports
  * `generate()` wall time (fastest of --repeats),
  * the model-compute floor: the same encoder pass and the same number of decoder rows × steps run by a bare
    loop of forward calls with the KV cache (no search bookkeeping), so generate overhead = the difference,
  * the op-level split from torch.profiler (self CPU time per category; "outside ATen" = wall − Σ op time: Python,
    dispatch, and framework code), and the Python functions with the most own time (cProfile);
and CTranslate2's wall time on the same batch, the achieved model GFLOP/s, and the fp32 GEMM speed of this machine
on the decoder's shapes (the compute roofline). The training step gets the same op-level split.
"""

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from vaswani.inference import quantize_for_cpu
from vaswani.modeling_vaswani import CACHE_NAME  # the cache's name in this transformers release

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_training import Trainee, bucket_batches, model_flops  # noqa: E402
from bench_translation import CT2Engine, TorchEngine  # noqa: E402
from common import (  # noqa: E402
    ENGINE_LABELS,
    Column,
    add_common_arguments,
    command_line,
    corpus_and_tokenizer,
    csv_of,
    pick_device,
    sample_sentences,
    vaswani_config,
    settings_of,
    write_report,
)

# First match wins; matched against the aten op name.
CATEGORIES = (
    ("matmul (linear layers, logits)", ("addmm", "aten::mm", "bmm", "baddbmm", "_mkl_linear", "mkldnn_linear",
                                        "aten::linear", "quantized::linear")),
    ("attention kernel", ("scaled_dot_product", "_flash_attention", "_efficient_attention", "softmax_backward")),
    ("softmax / log-softmax / loss", ("softmax", "nll_loss", "cross_entropy")),
    ("search (topk, sort, argmax)", ("topk", "sort", "argmax", "aten::max", "aten::gather", "aten::multinomial")),
    ("layer norm", ("layer_norm", "rms_norm")),
    ("cache & copies (cat, index_select, copy)", ("aten::cat", "index_select", "aten::copy_", "aten::clone",
                                                 "contiguous", "aten::index", "aten::to", "_to_copy", "repeat")),
    ("embedding", ("embedding",)),
    ("optimizer", ("_foreach", "adam", "sqrt", "lerp")),
)


def categorize(op_name: str) -> str:
    for category, patterns in CATEGORIES:
        if any(p in op_name for p in patterns):
            return category
    return "other ops (elementwise, masks, …)"


def op_breakdown(prof, wall_seconds: float) -> dict:
    """Self CPU time per category and the top ops, in seconds; 'outside ATen' is what no op accounts for."""
    by_category, ops = defaultdict(float), []
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "quantized::", "mkldnn", "_")):
            seconds = event.self_cpu_time_total / 1e6
            by_category[categorize(event.key)] += seconds
            ops.append((event.key, seconds, event.count))
    in_ops = sum(by_category.values())
    by_category["outside ATen (Python, dispatch, framework)"] = max(wall_seconds - in_ops, 0.0)
    ops.sort(key=lambda item: -item[1])
    return {"categories": dict(by_category), "top_ops": ops[:12], "wall_seconds": wall_seconds}


def python_hotspots(fn, limit: int = 12) -> list[tuple[str, float, int]]:
    """Python functions with the most own time (cProfile tottime), C builtins excluded: the framework overhead."""
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    stats = pstats.Stats(profiler).stats
    rows = []
    for (filename, line, function), (_, calls, tottime, _, _) in stats.items():
        if filename.startswith("~") or filename.startswith("<"):
            continue
        short = "/".join(Path(filename).parts[-2:])
        rows.append((f"{short}:{line} {function}", tottime, calls))
    rows.sort(key=lambda item: -item[1])
    return rows[:limit]


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def forward_floor(model, input_ids, attention_mask, beams: int, new_tokens: int, start_token: int):
    """The decoder work of generate() without its search: encoder once, then `new_tokens` cached decoder steps
    on batch × beams rows, feeding back the argmax."""
    with torch.inference_mode():
        encoder = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        hidden = encoder.last_hidden_state.repeat_interleave(beams, dim=0)
        mask = attention_mask.repeat_interleave(beams, dim=0)
        tokens = torch.full((hidden.shape[0], 1), start_token, dtype=torch.long)
        cache = None
        for _ in range(new_tokens):
            out = model(encoder_outputs=(hidden,), attention_mask=mask, decoder_input_ids=tokens,
                        **{CACHE_NAME: cache}, use_cache=True)
            cache, tokens = getattr(out, CACHE_NAME), out.logits[:, -1:].argmax(-1)


def decode_flops(config, source_lengths: list[int], beams: int, new_tokens: int) -> float:
    """Forward FLOPs of translating a batch: the encoder once, cross-attention keys/values once per beam row,
    `new_tokens` decoder steps per beam row (self-attention over the growing prefix, cross-attention over the
    source) including the output projection."""
    d, ff, vocab, layers = config.d_model, config.d_ff, config.vocab_size, config.decoder_layers
    flops = 0.0
    for s in source_lengths:
        flops += 2 * s * config.encoder_layers * (4 * d * d + 2 * d * ff) + 4 * config.encoder_layers * d * s * s
        flops += beams * 2 * s * layers * 2 * d * d  # cross-attention k, v (expanded per beam by generate)
        for t in range(1, new_tokens + 1):
            flops += beams * (2 * (layers * (6 * d * d + 2 * d * ff) + d * vocab) + 4 * layers * d * (t + s))
    return flops


def gemm_gflops(shapes, repeats: int = 20) -> dict:
    """Measured fp32 GEMM speed (GFLOP/s) of this machine on the decoder's matmul shapes."""
    results = {}
    for m, k, n in shapes:
        a, w = torch.randn(m, k), torch.randn(n, k)
        torch.nn.functional.linear(a, w)
        seconds = best_of(repeats, lambda: torch.nn.functional.linear(a, w))
        results[f"{m}×{k}·{k}×{n}"] = 2 * m * k * n / seconds / 1e9
    return results


def _reorder_self_attention_only(past_key_values, beam_idx):
    """Beam search reorders the cache rows every step; the cross-attention keys/values are identical for all beams
    of a sentence (beam_idx never leaves a sentence's group), so only the self-attention cache needs it."""
    past_key_values.self_attention_cache.reorder_cache(beam_idx)
    return past_key_values


def what_if_variants(model):
    """Changes applied to a built model from the outside, to estimate what the same change inside
    modeling_vaswani.py (or a fast decoding path) would give. Each returns a model; `_reorder_cache` is the hook
    generate() calls instead of the cache's own reorder_cache."""
    import copy

    def int8(m):
        return quantize_for_cpu(copy.deepcopy(m))

    def no_cross_reorder(m):
        m = copy.copy(m)  # shares the weights; only the hook differs
        m._reorder_cache = _reorder_self_attention_only
        return m

    return {
        "fp32, as shipped": lambda: model,
        "fp32, beam search skips the cross-attention cache reorder": lambda: no_cross_reorder(model),
        "bf16 weights (AVX512-BF16 GEMMs)": lambda: copy.deepcopy(model).to(torch.bfloat16),
        "int8 of every nn.Linear, lm_head included (quantize_for_cpu, what --int8 runs)": lambda: int8(model),
        "int8 + skip the cross-attention reorder": lambda: no_cross_reorder(int8(model)),
    }


def run(args: argparse.Namespace, argv) -> Path:
    device = pick_device("cpu", args.threads)
    corpus, pairs, tokenizer = corpus_and_tokenizer(args)
    config = vaswani_config(args.size, len(tokenizer))
    # The batch in the middle of the length-sorted sample the translation benchmark uses.
    ids = sorted(tokenizer([e for e, _ in sample_sentences(pairs, args.num_sentences, args.seed)])["input_ids"], key=len)
    middle = len(ids) // 2
    batch = ids[middle : middle + args.batch_size]
    source_lengths = list(map(len, batch))

    generation_rows, details = [], {}
    engines = {name: TorchEngine(name, config, tokenizer, device, args.seed) for name in ("vaswani", "marian")}
    for beams in args.beams:
        for name, engine in engines.items():
            model = engine.model
            pad = model.config.pad_token_id
            width = max(source_lengths)
            input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in batch])
            mask = input_ids != pad
            translate = lambda: engine.translate(batch, beams, args.new_tokens, stop_at_eos=False)  # noqa: E731
            floor = lambda: forward_floor(model, input_ids, mask, beams, args.new_tokens,  # noqa: E731
                                          model.config.decoder_start_token_id)
            translate(), floor()  # warm-up
            wall = best_of(args.repeats, translate)
            floor_wall = best_of(args.repeats, floor)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                with record_function("generate"):
                    start = time.perf_counter()
                    translate()
                    profiled_wall = time.perf_counter() - start
            breakdown = op_breakdown(prof, profiled_wall)
            hotspots = python_hotspots(translate)
            flops = decode_flops(config, source_lengths, beams, args.new_tokens)
            key = f"{name}-beams{beams}"
            details[key] = {"ops": breakdown, "python_hotspots": hotspots}
            generation_rows.append({
                "engine": name, "engine_label": ENGINE_LABELS[name], "beams": beams, "generate_s": wall,
                "forward_floor_s": floor_wall, "generate_overhead_s": wall - floor_wall,
                "overhead_share": (wall - floor_wall) / wall, "model_gflops_per_s": flops / wall / 1e9,
                "matmul_share": breakdown["categories"].get("matmul (linear layers, logits)", 0.0) / profiled_wall,
                "outside_aten_share": breakdown["categories"]["outside ATen (Python, dispatch, framework)"] / profiled_wall,
            })
            print(generation_rows[-1], flush=True)

    # What-if: the same batch through modified copies of the Vaswani model.
    what_if_rows = []
    vaswani = engines["vaswani"]
    shipped = vaswani.model
    for label, make in what_if_variants(shipped).items():
        vaswani.model = make()
        for beams in args.beams:
            translate = lambda: vaswani.translate(batch, beams, args.new_tokens, stop_at_eos=False)  # noqa: E731
            translate()
            wall = best_of(args.repeats, translate)
            row = {"variant": label, "beams": beams, "generate_s": wall}
            if label.startswith("int8 +"):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    start = time.perf_counter()
                    translate()
                    profiled_wall = time.perf_counter() - start
                details[f"vaswani-int8-no-cross-reorder-beams{beams}"] = {"ops": op_breakdown(prof, profiled_wall)}
            what_if_rows.append(row)
            print(row, flush=True)
    vaswani.model = shipped
    del engines

    if not args.skip_ct2:
        with tempfile.TemporaryDirectory() as workdir:
            for name in ("ct2-float32", "ct2-int8"):
                engine = CT2Engine(name, config, tokenizer, device, args.seed, args.threads, Path(workdir))
                for beams in args.beams:
                    translate = lambda: engine.translate(batch, beams, args.new_tokens, stop_at_eos=False)  # noqa: E731
                    translate()
                    wall = best_of(args.repeats, translate)
                    flops = decode_flops(config, source_lengths, beams, args.new_tokens)
                    generation_rows.append({"engine": name, "engine_label": ENGINE_LABELS[name], "beams": beams,
                                            "generate_s": wall, "model_gflops_per_s": flops / wall / 1e9})
                    print(generation_rows[-1], flush=True)
                engine.close()
    def reference(engine, beams):
        return next((r["generate_s"] for r in generation_rows if r["engine"] == engine and r["beams"] == beams), None)

    for row in generation_rows + what_if_rows:
        row["vs_marian"] = reference("marian", row["beams"]) / row["generate_s"]
        ct2_int8 = reference("ct2-int8", row["beams"])
        row["vs_ct2_int8"] = ct2_int8 / row["generate_s"] if ct2_int8 else None

    # One training step of the same size on a real length-bucketed batch.
    encoded = tokenizer([e for e, _ in pairs[:: args.train_pair_stride]],
                        text_target=[f for _, f in pairs[:: args.train_pair_stride]])
    order = bucket_batches(encoded["input_ids"], encoded["labels"], args.batch_tokens, args.seed)
    train_batch = [([encoded["input_ids"][i] for i in b], [encoded["labels"][i] for i in b]) for b in order[:2]]
    training_rows = []
    for name in ("vaswani", "marian"):
        trainee = Trainee(name, config, device, train_batch, args.seed, 1e-4)
        trainee.step(0)
        wall = best_of(args.repeats, lambda: trainee.step(1))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            trainee.step(1)
            profiled_wall = time.perf_counter() - start
        breakdown = op_breakdown(prof, profiled_wall)
        details[f"{name}-train"] = {"ops": breakdown}
        sources, targets = train_batch[1]
        flops = model_flops(config, list(map(len, sources)), list(map(len, targets)))
        tokens = sum(map(len, sources)) + sum(map(len, targets))
        training_rows.append({
            "engine": name, "engine_label": ENGINE_LABELS[name], "step_s": wall, "tokens_per_s": tokens / wall,
            "model_gflops_per_s": flops / wall / 1e9,
            "matmul_share": breakdown["categories"].get("matmul (linear layers, logits)", 0.0) / profiled_wall,
            "outside_aten_share": breakdown["categories"]["outside ATen (Python, dispatch, framework)"] / profiled_wall,
        })
        print(training_rows[-1], flush=True)
        del trainee

    rows_m = args.batch_size * max(args.beams)
    gemm = gemm_gflops([(args.batch_size, config.d_model, config.d_ff), (rows_m, config.d_model, config.d_ff),
                        (args.batch_size, config.d_model, config.vocab_size), (rows_m, config.d_model, config.vocab_size),
                        (args.batch_tokens, config.d_model, config.d_ff)])
    settings = settings_of(
        args,
        source_lengths=source_lengths, train_batch_sentences=len(train_batch[1][0]),
        gemm_gflops=gemm, load_average_end=os.getloadavg()[0],
    )
    notes = [
        f"One batch of {args.batch_size} sentences (the middle batch of the translation benchmark's length-sorted "
        f"{args.num_sentences}-sentence sample; source lengths {min(source_lengths)}–{max(source_lengths)}), "
        f"{args.new_tokens} new tokens each, {args.size} size, fp32, {torch.get_num_threads()} thread(s); best of "
        f"{args.repeats}.",
        "forward floor = encoder + the same decoder rows × steps as a bare loop of cached forward calls (no search): "
        "what the model itself costs; generate overhead = generate − floor.",
        "Measured fp32 GEMM speed on this machine (GFLOP/s): " + ", ".join(f"{k}: {v:.0f}" for k, v in gemm.items()),
    ]
    gen_columns = [
        Column("engine_label", "engine"), Column("beams", "beams"), Column("generate_s", "generate s", "{:.3f}"),
        Column("forward_floor_s", "forward floor s", "{:.3f}"), Column("overhead_share", "generate overhead", "{:.0%}"),
        Column("matmul_share", "matmul share", "{:.0%}"), Column("outside_aten_share", "outside ATen", "{:.0%}"),
        Column("model_gflops_per_s", "model GFLOP/s", "{:.1f}"), Column("vs_marian", "× Marian", "{:.2f}"),
        Column("vs_ct2_int8", "× CT2 int8", "{:.2f}"),
    ]
    what_if_columns = [
        Column("variant", "Vaswani variant (applied from outside the model)"), Column("beams", "beams"),
        Column("generate_s", "generate s", "{:.3f}"), Column("vs_marian", "× Marian fp32", "{:.2f}"),
        Column("vs_ct2_int8", "× CT2 int8", "{:.2f}"),
    ]
    train_columns = [
        Column("engine_label", "engine"), Column("step_s", "step s", "{:.3f}"), Column("tokens_per_s", "tokens/s", "{:.0f}"),
        Column("model_gflops_per_s", "model GFLOP/s", "{:.1f}"), Column("matmul_share", "matmul share", "{:.0%}"),
        Column("outside_aten_share", "outside ATen", "{:.0%}"),
    ]
    category_rows = []
    for key, detail in details.items():
        wall = detail["ops"]["wall_seconds"]
        category_rows.append({"run": key, **{c: f"{s / wall:.0%}" for c, s in detail["ops"]["categories"].items()}})
    categories = [name for name, _ in CATEGORIES] + ["other ops (elementwise, masks, …)",
                                                     "outside ATen (Python, dispatch, framework)"]
    category_columns = [Column("run", "run")] + [Column(c, c) for c in categories]
    hotspot_rows = [
        {"run": key, "function": function, "seconds": seconds, "calls": calls}
        for key, detail in details.items() if "python_hotspots" in detail and key.endswith("beams4")
        for function, seconds, calls in detail["python_hotspots"][:8]
    ]
    hotspot_columns = [Column("run", "run"), Column("function", "function"), Column("seconds", "own s (cProfile)", "{:.3f}"),
                       Column("calls", "calls")]
    name = args.output_name or "profile-cpu"
    path, _ = write_report(
        name, f"CPU profile: {args.size} size, translation batch {args.batch_size} and one training step",
        command_line(__file__, argv), device, settings, generation_rows, gen_columns, notes, args.results_dir,
        extra_tables=[("What if (Vaswani, same batch)", what_if_rows, what_if_columns),
                      ("Training step", training_rows, train_columns),
                      ("Self CPU time by op category (share of wall time)", category_rows, category_columns),
                      ("Python functions with the most own time, beam 4", hotspot_rows, hotspot_columns)],
    )
    Path(path).with_name(f"{name}-details.json").write_text(__import__("json").dumps(details, indent=1, default=str))
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--size", default="base")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--beams", type=csv_of(int), default=[1, 4])
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--num_sentences", type=int, default=320)
    parser.add_argument("--batch_tokens", type=int, default=2048, help="training batch: padded tokens per side")
    parser.add_argument("--train_pair_stride", type=int, default=10, help="bucket every n-th pair (speed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip_ct2", action="store_true")
    return parser


def main(argv=None) -> Path:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    main()
