"""Scaling with sequence length of the decoder-only variant (`VaswaniForCausalLM`): tokens/s and peak memory from
64 to 4096 tokens, with multi-head and grouped-query attention, and KV-cache memory per token for MHA vs GQA vs MQA.

    python benchmarks/bench_scaling.py                                        # GPU: train, forward, decode
    python benchmarks/bench_scaling.py --device cpu --modes train,decode --batch_tokens 2048

Modes, on windows of the corpus' token stream: train (forward, backward, Adam; `batch_tokens // length` sequences a
step), forward (the same without gradients: a prefill), decode (greedy steps with the KV cache after an untimed
`length`-token prompt: where GQA's smaller cache matters).
"""

import contextlib
import os
from functools import partial
from pathlib import Path

import torch

from vaswani import VaswaniConfig, VaswaniForCausalLM
from vaswani.modeling_vaswani import CACHE_NAME  # the cache's name in this transformers release

from common import (
    Column, PeakMemory, argument_parser, corpus_and_tokenizer, csv_of, pick_device, report, resident_mib,
    sample_sentences, timed,
)


def attention_name(config) -> str:
    if config.num_key_value_heads == config.num_attention_heads:
        return "MHA"
    if config.num_key_value_heads == 1:
        return "MQA"
    return f"GQA ({config.num_attention_heads // config.num_key_value_heads} q/kv)"


def causal_lm_flops(config, batch: int, length: int, backward: bool) -> float:
    """Model FLOPs of one step: 2 × matmul weights per token + 4·d_model per layer per (query, key) pair, ×3
    with the backward pass (PaLM's convention, no discount for the causal mask)."""
    d = config.d_model
    kv_width = config.num_key_value_heads * config.head_dim
    ffn = (3 if config.ffn_activation in ("swiglu", "geglu") else 2) * d * config.d_ff
    weights = config.decoder_layers * (2 * d * d + 2 * d * kv_width + ffn) + d * config.vocab_size
    forward = 2 * weights * batch * length + 4 * d * config.decoder_layers * batch * length * length
    return forward * (3 if backward else 1)


