"""A checkpoint → an engine that translates (or a model and tokenizer), with the checks, the device, the
precision, int8, the decoding loop and the decoding settings decided in one place for every tool.

    engine = load_engine("outputs/en-fr")                     # a GPU if there is one, else the CPU; bf16 where faster
    engine = load_engine("outputs/en-fr", device="cpu", int8=True, num_beams=1)   # int8 CPU decoding, greedy
    engine = load_engine("outputs/en-fr-ct2", compute_type="int8")                # a CTranslate2 export
    engine = engine_for_model(model, tokenizer)                # a model already in memory (validation BLEU, tests)
    translations = vaswani.translation.translate(engine, sentences).texts

The engines are `vaswani.translation`'s, built here only, each with the one `DecodingSettings` resolved here: a
setting left out (or None) is the checkpoint's `generation_config`, read once, before the weights, and refused in one
line naming the file and the field where generate() could not honour it; the output length, unless `max_new_tokens`
is set there or here, is each source's length plus `translation.OUTPUT_SLACK`.
`load_translator` gives the model and tokenizer alone, for tools that run the model another way (heatmaps, export).

Stricter than `from_pretrained`, because a translation from partly random weights is a silent wrong result: only
safetensors weights are read, no remote code runs, and a checkpoint that is not a Vaswani model, or whose weights
or files are missing, unexpected, mismatched, truncated or corrupted, is an error naming the problem; so is a
tokenizer that is missing or does not fit the model.
"""

import dataclasses
import functools
import json
import os
import sys
import time

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig, MarianTokenizer

from .checkpoints import RECOPY, check_checkpoint_files, check_weights, damaged_weights
from .configuration_vaswani import check_tokenizer_fits
from .decoding import use_lean_decoding
from .decoding_settings import DecodingSettings, is_learned, model_decoding
from .files import read_json_object
from .generation_vaswani import runs_as
from .inference import compile_decoding_steps, keep_freed_cpu_memory, pack_for_cpu, quantize_for_cpu
from .machine import cache_dir, machine, measured_once
from .tokenization_vaswani import VaswaniTokenizer
from .translation import CTranslate2Engine, Engine, TorchEngine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DECODING_LOOPS = ("auto", "lean", "compiled", "graphs", "transformers")
# What marks a CTranslate2 model directory (`vaswani.export`), as config.json marks a checkpoint.
CTRANSLATE2_WEIGHTS = "model.bin"


# --------------------------------------------------------------------------------------------------
# Device and precision


def choose_device(device: str | torch.device | None = None, local_rank: int | None = None) -> torch.device:
    """`device`, with "auto" (or None) meaning a GPU when there is one, else the CPU: the process's own GPU,
    `cuda:<local_rank>`, under a launcher that starts one process per GPU."""
    if device in (None, "auto"):
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda" if local_rank is None else f"cuda:{local_rank}")
    return torch.device(device)


