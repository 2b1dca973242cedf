"""The int8 matrix-product kernels that a CPU `--int8` path could stand on, one layer at a time.

`--int8` (`vaswani.inference.quantize_for_cpu`) runs fbgemm through torch's quantized operators, which newer torch
releases mark deprecated. This measures it and each candidate that could replace it on the shapes of a checkpoint's linear layers
(attention projections, feed-forward in and out, the output projection over the vocabulary) at the row counts that
decoding gives them (a batch of sentences, or of sentences × beams), in microseconds per call, beside fp32 and
bf16, with each kernel's largest error against fp32 relative to the largest fp32 output, and whether its int8 products
saturate on this CPU (`saturating_kernels`):

* `Int8Linear`: `vaswani.inference.Int8Linear`, what `--int8` runs (fbgemm, the activations quantized per row by
  torch operations around the call);
* `torchao`: torchao's `Int8DynamicActivationInt8WeightConfig`, eager (the package's maintained successor; skipped
  when torchao is not installed);
* `onednn`: torch's oneDNN int8 linear (`torch.ops.onednn.qlinear_pointwise`, the kernel that inductor's x86 int8
  lowering calls) on plain int8 tensors, the activations quantized per tensor by torch operations before the call;
* `_int_mm`: `torch._int_mm` (int8 × int8 → int32) with per-row activation scales, as torchao's int8 path computes
  it, the scales applied after the product;
* `int8 weights only`: `torch.ops.aten._weight_int8pack_mm` (int8 weights, fp32 activations).

    python benchmarks/bench_int8_kernels.py --model outputs/en-fr-small --threads 2
    python benchmarks/bench_int8_kernels.py --threads 1 --rows 8,32,128      # the main job's shapes, no checkpoint
"""

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from vaswani.inference import Int8Linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Column, add_result_arguments, command_line, csv_of, pick_device, result_name, write_report  # noqa: E402

KERNELS = ("fp32", "bf16", "Int8Linear", "torchao", "onednn", "_int_mm", "int8 weights only")
# The main job's model (scripts/main_job.sh): d_model 256, d_ff 1,024, 8,000 tokens.
MAIN_JOB_SHAPES = {"d_model": 256, "d_ff": 1024, "vocab_size": 8000}


def layer_shapes(d_model: int, d_ff: int, vocab_size: int) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each kind of linear layer of a Vaswani encoder-decoder."""
    return {
        "attention projection": (d_model, d_model),
        "feed-forward in": (d_model, d_ff),
        "feed-forward out": (d_ff, d_model),
        "output projection": (d_model, vocab_size),
    }


def _per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weights with one scale per output channel, as all the int8 kernels here use them."""
    scale = weight.abs().amax(dim=1).clamp_min(1e-8) / 127
    return torch.clamp(torch.round(weight / scale[:, None]), -127, 127).to(torch.int8), scale


def kernels(linear: torch.nn.Linear, rows: int, names) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The kernels `names` (of KERNELS), each as a function of the fp32 input (rows, in_features) giving the fp32
    output, set up once. oneDNN's is left out where torch was built without it."""
    weight, bias = linear.weight.detach(), linear.bias.detach()
    out_features, in_features = weight.shape
    w8, w_scale = _per_channel_int8(weight)

    def bf16():
        w16, b16 = weight.bfloat16(), bias.bfloat16()
        return lambda x: F.linear(x.bfloat16(), w16, b16).float()

    def torchao():
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features))
        model.load_state_dict({"0.weight": weight, "0.bias": bias})
        quantize_(model, Int8DynamicActivationInt8WeightConfig())
        return model

    def onednn():
        packed = torch.ops.onednn.qlinear_prepack(w8, [rows, in_features])
        w_zero = torch.zeros(out_features, dtype=torch.int32)

        def call(x):  # asymmetric uint8 activations, one scale and zero point per tensor
            low, high = torch.aminmax(x)
            scale = (high - low).clamp_min(1e-8) / 255
            zero = torch.round(-low / scale).to(torch.int32)
            qx = torch.clamp(torch.round(x / scale) + zero, 0, 255).to(torch.uint8)
            return torch.ops.onednn.qlinear_pointwise.tensor(qx, scale, zero, packed, w_scale, w_zero, bias, 1.0, 0,
                                                             torch.float32, "none", [], "")

        return call

    def int_mm(x):  # symmetric int8 activations, one scale per row
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
        qx = torch.round(x / x_scale).to(torch.int8)
        return torch._int_mm(qx, w8.t()) * x_scale * w_scale + bias

    makers = {
        "fp32": lambda: lambda x: F.linear(x, weight, bias),
        "bf16": bf16,
        "Int8Linear": lambda: Int8Linear(linear),
        "torchao": torchao,
        "onednn": onednn,
        "_int_mm": lambda: int_mm,
        "int8 weights only": lambda: lambda x: torch.ops.aten._weight_int8pack_mm(x, w8, w_scale) + bias,
    }
    if not hasattr(torch.ops.onednn, "qlinear_prepack"):  # torch built without oneDNN
        names = [name for name in names if name != "onednn"]
    return {name: makers[name]() for name in names}


