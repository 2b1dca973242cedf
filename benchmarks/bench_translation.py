"""Translation throughput: sentences/s and output tokens/s of greedy and beam search, Vaswani vs Marian (same
weight shapes), and on CPU Vaswani's opt-in int8 path (`vaswani.inference.quantize_for_cpu`), CTranslate2
running that Marian model (fp32 and int8), and CTranslate2 running the Vaswani model after
`vaswani.export.export_to_ctranslate2` (int8).

Identical work across engines: the same English sentences from the real corpus, tokenized once by the project's
joint BPE, sorted by length and cut into the same batches; every engine generates exactly `--new_tokens` tokens per
sentence. Random weights would otherwise stop at arbitrary points, so nothing stops at the end-of-sentence token:
transformers runs `max_new_tokens` steps with `eos_token_id=None` (no stopping criterion and no logits processor,
so no extra work), CTranslate2 gets `min_decoding_length` = `max_decoding_length` (it masks EOS in place, a
negligible cost), and the count is checked on every output. Only warm runs are timed.

Every engine runs in a process of its own, as it would be deployed (`EngineProcess`); the parent interleaves them
batch by batch. In one shared process, CTranslate2 and PyTorch slow each other down (`--same_process` shows it).

With `--model DIR` the engines run a trained checkpoint instead, as users translate: the first `--num_sentences` of
its held-out test split, each stopping at its own end of sentence (`--stopping eos`, at most `--max_new_tokens`),
with forced-length rows beside them (`--stopping forced`). Marian is `vaswani.convert.to_marian` of the checkpoint
(the same function, so the same translations) and CTranslate2 runs the checkpoint's own export
(`vaswani.export.export_to_ctranslate2`: CTranslate2's Marian converter assumes Marian's zero-embedding decoder
start, which a Vaswani checkpoint does not use). Each row counts the translations identical to Vaswani fp32's.

    python benchmarks/bench_translation.py                     # GPU defaults: 3,000 sentences, batch 1/32/256
    python benchmarks/bench_translation.py --device cpu --batch_sizes 32 --num_sentences 320
    python benchmarks/bench_translation.py --device cpu --threads 2 --batch_sizes 32 --model outputs/en-fr-small
"""

import argparse
import functools
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from vaswani.convert import to_marian
from vaswani.data import load_translation_dataset
from vaswani.decoding import use_lean_decoding
from vaswani.export import export_to_ctranslate2
from vaswani.inference import compile_for_generation, keep_freed_cpu_memory, quantize_for_cpu
from vaswani.modeling_vaswani import VaswaniForConditionalGeneration
from vaswani.tokenization_vaswani import VaswaniTokenizer
from vaswani.generation_vaswani import decode_in_slots
from vaswani.translation import CTranslate2Engine, generate_token_ids, output_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ENGINE_LABELS,
    Column,
    PeakMemory,
    loaded,
    add_common_arguments,
    build_seq2seq,
    command_line,
    corpus_and_tokenizer,
    count_parameters,
    csv_of,
    pick_device,
    resolve_corpus,
    result_name,
    sample_sentences,
    timed,
    vaswani_config,
    sdpa_backend,
    settings_of,
    write_report,
)

ENGINE_LABELS = {**ENGINE_LABELS, "vaswani-hfloop": "Vaswani transformers' loop",
                 "vaswani-lean": "Vaswani lean loop", "vaswani-int8": "Vaswani int8",
                 "vaswani-int8-hfloop": "Vaswani int8 transformers' loop", "vaswani-compiled": "Vaswani compiled",
                 "vaswani-graphs": "Vaswani CUDA graphs", "vaswani-graphs-compiled": "Vaswani CUDA graphs compiled",
                 "vaswani-ct2-int8": "Vaswani→CT2 int8", "vaswani-ct2-float32": "Vaswani→CT2 fp32",
                 "vaswani-bf16": "Vaswani bf16", "marian-bf16": "Marian (HF) bf16", "vaswani-slots": "Vaswani slots",
                 "vaswani-bf16-slots": "Vaswani bf16 slots"}
TORCH_OPTIONS = {"int8", "hfloop", "lean", "graphs", "compiled", "bf16", "slots"}

