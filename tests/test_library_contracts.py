"""Contracts every in-library transformers model keeps, which transformers' own common tests (tests/test_upstream_suite.py)
found broken: tuples on `return_dict=False`, pre-shifted `shift_labels`, a checkpoint without the shared embedding
table, the deprecated cache argument, and left-padded prompts of the decoder-only model. (Positions with a custom 4D
mask, as transformers' generation tests pass them: tests/test_generation_mixin.py.)
"""

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import padded_batch, random_ids, tiny_config
from vaswani import (
    VaswaniConfig,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForSequenceClassification,
    VaswaniModel,
)
from vaswani.modeling_vaswani import CACHE_NAME

pytestmark = pytest.mark.usefixtures("single_thread")

MODEL_CLASSES = [VaswaniModel, VaswaniForConditionalGeneration, VaswaniForCausalLM, VaswaniForSequenceClassification]


def inputs_for(model_class, config) -> dict:
    input_ids, attention_mask = padded_batch(config, [6, 4], seed=1)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if model_class in (VaswaniModel, VaswaniForConditionalGeneration):
        inputs["decoder_input_ids"] = random_ids(config, 2, 5, seed=2)
    return inputs


@pytest.mark.parametrize("model_class", MODEL_CLASSES, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("where", ["argument", "config"])
def test_return_dict_false_gives_the_outputs_as_a_tuple(model_class, where):
    config = tiny_config()
    model = model_class(config).eval()
    inputs = inputs_for(model_class, config)
    with torch.no_grad():
        expected = model(**inputs).to_tuple()
        if where == "argument":
            got = model(**inputs, return_dict=False)
        else:
            model.config.return_dict = False
            got = model(**inputs)
    assert type(got) is tuple and len(got) == len(expected)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)


def test_causal_lm_loss_is_taken_against_shift_labels_when_given():
    """Under context parallelism the Trainer passes targets already aligned with the positions (`shift_labels`);
    the model must use them as they are, and not shift `labels` instead."""
    config = tiny_config()
    model = VaswaniForCausalLM(config).eval()
    input_ids = random_ids(config, 2, 6, seed=1)
    shift_labels = random_ids(config, 2, 6, seed=3)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
        loss = model(input_ids=input_ids, labels=input_ids, shift_labels=shift_labels).loss
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift_labels.flatten())
        torch.testing.assert_close(loss, expected)
        # `labels` alone are still shifted by one: position t predicts token t+1.
        own = model(input_ids=input_ids, labels=input_ids).loss
        shifted = torch.nn.functional.pad(input_ids, (0, 1), value=-100)[:, 1:]
        torch.testing.assert_close(own, model(input_ids=input_ids, shift_labels=shifted).loss)


@pytest.mark.parametrize("model_class", [VaswaniModel, VaswaniForConditionalGeneration], ids=lambda cls: cls.__name__)
def test_checkpoint_without_the_shared_embedding_reports_it_missing_and_initialises_it(model_class, tmp_path):
    config = tiny_config()
    model_class(config).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    key = next(name for name in weights if name.endswith("encoder.embed_tokens.weight"))
    del weights[key]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})

    model, info = model_class.from_pretrained(tmp_path, output_loading_info=True)
    assert key in info["missing_keys"]
    embeddings = model.get_input_embeddings().weight
    assert embeddings.device.type == "cpu"
    # Initialised by `_init_weights` (N(0, d_model^-1/2)), not left as whatever memory it was given.
    assert torch.isfinite(embeddings).all() and 0.5 < embeddings.std().item() * config.d_model**0.5 < 2
    assert model.base_model.decoder.embed_tokens.weight is model.base_model.encoder.embed_tokens.weight
    inputs = inputs_for(model_class, config)
    with torch.no_grad():
        model(**inputs)


@pytest.mark.skipif(CACHE_NAME != "cache", reason="the decoding cache is still called past_key_values before 5.24")
def test_the_old_cache_name_still_works_with_a_deprecation_warning():
    config = tiny_config()
    model = VaswaniForCausalLM(config).eval()
    input_ids = random_ids(config, 1, 4, seed=1)
    with torch.no_grad():
        cache = model(input_ids=input_ids[:, :3], use_cache=True).cache
        with pytest.warns(FutureWarning, match="`past_key_values` is deprecated"):
            old = model(input_ids=input_ids[:, 3:], past_key_values=cache).logits
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the new name, as generate() passes it, warns about nothing
            model(input_ids=input_ids[:, :3], use_cache=True)
    torch.testing.assert_close(old[:, -1], model(input_ids=input_ids).logits[:, -1])


@pytest.mark.parametrize("variant", [{}, {"position_embedding_type": "learned"}, {"position_embedding_type": "rope"}],
                         ids=["sinusoidal", "learned", "rope"])
def test_causal_lm_left_padding_changes_no_logits(variant):
    """transformers' `test_left_padding_compatibility` (in its generation tests, which its sdist does not ship): with
    position ids counted from the attention mask, as generate() derives them, a left-padded batch gives each row the
    logits it gets unpadded."""
    config = tiny_config(**variant)
    model = VaswaniForCausalLM(config).eval()
    input_ids, attention_mask = padded_batch(config, [7, 3, 5], seed=1, side="left")
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        for row, length in enumerate(attention_mask.sum(-1).tolist()):
            alone = model(input_ids=input_ids[row : row + 1, -length:]).logits
            torch.testing.assert_close(padded[row : row + 1, -length:], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("separate", [False, True])
def test_the_decoder_side_config_has_the_decoder_vocabulary(separate):
    """generate() and transformers' common tests read `get_text_config(decoder=True).vocab_size`; the generic flat
    encoder-decoder view copied `decoder_vocab_size` (None: "the same as vocab_size") onto it."""
    overrides = {"share_embeddings": False, "decoder_vocab_size": 150} if separate else {}
    config = VaswaniConfig.tiny(vocab_size=99, **overrides)
    assert config.get_text_config(decoder=True).vocab_size == (150 if separate else 99)
    assert config.get_text_config(encoder=True).vocab_size == 99
