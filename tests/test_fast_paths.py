"""The speed paths compute what the reference path computes (issue 4: "outputs stay identical to the reference path
(eager, no packing) within dtype tolerance").

* Training under `torch.compile` (what `--torch_compile` and the benchmark's `vaswani-compiled` run): the same loss
  and the same gradients as the eager model, across batches of different shapes (automatic dynamic shapes).
* Generation after `vaswani.inference.compile_for_generation` (static KV cache + compiled decoding step, CUDA
  graphs on GPU): the same tokens as eager `generate()`, greedy and beam search; beam search reorders only the
  self-attention cache, in place when static.
* Input checks that cost no host sync on accelerators still catch bad ids.

Each runs on the CPU (compilation makes them slow: a minute or so in all) and, where CUDA is available, on the GPU too.
"""

import copy
import importlib.util
import subprocess
import sys

import pytest
import torch

from vaswani import VaswaniConfig, VaswaniForCausalLM, VaswaniForConditionalGeneration
from vaswani.inference import compile_for_generation
from vaswani.trainer import mark_sizes_dynamic
from vaswani.modeling_vaswani import check_ids

from conftest import padded_batch

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)
DEVICES = ["cpu", CUDA]


def _config(**overrides) -> VaswaniConfig:
    return VaswaniConfig.tiny(dropout=0.0, **overrides)


def _translation_batch(config, source_lengths, target_lengths, seed, device):
    source, source_mask = padded_batch(config, source_lengths, seed=seed)
    labels, target_mask = padded_batch(config, target_lengths, seed=seed + 1)
    labels = labels.masked_fill(target_mask == 0, -100)
    return {"input_ids": source.to(device), "attention_mask": source_mask.to(device), "labels": labels.to(device)}


@pytest.fixture
def exact_matmuls():
    """fp32 comparisons on CUDA: no TF32 in either path."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["paper", "modern"])
def test_compiled_training_step_matches_eager(device, variant, exact_matmuls, single_thread):
    """Up to a minute on a CPU: inductor compiles the forward and backward and builds their C++ kernels. The batch
    and length dimensions are marked dynamic at the first batch, as `VaswaniTrainer` marks them before its first
    step: one graph then serves all three shapes, with no recompilation."""
    from torch._dynamo.utils import counters

    config = _config() if variant == "paper" else _config(
        norm_first=True, norm_type="rmsnorm", position_embedding_type="rope", ffn_activation="swiglu", num_key_value_heads=2
    )
    config.label_smoothing = 0.1
    eager = VaswaniForConditionalGeneration(config).to(device).train()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model)
    torch._dynamo.reset()  # graphs of earlier tests could otherwise serve these steps
    counters.clear()
    for step, (sources, targets) in enumerate([([7, 5, 3], [6, 4, 2]), ([9, 8, 2, 4], [5, 7, 3, 3]), ([4, 11], [9, 2])]):
        batch = _translation_batch(config, sources, targets, seed=10 * step, device=device)
        if step == 0:
            mark_sizes_dynamic(batch)
        expected = eager(**batch).loss
        actual = compiled(**batch).loss
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        expected.backward()
        actual.backward()
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
            p.grad = q.grad = None
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_beams", [1, 4])
def test_compiled_generation_matches_eager(device, num_beams, exact_matmuls, single_thread):
    from torch._dynamo.utils import counters

    config = _config()
    model = VaswaniForConditionalGeneration(config).to(device).eval()
    fast = compile_for_generation(copy.deepcopy(model))
    assert fast.generation_config.cache_implementation == "static"
    kwargs = {"num_beams": num_beams, "do_sample": False, "max_new_tokens": 7, "eos_token_id": None}
    torch._dynamo.reset()  # forget graphs compiled by earlier tests, which could otherwise be reused
    graphs = counters["stats"]["unique_graphs"]
    # Batches of different shapes: the compiled step must serve all of them (recompiling, then dynamic).
    for step, lengths in enumerate([[9, 6, 4], [5, 12], [3, 8, 8, 2]]):
        source, mask = padded_batch(config, lengths, seed=step)
        source, mask = source.to(device), mask.to(device)
        expected = model.generate(input_ids=source, attention_mask=mask, **kwargs)
        actual = fast.generate(input_ids=source, attention_mask=mask, **kwargs)
        assert torch.equal(actual, expected)
    assert counters["stats"]["unique_graphs"] > graphs, "generate() did not go through the compiled forward"


def test_beam_search_reorders_only_self_attention_in_place():
    """Cross-attention keys/values are equal across the beams of a sentence, so they are never reordered; a static
    self-attention cache is reordered in place (same storage: what a CUDA graph reads)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache

    config = _config()
    model = VaswaniForConditionalGeneration(config).eval()
    beam_idx = torch.tensor([1, 0, 0, 1])
    for self_cache in (DynamicCache(config=config), StaticCache(config=config, max_cache_len=6)):
        cache = EncoderDecoderCache(self_cache, DynamicCache(config=config))
        keys = torch.randn(4, config.num_key_value_heads, 3, config.head_dim)
        cache.self_attention_cache.update(keys, keys + 1, 0, {"cache_position": torch.arange(3)})
        cross = torch.randn(4, config.num_key_value_heads, 5, config.head_dim)
        cache.cross_attention_cache.update(cross, cross, 0)
        before = cache.self_attention_cache.layers[0].keys
        pointer = before.data_ptr()
        expected = before.index_select(0, beam_idx).clone()
        model._reorder_cache(cache, beam_idx)
        layer = cache.self_attention_cache.layers[0]
        assert torch.equal(layer.keys[:, :, :3], expected[:, :, :3])
        assert torch.equal(layer.values[:, :, :3], expected[:, :, :3] + 1)
        assert torch.equal(cache.cross_attention_cache.layers[0].keys, cross)  # untouched
        if isinstance(self_cache, StaticCache):
            assert layer.keys.data_ptr() == pointer


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_sdpa_matches_fp32_eager(device):
    """The GPU training/translation precision (bf16, sdpa) against the fp32 eager reference, within bf16 tolerance."""
    config = _config()
    reference = VaswaniForConditionalGeneration(config).to(device).eval()
    reference.config._attn_implementation = "eager"
    fast = copy.deepcopy(reference).to(torch.bfloat16)
    fast.config._attn_implementation = "sdpa"
    batch = _translation_batch(config, [9, 6, 4], [5, 7, 3], seed=3, device=device)
    with torch.no_grad():
        expected = reference(**batch).logits
        actual = fast(**batch).logits.float()
    valid = batch["labels"] != -100
    error = (actual - expected)[valid].norm() / expected[valid].norm()
    assert error < 2e-2, f"relative error {error:.3g}"


