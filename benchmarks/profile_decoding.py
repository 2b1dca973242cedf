"""Where a CPU decoding step's time goes: the PyTorch engine's greedy and beam search, split into the parts of a
step (attention, projections, the output layer, cache handling, masks, beam bookkeeping, Python glue), beside
CTranslate2's total on the same batches.

The engines are the translation benchmark's (`bench_translation.LocalEngine`, built by the package's factory as the
scripts build theirs) and decode the same sentences: the first `--num_sentences` of the checkpoint's held-out test
split, sorted by length and cut into batches of `--batch_size`, each stopping at its end of sentence; with
`--forced N` (random weights, which stop at arbitrary points) every sentence gets exactly N tokens instead.

The split comes from timing every module of the model (forward hooks) and the loop's own functions (wrapped) with
`time.perf_counter`, each part's *self* time (its time less that of the parts it calls). The instrumented pass is
slower than a plain one (the hooks' own cost lands mostly in "Python glue"); the table gives both totals, and
the plain ones (fastest of `--repeats`) are the ones to compare with CTranslate2's.

    python benchmarks/profile_decoding.py --model outputs/en-fr-small --threads 2
    python benchmarks/profile_decoding.py --size base --forced 16 --threads 2    # random weights at base size
"""

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.cache_utils import DynamicLayer

from vaswani import generation_vaswani, modeling_vaswani
from vaswani.data import load_translation_dataset
from vaswani.tokenization_vaswani import VaswaniTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_translation import LocalEngine, random_checkpoint  # noqa: E402
from common import RESULTS_DIR, command_line, environment, pick_device, resolve_corpus  # noqa: E402

# The parts of a step, in the table's order: what each is made of (module-path rules and wrapped functions below).
PARTS = [
    "encoder (once per batch)",
    "self-attention q/k/v/o projections",
    "cross-attention q/o projections",
    "cross-attention k/v projections (once per sentence)",
    "attention math (scores, softmax, weighted sum)",
    "attention glue (head reshapes, beam views)",
    "cache handling (append, reorder, drop rows)",
    "feed-forward (fc1, ReLU, fc2)",
    "layer norms",
    "residual adds, dropout calls (decoder layers)",
    "masks (causal, cross)",
    "embeddings and positions",
    "model forward glue (decoder, model, outputs)",
    "output layer (lm_head)",
    "top-k / argmax",
    "beam bookkeeping (rank, finished hypotheses)",
    "generate() and the loop (setup, log-softmax, tokens, stopping)",
]


def module_part(path: str, module: torch.nn.Module) -> str:
    """The part a module's self time belongs to, from its path in the model."""
    leaf = path.rsplit(".", 1)[-1]
    if path.startswith("model.encoder"):
        return PARTS[0]
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if ".self_attn." in path:
            return PARTS[1]
        return PARTS[3] if leaf in ("k_proj", "v_proj") else PARTS[2]
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


class StepTimer:
    """Self times per part: module hooks and wrapped functions push and pop frames on one stack."""

    def __init__(self, model):
        self.model, self.seconds, self.stack = model, collections.Counter(), []
        self.decoder_calls = 0
        self.handles, self.restore = [], []
        for path, module in model.named_modules():
            if module is model:
                continue
            part = module_part(path, module)
            self.handles.append(module.register_forward_pre_hook(lambda *_, part=part: self.push(part)))
            self.handles.append(module.register_forward_hook(lambda *_: self.pop()))
        self.handles.append(model.model.decoder.register_forward_pre_hook(lambda *_: self.count()))
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

    def push(self, part):
        self.stack.append([part, time.perf_counter(), 0.0])

    def pop(self):
        part, start, children = self.stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[part] += elapsed - children
        if self.stack:
            self.stack[-1][2] += elapsed

    def wrap(self, owner, name, part):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self.push(part)
            try:
                return original(*args, **kwargs)
            finally:
                self.pop()

        setattr(owner, name, timed)
        self.restore.append((owner, name, original))

    def close(self):
        for handle in self.handles:
            handle.remove()
        for owner, name, original in reversed(self.restore):
            setattr(owner, name, original)


def run_batches(engine, batches, beams, new_tokens, stop_at_eos) -> float:
    start = time.perf_counter()
    for batch in batches:
        engine.translate(batch, beams, new_tokens, stop_at_eos)
    return time.perf_counter() - start