def cpu_bf16_flags() -> bool:
    """Whether this CPU has bf16 matrix instructions (AMX or AVX512-BF16), from the kernel's CPU flags (torch does
    not say for every kind); False where there are none to read (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def bf16_product_speedup(rows: int = 1024, width: int = 256, repeats: int = 20) -> float:
    """fp32's time over bf16's for a (rows × width) @ (width × 4·width) product (a small model's feed-forward on a
    batch of about 1,000 tokens) on this process's threads: the fastest of `repeats`, the two interleaved so that
    other load hits both alike."""
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    operands = {dtype: (torch.randn(rows, width, dtype=dtype), torch.randn(width, 4 * width, dtype=dtype))
                for dtype in best}
    for repeat in range(repeats + 1):  # the first round warms up (oneDNN picks and builds its kernels)
        for dtype, (a, b) in operands.items():
            start = time.perf_counter()
            a @ b
            if repeat:
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


# bf16 pays only where its products are faster than fp32's by this factor in every one of `CPU_BF16_ROUNDS` timings.
# One machine's timings differ by a few hundredths (0.53, 0.54, 0.55 on an Intel Xeon without AMX) and the CPUs
# measured differ by far more (that Xeon 0.53 ×; bf16 training 1.6 × fp32's tokens/s on an AMD EPYC with
# AVX512-BF16: benchmarks/results/cpu-bf16-products.md, training-cpu-bf16.md), so no spread between runs crosses it.
CPU_BF16_MARGIN = 1.2
CPU_BF16_ROUNDS = 3
# Where the answer is kept for this machine (`vaswani.machine.cache_dir`).
CPU_BF16_RECORD = "cpu-bf16.json"


@functools.cache
def cpu_multiplies_bf16() -> bool:
    """Whether bf16 products are faster than fp32 ones on this CPU, so that bf16 pays: bf16 matrix instructions are
    needed (without them bf16 is converted to fp32 around every product) but not enough. Where an AMD EPYC with
    AVX512-BF16 trains faster in bf16, an Intel Xeon with AVX512-BF16 and no AMX multiplies bf16 slower than fp32
    (benchmarks/results/cpu-bf16-products.md), so the products are timed (`CPU_BF16_ROUNDS` rounds of about 0.2 s;
    yes only where every round is `CPU_BF16_MARGIN` × faster), once per machine: the answer and its speedups are
    recorded in `cache_dir()/cpu-bf16.json` under this machine's key (`vaswani.machine.machine`, any thread count)
    and read by every later process, so that one machine always trains and decodes in the same precision."""
    if not cpu_bf16_flags():
        return False
    def measure() -> dict:
        speedups = [round(bf16_product_speedup(), 3) for _ in range(CPU_BF16_ROUNDS)]
        return {"speedups": speedups, "bf16": min(speedups) >= CPU_BF16_MARGIN}

    # The records made before measured_once name their key "machine"; they stay the answer on their machines.
    record, _, error = measured_once(CPU_BF16_RECORD, machine(threads=None), measure, key_field="machine")
    if error is not None:  # decided for this process alone, and said so
        print(f"bf16 products timed {record['speedups']} × fp32's on this CPU; not recorded, "
              f"{cache_dir(CPU_BF16_RECORD)} cannot be written ({error}).", file=sys.stderr, flush=True)
    return record["bf16"]


# The narrowest models for which bf16 weights decode faster than the fp32 engine (its linear layers laid out for
# oneDNN), greedy and with beam search: at d_model 512 (base, OPUS-MT's shape) bf16 was the faster with both; at the
# main job's width, 256, it was not faster by more than one run differs from the next, with either search, though
# each bf16 product alone is faster there, and it changed translations that fp32 keeps (the bf16 rows of
# benchmarks/results/translation-cpu-main-job-model.md and translation-cpu-base.md, a 2-core AMD EPYC of family 26).
# Beam search at 256 had decoded faster in bf16 on an AMX Xeon, against torch's own fp32 products, before the oneDNN
# layout (translation-cpu-main-job-model-bf16.md). Narrower models stay in fp32.
CPU_BF16_MIN_D_MODEL = {"greedy": 512, "beam": 512}


def named_dtype(name: str, int8: bool = False) -> torch.dtype:
    """The precision called `name` ("float32" or "bfloat16"), refused with int8, which quantizes fp32 weights."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}; choose auto, {', '.join(DTYPES)}.")
    if int8 and name != "float32":
        raise ValueError("int8=True quantizes fp32 weights; leave dtype at auto or float32 with it. On the command "
                         "line, int8 decoding is CTranslate2's: --ctranslate2 --compute_type int8.")
    return DTYPES[name]


def choose_dtype(requested: str, device: torch.device, d_model: int, *, num_beams: int = 1, int8: bool = False,
                 cuda_bf16: bool | None = None, cpu_bf16: bool | None = None) -> torch.dtype:
    """The precision to translate in. `requested` is "float32", "bfloat16" or "auto": bf16 where the hardware
    multiplies it natively and it is faster (GPUs with bf16; CPUs whose bf16 products are faster than fp32's,
    `cpu_multiplies_bf16`, for models at least `CPU_BF16_MIN_D_MODEL` wide), fp32 elsewhere and under int8 (which
    quantizes fp32 weights). `cuda_bf16` and `cpu_bf16` say what the hardware does (default: ask it)."""
    if requested != "auto":
        return named_dtype(requested, int8)
    if int8:
        return torch.float32
    if runs_as(device) == "cuda":  # a CPU rehearsing CUDA multiplies bf16 too, if slowly
        native = (device.type != "cuda" or torch.cuda.is_bf16_supported()) if cuda_bf16 is None else cuda_bf16
        return torch.bfloat16 if native else torch.float32
    if device.type == "cpu":
        if d_model < CPU_BF16_MIN_D_MODEL["beam" if num_beams > 1 else "greedy"]:
            return torch.float32  # too narrow for bf16 to pay: no need to time this CPU's products
        native = cpu_multiplies_bf16() if cpu_bf16 is None else cpu_bf16
        return torch.bfloat16 if native else torch.float32
    return torch.float32


