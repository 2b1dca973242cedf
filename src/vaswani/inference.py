"""Fast decoding paths: `compile_for_generation(model)` (a static KV cache and a compiled decoding step, for any
device and decoding method, opt-in), `compile_decoding_steps(model)` (the lean loop's steps compiled with dynamic
shapes, opt-in: `decoding="compiled"`) and, for CPUs, fp32 linear layers through oneDNN with weights laid out once,
`pack_for_cpu(model)`, and a malloc that reuses freed memory, `keep_freed_cpu_memory()` (both applied by
`vaswani.loading` to every CPU engine), and int8 weights with `quantize_for_cpu(model)`.

Why: on a CPU, `generate()` is bound by fp32 matrix multiplications — the linear layers and the vocabulary-sized
output projection take most of its time (benchmarks/results/profile-decoding-cpu-after.md). `quantize_for_cpu` stores
every `nn.Linear` weight as int8 (one scale per output row) and quantizes each activation row on the fly (one scale per
row, that is per token), so the GEMMs run on fbgemm's int8 kernels with int32 accumulation. This is what
CTranslate2's `int8` compute type does. Because integer products accumulate exactly, a row's result depends on that
row alone, on any CPU: int8 makes a sentence's translation depend on its batch no more than fp32 does
(tests/test_decoding.py). Quantizing each row takes a few elementwise operators around the kernel: its speed against
fp32, and its BLEU, are in benchmarks/results/translation-cpu-int8-per-row.md and int8-per-row-bleu-cpu.md.

The decoding loop itself is made leaner by `vaswani.generation_vaswani` (the same outputs, less work per step),
which `generate()` uses with or without int8.

Not a checkpoint format: the model is loaded in fp32 as usual and quantized once, at load time. It is not shipped
with checkpoints (this module imports the model, not the other way round) and training never sees it.
"""

import ctypes
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn


def compile_for_generation(model: nn.Module) -> nn.Module:
    """Make `model.generate()` decode with a compiled step, for every decoding method (greedy, sampling, beam
    search); return `model` (changed in place, for inference only).

    * `generation_config.cache_implementation = "static"`: the self-attention keys/values are pre-allocated for
      `max_length` positions and written in place (beam search reorders them in place too, see
      `reorder_self_attention_cache`), so every decoding step has the same shapes and tensor addresses.
    * `model.forward` goes through `torch.compile(fullgraph=True)` (inductor: the elementwise work of a step fused
      into a few kernels, no Python between them). transformers compiles greedy and sampling decoding by itself once
      the cache is static, but not beam search; compiling `forward` covers all of them, so its own compilation is
      switched off to avoid doing it twice. CUDA graphs ("reduce-overhead") are not used: with torch 2.11 and
      transformers 5.23 the static cache's in-place length counter makes inductor skip them, and recording one
      crashed (benchmarks/results/gpu-notes.md).

    Outputs are those of the eager model (tests/test_fast_paths.py). The first calls with a new batch size or source
    length compile (seconds each) until torch marks those dimensions dynamic; later calls reuse the graph. It pays on
    a GPU, not in fp32 on a CPU: its sentences/s against the eager model's are in
    benchmarks/results/translation-cuda-h200.md and benchmarks/README.md, "Changes toward the CPU targets".
    """
    model.generation_config.cache_implementation = "static"
    model.generation_config.disable_compile = True  # ours below covers beam search too
    model.forward = torch.compile(model.forward, fullgraph=True)
    return model


# The most graphs `compile_decoding_steps` compiles for one model: greedy and beam search took 16 on the main job's
# model, in one process.
DECODING_GRAPHS = 64


def compile_decoding_steps(model: nn.Module) -> nn.Module:
    """Make each decoding step of the lean loop (`vaswani.generation_vaswani`) run through torch.compile with
    dynamic shapes; return `model` (changed in place, for inference only). `load_translator(decoding="compiled")`.

    Unlike `compile_for_generation`, the cache stays transformers' growing one and finished sentences still leave
    the batch, so a step attends to the positions decoded so far, not to `max_length` reserved ones. Inductor fuses
    the step's small operations (norms, residual adds, head reshapes, the attention's softmax) into a few kernels, no
    Python between them: on the main job's model, where those are a large share of a CPU step, greedy decoding and
    beam search ran faster than the fastest eager engine; at base size, where the products dominate, it gained
    nothing (benchmarks/results/README.md, "A compiled decoding step"). The price is compiling: the first batches
    of a process compile a handful of graphs (the first step, which projects the source, and later ones; with and
    without source padding; rows and cached positions as symbols), one to two and a half minutes on two cores, less
    once torch's on-disk cache holds them; so it pays on long files, not on a few sentences. The tokens are eager's
    where the sums run in the same order (the test checks them on a small model; 600 of 600 test sentences on the
    main job's model).

    Greedy and beam search in one process take more graphs than torch's default limit of 8 per function (beams
    attend as one query block per sentence, a batch can shrink to one row), after which torch would decode eagerly
    or, under `fullgraph`, fail; the limit is raised to `DECODING_GRAPHS` for these calls only.
    """
    compiled = torch.compile(model.forward, dynamic=True)

    @functools.wraps(model.forward)
    def forward(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=DECODING_GRAPHS):
            return compiled(*args, **kwargs)

    model.forward = forward
    return model