# x86 int8 kernels multiply unsigned by signed bytes. With VNNI (vpdpbusd) they add the products in 32 bits; without
# it (AVX2, or AVX-512 before VNNI) they use vpmaddubsw, which adds each pair of products in 16 bits and saturates
# above 32,767: the same reason vaswani.inference keeps its activations in [-63, 63]. Which instructions a kernel
# runs depends on the CPU and on ONEDNN_MAX_CPU_ISA / FBGEMM_ENABLE_INSTRUCTIONS, and torch does not say, so each
# kernel is asked: on the probe below, int8 rounding is exact, and a kernel off by more than this saturates.
SATURATION_ERROR = 0.01


def saturating_kernels(names) -> set[str]:
    """Those of the kernels `names` that saturate on this CPU: their error on a layer whose weights are all one,
    given inputs of zeros and ones, where every kernel's int8 values are exact (127 for the weights; 255 or 127 for
    the ones) and every pair of byte products (2 · 255 · 127, or 2 · 127 · 127 after the +128 shift that s8 · s8
    kernels apply without VNNI) overflows 16 bits."""
    linear = torch.nn.Linear(256, 16)
    with torch.no_grad():
        linear.weight.fill_(1.0)
        linear.bias.zero_()
    x = torch.ones(4, 256)
    x[:, 0] = 0  # the asymmetric kernels' zero point then maps 0 to 0 and 1 to 255
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        made = kernels(linear, len(x), names)
        return {name for name, fn in made.items()
                if ((fn(x) - expected).abs().max() / expected.abs().max()).item() > SATURATION_ERROR}


