"""The model, flag by flag: every variant on every head, attention back-ends, masking, the loss.

Each variant flag is exercised alone (in the manner of x-transformers' per-flag tests) on every model class:
forward, backward (every parameter receives a gradient), save → reload (safetensors only, bit-identical outputs)
and, for the generative heads, `generate`.
"""

import importlib.util
import os

import pytest
import torch
from torch.nn import functional as F

from conftest import padded_batch, random_ids, tiny_config
from vaswani import (
    VaswaniConfig,
    VaswaniEncoderModel,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForSequenceClassification,
    VaswaniModel,
)
from vaswani.modeling_vaswani import SmoothedCrossEntropy, shift_tokens_right

pytestmark = pytest.mark.usefixtures("single_thread")


# The variant matrix ------------------------------------------------------------------------------------------------

VARIANTS = {
    "paper": {},
    "norm_first": {"norm_first": True},
    "rmsnorm": {"norm_type": "rmsnorm"},
    "rmsnorm_pre": {"norm_type": "rmsnorm", "norm_first": True},
    "learned_positions": {"position_embedding_type": "learned"},
    "rope": {"position_embedding_type": "rope"},
    "gqa": {"num_key_value_heads": 2},
    "mqa": {"num_key_value_heads": 1},
    "gelu": {"ffn_activation": "gelu"},
    "silu": {"ffn_activation": "silu"},
    "swiglu": {"ffn_activation": "swiglu"},
    "geglu": {"ffn_activation": "geglu"},
    "no_bias": {"bias": False},
    "unscaled_embeddings": {"scale_embedding": False},
    "layers_1_3": {"encoder_layers": 1, "decoder_layers": 3},
    "no_encoder_layers": {"encoder_layers": 0},
    "no_encoder_layers_pre": {"encoder_layers": 0, "norm_first": True},
    "unshared": {"share_embeddings": False},
    "untied": {"tie_word_embeddings": False},
    "unshared_untied": {"share_embeddings": False, "tie_word_embeddings": False},
    "dropouts": {"dropout": 0.1, "attention_dropout": 0.1, "activation_dropout": 0.1},
    "modern": "modern",
}
HEADS = [
    VaswaniModel,
    VaswaniForConditionalGeneration,
    VaswaniForCausalLM,
    VaswaniEncoderModel,
    VaswaniForSequenceClassification,
]
GENERATIVE = (VaswaniForConditionalGeneration, VaswaniForCausalLM)


def variant_config(name: str) -> VaswaniConfig:
    if VARIANTS[name] == "modern":
        # The modern preset at tiny width: pre-RMSNorm, RoPE, SwiGLU, GQA (2 query heads per K/V head), no biases.
        return VaswaniConfig.modern(
            vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, num_attention_heads=4,
            num_key_value_heads=2, d_ff=64, max_position_embeddings=64,
        )
    return tiny_config(**VARIANTS[name])


def model_inputs(model_class, config: VaswaniConfig) -> dict:
    """A padded batch with labels for every head: seq2seq gets a shorter, padded target."""
    input_ids, attention_mask = padded_batch(config, [7, 5, 3], seed=1)
    if model_class in (VaswaniModel, VaswaniForConditionalGeneration):
        labels, label_mask = padded_batch(config, [4, 6, 2], seed=2)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if model_class is VaswaniModel:
            decoder_input_ids = shift_tokens_right(labels, config.pad_token_id, config.decoder_start_token_id)
            return {**inputs, "decoder_input_ids": decoder_input_ids}
        return {**inputs, "labels": labels.masked_fill(label_mask == 0, -100)}
    if model_class is VaswaniForCausalLM:
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "labels": input_ids.masked_fill(attention_mask == 0, -100)}
    if model_class is VaswaniForSequenceClassification:
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": torch.tensor([0, 1, 1])}
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def expected_shape(model_class, config: VaswaniConfig, inputs: dict) -> tuple:
    batch, length = inputs["input_ids"].shape
    if model_class is VaswaniModel:
        return batch, inputs["decoder_input_ids"].shape[1], config.d_model
    if model_class is VaswaniForConditionalGeneration:
        return batch, inputs["labels"].shape[1], config.vocab_size
    if model_class is VaswaniForCausalLM:
        return batch, length, config.vocab_size
    if model_class is VaswaniEncoderModel:
        return batch, length, config.d_model
    return batch, config.num_labels


