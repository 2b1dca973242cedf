"""The int8 CPU decoding path: `vaswani.inference.quantize_for_cpu` (`load_engine(int8=True)`) and the benchmark's
`vaswani-int8` engine, on the tiny trained-ish model of tiny_translation_model.py. The scripts no longer offer it
(benchmarks/results/int8-cpu-decision.md): on a CPU their int8 is CTranslate2's (`--ctranslate2 --compute_type
int8`)."""

import copy

import pytest
import torch
from torch import nn
from tiny_translation_model import SOURCES

from vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani.inference import Int8Linear, quantize_for_cpu


def plain_linears(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if type(module) is nn.Linear]


def test_every_linear_is_replaced_and_the_fp32_embeddings_are_untouched(trained):
    model, _ = trained
    original = copy.deepcopy(model.state_dict())
    linears = plain_linears(model)
    assert "lm_head" in linears and len(linears) > 10

    quantized = quantize_for_cpu(copy.deepcopy(model))

    assert plain_linears(quantized) == []
    modules = dict(quantized.named_modules())
    assert all(isinstance(modules[name], Int8Linear) for name in linears)
    lm_head = modules["lm_head"].weight()
    assert lm_head.q_per_channel_scales().numel() == lm_head.shape[0]  # one scale per vocabulary row
    # The output projection's tied table stays an fp32 embedding, shared by encoder and decoder as before.
    embeddings = quantized.model.encoder.embed_tokens.weight
    assert embeddings.dtype == torch.float32 and embeddings is quantized.model.decoder.embed_tokens.weight
    assert torch.equal(embeddings, original["model.encoder.embed_tokens.weight"])
    # Quantizing a copy leaves the fp32 model as it was.
    assert plain_linears(model) == linears
    assert all(torch.equal(value, original[key]) for key, value in model.state_dict().items())


def test_in_place_and_returns_the_model():
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=64))
    assert quantize_for_cpu(model) is model and plain_linears(model) == []


def test_int8_logits_and_greedy_translations_agree_with_fp32(trained):
    model, tokenizer = trained
    quantized = quantize_for_cpu(copy.deepcopy(model))
    batch = tokenizer(SOURCES, return_tensors="pt", padding=True)
    with torch.inference_mode():
        fp32_ids = model.generate(**batch, num_beams=1, max_new_tokens=16)
        int8_ids = quantized.generate(**batch, num_beams=1, max_new_tokens=16)
        # Teacher-forced on the fp32 output, so that both score the same prefixes.
        fp32 = model(**batch, decoder_input_ids=fp32_ids[:, :-1]).logits
        int8 = quantized(**batch, decoder_input_ids=fp32_ids[:, :-1]).logits
    # int8 rounds each weight to 1/127 of its row's largest magnitude and each activation to 1/126 of its row's,
    # an error of a few tenths of a percent per product that grows through 2+2 layers and the √d_model-scaled
    # tied projection; 10 % of the logits' range bounds it with room (observed: ~4 % here).
    assert (fp32 - int8).abs().max() < 0.1 * fp32.abs().max()
    mask = batch["attention_mask"].new_ones(fp32.shape[:2], dtype=torch.bool)
    agreement = (fp32.argmax(-1) == int8.argmax(-1))[mask].float().mean()
    assert agreement >= 0.9
    assert (fp32_ids == int8_ids).float().mean() >= 0.9


def test_each_output_row_depends_on_its_input_row_alone():
    """Per-row activation scales and exact int32 sums: a row's output is the same, bit for bit, whatever rows share
    the call, and it is the integer product of the quantized row and weights, scaled."""
    linear = nn.Linear(96, 40)
    quantized = Int8Linear(linear)
    x = torch.randn(6, 5, 96, generator=torch.Generator().manual_seed(0))
    x[2] *= 1000  # a row far larger than the others would have set a per-tensor scale for all of them
    x[3, 1] = 0  # an all-zero row
    with torch.no_grad():
        together = quantized(x)
        assert together.shape == (6, 5, 40)
        assert all(torch.equal(quantized(x[i, j]), together[i, j]) for i in range(6) for j in range(5))
        assert torch.equal(quantized(x[1:4, 2:]), together[1:4, 2:])
        rows = x.reshape(-1, 96)
        scale = rows.abs().amax(dim=1, keepdim=True) / 63
        integers = torch.round(rows / scale.clamp_min(torch.finfo(torch.float32).tiny))
        weight = quantized.weight()
        exact = integers.double() @ weight.int_repr().double().t()  # float64 holds these sums exactly
        expected = exact.float() * weight.q_per_channel_scales().float() * scale + linear.bias
        torch.testing.assert_close(together.reshape(-1, 40), expected, rtol=1e-6, atol=1e-6)
        assert (together - linear(x)).abs().max() < 0.02 * linear(x).abs().max()


def test_refuses_a_model_off_the_cpu():
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=64)).to("meta")
    with pytest.raises(ValueError, match="runs on CPU only, but the model is on meta.* --ctranslate2 --compute_type"):
        quantize_for_cpu(model)


def test_refuses_a_model_not_in_fp32():
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=64)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="starts from fp32 weights"):
        quantize_for_cpu(model)
