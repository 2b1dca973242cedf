"""Translation throughput: sentences/s and output tokens/s of greedy and beam search, Vaswani against Marian
(`vaswani.convert.to_marian` of the same weights) and CTranslate2 (the model's export), each engine built by
`vaswani.loading.load_engine` as the scripts build theirs and timed below the text (token ids in, token ids out).

Identical work: the same sentences, tokenized once, sorted by length and cut into the same batches. Random weights
(`--sizes`) generate exactly `--new_tokens` tokens per sentence (`--stopping forced`, checked on every output);
`--model DIR` runs a trained checkpoint on its held-out test split, each sentence stopping at its end (`eos`) beside
forced rows. Only warm runs are timed. Every engine runs in a process of its own, as deployed; in one shared process
CTranslate2 and PyTorch slow each other down (`--same_process`; benchmarks/README.md, "One process per engine").

    python benchmarks/bench_translation.py                     # GPU defaults: 3,000 sentences, batch 1/32/256
    python benchmarks/bench_translation.py --device cpu --batch_sizes 32 --num_sentences 320
    python benchmarks/bench_translation.py --device cpu --threads 2 --batch_sizes 32 --model outputs/en-fr-small
"""

import dataclasses
import multiprocessing
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partialmethod
from pathlib import Path

import torch
from torch import nn

from vaswani.batching import token_budget_batches
from vaswani.convert import to_marian
from vaswani.export import export_to_ctranslate2
from vaswani.slots import decode_in_slots
from vaswani.inference import PackedLinear, compile_for_generation, replace_modules
from vaswani.loading import load_engine
from vaswani.tokenization_vaswani import VaswaniTokenizer
from vaswani.translation import CTranslate2Engine, generate_token_ids, output_ids

from common import (
    SDPA_BACKENDS, Column, PeakMemory, Stopped, argument_parser, attention_ran, check_ran, corpus_and_tokenizer,
    engine_label, csv_of, pick_device, random_checkpoint, report, resident_mib, sample_sentences, test_sources, timed,
)
from common import stopping as stop_signals  # `stopping` is the run's stopping modes here

# An engine's options after its model's name (`vaswani-int8-hfloop`): `load_engine`'s precision (`int8`, CPU only;
# `bf16`) and decoding loop (`hfloop`: transformers', `lean`, `graphs`: the lean loop as CUDA graphs, `steps`: the
# lean loop with compiled steps, `load_translator(decoding="compiled")`), `compiled`
# (`compile_for_generation`), `slots` (`decode_in_slots`: all sentences in one call, a slot per batch row) and
# `unpacked` (plain `nn.Linear` layers, torch's own products, where `load_engine` packs fp32 weights for oneDNN).
LOOPS = {"hfloop": "transformers", "lean": "lean", "graphs": "graphs", "steps": "compiled"}
TORCH_OPTIONS = {"int8", "bf16", "compiled", "slots", "unpacked", *LOOPS}

# `vaswani` is the scripts' default loop (`loading.decoding_loop`): on CUDA the lean loop as CUDA graphs, which
# `vaswani-graphs` would time again.
DEFAULT_ENGINES_CUDA = ["vaswani", "vaswani-lean", "vaswani-compiled", "marian"]
DEFAULT_ENGINES_CPU = ["vaswani", "vaswani-hfloop", "vaswani-int8", "vaswani-int8-hfloop", "marian", "ct2-float32",
                       "ct2-int8"]

STOPPING = ("eos", "forced")
STARTED = time.monotonic()  # for the progress lines


