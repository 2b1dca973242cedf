"""What every command-line tool shares: loading a checkpoint for inference, and turning user errors into one line."""

import functools
import sys

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

# Errors a user can fix from the message alone; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError, KeyError)


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


def load_translator(model_dir: str, device: str | None = None, attn_implementation: str | None = None):
    """Model (eval mode, on `device`) and tokenizer from a directory or Hub id. bf16 on GPUs that support it."""
    import vaswani  # noqa: F401  (registers the Auto classes: no remote code needed)

    device = pick_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model.to(device).eval(), tokenizer