# --------------------------------------------------------------------------------------------------
# Loading


# The PyTorch engine's own options (`load_engine`'s), with the values that mean "not given".
PYTORCH_OPTIONS = {"dtype": "auto", "int8": False, "decoding": "auto", "slots": None, "attn_implementation": None}


def pytorch_options(**options) -> dict[str, bool]:
    """Which options of the PyTorch engine `options` (`load_engine`'s keyword arguments) give, by flag: its own
    (`PYTORCH_OPTIONS`) and the decoding settings given that CTranslate2 does not take (not among
    `CTranslate2Engine.SETTINGS`)."""
    given = {f"--{name}": options.get(name, unset) != unset for name, unset in PYTORCH_OPTIONS.items()}
    return given | {f"--{name}": value is not None for name, value in options.items()
                    if name not in PYTORCH_OPTIONS and name not in CTranslate2Engine.SETTINGS}


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """An engine asked of `model_dir`, its settings resolved once (`engine_request`): what chooses the engine reads
    them (`vaswani.engine_choice.decide`), and `build_engine` builds it from them.

    `exported`: `model_dir` holds a CTranslate2 model (`model.bin`), not a checkpoint. `pytorch_only`: by flag, the
    options given that only the PyTorch engine takes (`pytorch_options`). `config` and `decoding`: a checkpoint's
    config and decoding settings with the caller's overrides, read and checked once, before any weight (None for a
    CTranslate2 model, whose settings are its own export's). `options`: `load_engine`'s keyword arguments as given."""

    model_dir: str
    device: torch.device
    exported: bool
    pytorch_only: dict[str, bool]
    config: object | None
    decoding: DecodingSettings | None
    options: dict


def engine_request(model_dir: str, *, device: str | torch.device | None = None, local_rank: int | None = None,
                   **options) -> EngineRequest:
    """The settings of an engine for `model_dir`, resolved once: the device (`choose_device`, with `local_rank`), the
    PyTorch engine's options given, and for a checkpoint its checks, config and decoding settings. `options`:
    `load_engine`'s keyword arguments (`ctranslate2`, `export_of` and `pack` aside, which `build_engine` takes)."""
    device = choose_device(device, local_rank)
    given = {name: value for name, value in options.items() if name != "compute_type"}
    exported = os.path.isfile(os.path.join(model_dir, CTRANSLATE2_WEIGHTS))
    config, decoding = (None, None) if exported else checked_checkpoint(model_dir, **options)
    return EngineRequest(model_dir, device, exported, pytorch_options(**given), config, decoding, options)


def checked_checkpoint(model_dir: str, **options):
    """The checkpoint in `model_dir`, checked (`check_checkpoint_dir`): its config and its decoding settings with the
    decoding settings among `options`, resolved, and refused if generate() could not honour them, before any weight
    is read."""
    check_checkpoint_dir(model_dir)
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
    overrides = {name: value for name, value in options.items()
                 if name not in PYTORCH_OPTIONS and name != "compute_type"}
    return config, checkpoint_decoding(model_dir, config, **overrides)