def build_engine(name: str, model_dir: str, device, ct2_dir: Path):
    """Engine `name` from the package's factory on checkpoint `model_dir` (`ct2-*`: its CTranslate2 export, made
    into `ct2_dir` once); Marian's is that engine with `to_marian` of its model, in the same precision."""
    base, *options = name.split("-")
    if base == "ct2":
        if not (ct2_dir / "model.bin").is_file():
            export_to_ctranslate2(model_dir, str(ct2_dir), force=True)
        return load_engine(str(ct2_dir), device=device.device, compute_type=name.removeprefix("ct2-"))
    loops = [LOOPS[option] for option in options if option in LOOPS]
    if (base not in ("vaswani", "marian") or set(options) - TORCH_OPTIONS or len(loops) > 1
            or (base == "marian" and set(options) - {"bf16"}) or {"int8", "bf16"} <= set(options)):
        raise ValueError(f"Unknown engine {name!r}: vaswani[-int8|-bf16][-hfloop|-lean|-graphs|-steps|-slots]"
                         "[-compiled][-unpacked], marian[-bf16] or ct2-<compute type>.")
    engine = load_engine(model_dir, device=device.device, dtype="bfloat16" if "bf16" in options else device.dtype_name,
                         int8="int8" in options, decoding=loops[0] if loops else "auto", slots=0)
    if base == "marian":  # the same engine and settings, running the MarianMTModel that computes the same function
        engine.model = to_marian(engine.model).to(engine.model.device, engine.model.dtype)
    if "unpacked" in options:
        replace_modules(engine.model, PackedLinear, _plain_linear)
    if "compiled" in options:
        engine.model = compile_for_generation(engine.model)
    return engine


def _plain_linear(packed: PackedLinear) -> nn.Linear:
    """The `nn.Linear` of a `PackedLinear`'s own parameters."""
    linear = nn.Linear(packed.in_features, packed.out_features, bias=packed.bias is not None, device="meta")
    linear.weight, linear.bias = packed.weight, packed.bias
    return linear


class LocalEngine:
    """An engine in this process with what `measure` asks of it: timed translations (token ids), the peak memory of
    one."""

    def __init__(self, name, model_dir, device_name, threads, ct2_dir):
        self.device = pick_device(device_name, threads)
        before = resident_mib(self.device, settle=True)
        self.engine = build_engine(name, model_dir, self.device, ct2_dir)
        after = resident_mib(self.device, settle=True)  # the memory the engine added while staying resident
        self.load_mib = None if None in (before, after) else after - before
        self.name, self.ct2 = name, isinstance(self.engine, CTranslate2Engine)
        self.slots = "slots" in name.split("-")
        # None for CTranslate2 and int8 (whose weights are buffers): the fp32 rows of the same weights count them.
        torch_weights = not self.ct2 and "int8" not in name
        self.parameters = self.engine.model.num_parameters(only_trainable=True) if torch_weights else None
        self.ran = self.check() if torch_weights else None

    def check(self) -> dict:
        """What the engine's encoder ran on a few tokens (`common.check_ran`: stops where it is not the engine's)."""
        model = self.engine.model
        ids = torch.arange(3, 8, device=model.device)[None]
        with torch.no_grad():
            ran = attention_ran(lambda: model.get_encoder()(input_ids=ids))
        kernels = {"eager"} if model.config._attn_implementation == "eager" else set(SDPA_BACKENDS)
        linear = "onednn-packed" if any(isinstance(module, PackedLinear) for module in model.modules()) else "aten"
        check_ran(self.name, ran, kernels, str(model.dtype).removeprefix("torch."), linear)
        return ran

    def translate(self, batch, beams, new_tokens, stop_at_eos, slots=None) -> list[list[int]]:
        """Each sentence's generated token ids, up to its end of sentence (all `new_tokens` when forced)."""
        engine = self.engine
        if self.ct2:
            engine.decoding = dataclasses.replace(engine.decoding, num_beams=beams, max_new_tokens=new_tokens,
                                                  min_new_tokens=0 if stop_at_eos else new_tokens)
            return engine.generate_ids(batch)
        # The engine's settings at this row's beam count: beam search's own settings go along only with beams.
        decoding = dataclasses.replace(engine.decoding, num_beams=beams, do_sample=False)
        options = {**decoding.generate_options(), **({} if stop_at_eos else {"eos_token_id": None})}
        if self.slots:
            eos = engine.model.generation_config.eos_token_id if stop_at_eos else None
            with torch.inference_mode():
                outputs = decode_in_slots(engine.model, batch, new_tokens, slots=slots or len(batch), **options)
            return [output_ids(output[1:], eos) for output in outputs]
        padded = engine.tokenizer.pad({"input_ids": batch}, return_tensors="pt").to(engine.model.device)
        return generate_token_ids(engine.model, padded["input_ids"], padded["attention_mask"],
                                  max_new_tokens=new_tokens, **options)

    def timed_translate(self, batch, beams, new_tokens, stop_at_eos, *slots) -> tuple[list[list[int]], float]:
        return timed(self.device, lambda: self.translate(batch, beams, new_tokens, stop_at_eos, *slots))

    def peak_mib(self, batch, beams, new_tokens, stop_at_eos, *slots) -> float | None:
        with PeakMemory(self.device) as memory:
            self.translate(batch, beams, new_tokens, stop_at_eos, *slots)
        return memory.added_mib

    def close(self):
        self.engine = None

    abandon = close  # after a failure: nothing to ask of an engine in this process


