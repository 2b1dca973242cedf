"""For the scripts in scripts/ only: the arguments several of them share, and user errors turned into one line.
The library never imports this module; what the scripts call lives in the library (loading a checkpoint:
`vaswani.loading`; text files: `vaswani.files`)."""

import argparse
import functools
import sys

from .loading import DECODING_LOOPS

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


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """`--int8`, `--decoding` and `--slots`, for scripts that decode (the first two passed on to
    `vaswani.loading.load_translator`, `--slots` to `vaswani.translation.TorchEngine`)."""
    parser.add_argument("--int8", action="store_true", help="int8 dynamic quantization of the linear layers, and a "
                        "malloc that reuses freed memory (CPU only; faster decoding, see vaswani.inference)")
    parser.add_argument("--decoding", choices=DECODING_LOOPS, default="auto",
                        help="the loop behind generate(): auto (the default: lean on a CPU, transformers' elsewhere, "
                        "where it measured faster), lean (vaswani.generation_vaswani: the same outputs, less work per "
                        "step), graphs (lean with each step a replayed CUDA graph, for GPUs), or transformers (its own)")
    parser.add_argument("--slots", type=int, default=None,
                        help="decode continuously, this many sentences side by side, each finished one replaced at "
                        "once by the next (vaswani.generation_vaswani.decode_in_slots; each output as generate() "
                        "gives it for that sentence alone, up to its length plus 50 tokens); 0: in batches. Default: "
                        "the engine's (vaswani.translation.TorchEngine)")