def load_engine(model_dir: str, *, device: str | torch.device | None = None, dtype: str | torch.dtype = "auto",
                int8: bool = False, decoding: str = "auto", slots: int | None = None, ctranslate2: bool | None = None,
                compute_type: str = "default", attn_implementation: str | None = None, export_of: str | None = None,
                pack: bool = True, **decoding_overrides) -> Engine:
    """The engine that translates with the checkpoint in `model_dir` (a directory or Hub id), or with the
    CTranslate2 model there: `build_engine(engine_request(...))`.

    `ctranslate2`: True, CTranslate2 decodes the export in `model_dir` (`model.bin`); False, the PyTorch checkpoint
    decodes; None (the default), whichever `model_dir` holds. `export_of`: the checkpoint that `model_dir` is the
    cached export of (`vaswani.engine_choice.load_default_engine`, which makes it when asked to decode a checkpoint
    with CTranslate2), named in the engine's description and its truncation warning.

    `device`: see `choose_device` (decided here, once, for either engine). For a PyTorch checkpoint: `dtype`,
    `int8`, `decoding`, `attn_implementation` and `pack` as `load_translator` takes them, `slots` as `TorchEngine` does; for
    a CTranslate2 model: `compute_type` (CTranslate2's: int8, int8_float32, float32, …; "default" keeps the format
    on disk), and those five are refused. `decoding_overrides`: `num_beams`, `max_new_tokens`, `max_source_length`,
    and for PyTorch any `generate()` option (`length_penalty`, `do_sample`, `temperature`…); one given as None is
    the checkpoint's `generation_config` (`vaswani.decoding_settings.DecodingSettings.resolve`).
    """
    options = {"dtype": dtype, "int8": int8, "decoding": decoding, "slots": slots, "compute_type": compute_type,
               "attn_implementation": attn_implementation, **decoding_overrides}
    if export_of is not None:
        return build_engine(engine_request(export_of, device=device, **options), ctranslate2=True, export_dir=model_dir,
                            pack=pack)
    return build_engine(engine_request(model_dir, device=device, **options), ctranslate2=ctranslate2, pack=pack)


def build_engine(request: EngineRequest, *, ctranslate2: bool | None = None, export_dir: str | None = None,
                 pack: bool = True) -> Engine:
    """The engine `request` asks for, as `load_engine` describes it: CTranslate2 where `ctranslate2` says so (None:
    where `request.model_dir` is a CTranslate2 model), decoding the model there or, for a checkpoint, its export in
    `export_dir`, the PyTorch engine's options refused by name; else the PyTorch checkpoint, with its linear layers
    laid out for oneDNN where `pack` (and torch can)."""
    options = dict(PYTORCH_OPTIONS, compute_type="default") | request.options
    decoding_overrides = {name: value for name, value in options.items()
                          if name not in PYTORCH_OPTIONS and name != "compute_type"}
    path, export_of = (request.model_dir, None) if export_dir is None else (export_dir, request.model_dir)
    if ctranslate2 is None:
        ctranslate2 = request.exported
    elif ctranslate2 and not os.path.isfile(os.path.join(path, CTRANSLATE2_WEIGHTS)):
        raise ValueError(f"{path} holds no CTranslate2 export (model.bin); export it with "
                         "scripts/export_ctranslate2.py, or translate with the scripts, which use a cached export.")
    if ctranslate2:
        if given := [flag for flag, value in (request.pytorch_only | {"pack=False": not pack}).items() if value]:
            raise ValueError(f"{', '.join(given)}: the PyTorch engine's; a CTranslate2 model takes --compute_type and "
                             f"{', '.join('--' + name for name in CTranslate2Engine.SETTINGS)}.")
        check_ctranslate2_dir(path)
        origin = os.path.join(path, "generation_config.json")
        exported = read_generation_config(path) if os.path.isfile(origin) else GenerationConfig()
        positions = "exported positions"
        if export_of is not None:
            # Sources are cut where the checkpoint's positions end, named as its PyTorch engine names them.
            positions = "learned positions" if is_learned(request.config) else "source positions"
        settings = DecodingSettings.resolve(exported, positions=exported_positions(path), learned=True,
                                            origin=origin, **decoding_overrides)
        CTranslate2Engine.check(settings)
        # CPU threads as torch uses them (its own default is a fixed count), so either engine gets the same cores.
        threads = torch.get_num_threads() if request.device.type == "cpu" else 0
        translator, tokenizer = checked_ctranslate2(path, request.device, options["compute_type"], threads)
        return CTranslate2Engine(translator, tokenizer, settings, path=path, export_of=export_of,
                                 positions=positions)
    if options["compute_type"] != "default":
        raise ValueError("--compute_type is CTranslate2's: add --ctranslate2 (--ctranslate2 --compute_type int8 "
                         "decodes a checkpoint in int8); the PyTorch engine takes --dtype.")
    config, decoding = request.config, request.decoding
    if request.exported:  # a PyTorch engine asked of a CTranslate2 directory: refused as no checkpoint, by name
        config, decoding = checked_checkpoint(request.model_dir, **request.options)
    dtype = checked_options(options["int8"], options["decoding"], options["dtype"])
    model, tokenizer = checked_translator(request.model_dir, request.device, config, options["attn_implementation"],
                                          options["int8"], options["decoding"], dtype, num_beams=decoding.num_beams,
                                          pack=pack)
    return TorchEngine(model, tokenizer, decoding, slots=options["slots"])