def main_output(model_class, outputs) -> torch.Tensor:
    return outputs.last_hidden_state if model_class in (VaswaniModel, VaswaniEncoderModel) else outputs.logits


def scalar_objective(model_class, outputs) -> torch.Tensor:
    if outputs.get("loss") is not None:
        return outputs.loss
    # A fixed random projection: the plain sum of a post-LayerNorm output has an (analytically) zero gradient.
    hidden = outputs.last_hidden_state
    return (hidden * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))).sum()


@pytest.mark.parametrize("model_class", HEADS, ids=lambda c: c.__name__.removeprefix("Vaswani"))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_forward_backward_save_reload_generate(variant, model_class, tmp_path):
    config = variant_config(variant)
    model = model_class(config)
    inputs = model_inputs(model_class, config)
    batch, length = inputs["input_ids"].shape

    # Forward: shapes of the head's main output.
    model.eval()
    with torch.no_grad():
        outputs = model(**inputs)
    assert main_output(model_class, outputs).shape == expected_shape(model_class, config, inputs)
    assert torch.isfinite(main_output(model_class, outputs)).all()

    # Backward, in training mode (dropout and label smoothing on): every parameter takes part.
    model.train()
    scalar_objective(model_class, model(**inputs)).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{name} received no gradient"
        assert parameter.grad.abs().sum() > 0, f"{name} has an all-zero gradient"
        assert torch.isfinite(parameter.grad).all(), name

    # Save → reload: safetensors only (no pickles), bit-identical outputs, same tying.
    model.eval()
    model.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert "model.safetensors" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))], files
    reloaded = model_class.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(main_output(model_class, model(**inputs)), main_output(model_class, reloaded(**inputs)))
    assert_same_sharing(model, reloaded)

    if model_class in GENERATIVE:
        generate_inputs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        if model_class is VaswaniForCausalLM:  # prompts are left-padded for generation
            generate_inputs = dict(zip(("input_ids", "attention_mask"), padded_batch(config, [7, 5, 3], 1, "left")))
        greedy = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
        tokens = model.generate(**generate_inputs, **greedy)
        prompt_length = 1 if model.config.is_encoder_decoder else length  # seq2seq outputs start with decoder_start
        assert tokens.shape == (batch, prompt_length + 4)
        assert torch.equal(tokens, reloaded.generate(**generate_inputs, **greedy))


def assert_same_sharing(model, reloaded):
    """Which parameters are one and the same tensor must survive a save/reload."""

    def groups(m):
        by_tensor = {}
        for name, parameter in m.named_parameters(remove_duplicate=False):
            by_tensor.setdefault(id(parameter), []).append(name)
        return sorted(sorted(names) for names in by_tensor.values() if len(names) > 1)

    assert groups(model) == groups(reloaded)