def profile(args) -> dict:
    device = pick_device("cpu", args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        if args.model:
            tokenizer = VaswaniTokenizer.from_pretrained(args.model)
            sentences = load_translation_dataset(data_file=str(resolve_corpus(args.corpus)))["test"]["source"]
            model_dir, label = args.model, Path(args.model).name
        else:  # the same sentences and tokenizer as a trained checkpoint's, random weights at another size
            tokenizer = VaswaniTokenizer.from_pretrained(args.tokenizer)
            sentences = load_translation_dataset(data_file=str(resolve_corpus(args.corpus)))["test"]["source"]
            model_dir = random_checkpoint(args.size, tokenizer, 0, Path(workdir) / args.size)
            label = f"{args.size} preset, random weights, {len(tokenizer)}-token vocabulary of {args.tokenizer}"
        ids = sorted(tokenizer(sentences[: args.num_sentences])["input_ids"], key=len)
        batches = [ids[i: i + args.batch_size] for i in range(0, len(ids), args.batch_size)]
        stop_at_eos, new_tokens = args.forced is None, args.forced or args.max_new_tokens
        spec = dict(model_dir=model_dir, device_name="cpu", threads=args.threads, attention_kernel=None,
                    ct2_dir=Path(workdir) / "ct2", keep_freed_memory=False)
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
                timer = StepTimer(torch_engine.engine.model)
                try:
                    timers.append((run_batches(torch_engine, batches, beams, new_tokens, stop_at_eos), timer))
                finally:
                    timer.close()
            instrumented, timer = min(timers, key=lambda pair: pair[0])
            timer.seconds[PARTS[-1]] += instrumented - sum(timer.seconds.values())
            steps = timer.decoder_calls - len(batches)  # the first call of a batch reads the prompt
            results["searches"].append({
                "beams": beams, "plain_seconds": min(plain), "ct2_float32_seconds": min(ct2),
                "instrumented_seconds": instrumented, "decoding_steps": steps,
                "parts_seconds": {part: timer.seconds[part] for part in PARTS},
            })
            print(f"beams {beams}: vaswani {min(plain):.2f} s, ct2-float32 {min(ct2):.2f} s, instrumented "
                  f"{instrumented:.2f} s over {steps} steps", flush=True)
    return results


def search_name(beams: int) -> str:
    return "greedy" if beams == 1 else f"beam {beams}"


def markdown(results: dict, env: dict, command: str) -> str:
    searches = results["searches"]
    names = " | ".join(f"{search_name(s['beams'])} ms | % | µs/step" for s in searches)
    lines = [
        "# Where a CPU decoding step's time goes", "", "```bash", command, "```", "",
        f"Device: **{env['device_name']}** ({env['torch_threads']} torch threads, {env['cpu_count']} cores, shared and "
        f"loaded: compare only within this run). Versions: "
        f"{', '.join(f'{k} {v}' for k, v in env['versions'].items())}. Commit {env['git_commit']}"
        f"{' (model code with uncommitted changes)' if env['model_code_uncommitted_changes'] else ''}.", "",
        f"Model {results['model']}; {results['sentences']} held-out sentences in batches of {results['batch_size']}, "
        f"stopping: {results['stopping']}.", "",
        f"| part | {names} |", "|---|" + "---|---|---|" * len(searches),
    ]
    for part in PARTS:
        cells = []
        for s in searches:
            seconds = s["parts_seconds"][part]
            cells.append(f"{seconds * 1e3:.0f} | {100 * seconds / s['instrumented_seconds']:.1f} | "
                         f"{seconds * 1e6 / max(s['decoding_steps'], 1):.0f}")
        lines.append(f"| {part} | {' | '.join(cells)} |")
    totals = (("total, instrumented", "instrumented_seconds"), ("**total, plain (no hooks)**", "plain_seconds"),
              ("**CTranslate2 float32, same batches**", "ct2_float32_seconds"))
    for label, key in totals:
        cells = [f"{s[key] * 1e3:.0f} | | {s[key] * 1e6 / max(s['decoding_steps'], 1):.0f}" for s in searches]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines.append("| decoding steps (batch calls after the first) | "
                 + " | ".join(f"{s['decoding_steps']} | | " for s in searches) + " |")
    lines.append("| **Vaswani ÷ CTranslate2 float32 time** | "
                 + " | ".join(f"{s['plain_seconds'] / s['ct2_float32_seconds']:.2f} | | " for s in searches) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default=None, help="a trained checkpoint; else random weights at --size (needs --forced)")
    add("--size", default="base")
    add("--tokenizer", default=None, help="with --size: the checkpoint whose tokenizer (and test split) to use")
    add("--corpus", default=None)
    add("--threads", type=int, default=2)
    add("--batch_size", type=int, default=32)
    add("--num_sentences", type=int, default=320)
    add("--beams", type=lambda text: [int(b) for b in text.split(",")], default=[1, 4])
    add("--forced", type=int, default=None, help="exactly this many tokens per sentence (random weights)")
    add("--max_new_tokens", type=int, default=128)
    add("--repeats", type=int, default=3)
    add("--output_name", default="profile-decoding-cpu")
    args = parser.parse_args(argv)
    if args.model is None and (args.forced is None or args.tokenizer is None):
        parser.error("random weights stop at arbitrary points: give --forced N and --tokenizer DIR (or a --model)")
    results = profile(args)
    env = environment(pick_device("cpu", args.threads))
    command = command_line(__file__, argv)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.output_name}.json").write_text(json.dumps({"command": command, "environment": env,
                                                                      **results}, indent=1) + "\n")
    (RESULTS_DIR / f"{args.output_name}.md").write_text(markdown(results, env, command))
    print((RESULTS_DIR / f"{args.output_name}.md").read_text())


if __name__ == "__main__":
    main()