def checkpoint_decoding(model_dir: str, config, **decoding_overrides) -> DecodingSettings:
    """The decoding settings of the checkpoint in `model_dir` (whose config is `config`): its generation config with
    `decoding_overrides`, refused in one line where generate() could not honour them."""
    return DecodingSettings.resolve(
        read_generation_config(model_dir), positions=config.max_position_embeddings,
        learned=is_learned(config), origin=generation_config_name(model_dir), **decoding_overrides)


def engine_for_model(model, tokenizer, *, slots: int | None = None, **decoding_overrides) -> TorchEngine:
    """The engine for a model already in memory, on its own device and in its own precision (training's
    validation and test BLEU, tests): `load_engine`'s settings and checks, without the loading."""
    check_tokenizer_fits(model, tokenizer)
    return TorchEngine(model, tokenizer, model_decoding(model, **decoding_overrides), slots=slots)


def read_generation_config(model_dir: str) -> GenerationConfig:
    """The generation config saved in `model_dir` (a directory or Hub id), or a one-line error naming the file and
    what generate() would refuse in it, before any model is loaded."""
    try:
        return GenerationConfig.from_pretrained(model_dir)
    except (ValueError, OSError) as error:  # OSError: a Hub repository's file that is not JSON, or cannot be fetched
        raise ValueError(f"{generation_config_name(model_dir)}: {str(error).splitlines()[0]}") from error


def generation_config_name(model_dir: str) -> str:
    return os.path.join(model_dir, "generation_config.json") if os.path.isdir(model_dir) else \
        f"{model_dir}'s generation_config.json"


def load_translator(model_dir: str, device: str | torch.device | None = None, attn_implementation: str | None = None,
                    int8: bool = False, decoding: str = "auto", dtype: str | torch.dtype | None = "auto", *,
                    num_beams: int | None = None, pack: bool = True):
    """Model (eval mode, on `device`, see `choose_device`) and tokenizer from a directory or Hub id.

    `dtype`: a torch dtype, or a name that `choose_dtype` decides ("auto" or None, "float32", "bfloat16"), "auto"
    from the model's width in its config, read before the weights, and from `num_beams` (None: the checkpoint's
    generation_config). On a CPU, `int8` gives int8 linear layers (`vaswani.inference.quantize_for_cpu`); otherwise,
    with `pack`, fp32 weights multiply with oneDNN, laid out once (`pack_for_cpu`); and freed memory is reused,
    process-wide (`keep_freed_cpu_memory`). Reusing memory decoded faster with the same translations; oneDNN did on
    some CPUs and not on others, which scripts/choose_engine.py times (`vaswani.engine_choice`;
    benchmarks/results/README.md, "CPU linear layers" and "Freed memory reused"). `decoding` chooses the loop
    behind `generate()` (`DECODING_LOOPS`): "auto" is `decoding_loop`'s choice for the device (on a GPU "graphs",
    elsewhere the model's default: `generation_vaswani`'s lean loop on a CPU), "lean" the lean loop on any device (the
    same outputs as transformers' loop), "graphs" the lean loop with `cuda_graphs=True` (static shapes, each step a
    replayed CUDA graph on a GPU), "transformers" transformers' own loop (`lean_decoding=False`), "compiled" the lean
    loop with each step through torch.compile (`vaswani.inference.compile_decoding_steps`: once compiled, faster than
    the eager engine on one CPU and slower on another, benchmarks/results/README.md). The checks are the module
    docstring's.
    """
    dtype = checked_options(int8, decoding, dtype)  # a wrong choice is refused before any file is read
    check_checkpoint_dir(model_dir)
    return checked_translator(model_dir, choose_device(device), None, attn_implementation, int8, decoding, dtype,
                              num_beams=num_beams, pack=pack)