class EngineProcess:
    """A `LocalEngine` in a process of its own (a fresh interpreter), each call timed there; its errors are raised
    here, with the engine process' traceback as their cause."""

    def __init__(self, **spec):
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            self.parameters, self.load_mib, self.ran = self._call("describe", spec)
        except Exception:
            self.abandon()
            raise

    def _call(self, method: str, *args):
        return self._pool.submit(_serve, method, *args).result()

    timed_translate = partialmethod(_call, "timed_translate")
    peak_mib = partialmethod(_call, "peak_mib")

    def close(self):
        self._pool.shutdown()

    def abandon(self):
        """After a failure (perhaps the process' crash): leave it without waiting."""
        self._pool.shutdown(wait=False, cancel_futures=True)


_engine = None  # in an engine's process: its LocalEngine


def _serve(method: str, *args):
    global _engine
    if method == "describe":
        _engine = LocalEngine(**args[0])
        return _engine.parameters, _engine.load_mib, _engine.ran
    return getattr(_engine, method)(*args)


def measure(engines: dict, batches: list, beams: int, stop_at_eos: bool, args, failed: dict) -> list[dict]:
    """Time every engine on the same batches, interleaved; return one row per engine. With --keep_going, an engine
    that fails is removed from `engines` and recorded in `failed`, and the others go on."""
    new_tokens = args.max_new_tokens if stop_at_eos else args.new_tokens
    # Engines that decode in slots get every sentence at once, in the batches' order, in as many slots as a batch has
    # sentences: one timed call per repeat instead of one per batch.
    streams = {name for name in engines if "slots" in name.split("-")}
    stream, slots = [ids for batch in batches for ids in batch], len(batches[0])

    def call(name, method, *call_args):
        try:
            extra = (slots,) if name in streams else ()
            result = getattr(engines[name], method)(*call_args, beams, new_tokens, stop_at_eos, *extra)
            lengths = set(map(len, result[0])) if method == "timed_translate" else {new_tokens}
            if not stop_at_eos and lengths != {new_tokens}:
                raise RuntimeError(f"{name} produced {sorted(lengths)} tokens per sentence instead of exactly "
                                   f"{new_tokens}; the comparison would not be of identical work.")
            return result
        except Exception as error:  # an error in the engine, or its process died (BrokenProcessPool)
            if not args.keep_going:
                raise
            last_line = (str(error).strip().splitlines() or [""])[-1]
            failed[name] = f"{type(error).__name__} in {method}: {last_line}"
            print(f"{name} failed, dropped: {failed[name]}", flush=True)
            engines.pop(name).abandon()
            return None

    for name in list(engines):
        for warmup in {0, len(batches) - 1}:
            if name in engines:
                call(name, "timed_translate", batches[warmup])
        # Progress on stderr: a GPU run cut short by its time limit still says how far it got.
        print(f"{name}: warm ({'eos' if stop_at_eos else 'forced'}, beams {beams}) after "
              f"{time.monotonic() - STARTED:.0f} s", file=sys.stderr, flush=True)
    names = list(engines)
    best = {name: [float("inf")] * (1 if name in streams else len(batches)) for name in names}
    outputs = {name: [None] * (1 if name in streams else len(batches)) for name in names}
    for _ in range(args.repeats):
        for i, batch in enumerate(batches):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                if name in engines and name not in streams and (result := call(name, "timed_translate", batch)):
                    outputs[name][i], best[name][i] = result[0], min(best[name][i], result[1])
        for name in [name for name in names if name in streams]:
            if name in engines and (result := call(name, "timed_translate", stream)):
                outputs[name][0], best[name][0] = result[0], min(best[name][0], result[1])
    load_average = os.getloadavg()[0]
    sentences = sum(map(len, batches))
    translations = {name: [ids for batch in outputs[name] for ids in batch or []] for name in names}
    reference = translations["vaswani"] if "vaswani" in engines else None
    rows = []
    longest = max(batches, key=lambda b: len(b) * max(map(len, b)))
    for name in [name for name in names if name in engines]:
        work_mib = call(name, "peak_mib", longest)
        if name not in engines:  # it failed just now
            continue
        seconds = sum(best[name])
        output_tokens = sum(map(len, translations[name]))
        rows.append({
            "engine": name, "engine_label": engine_label(name), "parameters": engines[name].parameters,
            "stopping": "eos" if stop_at_eos else "forced", "beams": beams, "sentences": sentences,
            "new_tokens_per_sentence": None if stop_at_eos else new_tokens, "output_tokens": output_tokens,
            "seconds": seconds, "sentences_per_s": sentences / seconds, "tokens_per_s": output_tokens / seconds,
            "identical_to_vaswani": sum(map(list.__eq__, translations[name], reference)) if reference else None,
            "work_mib": work_mib, "load_average": load_average, **(engines[name].ran or {}),
        })
    return rows


