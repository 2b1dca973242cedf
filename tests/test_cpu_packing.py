"""fp32 CPU inference through oneDNN with weights laid out once (`vaswani.inference.pack_for_cpu`, which
`load_engine` applies to an fp32 model on a CPU, beside reusing freed memory): the same parameters and translations
as the plain model, a copy that never goes stale, and a decoding step that multiplies with the laid-out weights and
never lays them out again."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tiny_translation_model import SOURCES
from vaswani import VaswaniConfig, VaswaniForConditionalGeneration, generation_vaswani, loading
from vaswani.inference import (
    PackedLinear, check_packing_operators, compile_for_generation, cpu_packs_linear_weights, pack_for_cpu,
)
from vaswani.loading import load_engine

pytestmark = pytest.mark.skipif(not cpu_packs_linear_weights(), reason="this torch has no oneDNN linear path")


def linears(model: nn.Module, kind: type) -> list[str]:
    return [name for name, module in model.named_modules() if type(module) is kind]


class Operators(TorchDispatchMode):
    """The aten and oneDNN operators a block of code calls, counted by name."""

    def __enter__(self):
        self.calls = {}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_the_private_operators_are_those_it_was_written_for():
    assert check_packing_operators() == []


def test_every_linear_is_packed_and_keeps_its_own_parameters(trained):
    model, _ = trained
    plain = linears(model, nn.Linear)
    assert "lm_head" in plain and len(plain) > 10
    packed = pack_for_cpu(copy.deepcopy(model))
    assert linears(packed, nn.Linear) == [] and linears(packed, PackedLinear) == plain
    # The same state dict, and the output projection still tied to the embeddings.
    assert packed.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in packed.state_dict().items())
    assert packed.lm_head.weight is packed.model.decoder.embed_tokens.weight


@pytest.mark.parametrize("num_beams", [1, 4])
def test_translations_are_the_plain_models(trained, num_beams):
    model, tokenizer = trained
    packed = pack_for_cpu(copy.deepcopy(model))
    batch = tokenizer(SOURCES, return_tensors="pt", padding=True)
    with torch.inference_mode():
        expected = model.generate(**batch, num_beams=num_beams, max_new_tokens=16)
        assert torch.equal(packed.generate(**batch, num_beams=num_beams, max_new_tokens=16), expected)
        # The numbers themselves differ only in their last bits: oneDNN sums in another order than MKL.
        logits = model(**batch, decoder_input_ids=expected).logits
        torch.testing.assert_close(packed(**batch, decoder_input_ids=expected).logits, logits, rtol=1e-5, atol=1e-4)


def test_a_changed_weight_is_laid_out_again():
    layer = PackedLinear(nn.Linear(16, 8))
    x = torch.randn(4, 16)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2)  # in place, as an optimizer step or load_state_dict changes it
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.load_state_dict({"weight": torch.randn(8, 16), "bias": torch.randn(8)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight = nn.Parameter(torch.randn(8, 16))  # replaced
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_autograd_other_dtypes_and_copies_take_the_plain_path_or_lay_out_again():
    layer = PackedLinear(nn.Linear(16, 8))
    x = torch.randn(4, 16)
    layer(x).sum().backward()  # training through the layer: F.linear, with gradients
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    with torch.no_grad():
        half = copy.deepcopy(layer).to(torch.bfloat16)
        assert torch.equal(half(x.bfloat16()), F.linear(x.bfloat16(), half.weight, half.bias))
        expected = layer(x)
        for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert torch.equal(copied(x), expected)
            assert copied.weight is not layer.weight


def test_a_decoding_step_multiplies_with_the_laid_out_weights_only(trained):
    """After the first call, no weight is laid out again, and no linear layer falls back to torch's own products."""
    model, tokenizer = trained
    packed = pack_for_cpu(copy.deepcopy(model))
    batch = tokenizer(SOURCES, return_tensors="pt", padding=True)
    with torch.inference_mode():
        packed.generate(**batch, num_beams=4, max_new_tokens=8)
        with Operators() as seen:
            packed.generate(**batch, num_beams=4, max_new_tokens=8)
    assert seen.calls.get("mkldnn._linear_pointwise", 0) > 0
    assert "mkldnn._reorder_linear_weight" not in seen.calls
    assert not {"aten.mm", "aten.addmm", "aten.linear"} & seen.calls.keys(), seen.calls


def test_load_engine_packs_fp32_weights_and_reuses_freed_memory_on_a_cpu_only(checkpoint, monkeypatch):
    kept = []  # the real call would change this test process' malloc for good
    monkeypatch.setattr(loading, "keep_freed_cpu_memory", lambda: kept.append(True) or True)
    engine = load_engine(str(checkpoint), device="cpu", dtype="float32")
    assert linears(engine.model, nn.Linear) == [] and "oneDNN-packed" in engine.description and kept == [True]
    for options in (dict(dtype="bfloat16"), dict(int8=True)):
        engine = load_engine(str(checkpoint), device="cpu", **options)
        assert not linears(engine.model, PackedLinear) and "oneDNN" not in engine.description, options
    assert kept == [True] * 3
    monkeypatch.setattr(generation_vaswani, "rehearsing_cuda", True)  # a GPU multiplies with its own kernels
    engine = load_engine(str(checkpoint), device="cpu", dtype="float32")
    assert not linears(engine.model, PackedLinear) and kept == [True] * 3


def test_a_model_without_the_operators_is_left_as_it_was(monkeypatch):
    import vaswani.inference as inference

    monkeypatch.setattr(inference, "check_packing_operators", lambda: ["torch.ops.mkldnn._linear_pointwise is missing"])
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=32))
    assert linears(pack_for_cpu(model), PackedLinear) == []


def test_a_packed_model_compiles_as_the_plain_one_does(trained):
    """`compile_for_generation` on an engine's packed model: Dynamo cannot trace oneDNN's laid-out copy, so under
    torch.compile the layers are `F.linear`, and inductor decodes what the eager model decodes."""
    model, tokenizer = trained
    batch = tokenizer(SOURCES[:2], return_tensors="pt", padding=True)
    with torch.inference_mode():
        expected = model.generate(**batch, num_beams=1, max_new_tokens=6)
    compiled = compile_for_generation(pack_for_cpu(copy.deepcopy(model)))
    with torch.inference_mode():
        assert torch.equal(compiled.generate(**batch, num_beams=1, max_new_tokens=6), expected)