def checked_options(int8: bool, decoding: str, dtype: str | torch.dtype | None) -> str | torch.dtype:
    """`load_translator`'s `decoding` and `dtype`, refused where they are not one of its choices or not with `int8`;
    returns the dtype (a torch dtype, or "auto")."""
    if decoding not in DECODING_LOOPS:
        raise ValueError(f"decoding={decoding!r}; choose one of {', '.join(DECODING_LOOPS)}.")
    if int8 and decoding == "compiled":  # torch.compile cannot trace fbgemm's packed int8 weights
        raise ValueError("decoding='compiled' compiles fp32 or bf16 models, not int8 ones (int8=True).")
    dtype = "auto" if dtype is None else dtype
    return named_dtype(dtype, int8) if isinstance(dtype, str) and dtype != "auto" else dtype


def checked_translator(model_dir: str, device: torch.device, config, attn_implementation: str | None, int8: bool,
                       decoding: str, dtype: str | torch.dtype, *, num_beams: int | None = None, pack: bool = True):
    """`load_translator` for a checkpoint that `check_checkpoint_dir` has passed, with options that `checked_options`
    has passed, on `device` (resolved); `config` is the checkpoint's where it has been read (None: read here, where
    the precision needs it)."""
    import vaswani  # noqa: F401  (registers the Auto classes: no remote code needed)

    # The tokenizer first: it is cheap, and a missing one is refused before the weights are read.
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    try:
        if dtype == "auto":
            d_model = (config or AutoConfig.from_pretrained(model_dir, trust_remote_code=False)).d_model
            if num_beams is None:  # the checkpoint's, as every engine resolves it
                num_beams = DecodingSettings.resolve(read_generation_config(model_dir),
                                                     origin=generation_config_name(model_dir)).num_beams
            dtype = choose_dtype("auto", device, d_model, num_beams=num_beams, int8=int8)
        model, info = AutoModelForSeq2SeqLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attn_implementation, use_safetensors=True,
            trust_remote_code=False, output_loading_info=True,
        )
    except SafetensorError as error:  # a Hub checkpoint, whose files are checked only as they download
        raise damaged_weights(model_dir, error) from error
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        raise ValueError(f"Some tensors in {model_dir} do not have the shapes its config.json gives (see the load "
                         "report above); the weights and the config come from different models.") from error
    except OSError as error:  # no weights file, or neither a directory nor a reachable Hub repository
        raise FileNotFoundError(f"Cannot load a model from {model_dir}: {str(error).splitlines()[0]}") from error
    problems = {kind: sorted(keys) for kind, keys in info.items() if kind != "error_msgs" and keys}
    if problems:
        listed = "; ".join(f"{kind.replace('_', ' ')}: {', '.join(keys[:5])}{' …' if len(keys) > 5 else ''}"
                           for kind, keys in problems.items())
        raise ValueError(f"{model_dir} does not hold this model's weights ({listed}); it would run with random "
                         "weights in their place. Use the checkpoint's own directory, or re-save it.")
    check_tokenizer_fits(model, tokenizer)
    model = model.to(device).eval()
    on_cpu = runs_as(device) == "cpu"
    if int8:
        model = quantize_for_cpu(model)
    elif on_cpu and model.dtype == torch.float32 and pack:
        model = pack_for_cpu(model)
    if on_cpu:
        keep_freed_cpu_memory()
    decoding = decoding_loop(decoding, device)
    if decoding == "graphs":
        model = use_lean_decoding(model, cuda_graphs=True)
    elif decoding in ("lean", "compiled", "transformers"):
        model.generate = functools.partial(model.generate, lean_decoding=decoding != "transformers")
    if decoding == "compiled":
        model = compile_decoding_steps(model)
    return model, tokenizer