DEFAULT_ENGINES_CUDA = ["vaswani", "vaswani-lean", "vaswani-graphs", "vaswani-compiled", "marian"]
DEFAULT_ENGINES_CPU = ["vaswani", "vaswani-hfloop", "vaswani-int8", "vaswani-int8-hfloop", "marian", "ct2-float32",
                       "ct2-int8", "vaswani-ct2-int8"]

# Longer than nearly every French reference of the corpus under the joint BPE, so that forced rows do about the work
# of translating to the end of sentence, and then some.
DEFAULT_NEW_TOKENS = 16
# eos: each sentence stops at its end-of-sentence token (at most --max_new_tokens), as users translate (a trained
# model only); forced: exactly --new_tokens tokens per sentence, identical work whatever the weights.
STOPPING = ("eos", "forced")
# The kernels of a PyTorch engine's linear layers on a CPU, as torch.profiler names them: fp32 (`aten::addmm` with a
# bias, `aten::mm` without, as in a tied output projection) and `--int8`'s fbgemm product (its per-row quantization
# and scaling are elementwise operators, not counted).
LINEAR_KERNELS = {"aten::addmm", "aten::mm", "quantized::linear_with_input_q_dq_qweight_dq_output_fp32"}


class TorchEngine:
    """A transformers model translating through `generate()`, as a user would call it (a Vaswani model's decodes
    with its lean loop on a CPU and transformers' loop elsewhere, `vaswani.generation_vaswani`). Options, joined to
    the model's name with dashes
    (`vaswani-int8-hfloop`):

    * `int8`: `vaswani.inference.quantize_for_cpu` (fp32 weights quantized once at load) and
      `keep_freed_cpu_memory()`, as `--int8` does in the scripts (`vaswani-int8` is the scripts' `--int8` path);
    * `hfloop`: transformers' own decoding loop (`generate(..., lean_decoding=False)`);
    * `lean`: the lean loop on any device (`generate(..., lean_decoding=True)`);
    * `graphs`: `generate(..., cuda_graphs=True)`: static shapes, each decoding step recorded once as a
      CUDA graph and replayed by later batches of the same shape (on a CPU the same steps run as they are);
    * `compiled`: `vaswani.inference.compile_for_generation`: a static (pre-allocated) KV cache and the decoding step
      under torch.compile, greedy and beam search alike; with `graphs`, the compiled steps are what the CUDA graphs
      record;
    * `bf16`: the weights cast to bf16 and generate() run in bf16 (`marian-bf16` too), as `scripts/translate.py
      --dtype bfloat16` runs, and as its `--dtype auto` chooses where these rows show that bf16 pays;
    * `slots`: continuous batching (`generation_vaswani.decode_in_slots`, what `TorchEngine(slots=...)` and the
      scripts' `--slots` run): `measure` hands it all sentences as one stream, in the batches' order, with as many
      slots as a batch has sentences; each finished sentence's slot goes to the next one at once (replayed as CUDA
      graphs on a GPU)."""

    def __init__(self, name, config, tokenizer, device, seed, attention_kernel=None, model_dir=None):
        self.attention_kernel = attention_kernel
        base, *options = name.split("-")
        if set(options) - TORCH_OPTIONS or (base == "marian" and set(options) - {"bf16"}) or base not in (
                "vaswani", "marian") or {"int8", "bf16"} <= set(options):
            raise ValueError(f"Unknown engine {name!r}: vaswani[-int8|-bf16][-hfloop|-lean|-graphs|-slots]"
                             "[-compiled] or marian[-bf16].")
        if model_dir:  # the trained checkpoint, or the Marian model computing the same function
            self.model = VaswaniForConditionalGeneration.from_pretrained(model_dir).eval()
            self.model = (to_marian(self.model) if base == "marian" else self.model).to(device.device, device.dtype)
        else:
            self.model = build_seq2seq(base, config, device, device.dtype, seed).eval()
        self.parameters = count_parameters(self.model)  # before quantization, which turns weights into buffers
        if "bf16" in options:
            self.model = self.model.to(torch.bfloat16)
        if "int8" in options:
            self.model = quantize_for_cpu(self.model)
            keep_freed_cpu_memory()
        if "hfloop" in options or "lean" in options:
            self.model.generate = functools.partial(self.model.generate, lean_decoding="lean" in options)
        if "graphs" in options:
            self.model = use_lean_decoding(self.model, cuda_graphs=True)
        if "compiled" in options:
            self.model = compile_for_generation(self.model)
        self.device, self.pad = device, self.model.config.pad_token_id
        self.slots = "slots" in options

    def translate(self, batch: list[list[int]], beams: int, new_tokens: int, stop_at_eos: bool,
                  slots: int | None = None) -> list[list[int]]:
        """Each sentence's generated token ids (`vaswani.translation.generate_token_ids`, the package engine's own
        generate() call, or `decode_in_slots` in `slots` slots, by default as many as `batch` has sentences): without
        the decoder start token, up to its end of sentence (all `new_tokens` when forced)."""
        # Forced: no stopping on EOS, exactly new_tokens steps (see the module docstring).
        stopping = {} if stop_at_eos else {"eos_token_id": None}
        if self.slots:
            eos = self.model.generation_config.eos_token_id if stop_at_eos else None
            with torch.inference_mode(), sdpa_backend(self.attention_kernel):
                outputs = decode_in_slots(self.model, batch, new_tokens, slots=slots or len(batch), num_beams=beams,
                                          do_sample=False, **stopping)
            return [output_ids(output[1:], eos) for output in outputs]
        width = max(map(len, batch))
        ids = torch.tensor([s + [self.pad] * (width - len(s)) for s in batch], device=self.device.device)
        with sdpa_backend(self.attention_kernel):
            return generate_token_ids(self.model, ids, ids != self.pad, num_beams=beams, do_sample=False,
                                      max_new_tokens=new_tokens, **stopping)

    def close(self):
        del self.model