def batchings(args, sampled_ids: list[list[int]], source_ids: list[list[int]]):
    """(batch label, batches) for each of `--batch_sizes` (`source_ids` in order, cut every N) and `--max_tokens`
    (cut by token budget as `vaswani.translation.translate` cuts them); every engine decodes exactly these."""
    for batch_size in args.batch_sizes:
        chosen = source_ids
        if batch_size == 1 and args.batch1_sentences:  # the first draws of the same seeded sample
            chosen = sorted(sampled_ids[: args.batch1_sentences], key=len)
        yield batch_size, [chosen[i : i + batch_size] for i in range(0, len(chosen), batch_size)]
    for budget in args.max_tokens:
        budget_batches = token_budget_batches([len(ids) for ids in source_ids], budget)
        yield f"{budget} tokens", [[source_ids[i] for i in batch] for batch in budget_batches]


def _add_ratios(rows: list[dict]) -> None:
    """× Marian, × CT2 int8: this engine's sentences/s over theirs; Vaswani ×: Vaswani fp32's over this engine's."""
    key = lambda r: (r["size"], r["batch_size"], r["beams"], r["stopping"])  # noqa: E731
    by_engine = {(key(r), r["engine"]): r["sentences_per_s"] for r in rows}
    for r in rows:
        marian, vaswani, ct2_int8 = (by_engine.get((key(r), name)) for name in ("marian", "vaswani", "ct2-int8"))
        r["vs_marian"] = r["sentences_per_s"] / marian if marian and r["engine"] != "marian" else None
        r["vaswani_vs"] = vaswani / r["sentences_per_s"] if vaswani and r["engine"] != "vaswani" else None
        r["vs_ct2_int8"] = r["sentences_per_s"] / ct2_int8 if ct2_int8 and r["engine"] != "ct2-int8" else None