# oneDNN's linear operators, as torch's inductor calls them for frozen CPU models: private, and the only ones that take
# a weight laid out once in oneDNN's blocked format. `check_packing_operators` names them if a release changes them.
PACKING_OPERATORS = {"_reorder_linear_weight": ("self", "batch_size"),
                     "_linear_pointwise": ("X", "W", "B", "attr", "scalars", "algorithm")}


def check_packing_operators() -> list[str]:
    """The oneDNN operators `PackedLinear` calls that this torch lacks or has changed (empty: all as expected)."""
    problems = []
    for name, arguments in PACKING_OPERATORS.items():
        try:
            schema = getattr(torch.ops.mkldnn, name).default._schema
        except (AttributeError, RuntimeError):
            problems.append(f"torch.ops.mkldnn.{name} is missing")
            continue
        if tuple(argument.name for argument in schema.arguments) != arguments:
            problems.append(f"torch.ops.mkldnn.{name} now takes {schema}")
    return problems


def cpu_packs_linear_weights() -> bool:
    """Whether this torch can run `PackedLinear`'s oneDNN path (built with oneDNN, the operators as expected)."""
    return torch.backends.mkldnn.is_available() and not check_packing_operators()


class PackedLinear(nn.Module):
    """An `nn.Linear` for fp32 inference on a CPU that multiplies with oneDNN, its weight laid out once in oneDNN's
    blocked format instead of at every call.

    torch's fp32 `F.linear` on a CPU calls MKL's sgemm, which multiplies the decoding step's small matrices (tens to
    hundreds of rows) more slowly than oneDNN given a pre-laid-out weight: the output projection most of all, and
    it is the largest product of a step. What a translation gains is in benchmarks/results/README.md ("CPU linear
    layers"). The sums run in another order than MKL's, so the last bits of a result differ; and, as with MKL, they
    may depend on how many rows a call has (with torch 2.11's oneDNN on AVX2 they do, with 2.15's they did not).

    `weight` and `bias` stay the layer's own parameters (the same objects: the state dict, tied weights and
    `save_pretrained` are unchanged). The laid-out copy is made again whenever the weight changes (in place, or
    replaced), so it never goes stale. Where oneDNN is not the path (another device or dtype, autograd through the
    layer, or torch.compile) the layer is `F.linear`, exactly.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._packed, self._packed_from = None, None

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        source = (weight.data_ptr(), weight._version)
        if source != self._packed_from:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self._packed_from = source
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
        on_cpu = x.device.type == weight.device.type == "cpu"
        # Under torch.compile, inductor chooses the kernels (and lays CPU weights out itself when it freezes them);
        # Dynamo cannot trace the laid-out copy.
        if training or not on_cpu or {x.dtype, weight.dtype} != {torch.float32} or torch.compiler.is_compiling():
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), bias, "none", [], "")  # (..., out_features)

    def __getstate__(self):
        # oneDNN's laid-out tensor has no storage to copy or pickle; a copy lays its weight out again when first called.
        return {**self.__dict__, "_packed": None, "_packed_from": None}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_for_cpu(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` of `model` by a `PackedLinear`, in place; return `model`. Where this torch has no
    oneDNN path (`cpu_packs_linear_weights`), nothing changes."""
    if cpu_packs_linear_weights():
        replace_modules(model, nn.Linear, PackedLinear)
    return model


def replace_modules(model: nn.Module, kind: type, make) -> None:
    """Replace every module of `model` whose type is exactly `kind` by `make(module)`, in place."""
    for name, module in list(model.named_modules()):
        if type(module) is kind:
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, make(module))