@pytest.mark.parametrize(
    "overrides, shared, tied",
    [({}, True, True), ({"share_embeddings": False}, False, True), ({"tie_word_embeddings": False}, True, False),
     ({"share_embeddings": False, "tie_word_embeddings": False}, False, False)],
)
def test_embedding_sharing_and_tying_follow_the_config(overrides, shared, tied):
    model = VaswaniForConditionalGeneration(tiny_config(**overrides))
    encoder, decoder = model.model.encoder.embed_tokens.weight, model.model.decoder.embed_tokens.weight
    assert (encoder is decoder) == shared
    assert (model.lm_head.weight is decoder) == tied  # §3.4: the output projection reuses the decoder embedding
    causal = VaswaniForCausalLM(tiny_config(**overrides))
    assert (causal.lm_head.weight is causal.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("field", ["dropout", "attention_dropout", "activation_dropout"])
def test_each_dropout_acts_in_training_only(field):
    model = VaswaniForConditionalGeneration(tiny_config(**{field: 0.5}))
    inputs = model_inputs(VaswaniForConditionalGeneration, model.config)
    model.train()
    assert not torch.equal(model(**inputs).logits, model(**inputs).logits)
    model.eval()
    assert torch.equal(model(**inputs).logits, model(**inputs).logits)


# Attention implementations -----------------------------------------------------------------------------------------


def _flex_forward(model, **inputs):
    """FlexAttention is compiled by inductor; where no compiler toolchain works, skip. Only the compiler's own
    failures skip: a shape or mask bug of ours still fails the test."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    try:
        return model(**inputs)
    except (BackendCompilerFailed, InductorError) as error:
        pytest.skip(f"flex_attention cannot be compiled on this machine: {type(error).__name__}")


FLASH = pytest.param(
    "flash_attention_2",
    marks=pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
        reason="flash_attention_2 needs CUDA and the flash_attn package",
    ),
)


def _device_and_dtype(implementation: str):
    # Flash attention runs in half precision on a GPU only; compare there with a looser tolerance.
    if implementation == "flash_attention_2":
        return torch.device("cuda"), torch.bfloat16, 2e-2
    return torch.device("cpu"), torch.float32, 1e-5


@pytest.mark.parametrize("implementation", ["sdpa", FLASH])
@pytest.mark.parametrize("variant", ["paper", "gqa", "mqa", "modern"])
def test_attention_implementations_match_eager(variant, implementation):
    device, dtype, atol = _device_and_dtype(implementation)
    config = variant_config(variant)
    source, source_mask = padded_batch(config, [9, 6, 4], seed=1)
    target, target_mask = padded_batch(config, [5, 7, 3], seed=2)
    source, source_mask, target, target_mask = (t.to(device) for t in (source, source_mask, target, target_mask))

    for model_class, inputs, valid in [
        (VaswaniForConditionalGeneration,
         {"input_ids": source, "attention_mask": source_mask, "decoder_input_ids": target,
          "decoder_attention_mask": target_mask}, target_mask),
        (VaswaniForCausalLM, {"input_ids": target, "attention_mask": target_mask}, target_mask),
        (VaswaniForSequenceClassification, {"input_ids": source, "attention_mask": source_mask}, None),
    ]:
        model = model_class(variant_config(variant)).to(device, dtype).eval()
        with torch.no_grad():
            model.set_attn_implementation("eager")
            reference = model(**inputs).logits
            model.set_attn_implementation(implementation)
            assert model.config._attn_implementation == implementation
            logits = model(**inputs).logits
        if valid is not None:  # padded query rows are never read; compare real positions only
            reference, logits = reference[valid.bool()], logits[valid.bool()]
        torch.testing.assert_close(logits.float(), reference.float(), atol=atol, rtol=0)


def test_output_attentions_shapes_and_masks():
    config = tiny_config(num_key_value_heads=2)  # weights are per query head, also under GQA
    model = VaswaniForConditionalGeneration(config).eval()
    model.set_attn_implementation("eager")
    source, source_mask = padded_batch(config, [8, 5], seed=1)
    target = random_ids(config, 2, 6, seed=2)
    with torch.no_grad():
        outputs = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target, output_attentions=True)
    heads = config.num_attention_heads
    assert len(outputs.encoder_attentions) == config.encoder_layers
    assert len(outputs.decoder_attentions) == len(outputs.cross_attentions) == config.decoder_layers
    padding = source_mask == 0
    for weights in outputs.encoder_attentions:
        assert weights.shape == (2, heads, 8, 8)
        assert (weights.masked_select(padding[:, None, None, :]) == 0).all()  # nobody attends to source padding
    for weights in outputs.decoder_attentions:
        assert weights.shape == (2, heads, 6, 6)
        assert torch.equal(weights, weights.tril())  # masked self-attention: no peeking at later target tokens
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, heads, 6))
    for weights in outputs.cross_attentions:
        assert weights.shape == (2, heads, 6, 8)
        assert (weights.masked_select(padding[:, None, None, :]) == 0).all()
        assert (weights[0] > 0).all()  # the full-length source row: every source position is attended (not causal)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, heads, 6))
    hidden = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target, output_hidden_states=True)
    assert len(hidden.encoder_hidden_states) == config.encoder_layers + 1  # embeddings + each layer
    assert len(hidden.decoder_hidden_states) == config.decoder_layers + 1


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "mask"])
def test_encoder_and_cross_attention_are_not_causal(implementation, with_mask):
    """A later source token must influence earlier encoder outputs and the first decoder position. With no mask,
    SDPA's `is_causal` default would silently make encoder attention causal if the module flag were wrong."""
    config = tiny_config()
    model = VaswaniForConditionalGeneration(config).eval()
    model.set_attn_implementation(implementation)
    source = random_ids(config, 1, 8, seed=1)
    changed = source.clone()
    changed[0, -1] = 4 if source[0, -1] != 4 else 5
    target = random_ids(config, 1, 3, seed=2)
    mask = {"attention_mask": torch.ones_like(source)} if with_mask else {}
    with torch.no_grad():
        a = model(input_ids=source, decoder_input_ids=target, **mask)
        b = model(input_ids=changed, decoder_input_ids=target, **mask)
    assert not torch.allclose(a.encoder_last_hidden_state[0, 0], b.encoder_last_hidden_state[0, 0])
    assert not torch.allclose(a.logits[0, 0], b.logits[0, 0])  # via cross-attention, at the very first position


@pytest.mark.slow  # FlexAttention is compiled by inductor: ~10 s per distinct mask and shape on CPU
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit / create_block_mask(_compile=) inside libraries
def test_flex_attention_matches_eager_and_is_not_causal():
    """One padded GQA batch through all three attention roles; then a later source token of the full-length row
    is changed (same shapes, so no recompilation) and must reach earlier encoder outputs and the first decoder
    position. Then the modern decoder (causal, GQA, RoPE) on a padded batch. On CPU FlexAttention runs forward only,
    hence no_grad. The CPU's one FlexAttention test (test_fast_paths runs it on CUDA): each compiles for long."""
    config = tiny_config(num_key_value_heads=2)
    model = VaswaniForConditionalGeneration(config).eval()
    source, source_mask = padded_batch(config, [9, 6, 4], seed=1)
    target, target_mask = padded_batch(config, [5, 7, 3], seed=2)
    inputs = {"attention_mask": source_mask, "decoder_input_ids": target, "decoder_attention_mask": target_mask}
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model(input_ids=source, **inputs)
        model.set_attn_implementation("flex_attention")
        assert model.config._attn_implementation == "flex_attention"
        flex = _flex_forward(model, input_ids=source, **inputs)
        changed = source.clone()
        changed[0, -1] = 4 if source[0, -1] != 4 else 5
        flex_changed = model(input_ids=changed, **inputs)
    valid = target_mask.bool()
    torch.testing.assert_close(flex.logits[valid], reference.logits[valid], atol=1e-5, rtol=0)
    assert not torch.allclose(flex.encoder_last_hidden_state[0, 0], flex_changed.encoder_last_hidden_state[0, 0])
    assert not torch.allclose(flex.logits[0, 0], flex_changed.logits[0, 0])
    modern = VaswaniForCausalLM(VaswaniConfig.modern(
        vocab_size=99, d_model=32, decoder_layers=1, num_attention_heads=4, num_key_value_heads=2, d_ff=64,
        max_position_embeddings=64, dropout=0.0)).eval()
    ids, mask = padded_batch(modern.config, [9, 6, 4], seed=5)
    with torch.no_grad():
        reference = modern(input_ids=ids, attention_mask=mask).logits
        modern.set_attn_implementation("flex_attention")
        flex = modern(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(flex[mask.bool()], reference[mask.bool()], atol=1e-5, rtol=0)


# Causality and padding invariance ----------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", ["paper", "learned_positions", "modern"])
def test_future_target_tokens_never_change_earlier_outputs(variant, implementation):
    config = variant_config(variant)
    for model_class in (VaswaniForConditionalGeneration, VaswaniForCausalLM):
        model = model_class(variant_config(variant)).eval()
        model.set_attn_implementation(implementation)
        target = random_ids(config, 2, 7, seed=3)
        seq2seq = model_class is VaswaniForConditionalGeneration
        extra = {"input_ids": random_ids(config, 2, 5, seed=4)} if seq2seq else {}
        key = "decoder_input_ids" if seq2seq else "input_ids"
        with torch.no_grad():
            reference = model(**extra, **{key: target}).logits
            for t in range(1, 7):
                changed = target.clone()
                changed[:, t:] = random_ids(config, 2, 7 - t, seed=10 + t)
                logits = model(**extra, **{key: changed}).logits
                torch.testing.assert_close(logits[:, :t], reference[:, :t], atol=1e-6, rtol=0)
                assert not torch.allclose(logits[:, t], reference[:, t])


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", ["paper", "learned_positions", "modern"])
def test_extra_padding_never_changes_outputs(variant, implementation):
    config = variant_config(variant)
    model = VaswaniForConditionalGeneration(config).eval()
    model.set_attn_implementation(implementation)
    source, source_mask = padded_batch(config, [6, 4], seed=1)
    target, target_mask = padded_batch(config, [5, 3], seed=2)
    pad = lambda t, n, value: F.pad(t, (0, n), value=value)  # noqa: E731
    with torch.no_grad():
        reference = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target,
                          decoder_attention_mask=target_mask)
        padded = model(input_ids=pad(source, 5, 0), attention_mask=pad(source_mask, 5, 0),
                       decoder_input_ids=pad(target, 2, 0), decoder_attention_mask=pad(target_mask, 2, 0))
    valid = target_mask.bool()
    torch.testing.assert_close(padded.logits[:, :5][valid], reference.logits[valid], atol=1e-5, rtol=0)
    source_valid = source_mask.bool()
    torch.testing.assert_close(padded.encoder_last_hidden_state[:, :6][source_valid],
                               reference.encoder_last_hidden_state[source_valid], atol=1e-5, rtol=0)

    causal = VaswaniForCausalLM(variant_config(variant)).eval()
    causal.set_attn_implementation(implementation)
    with torch.no_grad():
        reference = causal(input_ids=target, attention_mask=target_mask).logits
        padded = causal(input_ids=pad(target, 4, 0), attention_mask=pad(target_mask, 4, 0)).logits
    torch.testing.assert_close(padded[:, :5][valid], reference[valid], atol=1e-5, rtol=0)


# The loss ----------------------------------------------------------------------------------------------------------


def test_loss_ignores_minus_100_and_smooths_labels_only_in_training():
    config = tiny_config()
    assert VaswaniConfig().label_smoothing == 0.1  # §5.4: ε_ls = 0.1
    model = VaswaniForConditionalGeneration(config)
    source, source_mask = padded_batch(config, [6, 4], seed=1)
    labels = random_ids(config, 2, 5, seed=2)
    labels[0, 3:] = -100
    labels[1, 1] = -100  # an ignored position in the middle, too

    for training, smoothing in [(True, 0.1), (False, 0.0)]:
        model.train(training)
        outputs = model(input_ids=source, attention_mask=source_mask, labels=labels)
        expected = F.cross_entropy(outputs.logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                   label_smoothing=smoothing)
        torch.testing.assert_close(outputs.loss, expected)
        kept = labels != -100
        plain = F.cross_entropy(outputs.logits[kept], labels[kept], label_smoothing=smoothing)
        torch.testing.assert_close(outputs.loss, plain)

    causal = VaswaniForCausalLM(config)
    ids, mask = padded_batch(config, [6, 4], seed=3)
    causal_labels = ids.masked_fill(mask == 0, -100)
    for training, smoothing in [(True, 0.1), (False, 0.0)]:
        causal.train(training)
        outputs = causal(input_ids=ids, attention_mask=mask, labels=causal_labels)
        expected = F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), causal_labels[:, 1:].flatten(),
                                   ignore_index=-100, label_smoothing=smoothing)
        torch.testing.assert_close(outputs.loss, expected)


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_gradient_is_autograds(smoothing, device):
    """The loss' hand-written backward (softmax − smoothed targets) gives what autograd gives through
    F.cross_entropy, and passes gradcheck; ignored rows get no gradient."""
    logits = torch.randn(7, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits = logits.to(device).requires_grad_()
    labels = torch.tensor([3, -100, 0, 10, 5, -100, 3], device=device)
    loss = SmoothedCrossEntropy.apply(logits, labels, smoothing)
    expected = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum", label_smoothing=smoothing)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(2.5 * loss, logits)
    (expected_grad,) = torch.autograd.grad(2.5 * expected, logits)
    torch.testing.assert_close(grad, expected_grad)
    assert not grad[labels == -100].any()
    assert torch.autograd.gradcheck(lambda z: SmoothedCrossEntropy.apply(z, labels, smoothing), (logits,))


def test_training_step_gradients_match_autograds_loss():
    """Through the whole model: parameter gradients of a training step (label smoothing on, tied embeddings) equal
    those of the same loss written with F.cross_entropy."""
    config = tiny_config(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = VaswaniForConditionalGeneration(config).train()
    source, source_mask = padded_batch(config, [6, 4], seed=1)
    labels = random_ids(config, 2, 5, seed=2)
    labels[1, 3:] = -100
    outputs = model(input_ids=source, attention_mask=source_mask, labels=labels)
    grads = torch.autograd.grad(outputs.loss, list(model.parameters()), retain_graph=True)
    expected = F.cross_entropy(outputs.logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                               label_smoothing=config.label_smoothing)
    torch.testing.assert_close(outputs.loss, expected)
    for grad, expected_grad in zip(grads, torch.autograd.grad(expected, list(model.parameters()))):
        torch.testing.assert_close(grad, expected_grad)


def test_bad_inputs_are_value_errors_that_say_what_is_wrong():
    model = VaswaniForConditionalGeneration(tiny_config())
    with pytest.raises(ValueError, match="outside the vocabulary"):  # an input id
        model(input_ids=torch.tensor([[5, 99]]), decoder_input_ids=torch.tensor([[3]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):  # a label id (-100 is fine)
        model(input_ids=torch.tensor([[5, 6]]), labels=torch.tensor([[7, -100, 120]]))
    for shape in [(0, 5), (2, 0)]:
        with pytest.raises(ValueError, match="empty batch"):
            model(input_ids=torch.zeros(shape, dtype=torch.long), decoder_input_ids=torch.full((shape[0], 1), 3))


def test_loss_divides_by_num_items_in_batch_when_given():
    """The Trainer passes the token count of the whole accumulated batch; the loss is then sum / that count."""
    config = tiny_config()
    model = VaswaniForConditionalGeneration(config).eval()
    source = random_ids(config, 2, 5, seed=1)
    labels = random_ids(config, 2, 4, seed=2)
    mean = model(input_ids=source, labels=labels).loss
    torch.testing.assert_close(model(input_ids=source, labels=labels, num_items_in_batch=20).loss, mean * 8 / 20)


def _successor_model(model_class, config):
    """A model whose answer is known: it predicts "the token after the current input token" (id + 1).

    Pre-norm residual blocks with zeroed output projections are the identity, so the final hidden state at position
    t is LayerNorm(one-hot(x_t)) (embeddings are the identity matrix, RoPE adds nothing to the residual stream); the
    untied output projection maps token i to i + 1, times a large gain.
    """
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(part in name for part in ("o_proj", "fc2", "down_proj")):
                parameter.zero_()
        identity = torch.eye(config.vocab_size)
        model.get_input_embeddings().weight.copy_(identity)
        if model_class is VaswaniForConditionalGeneration:
            model.model.decoder.embed_tokens.weight.copy_(identity)
        model.lm_head.weight.copy_(100 * identity.roll(1, dims=0))  # logit of (i + 1) reads channel i
    return model


def test_labels_are_predicted_position_by_position_no_double_shift():
    config = tiny_config(vocab_size=32, d_model=32, norm_first=True, position_embedding_type="rope",
                         share_embeddings=False, tie_word_embeddings=False, scale_embedding=False,
                         decoder_start_token_id=3)
    # Seq2seq: labels 4 5 6 7 8; the decoder reads <start>=3 4 5 6 7, so "id + 1" is exactly right at every position.
    model = _successor_model(VaswaniForConditionalGeneration, config)
    labels = torch.arange(4, 9)[None]
    outputs = model(input_ids=random_ids(config, 1, 5), labels=labels)
    assert torch.equal(outputs.logits.argmax(-1), labels)
    assert outputs.loss < 1e-3
    assert model(input_ids=random_ids(config, 1, 5), labels=labels + 1).loss > 10  # one shift too many: wrong

    # Causal LM: labels are the inputs; position t is scored against token t + 1, which is x_t + 1.
    causal = _successor_model(VaswaniForCausalLM, config)
    ids = torch.arange(4, 12)[None]
    outputs = causal(input_ids=ids, labels=ids)
    assert torch.equal(outputs.logits.argmax(-1)[:, :-1], ids[:, 1:])
    assert outputs.loss < 1e-3


# Paper fidelity of the embedding layer -----------------------------------------------------------------------------


def test_embedding_is_scaled_tokens_plus_the_papers_sinusoids():
    """§3.4: token embeddings × √d_model; §3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
    config = tiny_config()
    model = VaswaniModel(config).eval()
    ids = random_ids(config, 2, 11)
    position = torch.arange(11, dtype=torch.float64)[:, None]
    i = torch.arange(config.d_model // 2, dtype=torch.float64)[None]
    angle = position / 10000 ** (2 * i / config.d_model)
    table = torch.zeros(11, config.d_model, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = angle.sin(), angle.cos()
    expected = model.encoder.embed_tokens.weight[ids].double() * config.d_model**0.5 + table
    with torch.no_grad():
        for stack in (model.encoder, model.decoder):  # the decoder shares the table and the positions
            embedded, rotary = stack.embed(ids, None, None)
            assert rotary is None
            torch.testing.assert_close(embedded.double(), expected, atol=1e-5, rtol=0)


# Heads -------------------------------------------------------------------------------------------------------------


def test_sequence_classification_loss_and_padding_invariance():
    config = tiny_config(num_labels=3)
    model = VaswaniForSequenceClassification(config).eval()
    ids, mask = padded_batch(config, [6, 3], seed=1)
    labels = torch.tensor([2, 0])
    outputs = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(outputs.loss, F.cross_entropy(outputs.logits, labels))
    with torch.no_grad():  # mean pooling covers real tokens only: appended padding changes nothing
        padded = model(input_ids=F.pad(ids, (0, 4)), attention_mask=F.pad(mask, (0, 4))).logits
    torch.testing.assert_close(padded, outputs.logits.detach(), atol=1e-5, rtol=0)


def test_causal_lm_leaves_the_callers_config_alone():
    """A decoder-only model turns `is_encoder_decoder` off on its own copy; a translation model built from the
    same config object must still run its encoder in generate()."""
    config = tiny_config()
    translator = VaswaniForConditionalGeneration(config)
    language_model = VaswaniForCausalLM(config)
    assert config.is_encoder_decoder and translator.config.is_encoder_decoder
    assert not language_model.config.is_encoder_decoder
    tokens = translator.generate(input_ids=random_ids(config, 1, 4), max_new_tokens=2, min_new_tokens=2)
    assert tokens.shape == (1, 3)


def test_zero_decoder_layers_still_generate():
    """`decoder_layers=0` is allowed by the config (an embedding-only bigram model); it must not break caching."""
    for model_class in GENERATIVE:
        model = model_class(tiny_config(decoder_layers=0)).eval()
        ids = random_ids(model.config, 2, 4)
        assert model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3).shape[1] == (
            4 if model.config.is_encoder_decoder else 7
        )