STARTED = time.monotonic()  # for the progress lines


class CT2Engine:
    """CTranslate2 (quantized at load time for int8) running either the Marian twin (`ct2-<compute type>`, converted
    by CTranslate2's own Marian converter) or the Vaswani model (`vaswani-ct2-<compute type>`, exported by
    `vaswani.export.export_to_ctranslate2`). Both are converted once per size into `workdir`. With a trained
    `checkpoint` (`--model`), `ct2-<compute type>` runs that checkpoint's export."""

    def __init__(self, name, config, tokenizer, device, seed, threads, workdir: Path, checkpoint=None):
        import ctranslate2

        compute_type = name.rpartition("ct2-")[2]
        if checkpoint and name.startswith("vaswani-"):
            raise ValueError(f"Engine {name!r}: with --model, ct2-<compute type> already runs the checkpoint's own "
                             "CTranslate2 export.")
        source = "vaswani" if name.startswith("vaswani-") else "marian"
        model_dir = workdir / ("ct2-checkpoint" if checkpoint else f"ct2-{source}")
        if checkpoint and not (model_dir / "model.bin").is_file():
            export_to_ctranslate2(checkpoint, model_dir, force=True)
        elif not (model_dir / "model.bin").is_file():
            self._convert(source, config, tokenizer, seed, workdir, model_dir)
        self.parameters = None  # counted on the PyTorch rows of the same weights
        self.translator = ctranslate2.Translator(
            str(model_dir),
            device=device.device.type,
            compute_type=compute_type,
            intra_threads=threads or torch.get_num_threads(),
            inter_threads=1,
        )
        self.tokenizer = tokenizer

    @staticmethod
    def _convert(source, config, tokenizer, seed, workdir: Path, model_dir: Path) -> None:
        from ctranslate2.converters import TransformersConverter

        if source == "vaswani":
            vaswani = build_seq2seq("vaswani", config, pick_device("cpu"), torch.float32, seed)
            export_to_ctranslate2(vaswani, model_dir, tokenizer=tokenizer, force=True)
            return
        marian = build_seq2seq("marian", config, pick_device("cpu"), torch.float32, seed)
        config_dir = workdir / "marian-config"
        marian.config.save_pretrained(config_dir)

        class InMemoryConverter(TransformersConverter):
            """Converts the model object we already have, with our tokenizer's vocabulary."""

            def load_model(self, model_class, model_name_or_path, **kwargs):
                return marian

            def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
                return _MarianVocabulary(tokenizer)

        InMemoryConverter(str(config_dir)).convert(str(model_dir), force=True)

    def translate(self, batch: list[list[int]], beams: int, new_tokens: int, stop_at_eos: bool) -> list[list[int]]:
        """Each sentence's generated token ids through the package's engine (`vaswani.translation.CTranslate2Engine`);
        forced: `min_decoding_length` = `max_decoding_length`, so EOS is masked until then."""
        engine = CTranslate2Engine(self.translator, self.tokenizer, num_beams=beams, max_new_tokens=new_tokens,
                                   min_decoding_length=0 if stop_at_eos else new_tokens)
        return engine.generate_ids(batch)

    def close(self):
        del self.translator