def token_stream(pairs, tokenizer, needed: int, seed: int) -> torch.Tensor:
    """Real text as one long id stream: sampled sentence pairs, English then French, each ending with </s>."""
    ids: list[int] = []
    sample = sample_sentences(pairs, len(pairs), seed)
    for start in range(0, len(sample), 2000):  # a chunk at a time, until there are enough
        texts = [text for pair in sample[start : start + 2000] for text in pair]
        ids.extend(token for row in tokenizer(texts)["input_ids"] for token in row)
        if len(ids) >= needed:
            break
    return torch.tensor((ids * -(-needed // len(ids)))[:needed])  # repeated where the corpus is short


def measure(mode, config, length, batch, stream, args, device) -> dict:
    before = resident_mib(device, settle=True)
    torch.manual_seed(args.seed)
    train = mode == "train"
    dtype = torch.float32 if train or not device.as_cuda else device.dtype
    model = VaswaniForCausalLM(config).to(device.device, dtype).train(train)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9) if train else None
    bf16 = train and device.as_cuda
    autocast = torch.autocast(device.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    batch = args.decode_batch if mode == "decode" else batch
    windows = stream[: (1 + args.steps) * batch * length].view(1 + args.steps, batch, length).to(device.device)

    def train_step(ids):
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.inference_mode()
    def forward_step(ids):
        model(input_ids=ids, use_cache=False)

    @torch.inference_mode()
    def decode(ids):
        """Prefill (untimed), then greedy steps with the cache (timed); returns (seconds, cache)."""
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, token = getattr(out, CACHE_NAME), out.logits[:, -1:].argmax(-1)

        def steps():
            nonlocal cache, token
            for _ in range(args.decode_tokens):
                out = model(input_ids=token, **{CACHE_NAME: cache}, use_cache=True)
                cache, token = getattr(out, CACHE_NAME), out.logits[:, -1:].argmax(-1)

        return timed(device, steps)[1], cache

    seconds, kv_mib = 0.0, None
    with PeakMemory(device, baseline_mib=before) as peak:
        for step in range(1 + args.steps):
            if mode == "decode":
                elapsed, cache = decode(windows[step])
                kv_mib = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) / 2**20
                del cache
            else:
                _, elapsed = timed(device, lambda: (train_step if train else forward_step)(windows[step]))
            if step:  # the first is the warm-up
                seconds += elapsed
    new_tokens = batch * (args.decode_tokens if mode == "decode" else length) * args.steps
    return {"batch": batch, "parameters": model.num_parameters(only_trainable=True), "steps": args.steps,
            "seconds": seconds, "tokens_per_s": new_tokens / seconds, "peak_mib": peak.added_mib,
            "kv_cache_mib": kv_mib,
            "flops": causal_lm_flops(config, batch, length, backward=train) * args.steps if mode != "decode" else None,
            "load_average": os.getloadavg()[0]}


def kv_cache_row(config, device) -> dict:
    model = VaswaniForCausalLM(config).to(device.device, device.dtype).eval()
    length = 16
    with torch.inference_mode():
        out = model(input_ids=torch.full((1, length), 5, device=device.device), use_cache=True)
    measured = sum(layer.keys.nbytes + layer.values.nbytes for layer in getattr(out, CACHE_NAME).layers) // length
    expected = 2 * config.decoder_layers * config.num_key_value_heads * config.head_dim * device.dtype.itemsize
    if measured != expected:
        raise RuntimeError(f"KV cache holds {measured} bytes per token, expected {expected}.")
    return {"attention": attention_name(config), "kv_heads": config.num_key_value_heads,
            "num_heads": config.num_attention_heads, "bytes_per_token": measured, "kib_per_token": measured / 1024}


def main(argv=None) -> Path:
    parser, add = argument_parser(__doc__)
    add("--preset", default="modern", help="VaswaniConfig preset of the decoder")
    add("--kv_heads", type=csv_of(int), default=[8, 2], help="num_key_value_heads to time")
    add("--cache_kv_heads", type=csv_of(int), default=[8, 2, 1], help="for the KV-cache table")
    add("--modes", type=csv_of(str), default=["train", "forward", "decode"])
    add("--lengths", type=csv_of(int), default=[64, 128, 256, 512, 1024, 2048, 4096])
    add("--batch_tokens", type=int, default=None, help="tokens per train/forward step; default 32768 CUDA, 2048 CPU")
    add("--steps", type=int, default=2, help="timed steps after one warm-up")
    add("--decode_batch", type=int, default=None, help="default 8 CUDA, 1 CPU")
    add("--decode_tokens", type=int, default=32)
    args = parser.parse_args(argv)
    device = pick_device(args.device, args.threads)
    batch_tokens = args.batch_tokens or (32768 if device.as_cuda else 2048)
    corpus, pairs, tokenizer = corpus_and_tokenizer(args.corpus, args.cache_dir, args.vocab_size)
    args.decode_batch = args.decode_batch or (8 if device.as_cuda else 1)
    batch_of = {length: max(1, batch_tokens // length) for length in args.lengths}
    per_step = max(max(batch_of[n] * n for n in args.lengths), args.decode_batch * max(args.lengths))
    stream = token_stream(pairs, tokenizer, per_step * (1 + args.steps), args.seed)
    peak_tflops = device.bf16_peak_tflops
    preset = partial(VaswaniConfig.from_preset, args.preset, vocab_size=len(tokenizer))

    rows = []
    for kv_heads in args.kv_heads:
        config = preset(num_key_value_heads=kv_heads, dropout=0.0)
        for mode in args.modes:
            for length in args.lengths:
                row = measure(mode, config, length, batch_of[length], stream, args, device)
                row.update(preset=args.preset, kv_heads=kv_heads, attention=attention_name(config), mode=mode,
                           length=length)
                if row["flops"]:
                    row["model_tflops_per_s"] = row["flops"] / row["seconds"] / 1e12
                    row["mfu"] = row["model_tflops_per_s"] / peak_tflops if peak_tflops else None
                rows.append(row)
                print(f"{mode:>7} {row['attention']:>14} length {length:>5} batch {row['batch']:>4}: "
                      f"{row['tokens_per_s']:9.0f} tokens/s, peak {row['peak_mib'] or 0:.0f} MiB", flush=True)

    cache_rows = [kv_cache_row(preset(num_key_value_heads=k, dropout=0.0), device) for k in args.cache_kv_heads]
    base = next((r["bytes_per_token"] for r in cache_rows if r["kv_heads"] == cache_rows[0]["num_heads"]), None)
    for r in cache_rows:
        r["vs_mha"] = r["bytes_per_token"] / base if base else None

    settings = dict(batch_tokens=batch_tokens, sequences_per_batch=batch_of, peak_tflops=peak_tflops,
                    corpus=str(corpus), vocab_size_actual=len(tokenizer))
    config = preset()
    notes = [
        f"VaswaniForCausalLM, preset `{args.preset}` (d_model {config.d_model}, {config.decoder_layers} layers, "
        f"{config.num_attention_heads} query heads, {config.position_embedding_type} positions, "
        f"{config.ffn_activation} FFN), vocabulary {len(tokenizer)}, dropout 0; only num_key_value_heads varies.",
        f"Sequences are consecutive windows of the corpus' token stream (sentence pairs sampled with seed "
        f"{args.seed}, English then French). train/forward: max(1, {batch_tokens} // length) sequences per step, "
        f"{args.steps} timed step(s) after 1 warm-up; decode: batch {args.decode_batch}, {args.decode_tokens} "
        "greedy steps with the KV cache after an untimed prefill of the prompt.",
        "tokens/s: train/forward = tokens processed; decode = new tokens generated. Peak memory over the steps, less "
        "the level before the model was built (CUDA: tensors; CPU: RSS): weights, optimizer state and KV cache.",
        f"KV cache per token: measured on the cache after a forward pass (all layers, keys + values, in "
        f"{str(device.dtype).removeprefix('torch.')}), = 2 · layers · kv_heads · head_dim · bytes.",
        f"Precision: {'bf16 autocast for train, bf16 weights for forward/decode' if device.as_cuda else 'fp32'}; "
        "attention implementation: the transformers default (sdpa).",
    ]
    columns = [Column("mode", "mode"), Column("attention", "attention"), Column("length", "length"),
               Column("batch", "batch"), Column("tokens_per_s", "tokens/s", "{:.0f}"),
               Column("model_tflops_per_s", "model TFLOP/s", "{:.3f}"), Column("mfu", "MFU", "{:.1%}"),
               Column("peak_mib", "peak MiB", "{:.0f}"), Column("kv_cache_mib", "KV cache MiB", "{:.1f}"),
               Column("load_average", "load avg", "{:.1f}")]
    cache_columns = [Column("attention", "attention"), Column("kv_heads", "kv heads"),
                     Column("bytes_per_token", "KV cache bytes/token", "{:,}"),
                     Column("kib_per_token", "KiB/token", "{:.1f}"), Column("vs_mha", "× MHA", "{:.3f}")]
    return report(__file__, argv, args, device, "scaling", "Sequence-length scaling (decoder-only)", rows, columns,
                  notes, settings, extra_tables=[("KV cache per token", cache_rows, cache_columns)])


if __name__ == "__main__":
    main()