def decoding_loop(decoding: str, device: torch.device) -> str:
    """The loop `load_translator` sets up: `decoding` as asked, and for "auto" on a CUDA GPU the lean loop replayed as
    CUDA graphs, which translated more sentences a second than transformers' loop (`generate()`'s own default there)
    on every GPU that compared them (benchmarks/results/README.md, "What did each GPU measure?"). Elsewhere "auto"
    leaves `generate()` its default."""
    return "graphs" if decoding == "auto" and runs_as(device) == "cuda" else decoding


def load_ctranslate2(path: str, device: str | torch.device = "cpu", compute_type: str = "default", threads: int = 0):
    """A `ctranslate2.Translator` over a directory that `vaswani.export` wrote, and the tokenizer saved beside it
    (its `model_max_length` the exported position table's size). `device`:
    a torch device (cpu, cuda, cuda:1); `compute_type`: as `load_engine` takes it; `threads`: CPU threads, 0 = all
    cores. `load_engine` is the way in for translating; this is its CTranslate2 half."""
    check_ctranslate2_dir(path)
    return checked_ctranslate2(path, device, compute_type, threads)


def checked_ctranslate2(path: str, device: str | torch.device, compute_type: str, threads: int):
    """`load_ctranslate2` for a directory that `check_ctranslate2_dir` has passed."""
    import ctranslate2

    device = torch.device(device)
    translator = ctranslate2.Translator(path, device=device.type, device_index=device.index or 0,
                                        compute_type=compute_type, intra_threads=threads)
    with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as file:
        # A model converted from Marian keeps its sentencepiece tokenizer (vaswani.convert).
        marian = json.load(file).get("tokenizer_class") == "MarianTokenizer"
    tokenizer = (MarianTokenizer if marian else VaswaniTokenizer).from_pretrained(path)
    # The exported position table ends here: sources are truncated to it and outputs stop at it, where CTranslate2
    # would otherwise fail ("No position encodings are defined for positions >= …").
    tokenizer.model_max_length = exported_positions(path) or tokenizer.model_max_length
    return translator, tokenizer


def check_ctranslate2_dir(path: str) -> None:
    """`path` must be a directory that `vaswani.export` wrote."""
    if not os.path.isfile(os.path.join(path, CTRANSLATE2_WEIGHTS)):
        raise FileNotFoundError(f"{path} is not a CTranslate2 model directory (no {CTRANSLATE2_WEIGHTS}); make one "
                                "with scripts/export_ctranslate2.py.")
    check_checkpoint_files(path, weights=False)


def exported_positions(path: str) -> int | None:
    """The position table's size of the CTranslate2 model in `path`, as `vaswani.export` records it."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as file:
        return json.load(file).get("max_positions")


def check_checkpoint_dir(model_dir: str) -> None:
    """A local path must be a Vaswani checkpoint directory (anything else is tried as a Hub repository id)."""
    if not os.path.exists(model_dir):
        if os.path.isabs(model_dir) or model_dir.startswith(".") or model_dir.count("/") > 1:
            raise FileNotFoundError(f"Model directory {model_dir} does not exist.")
        return
    if not os.path.isdir(model_dir):
        raise NotADirectoryError(f"--model {model_dir} is a file; give the checkpoint directory.")
    check_checkpoint_files(model_dir, weights=False)  # config.json there, every JSON file whole
    model_type = read_json_object(os.path.join(model_dir, "config.json"), RECOPY, ("model_type",))["model_type"]
    if model_type != "vaswani":
        raise ValueError(f"{model_dir} holds a {model_type!r} model, not a Vaswani one; these tools load Vaswani "
                         "checkpoints only.")
    # Without generation_config.json the tools would decode with defaults instead of the checkpoint's own settings
    # (beams, length penalty, output length).
    if not os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        raise FileNotFoundError(f"{model_dir} has no generation_config.json, which holds the decoding settings the "
                                "model was trained and evaluated with; copy the whole checkpoint directory again, or "
                                "write one with `model.generation_config.save_pretrained(...)`.")
    check_weights(model_dir)