def keep_freed_cpu_memory(largest_block_mib: int | None = 32) -> bool:
    """Make glibc's malloc reuse freed memory for large tensors (process-wide); return whether it took effect.

    By default glibc maps every block of more than a few hundred KiB fresh from the kernel and unmaps it when it is
    freed, so each new large tensor pays a page fault per 4 KiB page. Decoding allocates several vocabulary-sized
    tensors per step (the logits, their float copy, the log-probabilities: 16 MiB each for 32 sentences × 4 beams ×
    32k tokens), and beam search's log-softmax over them is measurably slower inside `generate()` than with freed
    memory reused (benchmarks/README.md, "Changes toward the CPU targets"). This raises the mapping threshold
    to `largest_block_mib` (glibc's maximum is 32 MiB on 64-bit) and keeps freed memory in the heap, which is what a
    caching allocator (CTranslate2's, or jemalloc/tcmalloc preloaded) gives.

    `largest_block_mib=None` maps no block at all, so tensors of any size reuse freed memory. That is for training:
    a step's vocabulary-sized tensors (2,000 tokens × 32k logits, 250 MiB each, and their gradients) are far above
    32 MiB, and their page faults slow training down (benchmarks/results/training-cpu-default-malloc.md against
    training-cpu.md). `scripts/train_translation.py` does this when it trains on a CPU.

    The cost: the process keeps its peak heap instead of returning it. Not glibc (musl, macOS): returns False and
    changes nothing.
    """
    try:
        # The process' own symbols, the C library's among them: no search for its file (ctypes.util.find_library
        # runs `ldconfig -p`, a process, at every call).
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library to load, or one without mallopt
        mallopt = None
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold, m_mmap_max = -1, -3, -4  # <malloc.h>
    if largest_block_mib is None:
        mapped = mallopt(m_mmap_max, 0)
    else:
        mapped = mallopt(m_mmap_threshold, largest_block_mib << 20)
    kept = mallopt(m_trim_threshold, 2**31 - 1)  # the most mallopt's int takes: 2 GiB of free heap stays
    return bool(mapped and kept)


# Activations are rounded to integers in [-63, 63] and handed to fbgemm with zero point 64, so its unsigned 8-bit inputs
# stay below 128: on CPUs without VNNI its kernels add pairs of u8·s8 products in 16 bits (vpmaddubsw), which
# saturate above 32,767, and 2 · 127 · 127 does not (torch.ao's `reduce_range` keeps the same 7 bits for that reason).
_ACTIVATION_LEVELS = 63


class Int8Linear(nn.Module):
    """An `nn.Linear` for CPU inference with int8 weights (symmetric, one scale per output channel) and int8
    activations with one scale per row (per token), computed at each call from the row's largest magnitude.

    The product runs on fbgemm (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`), given rows that are
    already integers and a scale of 1, so that its own quantization (adding the zero point) is exact; it accumulates
    in int32, which is exact too, and scales by the weight's channel scale. Then each row is multiplied by its own
    scale and the bias added, in separate operations: each result is rounded once, the same whichever kernel or
    vector width computes it, so an output row depends only on its input row and never on the other rows of the
    call. torch.ao's dynamic int8 linear (`quantize_dynamic`) takes one activation scale per call instead, from the
    whole tensor's range, so a sentence's numbers changed with its batch.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        quantized = torch.quantize_per_channel(weight, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0,
                                               torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(quantized, None)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)

    def weight(self) -> torch.Tensor:
        """The int8 weight as a per-channel quantized tensor (`q_per_channel_scales()`: one scale per output)."""
        return torch.ops.quantized.linear_unpack(self._packed)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (tokens, in_features)
        scale = (rows.abs().amax(dim=1, keepdim=True) / _ACTIVATION_LEVELS).clamp_min_(torch.finfo(x.dtype).tiny)
        integers = rows.div(scale).round_()  # (tokens, in_features), in [-63, 63]
        out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(integers, 1.0, _ACTIVATION_LEVELS + 1,
                                                                                   self._packed)
        out = out.mul_(scale)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_for_cpu(model: nn.Module) -> nn.Module:
    """Replace every `nn.Linear` of `model` by an `Int8Linear`, in place; return `model`.

    Weights are quantized per output channel (int8 with zero point 0; the row-wise scale keeps rare vocabulary rows of
    the output projection as precise as frequent ones); activations per row at run time. The output projection
    `lm_head` is included: with a vocabulary of tens of thousands it is a large share of the decoding FLOPs. Its
    weight is tied to the embedding table, but quantizing packs a *copy* of that weight, so the fp32 embeddings (and
    the model's other non-Linear parameters) are left exactly as they were. In place, like `model.to()`: quantize a
    `copy.deepcopy` to keep an fp32 model too. The result is for inference on CPU only (no autograd through int8
    weights, no `.to("cuda")`).

    Why fbgemm through torch's quantized operators: every other int8 kernel torch offers (torchao's eager int8,
    oneDNN's qlinear, `_int_mm`, `_weight_int8pack_mm`) measured slower than fbgemm on the main job's layer shapes
    (benchmarks/README.md; the comparison's script is benchmarks/bench_int8_kernels.py of commit e4633a9).
    """
    devices = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
    if devices - {"cpu"}:
        raise ValueError(f"int8 quantization runs on CPU only, but the model is on {', '.join(sorted(devices))}; "
                         "load it with device='cpu'. On the command line, int8 decoding is CTranslate2's, on a CPU: "
                         "--ctranslate2 --compute_type int8.")
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise ValueError(f"int8 quantization starts from fp32 weights, but the model's are {sorted(map(str, dtypes))}; "
                         "load it in fp32 (model.float()).")
    with warnings.catch_warnings():
        # torch marks its quantized-tensor functions deprecated in favour of torchao, whose eager int8 kernels measured
        # slower (above); these still run, so silence only their notice.
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel",
                                category=UserWarning)
        replace_modules(model, nn.Linear, Int8Linear)
    return model.eval()
