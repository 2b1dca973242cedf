"""For the scripts in scripts/ only: the arguments several of them share, and user errors turned into one line.
The library never imports this module; what the scripts call lives in the library (loading a checkpoint:
`vaswani.loading`; text files: `vaswani.files`)."""

import argparse
import functools
import math
import sys

from .engine_choice import EngineChoice, load_default_engine
from .files import ClosedOutputError, DiskFullError
from .loading import DECODING_LOOPS, DTYPES
from .peers import PeerLost
from .preemption import Preempted

# Errors a user can fix from the message alone; anything else is a bug and keeps its traceback. A non-finite
# training loss (FloatingPointError) is here because its message names the step and the fix; a full disk
# (DiskFullError) and an output whose reader has gone (ClosedOutputError) because they name it and what it got.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               PermissionError, KeyError, FloatingPointError, DiskFullError, ClosedOutputError)


def user_errors_exit(main):
    """Run `main`; a user error prints `error: <message>` on stderr and exits with status 2, not a traceback. A run
    stopped by SIGTERM or SIGINT (`Preempted`) prints how to resume it and exits as the signal would have it
    (143, 130); one whose launch lost another process (`PeerLost`) prints which and what is kept, status 1."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except Preempted as stopped:
            print(stopped, file=sys.stderr)
            sys.exit(stopped.exit_status)
        except PeerLost as lost:
            print(f"error: {lost}", file=sys.stderr)
            sys.exit(lost.exit_status)
        except USER_ERRORS as error:
            message = error.args[0] if isinstance(error, KeyError) and error.args else error
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)

    return wrapper


def positive_int(text: str) -> int:
    """An argparse `type` for counts and sizes: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse `type` for counts where 0 means none or off: a whole number of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def finite_float(text: str) -> float:
    """An argparse `type` for a real number (no nan or inf)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse `type` for a real number above 0 (a temperature)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def probability(text: str) -> float:
    """An argparse `type` for a probability mass in (0, 1] (nucleus sampling's top_p)."""
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, got {text}")
    return value


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, for scripts that decode: where the model runs (`--device`, `--dtype`,
    `--decoding`, `--slots`, `--ctranslate2`, `--compute_type`) and how it decodes (`--num_beams`,
    `--max_new_tokens`, `--length_penalty`), all passed on to `vaswani.engine_choice.load_default_engine` by
    `engine_from_args`. A decoding setting left out is the checkpoint's (its generation_config.json)."""
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available; "
                        "under torchrun or accelerate launch, each process's own GPU)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="precision of the PyTorch model (default auto: bf16 where the hardware multiplies it "
                        "natively and it is faster, see vaswani.loading.choose_dtype; fp32 elsewhere)")
    parser.add_argument("--decoding", choices=DECODING_LOOPS, default="auto",
                        help="the loop behind generate(): auto (the default: graphs on a CUDA GPU, lean on a CPU, "
                        "transformers' elsewhere, each where it measured fastest), lean (vaswani.generation_vaswani: "
                        "the same outputs, less work per step), compiled (lean with each step through "
                        "torch.compile, after one to two and a half minutes of compiling: 1.28 / 1.13 x the eager "
                        "engine's sentences/s (greedy / beam 4) on an Intel Xeon, 0.87 / 0.79 x on an AMD EPYC of "
                        "family 26; benchmarks/results/README.md), graphs (lean with each step a replayed CUDA "
                        "graph, for GPUs), or transformers (its own)")
    parser.add_argument("--slots", type=non_negative_int, default=None,
                        help="decode continuously, this many sentences side by side, each finished one replaced at "
                        "once by the next (vaswani.slots.decode_in_slots; each output as generate() "
                        "gives it for that sentence alone, up to its length plus 50 tokens). Default: in batches, "
                        "which measured faster on a CPU and, at forced lengths, on a GPU (benchmarks/results/"
                        "README.md); the GPU plan's translation-trained stage compares them on a trained model")
    parser.add_argument("--ctranslate2", action=argparse.BooleanOptionalAction, default=None,
                        help="CTranslate2 decodes: --model's if it is an export (scripts/export_ctranslate2.py), else "
                        "the checkpoint's float32 export, made once and cached (rebuilt when the weights change). "
                        "--no-ctranslate2: the PyTorch checkpoint decodes, never exported or timed. Default: an "
                        "export decodes with CTranslate2; a checkpoint on a CPU with the engine that "
                        "scripts/choose_engine.py recorded beside it for this machine, else with PyTorch "
                        "(vaswani.engine_choice)")
    parser.add_argument("--compute_type", default="default",
                        help="with a CTranslate2 model: int8, int8_float32, float32, … (default: the format on disk)")
    add_search_arguments(parser)


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engine decodes (`--num_beams`, `--max_new_tokens`, `--length_penalty`); a setting left out is the
    checkpoint's (its generation_config.json)."""
    parser.add_argument("--num_beams", type=positive_int, default=None,
                        help="beam size (default: the checkpoint's generation config; 1 with --do_sample)")
    parser.add_argument("--max_new_tokens", type=positive_int, default=None,
                        help="longest output in tokens (default: the checkpoint's generation config's, else each "
                        "source's length plus 50); never past a learned position table")
    parser.add_argument("--length_penalty", type=finite_float, default=None,
                        help="beam search's length penalty (generate()'s: scores divided by length**penalty); "
                        "default: the checkpoint's generation config")


def engine_from_args(args: argparse.Namespace, local_rank: int | None = None, resumed: dict | None = None,
                     **decoding_options):
    """`vaswani.engine_choice.load_default_engine` over `--model` and the flags of `add_decoding_arguments`;
    `local_rank` (this process's GPU under a launcher, where `--device` is auto) and `decoding_options` (a script's
    own `generate()` flags) are passed on as they are. `resumed`: the recorded settings of the run this one resumes;
    where `--ctranslate2` leaves the engine open, that run's choice decodes again (a choice recorded since would
    otherwise change the engine, and the resume be refused). The engine and why it was chosen go to stderr in one
    line."""
    choice = (resumed or {}).get("engine_choice") if args.ctranslate2 is None else None
    engine = load_default_engine(args.model, device=args.device, local_rank=local_rank, dtype=args.dtype,
                                 decoding=args.decoding, slots=args.slots, ctranslate2=args.ctranslate2,
                                 compute_type=args.compute_type, num_beams=args.num_beams,
                                 max_new_tokens=args.max_new_tokens, length_penalty=args.length_penalty,
                                 choice=choice, **decoding_options)
    print(f"engine: {engine.description}; chosen: {EngineChoice(**engine.choice).line}", file=sys.stderr,
          flush=True)
    return engine