class _MarianVocabulary:
    """What CTranslate2's Marian converter reads from a tokenizer: our vocabulary plus Marian's last-row `<pad>`,
    which the converter drops again (it decodes from a zero embedding instead). Our own `<pad>` (id 0) is renamed
    to keep token strings unique; CTranslate2 pads internally, so no input ever contains it."""

    def __init__(self, tokenizer):
        vocab = {token: index for token, index in tokenizer.get_vocab().items() if token != "<pad>"}
        self.vocab = {"<unused-pad>": tokenizer.pad_token_id, **vocab, "<pad>": len(tokenizer)}
        self.eos_token, self.unk_token = tokenizer.eos_token, tokenizer.unk_token

    def get_vocab(self):
        return self.vocab


def make_engine(name, config, tokenizer, device_name, threads, seed, sdpa_backend, workdir, keep_freed_memory,
                model=None):
    """Build engine `name` in this process (on checkpoint `model` when given); return it as a `LocalEngine`."""
    device = pick_device(device_name, threads)
    if keep_freed_memory and not keep_freed_cpu_memory():
        raise RuntimeError("--keep_freed_memory needs glibc's mallopt, which this platform does not have.")
    if name.startswith(("ct2-", "vaswani-ct2-")):
        build = lambda: CT2Engine(name, config, tokenizer, device, seed, threads, workdir, model)  # noqa: E731
    else:
        build = lambda: TorchEngine(name, config, tokenizer, device, seed, sdpa_backend, model)  # noqa: E731
    return LocalEngine(device, build)


class LocalEngine:
    """An engine with what `measure` asks of it: timed translations and the peak memory of one."""

    def __init__(self, device, build):
        self.device = device
        self.engine, self.load_mib = loaded(device, build)
        self.parameters = self.engine.parameters

    def timed_translate(self, batch, beams, new_tokens, stop_at_eos, *slots) -> tuple[list[list[int]], float]:
        return timed(self.device, lambda: self.engine.translate(batch, beams, new_tokens, stop_at_eos, *slots))

    def peak_mib(self, batch, beams, new_tokens, stop_at_eos, *slots) -> float | None:
        with PeakMemory(self.device) as memory:
            self.engine.translate(batch, beams, new_tokens, stop_at_eos, *slots)
        return memory.added_mib

    def linear_seconds(self, batches, beams, new_tokens, stop_at_eos) -> float | None:
        """CPU seconds inside the linear layers' kernels (`LINEAR_KERNELS`) while translating every batch once,
        from torch.profiler's self time; None for engines that are not PyTorch's, or not on a CPU."""
        if not isinstance(self.engine, TorchEngine) or self.device.is_cuda:
            return None
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for batch in batches:
                self.engine.translate(batch, beams, new_tokens, stop_at_eos)
        kernels = [event for event in profiler.key_averages() if event.key in LINEAR_KERNELS]
        return sum(event.self_cpu_time_total for event in kernels) / 1e6

    def close(self):
        self.engine.close()

    def abandon(self):
        """After a failure: release what can be released, without expecting the engine to answer."""
        self.engine = None


class EngineProcess:
    """A `LocalEngine` in a process of its own, driven over a pipe; each call is timed inside that process.

    Deployments run one engine per process, and sharing one distorts the comparison: after CTranslate2 has translated
    once in a process, PyTorch's generate() in the same process can run slower for the rest of its life (one of
    torch's OpenMP threads then sits idle much of the time), and CTranslate2 slower next to torch
    (results/translation-cpu-same-process.md; `--same_process` reproduces it).
    """

    def __init__(self, **spec):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing inherited from the parent
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, spec), daemon=True)
        self._process.start()
        child.close()
        self.parameters, self.load_mib = self._call("describe")

    def _call(self, method: str, *args):
        self._pipe.send((method, args))
        status, value = self._pipe.recv()
        if status == "error":
            raise RuntimeError(f"engine process failed in {method}:\n{value}")
        return value

    def timed_translate(self, batch, beams, new_tokens, stop_at_eos, *slots) -> tuple[list[list[int]], float]:
        return self._call("timed_translate", batch, beams, new_tokens, stop_at_eos, *slots)

    def peak_mib(self, batch, beams, new_tokens, stop_at_eos, *slots) -> float | None:
        return self._call("peak_mib", batch, beams, new_tokens, stop_at_eos, *slots)

    def linear_seconds(self, batches, beams, new_tokens, stop_at_eos) -> float | None:
        return self._call("linear_seconds", batches, beams, new_tokens, stop_at_eos)

    def close(self):
        self._call("close")
        self._process.join()

    def abandon(self):
        """After a failure (perhaps a crash): end the process without asking it."""
        self._process.kill()
        self._process.join()


