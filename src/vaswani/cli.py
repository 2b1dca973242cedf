"""What every command-line tool shares: loading a checkpoint for inference, reading input files, writing output
files, and turning user errors into one line."""

import argparse
import functools
import json
import os
import sys
from collections.abc import Iterable

import torch
from safetensors import SafetensorError
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from .configuration_vaswani import check_tokenizer_fits
from .decoding import use_lean_decoding
from .inference import keep_freed_cpu_memory, quantize_for_cpu

# Errors a user can fix from the message alone; anything else is a bug and keeps its traceback. A non-finite
# training loss (FloatingPointError) is here because its message names the step and the fix.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               PermissionError, KeyError, FloatingPointError)


def user_errors_exit(main):
    """Run `main`; a user error prints `error: <message>` on stderr and exits with status 2, not a traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except USER_ERRORS as error:
            message = error.args[0] if isinstance(error, KeyError) and error.args else error
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)

    return wrapper


def pick_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


DECODING_LOOPS = ("lean", "graphs", "transformers")


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """`--int8` and `--decoding`, for scripts that decode (passed on to `load_translator`)."""
    parser.add_argument("--int8", action="store_true", help="int8 dynamic quantization of the linear layers, and a "
                        "malloc that reuses freed memory (CPU only; faster decoding, see vaswani.inference)")
    parser.add_argument("--decoding", choices=DECODING_LOOPS, default="lean",
                        help="the loop behind generate(): lean (the default, vaswani.generation_vaswani: the same "
                        "outputs, less work per step), graphs (lean with each step a replayed CUDA graph, for GPUs), "
                        "or transformers (its own)")


def load_translator(model_dir: str, device: str | None = None, attn_implementation: str | None = None,
                    int8: bool = False, decoding: str = "lean", dtype: torch.dtype | None = None):
    """Model (eval mode, on `device`) and tokenizer from a directory or Hub id. In `dtype`, by default bf16 on GPUs
    that support it and fp32 elsewhere (`vaswani.file_translation.choose_dtype` decides it for a model); with
    `int8`, the CPU decoding path of `vaswani.inference` (int8 linear layers, freed memory reused). `decoding`
    chooses the loop behind `generate()` (`DECODING_LOOPS`): "lean" is the model's own (`generation_vaswani`, the
    same outputs as transformers' loop), "graphs" the same with `cuda_graphs=True` (static shapes, each step a
    replayed CUDA graph on a GPU), "transformers" transformers' own loop (`lean_decoding=False`).

    Stricter than `from_pretrained`, because a translation from partly random weights is a silent wrong result:
    only safetensors weights are read, no remote code runs, and a checkpoint that is not a Vaswani model, or whose
    weights are missing, unexpected, mismatched, truncated or corrupted, is a `ValueError` naming the problem; so is
    a tokenizer that is missing or does not fit the model (`check_tokenizer_fits`).
    """
    import vaswani  # noqa: F401  (registers the Auto classes: no remote code needed)

    if decoding not in DECODING_LOOPS:
        raise ValueError(f"decoding={decoding!r}; choose one of {', '.join(DECODING_LOOPS)}.")

    _check_checkpoint_dir(model_dir)
    device = pick_device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    try:
        model, info = AutoModelForSeq2SeqLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attn_implementation, use_safetensors=True,
            trust_remote_code=False, output_loading_info=True,
        )
    except SafetensorError as error:
        raise ValueError(f"The weights in {model_dir} are truncated or corrupted ({error}); copy or download the "
                         "checkpoint again.") from error
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
    elif decoding == "transformers":
        model.generate = functools.partial(model.generate, lean_decoding=False)
    return model, tokenizer


def _check_checkpoint_dir(model_dir: str) -> None:
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
    """The files a checkpoint is written with and the tools need, beyond config.json and the weights (whose absence
    `from_pretrained` reports): without generation_config.json the tools would decode with defaults instead of the
    checkpoint's own settings (beams, length penalty, output length); without one of several weight shards the
    model cannot load."""
    again = "copy the whole checkpoint directory again"
    if not os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        raise FileNotFoundError(f"{model_dir} has no generation_config.json, which holds the decoding settings the "
                                f"model was trained and evaluated with; {again}, or write one with "
                                "`model.generation_config.save_pretrained(...)`.")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [shard for shard in shards if not os.path.isfile(os.path.join(model_dir, shard))]
        if missing:
            raise FileNotFoundError(f"{model_dir} lacks {len(missing)} of the {len(shards)} weight shards that "
                                    f"model.safetensors.index.json lists ({', '.join(missing)}); {again}.")


def read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 text file, without their line ends; a decoding error names the file and the line."""
    with open(path, "rb") as f:
        return decode_lines((raw.removesuffix(b"\n") for raw in f), path)


def decode_lines(raw_lines: Iterable[bytes], name: str, first_line: int = 1) -> list[str]:
    """UTF-8 lines (ended at b"\n" only: U+2028 is not a line end) without a trailing \r; an undecodable line is a
    ValueError naming `name` and its line number (`first_line` is the number of the first)."""
    lines = []
    for number, raw in enumerate(raw_lines, first_line):
        try:
            lines.append(raw.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{name} is not UTF-8 text (line {number}: {error.reason}); convert it, e.g. with "
                             "`iconv -t utf-8`.") from error
    return lines


def write_atomically(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary sibling and a rename: the file is complete or absent."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def generation_limits(model, max_new_tokens: int | None) -> tuple[int | None, int | None]:
    """(max_source_length, max_new_tokens) that a model with learned positions can take: sources are truncated to
    its `max_position_embeddings` and the output stops there. Sinusoidal and rotary positions have no limit."""
    config = model.config
    if config.position_embedding_type != "learned":
        return None, max_new_tokens
    limit = config.max_position_embeddings - 1  # the decoder's start token takes position 0
    return config.max_position_embeddings, limit if max_new_tokens is None else min(max_new_tokens, limit)