def _flash_attention_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


ATTENTION_IMPLEMENTATIONS = [
    "sdpa",
    "flex_attention",
    pytest.param("flash_attention_2", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() and _flash_attention_installed()), reason="needs CUDA and flash_attn")),
]


@pytest.mark.parametrize("implementation", ATTENTION_IMPLEMENTATIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_attention_implementations_match_eager(device, implementation):
    """Every attention kernel the model accepts computes the eager reference's logits on a padded batch: the
    translation model (padded source, causal target, cross-attention) and the modern decoder (causal, GQA, RoPE).
    fp32 on the CPU; on CUDA the kernels run in bf16, as training and translation do there."""
    if implementation == "flash_attention_2" and device == "cpu":
        pytest.skip("flash attention runs on CUDA only")
    if implementation == "flex_attention" and device == "cpu":  # inductor compiles it for a minute on a CPU
        pytest.skip("checked on the CPU by test_modeling.py::test_flex_attention_matches_eager_and_is_not_causal")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    # Heads of 16 dimensions: flex attention's CUDA kernel refuses fewer (torch's limit, not the model's).
    config = _config(d_model=64, d_ff=128)
    modern = VaswaniConfig.modern(vocab_size=99, d_model=64, decoder_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, d_ff=128, max_position_embeddings=64, dropout=0.0)
    ids, mask = padded_batch(modern, [9, 6, 4], seed=5)
    translation = _translation_batch(config, [9, 6, 4], [5, 7, 3], seed=3, device="cpu")
    causal = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    cases = [(VaswaniForConditionalGeneration(config), translation), (VaswaniForCausalLM(modern), causal)]
    for reference, batch in cases:
        batch = {key: value.to(device) for key, value in batch.items()}
        reference = reference.to(device).eval()
        reference.config._attn_implementation = "eager"
        fast = copy.deepcopy(reference).to(dtype)
        fast.config._attn_implementation = implementation
        with torch.no_grad():
            expected = reference(**batch).logits
            actual = fast(**batch).logits.float()
        valid = batch["labels"] != -100
        error = (actual - expected)[valid].norm() / expected[valid].norm()
        assert error < tolerance, f"{type(reference).__name__} {implementation}: relative error {error:.3g}"


@pytest.mark.parametrize("device", DEVICES)
def test_token_checks_do_not_read_back_on_accelerators(device, monkeypatch):
    """On the CPU a bad id raises a ValueError naming it. On CUDA the check is a device-side assertion instead (a
    failing one would poison the CUDA context, so here only: it is queued, and a valid batch never syncs for it)."""
    config = _config()
    model = VaswaniForCausalLM(config).to(device)
    ids, mask = padded_batch(config, [5, 3], seed=0)
    ids, mask = ids.to(device), mask.to(device)
    if device == "cpu":
        with pytest.raises(ValueError, match=f"Token id {config.vocab_size} is outside the vocabulary"):
            model(input_ids=ids.masked_fill(mask == 0, config.vocab_size))
        with pytest.raises(ValueError, match=f"Label id {config.vocab_size + 2} is outside the vocabulary"):
            model(input_ids=ids, labels=ids.masked_fill(mask == 0, config.vocab_size + 2))
        return
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation raises
    try:
        check_ids(ids, ids >= config.vocab_size, lambda bad: f"Token id {bad}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    asserted = []
    monkeypatch.setattr(torch, "_assert_async", lambda *args: asserted.append(args))
    model(input_ids=ids, attention_mask=mask, labels=ids)
    assert len(asserted) == 2  # the input ids and the labels


def test_eager_attention_takes_sdpa_boolean_masks():
    """A CPU decoding step under sdpa runs `eager_attention_forward` with the boolean mask built for sdpa."""
    from torch.nn import functional as F

    from vaswani.modeling_vaswani import eager_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 1, False
    query, key, value = torch.randn(3, 2, 1, 8), torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    allowed = torch.ones(3, 1, 1, 6, dtype=torch.bool)
    allowed[0, ..., 4:] = allowed[2, ..., :2] = False
    output, _ = eager_attention_forward(module, query, key, value, allowed, scaling=8**-0.5)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed).transpose(1, 2)
    torch.testing.assert_close(output, expected)


def test_single_query_cpu_steps_use_the_plain_path(monkeypatch):
    """sdpa stays the implementation for prompts and training; one-token decoding steps on a CPU take the
    matmul-softmax-matmul path, with the same tokens as an all-eager model."""
    import vaswani.modeling_vaswani as modeling

    config = _config()
    model = VaswaniForConditionalGeneration(config).eval()
    reference = copy.deepcopy(model)
    reference.config._attn_implementation = "eager"
    query_lengths = []
    original = modeling.eager_attention_forward

    def spy(module, query, *args, **kwargs):
        query_lengths.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    source, mask = padded_batch(config, [7, 4], seed=5)
    kwargs = {"num_beams": 2, "do_sample": False, "max_new_tokens": 5, "eos_token_id": None}
    expected = reference.generate(input_ids=source, attention_mask=mask, **kwargs)
    monkeypatch.setattr(modeling, "eager_attention_forward", spy)
    actual = model.generate(input_ids=source, attention_mask=mask, **kwargs)
    assert torch.equal(actual, expected)
    # Only decoding steps (the encoder ran sdpa): one query per row in self-attention, and in cross-attention one
    # per beam of a sentence, which the lean beam search attends with together.
    assert query_lengths and set(query_lengths) == {1, kwargs["num_beams"]}


_FREED_MEMORY_KEPT = """
import subprocess, sys, torch
from vaswani.inference import keep_freed_cpu_memory

def no_process(*args, **kwargs):
    raise AssertionError(f"keep_freed_cpu_memory started a process: {args}")

subprocess.Popen.__init__ = no_process  # it runs before every CPU engine loads: no process of its own

def resident_mib():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) >> 10

assert keep_freed_cpu_memory(None if sys.argv[1] == "none" else int(sys.argv[1])) is True
for mib in (16, 64):
    tensor = torch.ones(mib << 18)  # float32: mib MiB, every page touched
    holding = resident_mib()
    del tensor
    # Kept: freeing it gives (almost) nothing back. Comparing with the resident size before the allocation instead
    # would depend on whether it reused memory freed earlier (the 16 MiB block inside the 64 MiB one).
    print(mib, holding - resident_mib() <= 1)
"""


@pytest.mark.parametrize("largest_block_mib, kept", [("32", {16: True, 64: False}), ("none", {16: True, 64: True})])
def test_keep_freed_cpu_memory_keeps_freed_blocks_up_to_the_limit(largest_block_mib, kept):
    """After the call, a freed tensor's memory stays in the process (resident, to be reused) when it is at most
    `largest_block_mib`, of any size with None; larger ones are still returned to the system. It starts no process
    (every CPU engine load calls it). Each in a process of its own: the setting is process-wide."""
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    result = subprocess.run([sys.executable, "-c", _FREED_MEMORY_KEPT, largest_block_mib], capture_output=True,
                            text=True, check=True)
    assert {int(mib): flag == "True" for mib, flag in map(str.split, result.stdout.splitlines())} == kept


@pytest.mark.slow
def test_compiled_causal_lm_beam_search_matches_eager(single_thread):
    """The decoder-only model: a static cache reordered in place by beam search, under the compiled step."""
    config = _config(norm_first=True, position_embedding_type="rope", num_key_value_heads=2)
    model = VaswaniForCausalLM(config).eval()
    fast = compile_for_generation(copy.deepcopy(model))
    prompt, mask = padded_batch(config, [6, 3], seed=7, side="left")
    kwargs = {"num_beams": 3, "do_sample": False, "max_new_tokens": 6, "eos_token_id": None}
    expected = model.generate(input_ids=prompt, attention_mask=mask, **kwargs)
    actual = fast.generate(input_ids=prompt, attention_mask=mask, **kwargs)
    assert torch.equal(actual, expected)