def _notes(args, names, stopping, failed, corpus, tokenizer, source_ids, device) -> list[str]:
    sample = (f"{len(source_ids)} sentences drawn uniformly (seed {args.seed}) from the checkpoint's held-out test "
              f"split of {corpus.name}" if args.model else f"{len(source_ids)} English sentences drawn uniformly (seed {args.seed}) from "
              f"{corpus.name}")
    notes = [f"{sample}, tokenized ({len(tokenizer)} tokens; mean source length "
             f"{sum(map(len, source_ids)) / len(source_ids):.1f} tokens incl. </s>), sorted by length and batched "
             "identically for every engine."]
    if args.max_tokens:
        notes.append("Batch 'N tokens': batches of at most N padded source tokens, longest first, as "
                     "vaswani.translation.translate cuts them for translate.py and evaluate_bleu.py "
                     "(vaswani.batching.token_budget_batches).")
    if "forced" in stopping:
        notes.append(f"Forced rows: exactly {args.new_tokens} tokens per sentence, checked on every output"
                     + (" (identical compares the PyTorch engines only: CTranslate2 masks the end of sentence)."
                        if args.model else "."))
    if "eos" in stopping:
        notes.append(f"eos rows, as users translate: each sentence to its end (at most {args.max_new_tokens} new "
                     "tokens), with the checkpoint's generation config; identical = token ids equal to Vaswani fp32's.")
    return notes + [
        (f"Checkpoint {args.model}." if args.model else "Random weights (seeded), saved as a checkpoint of the preset.")
        + " Every engine from vaswani.loading.load_engine; Marian (HF) = that engine with vaswani.convert.to_marian of "
        "its model; CT2 = the checkpoint's export (vaswani.export.export_to_ctranslate2, inter_threads 1).",
        f"Precision {device.dtype_name} (bf16: dtype='bfloat16'); Vaswani = decoding='auto'; lean loop / "
        "transformers' loop / CUDA graphs / compiled steps = decoding='lean' / 'transformers' / 'graphs' / 'compiled' "
        "(compiled steps: the encoder eager, the decoding steps inductor's, whose compiling the warm and first timed "
        "runs pay); compiled = vaswani.inference.compile_for_generation; attention: sdpa.",
        "Warm runs only (the shortest and the longest batch first, untimed); engines interleaved batch by batch, the "
        f"order rotating; seconds = sum over batches of the fastest of {args.repeats} repeat(s).",
        ("All engines in one process. " if args.same_process else "Each engine in a process of its own. ")
        + ("On a CPU, load_engine's keep_freed_cpu_memory() holds in every PyTorch engine's process, Marian's "
           "included. " if device.device.type == "cpu" else "")
        + "Memory: load = resident memory the engine added; work = peak added while translating the longest batch; "
        "peak = load + work (on CPU, process RSS and VmHWM increments).",
        *(["int8 = load_engine(int8=True): vaswani.inference.quantize_for_cpu (every nn.Linear, the output projection "
           "included, int8 weights with a scale per output row, activations quantized per row at each call)."]
          if any(name.startswith("vaswani-") and "int8" in name.split("-") for name in names) else []),
        *(["slots = vaswani.slots.decode_in_slots, a slot per batch row: one call per repeat over all sentences; its "
           "memory is that of the longest batch decoded in slots alone."]
          if any("slots" in name.split("-") for name in names) else []),
        *(f"{engine_label(name)} failed and was left out from then on (--keep_going): {why}"
          for name, why in failed.items()),
    ]