def _serve(pipe, spec: dict) -> None:
    """The engine process: build the engine, then answer calls until `close`; errors go back as tracebacks."""
    engine = None
    while True:
        method, args = pipe.recv()
        try:
            if method == "describe":
                engine = make_engine(**spec)
                result = (engine.parameters, engine.load_mib)
            else:
                result = getattr(engine, method)(*args)
        except Exception:  # noqa: BLE001 (reported to the parent, which raises it)
            pipe.send(("error", traceback.format_exc()))
            continue
        pipe.send(("ok", result))
        if method == "close":
            return


def run(args: argparse.Namespace, argv) -> Path:
    device = pick_device(args.device, args.threads)
    stopping = args.stopping or (list(STOPPING) if args.model else ["forced"])
    if "eos" in stopping and not args.model:
        raise SystemExit("--stopping eos needs a trained model (--model): random weights stop at arbitrary points.")
    names = args.engines or (DEFAULT_ENGINES_CUDA if device.is_cuda else DEFAULT_ENGINES_CPU)
    if args.model:
        names = args.engines or [name for name in names if not name.startswith("vaswani-ct2-")]
        corpus = resolve_corpus(args.corpus)
        tokenizer = VaswaniTokenizer.from_pretrained(args.model)
        test = load_translation_dataset(data_file=str(corpus))["test"]
        english = test["source"][: args.num_sentences]
        args.sizes = [Path(args.model).name]
    else:
        corpus, pairs, tokenizer = corpus_and_tokenizer(args)
        english = [source for source, _ in sample_sentences(pairs, args.num_sentences, args.seed)]
    sampled_ids = tokenizer(english)["input_ids"]  # each ends with </s>
    # Sorted by length so that batches pad little; every engine gets exactly these batches.
    source_ids = sorted(sampled_ids, key=len)
    rows = []
    failed = {}  # engine → why it was dropped (--keep_going)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.cache_dir) as workdir:
        for size in args.sizes:
            config = None if args.model else vaswani_config(size, len(tokenizer))
            start = make_engine if args.same_process else EngineProcess
            engines = {
                name: start(name=name, config=config, tokenizer=tokenizer, device_name=args.device,
                            threads=args.threads, seed=args.seed, sdpa_backend=args.sdpa_backend,
                            workdir=Path(workdir) / size, keep_freed_memory=args.keep_freed_memory, model=args.model)
                for name in names
            }
            for batch_size in args.batch_sizes:
                chosen = source_ids
                if batch_size == 1 and args.batch1_sentences:  # the first draws of the same seeded sample
                    chosen = sorted(sampled_ids[: args.batch1_sentences], key=len)
                batches = [chosen[i : i + batch_size] for i in range(0, len(chosen), batch_size)]
                for beams, mode in ((beams, mode) for mode in stopping for beams in args.beams):
                    for row in measure(engines, batches, beams, mode == "eos", args, failed):
                        row.update(size=size, batch_size=batch_size, load_mib=engines[row["engine"]].load_mib)
                        row["peak_mib"] = _sum_or_none(row["load_mib"], row["work_mib"])
                        rows.append(row)
                        print(_progress(row), flush=True)
            for engine in engines.values():
                engine.close()

    settings = settings_of(
        args,
        engines=names,
        corpus=str(corpus),
        vocab_size_actual=len(tokenizer),
        source_tokens_total=sum(map(len, source_ids)),
        source_tokens_mean=sum(map(len, source_ids)) / len(source_ids),
    )
    sample = (f"the first {len(source_ids)} sentences of the checkpoint's held-out test split of {corpus.name}, "
              "tokenized by the checkpoint's tokenizer" if args.model else
              f"{len(source_ids)} English sentences drawn uniformly (seed {args.seed}) from {corpus.name}, tokenized "
              "by the project's joint BPE")
    notes = [
        f"{sample[0].upper()}{sample[1:]} ({len(tokenizer)} tokens; mean source length "
        f"{settings['source_tokens_mean']:.1f} tokens incl. </s>), sorted by length and batched identically "
        "for every engine.",
    ]
    if "forced" in stopping:
        notes.append(
            f"Forced rows, identical work: every engine generates exactly {args.new_tokens} tokens per sentence, "
            "verified on every output: transformers with max_new_tokens and eos_token_id=None (no EOS stopping, no "
            "logits processor), CTranslate2 with min_decoding_length = max_decoding_length (EOS masked in place)."
            + (" So in forced rows CTranslate2's outputs differ from transformers' by construction once a sentence "
               "would have ended (transformers may emit the end of sentence and go on); there, identical compares "
               "the PyTorch engines only." if args.model else ""))
    if "eos" in stopping:
        notes.append(
            "eos rows, as users translate: each sentence stops at its own end of sentence, at most "
            f"{args.max_new_tokens} new tokens (transformers: generate() with the checkpoint's generation config and "
            "max_new_tokens; CTranslate2: max_decoding_length). identical = translations whose token ids equal "
            "Vaswani fp32's; output tokens exclude the end of sentence.")
    notes.append(
        f"Checkpoint {args.model}. Marian (HF) = vaswani.convert.to_marian of it: a MarianMTModel computing the same "
        "function, with the same generation config. CT2 = CTranslate2 running the checkpoint exported by "
        "vaswani.export.export_to_ctranslate2 (CTranslate2's own Marian converter assumes Marian's zero-embedding "
        "decoder start, which this checkpoint does not use)." if args.model else
        "Random weights (speed does not depend on their values once the output length is fixed). Marian and "
        "CTranslate2 run the same Marian weights; Vaswani has the same weight shapes (Marian adds its own last "
        "<pad> row, from which it starts decoding).")
    notes += [
        "Warm runs only: every engine first translates the shortest and the longest batch once, untimed. Engines "
        "are then interleaved batch by batch (the order rotating), so a change in machine load hits all of them "
        f"alike; seconds = sum over batches of the fastest of {args.repeats} repeat(s). Input tensors are built "
        "inside the timed call.",
        f"Precision {str(device.dtype).removeprefix('torch.')} (bf16 rows: the weights cast to bfloat16, "
        "generate() in bf16); PyTorch engines call `generate()` with the "
        "default attention implementation (sdpa). Vaswani int8 = the same fp32 model after "
        "vaswani.inference.quantize_for_cpu (every nn.Linear, lm_head included, on fbgemm's int8 kernel: "
        "int8 weights per output channel, activations quantized per row at each call) with keep_freed_cpu_memory(). "
        "Vaswani = generate() as users call it, which decodes with the lean loop of vaswani.generation_vaswani "
        "on a CPU (the same tokens as transformers' loop, less work per step) and with transformers' loop on other "
        "devices; Vaswani lean loop = generate(..., lean_decoding=True); Vaswani transformers' loop = "
        "generate(..., lean_decoding=False); Vaswani CUDA graphs = generate(..., cuda_graphs=True) (static "
        "shapes, every step a replayed CUDA graph); Vaswani int8 is what the scripts' --int8 runs. CTranslate2 int8 = int8 weights, "
        "dynamically quantized activations; inter_threads 1, intra_threads = torch threads. Vaswani→CT2 = the Vaswani "
        "weights exported by vaswani.export.export_to_ctranslate2 and run by CTranslate2 with the same settings.",
        ("Every engine ran in a process of its own (the parent interleaves them batch by batch). "
         if not args.same_process else "All engines shared one process (--same_process). ")
        + ("Every engine's process ran with vaswani.inference.keep_freed_cpu_memory() (glibc malloc reuses freed "
           "memory instead of mapping fresh pages per large tensor), Marian included. "
           if args.keep_freed_memory else "")
        + "Memory: load = resident memory added by loading the engine (weights, runtime); work = peak added while "
        "translating the longest batch; peak = load + work. On CPU these are process RSS (VmHWM) increments.",
    ]
    if args.linear_time:
        notes.append(
            "linear-layer s (--linear_time): after the timed passes, each PyTorch engine translated every batch once "
            "more under torch.profiler, and this is the CPU time inside its linear layers' kernels (self time of "
            f"{', '.join(sorted(LINEAR_KERNELS))}): the matrix products of the projections, the feed-forward layers and "
            "the output projection, a floor under that engine's seconds whatever is done around them. Attention's "
            "batched products are not included.")
    if any("slots" in name.split("-") for name in names):
        notes.append(
            "Vaswani slots = generation_vaswani.decode_in_slots (TorchEngine(slots=...), the scripts' --slots): "
            "continuous batching, as many slots as a batch has sentences, each finished sentence's slot taken at once "
            "by the next (replayed as CUDA graphs on a GPU). It gets all the sentences at once, in the batches' "
            "order, so its seconds are of one call per repeat (after that repeat's interleaved batches), the fastest "
            "counted; its memory is that of the longest batch decoded in slots alone.")
    for name, why in failed.items():
        notes.append(f"{ENGINE_LABELS.get(name, name)} failed and was left out from then on (--keep_going): {why}")
    if args.notes:
        notes.append(args.notes)
    columns = [
        Column("size", "model" if args.model else "size"),
        Column("engine_label", "engine"),
        *([Column("stopping", "stopping")] if args.model else []),
        Column("batch_size", "batch"),
        Column("beams", "beams"),
        Column("sentences", "sentences"),
        Column("seconds", "seconds", "{:.2f}"),
        Column("sentences_per_s", "sentences/s", "{:.1f}"),
        Column("tokens_per_s", "output tokens/s", "{:.0f}"),
        Column("vs_marian", "× Marian", "{:.2f}"),
        Column("vaswani_vs", "Vaswani ×", "{:.2f}"),
        Column("vs_ct2_int8", "× CT2 int8", "{:.2f}"),
        *([Column("identical_to_vaswani", "identical")] if args.model else []),
        *([Column("linear_seconds", "linear-layer s", "{:.2f}")] if args.linear_time else []),
        Column("peak_mib", "peak MiB", "{:.0f}"),
        Column("load_average", "load avg", "{:.1f}"),
    ]
    _add_ratios(rows)
    name = result_name(args, "translation", device)
    json_path, _ = write_report(
        name, "Translation throughput", command_line(__file__, argv), device, settings, rows, columns, notes,
        args.results_dir,
    )
    return json_path


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
            extra = (slots,) if name in streams and method != "linear_seconds" else ()
            result = getattr(engines[name], method)(*call_args, beams, new_tokens, stop_at_eos, *extra)
            lengths = set(map(len, result[0])) if method == "timed_translate" else {new_tokens}
            if not stop_at_eos and lengths != {new_tokens}:
                raise RuntimeError(
                    f"{name} produced {sorted(lengths)} tokens per sentence instead of exactly "
                    f"{new_tokens}; the comparison would not be of identical work."
                )
            return result
        except (Exception, EOFError) as error:  # an error in the engine, or its process died (a crash)
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
        linear_seconds = call(name, "linear_seconds", batches) if args.linear_time else None
        if name not in engines:  # it failed just now
            continue
        seconds = sum(best[name])
        output_tokens = sum(map(len, translations[name]))
        rows.append({
            "engine": name,
            "engine_label": ENGINE_LABELS.get(name, name),
            "parameters": engines[name].parameters,
            "stopping": "eos" if stop_at_eos else "forced",
            "beams": beams,
            "sentences": sentences,
            "new_tokens_per_sentence": None if stop_at_eos else new_tokens,
            "output_tokens": output_tokens,
            "seconds": seconds,
            "sentences_per_s": sentences / seconds,
            "tokens_per_s": output_tokens / seconds,
            "identical_to_vaswani": sum(map(list.__eq__, translations[name], reference)) if reference else None,
            "work_mib": work_mib,
            "linear_seconds": linear_seconds,
            "load_average": load_average,
        })
    return rows