def microseconds(fn: Callable[[], object], repeats: int, min_seconds: float) -> float:
    """The fastest of `repeats` timings of `fn`, each a loop of at least `min_seconds` (warm: one untimed call)."""
    fn()
    calls = 1
    while True:  # enough calls per timing that the clock's resolution does not matter
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            break
        calls *= 2
    best = elapsed / calls
    for _ in range(repeats - 1):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def run(args: argparse.Namespace, argv) -> Path:
    device = pick_device("cpu", args.threads)
    torch.manual_seed(args.seed)
    if args.model:
        from vaswani import VaswaniConfig

        config = VaswaniConfig.from_pretrained(args.model)
        dims = {"d_model": config.d_model, "d_ff": config.d_ff, "vocab_size": config.vocab_size}
    else:
        dims = MAIN_JOB_SHAPES
    saturating = saturating_kernels(args.kernels)
    rows = []
    for layer, (in_features, out_features) in layer_shapes(**dims).items():
        linear = torch.nn.Linear(in_features, out_features)
        if args.model:  # the checkpoint's own weights of that kind (the first such layer of the decoder)
            linear.load_state_dict(_checkpoint_linear(args.model, layer).state_dict())
        for count in args.rows:
            x = torch.randn(count, in_features)
            with torch.inference_mode():
                made = kernels(linear, count, args.kernels)
                reference = made["fp32"](x) if "fp32" in made else F.linear(x, linear.weight, linear.bias)
                timings = {name: microseconds(lambda fn=fn: fn(x), args.repeats, args.min_seconds)
                           for name, fn in made.items()}
                errors = {name: ((fn(x) - reference).abs().max() / reference.abs().max()).item()
                          for name, fn in made.items()}
            for name in made:
                rows.append({
                    "layer": layer, "in_features": in_features, "out_features": out_features, "rows": count,
                    "kernel": name, "microseconds": timings[name],
                    "x_int8": timings["Int8Linear"] / timings[name] if "Int8Linear" in timings else None,
                    "x_fp32": timings["fp32"] / timings[name] if "fp32" in timings else None,
                    "relative_error": errors[name], "saturates": name in saturating,
                })
                print(rows[-1], flush=True)
    columns = [
        Column("layer", "layer"),
        Column("in_features", "in"),
        Column("out_features", "out"),
        Column("rows", "rows"),
        Column("kernel", "kernel"),
        Column("microseconds", "µs per call", "{:.1f}"),
        Column("x_fp32", "speed × fp32", "{:.2f}"),
        Column("x_int8", "speed × Int8Linear", "{:.2f}"),
        Column("relative_error", "max error ÷ max output", "{:.1e}"),
        Column("saturates", "16-bit sums saturate"),
    ]
    source = (f"the weights of checkpoint {args.model}" if args.model else
              "random weights at the main job's shapes (d_model 256, d_ff 1,024, 8,000 tokens)")
    notes = [
        f"One linear layer of each kind, {source}; inputs are random normal rows. µs per call: the fastest of "
        f"{args.repeats} timed loops of at least {args.min_seconds} s each, in one process, after one warm call.",
        "speed × Int8Linear above 1 is faster than what --int8 runs. Error: the largest absolute difference "
        "from the fp32 output, divided by the largest fp32 output.",
        "Every int8 kernel uses the same symmetric per-output-channel int8 weights; torchao and onednn quantize "
        "activations per tensor and call, Int8Linear and _int_mm per row.",
        "16-bit sums saturate: True where the kernel adds pairs of int8 products in 16 bits on this CPU (without VNNI, "
        "or with ONEDNN_MAX_CPU_ISA / FBGEMM_ENABLE_INSTRUCTIONS set below it), found on a probe layer where int8 "
        "rounding is exact; its error is then that of the saturation, not int8 rounding's. Int8Linear keeps 7-bit "
        f"activations for that reason. ATen's CPU capability: {torch.backends.cpu.get_cpu_capability()}"
        + "".join(f"; {name}={os.environ[name]}" for name in ("ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS")
                  if name in os.environ) + ".",
    ]
    if "torchao" in args.kernels:
        import torchao

        notes.append(f"torchao {torchao.__version__}, eager (no torch.compile).")
    json_path, _ = write_report(result_name(args, "int8-kernels", device), "int8 linear kernels on CPU",
                                command_line(__file__, argv), device, vars(args) | dims, rows, columns, notes,
                                args.results_dir)
    return json_path


def _checkpoint_linear(model_dir: str, layer: str) -> torch.nn.Linear:
    """The first decoder layer's linear of the given kind, from a trained checkpoint (fp32)."""
    from vaswani import VaswaniForConditionalGeneration

    model = VaswaniForConditionalGeneration.from_pretrained(model_dir).float()
    if layer == "output projection":
        return _with_bias(model.lm_head)
    linears = [module for module in model.model.decoder.modules() if isinstance(module, torch.nn.Linear)]
    shape = {"attention projection": (model.config.d_model, model.config.d_model),
             "feed-forward in": (model.config.d_ff, model.config.d_model),
             "feed-forward out": (model.config.d_model, model.config.d_ff)}[layer]
    return _with_bias(next(module for module in linears if tuple(module.weight.shape) == shape))


def _with_bias(linear: torch.nn.Linear) -> torch.nn.Linear:
    """A copy with a bias (zeros where the layer has none), so that every kernel computes the same function."""
    copy = torch.nn.Linear(linear.in_features, linear.out_features)
    with torch.no_grad():
        copy.weight.copy_(linear.weight)
        copy.bias.copy_(linear.bias if linear.bias is not None else torch.zeros(linear.out_features))
    return copy


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a trained checkpoint whose shapes and weights to use; default: "
                        "the main job's shapes, random weights")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads; default: all cores")
    parser.add_argument("--rows", type=csv_of(int), default=[8, 32, 128],
                        help="rows per call: sentences (greedy) or sentences × beams still decoding")
    parser.add_argument("--kernels", type=csv_of(str, KERNELS), default=list(KERNELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min_seconds", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    add_result_arguments(parser)
    return parser


def main(argv=None) -> Path:
    args = build_parser().parse_args(argv)
    if "torchao" in args.kernels and importlib.util.find_spec("torchao") is None:
        args.kernels = [name for name in args.kernels if name != "torchao"]
        print("torchao is not installed: its rows are left out", flush=True)
    return run(args, argv)


if __name__ == "__main__":
    main()