def main(argv=None) -> Path:
    parser, add = argument_parser(__doc__)
    add("--sizes", type=csv_of(str), default=["base"], help="VaswaniConfig presets, e.g. tiny,base,big")
    add("--engines", type=csv_of(str), default=None, help="vaswani[-int8 (CPU only)|-bf16][-hfloop|-lean|-graphs|"
        "-steps|-slots][-compiled], marian[-bf16], ct2-<compute type> (CTranslate2 running the model's export: "
        f"ct2-float32, ct2-int8 …); default: {','.join(DEFAULT_ENGINES_CUDA)} on CUDA, "
        f"{','.join(DEFAULT_ENGINES_CPU)} on CPU")
    add("--batch_sizes", type=csv_of(int), default=[1, 32, 256])
    add("--max_tokens", type=csv_of(int), default=[], help="batches as translate.py cuts them too: at most N padded "
        "source tokens each, longest first (vaswani.batching.token_budget_batches, as vaswani.translation.translate "
        "batches; translate.py's --max_tokens_per_batch is 4096); their rows' batch reads 'N tokens'")
    add("--beams", type=csv_of(int), default=[1, 4], help="1 = greedy")
    add("--num_sentences", type=int, default=3000)
    add("--batch1_sentences", type=int, default=None, help="at batch size 1 only the first N sentences of the sample "
        "(a uniform sample too); default: all")
    # Longer than nearly every French reference of the corpus (joint BPE): forced rows do at least the real work.
    add("--new_tokens", type=int, default=16, help="tokens per sentence in the forced rows")
    add("--model", default=None, help="a trained checkpoint to run on its held-out test sentences instead of random "
        "weights (--sizes is then unused)")
    add("--stopping", type=csv_of(str, STOPPING), default=None, help=f"{', '.join(STOPPING)}: each sentence to its end "
        "of sentence (needs --model) / exactly --new_tokens; default: eos,forced with --model, else forced")
    add("--max_new_tokens", type=int, default=128, help="at most this many new tokens in the eos rows (the limit of "
        "the README's committed rows)")
    add("--keep_going", action="store_true", help="leave out an engine that fails (an error, or its process dies), "
        "named in the report's notes, and go on with the others (for unattended GPU runs)")
    add("--same_process", action="store_true", help="every engine in this one process instead of one process each "
        "(shows how CTranslate2 and PyTorch slow each other down in one process)")
    add("--repeats", type=int, default=1, help="timed passes; the fastest per batch counts")
    args = parser.parse_args(argv)
    device = pick_device(args.device, args.threads)
    stopping = args.stopping or (list(STOPPING) if args.model else ["forced"])
    if "eos" in stopping and not args.model:
        raise SystemExit("--stopping eos needs a trained model (--model): random weights stop at arbitrary points.")
    names = args.engines or (DEFAULT_ENGINES_CUDA if device.as_cuda else DEFAULT_ENGINES_CPU)
    if args.model:
        corpus, english = test_sources(args.corpus)
        # Drawn across the split, whose file order is by length: its first sentences are its shortest.
        tokenizer = VaswaniTokenizer.from_pretrained(args.model)
        english = random.Random(args.seed).sample(english, min(args.num_sentences, len(english)))
        args.sizes = [Path(args.model).name]
    else:
        corpus, pairs, tokenizer = corpus_and_tokenizer(args.corpus, args.cache_dir, args.vocab_size)
        english = [source for source, _ in sample_sentences(pairs, args.num_sentences, args.seed)]
    sampled_ids = tokenizer(english)["input_ids"]  # each ends with </s>
    # Sorted by length so that batches pad little; every engine gets exactly these batches.
    source_ids = sorted(sampled_ids, key=len)
    rows, failed = [], {}  # failed: engine → why it was dropped (--keep_going)
    columns = [Column("size", "model" if args.model else "size"), Column("engine_label", "engine"),
               *([Column("stopping", "stopping")] if args.model else []), Column("batch_size", "batch"),
               Column("beams", "beams"), Column("sentences", "sentences"), Column("seconds", "seconds", "{:.2f}"),
               Column("sentences_per_s", "sentences/s", "{:.1f}"), Column("tokens_per_s", "output tokens/s", "{:.0f}"),
               Column("vs_marian", "× Marian", "{:.2f}"), Column("vaswani_vs", "Vaswani ×", "{:.2f}"),
               Column("vs_ct2_int8", "× CT2 int8", "{:.2f}"), Column("attention", "attention"),
               Column("dtype", "dtype"), Column("linear", "linear"),
               *([Column("identical_to_vaswani", "identical")] if args.model else []),
               Column("peak_mib", "peak MiB", "{:.0f}"), Column("load_average", "load avg", "{:.1f}")]

    def write(stopped: Stopped | None = None) -> Path:
        """The report of the rows so far: rewritten as each setting's rows are in, and where a stop signal ends the
        run (`stopped`), with a note that says so."""
        _add_ratios(rows)
        cut = [f"Cut by {stopped}: the rows are the settings measured before; the later ones have none."] \
            if stopped else []
        return report(__file__, argv, args, device, "translation", "Translation throughput", rows, columns,
                      cut + _notes(args, names, stopping, failed, corpus, tokenizer, source_ids, device),
                      dict(engines=names, corpus=str(corpus), vocab_size_actual=len(tokenizer),
                           source_tokens_total=sum(map(len, source_ids)),
                           source_tokens_mean=sum(map(len, source_ids)) / len(source_ids)))

    args.cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.cache_dir) as workdir, stop_signals():
        try:
            for size in args.sizes:
                model_dir = args.model or random_checkpoint(size, tokenizer, args.seed, Path(workdir) / size)
                start = LocalEngine if args.same_process else EngineProcess
                engines = {name: start(name=name, model_dir=model_dir, device_name=args.device,
                                       threads=args.threads, ct2_dir=Path(workdir) / f"{size}-ct2") for name in names}
                for batch_size, batches in batchings(args, sampled_ids, source_ids):
                    for beams, mode in ((beams, mode) for mode in stopping for beams in args.beams):
                        for row in measure(engines, batches, beams, mode == "eos", args, failed):
                            load = engines[row["engine"]].load_mib
                            row.update(size=size, batch_size=batch_size, batches=len(batches), load_mib=load,
                                       peak_mib=None if None in (load, row["work_mib"]) else load + row["work_mib"])
                            rows.append(row)
                            print(f"{size:>5} {row['engine_label']:>12} {row['stopping']:>6} batch {batch_size:>4} "
                                  f"beams {beams}: {row['sentences_per_s']:8.1f} sentences/s "
                                  f"{row['tokens_per_s']:9.0f} tokens/s", flush=True)
                        write()
                for engine in engines.values():
                    engine.close()
        except Stopped as stopped:
            write(stopped)
            sys.exit(128 + stopped.signum)
    return write()


if __name__ == "__main__":
    main()