def _sum_or_none(*values):
    return None if any(v is None for v in values) else sum(values)


def _add_ratios(rows: list[dict]) -> None:
    """× Marian: this engine's sentences/s over HF Marian's; Vaswani ×: Vaswani's (fp32) sentences/s over this
    engine's; × CT2 int8: this engine's sentences/s over CTranslate2 int8's. The same sentences for every engine, so
    with forced lengths these are the ratios of output tokens/s too; with eos stopping, of the time users wait."""
    key = lambda r: (r["size"], r["batch_size"], r["beams"], r["stopping"])  # noqa: E731
    by_engine = {(key(r), r["engine"]): r["sentences_per_s"] for r in rows}
    for r in rows:
        marian = by_engine.get((key(r), "marian"))
        vaswani = by_engine.get((key(r), "vaswani"))
        ct2_int8 = by_engine.get((key(r), "ct2-int8"))
        r["vs_marian"] = r["sentences_per_s"] / marian if marian and r["engine"] != "marian" else None
        r["vaswani_vs"] = vaswani / r["sentences_per_s"] if vaswani and r["engine"] != "vaswani" else None
        r["vs_ct2_int8"] = r["sentences_per_s"] / ct2_int8 if ct2_int8 and r["engine"] != "ct2-int8" else None


def _progress(row: dict) -> str:
    return (
        f"{row['size']:>5} {row['engine_label']:>12} {row['stopping']:>6} batch {row['batch_size']:>4} beams {row['beams']}: "
        f"{row['sentences_per_s']:8.1f} sentences/s {row['tokens_per_s']:9.0f} tokens/s"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--sizes", type=csv_of(str), default=["base"], help="VaswaniConfig presets, e.g. tiny,base,big")
    parser.add_argument("--engines", type=csv_of(str), default=None,
                        help="vaswani[-int8 (CPU only)|-bf16][-hfloop|-lean|-graphs][-compiled], marian[-bf16], "
                        "ct2-<compute type> "
                        "(CTranslate2 running the Marian twin: ct2-float32, ct2-int8, ct2-bfloat16 …), "
                        "vaswani-ct2-<compute type> (CTranslate2 running the exported Vaswani model); default: "
                        f"{','.join(DEFAULT_ENGINES_CUDA)} on CUDA, {','.join(DEFAULT_ENGINES_CPU)} on CPU")
    parser.add_argument("--batch_sizes", type=csv_of(int), default=[1, 32, 256])
    parser.add_argument("--beams", type=csv_of(int), default=[1, 4], help="1 = greedy")
    parser.add_argument("--num_sentences", type=int, default=3000)
    parser.add_argument("--batch1_sentences", type=int, default=None,
                        help="at batch size 1 translate only the first N sentences of the sample (its uniform draws "
                        "are unordered, so any prefix is itself a uniform sample); default: all")
    parser.add_argument("--new_tokens", type=int, default=DEFAULT_NEW_TOKENS,
                        help="tokens generated per sentence in the forced rows")
    parser.add_argument("--model", default=None,
                        help="a trained Vaswani checkpoint to run instead of random weights (--sizes is then unused): "
                        "its held-out test sentences, Marian = vaswani.convert.to_marian of it, CTranslate2 = its "
                        "own export")
    parser.add_argument("--stopping", type=csv_of(str, STOPPING), default=None,
                        help=f"{', '.join(STOPPING)}: each sentence stops at its end of sentence (needs --model) / "
                        "exactly --new_tokens per sentence; default: eos,forced with --model, else forced")
    parser.add_argument("--max_new_tokens", type=int, default=128,
                        help="at most this many new tokens per sentence in the eos rows (the main job's "
                        "generation config)")
    parser.add_argument("--keep_freed_memory", action="store_true",
                        help="vaswani.inference.keep_freed_cpu_memory() in every engine's process (the int8 engines "
                        "apply it anyway, as --int8 does in the scripts): every PyTorch engine, Marian included, reuses "
                        "freed memory; CTranslate2 has its own caching allocator anyway")
    parser.add_argument("--keep_going", action="store_true",
                        help="an engine that fails (an error, or its process dies) is left out from then on and named "
                        "in the report's notes; the others go on (for unattended GPU runs)")
    parser.add_argument("--same_process", action="store_true",
                        help="run every engine in this one process instead of one process each (shows how "
                        "CTranslate2 and PyTorch slow each other down when they share a process)")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes; the fastest per batch counts")
    parser.add_argument("--linear_time", action="store_true",
                        help="on a CPU, also report each PyTorch engine's seconds inside its linear layers' kernels "
                        "(one more pass under torch.profiler, untimed): the floor that the rest of decoding adds to")
    return parser


def main(argv=None) -> Path:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    main()
