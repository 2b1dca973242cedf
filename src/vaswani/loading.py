"""A checkpoint → a model and tokenizer ready to translate, with the checks, the device and the precision decided
in one place for every tool.

    model, tokenizer = load_translator("outputs/en-fr")                      # a GPU if there is one, else the CPU
    model, tokenizer = load_translator("outputs/en-fr", "cpu", dtype="auto", num_beams=4)  # bf16 where it is faster
    model, tokenizer = load_translator("outputs/en-fr", "cpu", int8=True)    # int8 CPU decoding

Stricter than `from_pretrained`, because a translation from partly random weights is a silent wrong result: only
safetensors weights are read, no remote code runs, and a checkpoint that is not a Vaswani model, or whose weights
or files are missing, unexpected, mismatched, truncated or corrupted, is an error naming the problem; so is a
tokenizer that is missing or does not fit the model.
"""

import functools
import json
import os

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

from .checkpoints import check_weights, damaged_weights
from .configuration_vaswani import check_tokenizer_fits
from .decoding import use_lean_decoding
from .inference import keep_freed_cpu_memory, quantize_for_cpu

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DECODING_LOOPS = ("auto", "lean", "graphs", "transformers")


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


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AMX or AVX512-BF16), which oneDNN uses for bf16 GEMMs;
    without them bf16 is converted to fp32 around every product and is slower than fp32. From the kernel's CPU
    flags (torch does not say); False where there are none to read (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


# The narrowest models for which bf16 weights decoded faster than fp32 on an AMX CPU, greedy and with beam search:
# at d_model 512 (base, OPUS-MT's shape) both ran faster in bf16; at the main job's width, 256, beam search did and
# greedy did not (the bf16 rows of benchmarks/results/translation-cpu-*bf16*.md). Narrower models stay in fp32.
CPU_BF16_MIN_D_MODEL = {"greedy": 512, "beam": 256}


def named_dtype(name: str, int8: bool = False) -> torch.dtype:
    """The precision called `name` ("float32" or "bfloat16"), refused with int8, which quantizes fp32 weights."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}; choose auto, {', '.join(DTYPES)}.")
    if int8 and name != "float32":
        raise ValueError("--int8 quantizes fp32 weights; leave --dtype at auto or float32 with it.")
    return DTYPES[name]


def choose_dtype(requested: str, device: torch.device, d_model: int, *, num_beams: int = 1, int8: bool = False,
                 cuda_bf16: bool | None = None, cpu_bf16: bool | None = None) -> torch.dtype:
    """The precision to translate in. `requested` is "float32", "bfloat16" or "auto": bf16 where the hardware
    multiplies it natively and it is faster (GPUs with bf16; CPUs with AMX or AVX512-BF16 for models at least
    `CPU_BF16_MIN_D_MODEL` wide), fp32 elsewhere and under int8 (which quantizes fp32 weights). `cuda_bf16` and
    `cpu_bf16` say what the hardware does (default: ask it)."""
    if requested != "auto":
        return named_dtype(requested, int8)
    if int8:
        return torch.float32
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
        return torch.bfloat16 if native else torch.float32
    if device.type == "cpu":
        native = cpu_multiplies_bf16() if cpu_bf16 is None else cpu_bf16
        wide_enough = d_model >= CPU_BF16_MIN_D_MODEL["beam" if num_beams > 1 else "greedy"]
        return torch.bfloat16 if native and wide_enough else torch.float32
    return torch.float32


# --------------------------------------------------------------------------------------------------
# Loading


def load_translator(model_dir: str, device: str | torch.device | None = None, attn_implementation: str | None = None,
                    int8: bool = False, decoding: str = "auto", dtype: str | torch.dtype | None = None, *,
                    num_beams: int = 1):
    """Model (eval mode, on `device`, see `choose_device`) and tokenizer from a directory or Hub id.

    `dtype`: a torch dtype; a name that `choose_dtype` decides ("auto", "float32", "bfloat16"), "auto" from the
    model's width in its config, read before the weights, and from `num_beams`; or None: bf16 on GPUs that support
    it, fp32 elsewhere (no CPU bf16). With `int8`, the CPU decoding path of `vaswani.inference` (int8 linear layers,
    freed memory reused). `decoding` chooses the loop behind `generate()` (`DECODING_LOOPS`): "auto" is the model's
    default (`generation_vaswani`: the lean loop on a CPU, transformers' elsewhere), "lean" the lean loop on any
    device (the same outputs as transformers' loop), "graphs" the lean loop with `cuda_graphs=True` (static shapes,
    each step a replayed CUDA graph on a GPU), "transformers" transformers' own loop (`lean_decoding=False`). The checks are the module docstring's.
    """
    import vaswani  # noqa: F401  (registers the Auto classes: no remote code needed)

    if decoding not in DECODING_LOOPS:
        raise ValueError(f"decoding={decoding!r}; choose one of {', '.join(DECODING_LOOPS)}.")
    if isinstance(dtype, str) and dtype != "auto":
        dtype = named_dtype(dtype, int8)  # a wrong choice is refused before any file is read

    check_checkpoint_dir(model_dir)
    device = choose_device(device)
    if dtype is None:
        dtype = choose_dtype("auto", device, 0, int8=int8, cpu_bf16=False)
    try:
        if dtype == "auto":
            d_model = AutoConfig.from_pretrained(model_dir, trust_remote_code=False).d_model
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
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    check_tokenizer_fits(model, tokenizer)
    model = model.to(device).eval()
    if int8:
        model = quantize_for_cpu(model)
        keep_freed_cpu_memory()
    if decoding == "graphs":
        model = use_lean_decoding(model, cuda_graphs=True)
    elif decoding in ("lean", "transformers"):
        model.generate = functools.partial(model.generate, lean_decoding=decoding == "lean")
    return model, tokenizer


def check_checkpoint_dir(model_dir: str) -> None:
    """A local path must be a Vaswani checkpoint directory (anything else is tried as a Hub repository id)."""
    if not os.path.exists(model_dir):
        if os.path.isabs(model_dir) or model_dir.startswith(".") or model_dir.count("/") > 1:
            raise FileNotFoundError(f"Model directory {model_dir} does not exist.")
        return
    if not os.path.isdir(model_dir):
        raise NotADirectoryError(f"--model {model_dir} is a file; give the checkpoint directory.")
    config = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"{model_dir} has no config.json, so it is not a (complete) checkpoint directory.")
    try:
        with open(config, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config} is not valid JSON ({error}).") from error
    if model_type != "vaswani":
        raise ValueError(f"{model_dir} holds a {model_type!r} model, not a Vaswani one; these tools load Vaswani "
                         "checkpoints only.")
    _check_checkpoint_files(model_dir)


def _check_checkpoint_files(model_dir: str) -> None:
    """The files a checkpoint is written with and the tools need, beyond config.json: without
    generation_config.json the tools would decode with defaults instead of the checkpoint's own settings (beams,
    length penalty, output length); the weights must all be there, complete (`checkpoints.check_weights`), before
    any is read."""
    if not os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        raise FileNotFoundError(f"{model_dir} has no generation_config.json, which holds the decoding settings the "
                                "model was trained and evaluated with; copy the whole checkpoint directory again, or "
                                "write one with `model.generation_config.save_pretrained(...)`.")
    check_weights(model_dir)
