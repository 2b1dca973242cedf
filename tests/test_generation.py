"""Generation: the key/value cache changes nothing but speed.

Cached decoding must give the same tokens as recomputing everything (greedy, beam search, sampling), static caches
the same as dynamic ones, every cached step the logits of a full forward pass over the prefix (so positions are
right at every step), left-padded batches of prompts the same as one prompt at a time, and the encoder-side keys and
values of cross-attention are projected once per source, not once per step.
"""

import logging
import warnings

import pytest
import torch
from transformers import StaticCache
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as transformers_logging

from conftest import padded_batch, random_ids, tiny_config
from vaswani import VaswaniConfig, VaswaniForCausalLM, VaswaniForConditionalGeneration
import vaswani.decoding
from vaswani.modeling_vaswani import CACHE_NAME

pytestmark = pytest.mark.usefixtures("single_thread")

VARIANTS = {
    "paper": {},
    "learned_positions": {"position_embedding_type": "learned"},
    "modern": {"norm_first": True, "norm_type": "rmsnorm", "position_embedding_type": "rope",
               "ffn_activation": "swiglu", "num_key_value_heads": 2, "bias": False},
}
NEW_TOKENS = 6


def seq2seq(variant: str) -> tuple[VaswaniForConditionalGeneration, dict]:
    config = tiny_config(**VARIANTS[variant])
    model = VaswaniForConditionalGeneration(config).eval()
    input_ids, attention_mask = padded_batch(config, [7, 4, 6], seed=1)
    return model, {"input_ids": input_ids, "attention_mask": attention_mask}


def causal(variant: str) -> tuple[VaswaniForCausalLM, dict]:
    config = tiny_config(**VARIANTS[variant])
    model = VaswaniForCausalLM(config).eval()
    input_ids, attention_mask = padded_batch(config, [5, 2, 4], seed=1, side="left")
    return model, {"input_ids": input_ids, "attention_mask": attention_mask}


BUILDERS = {"seq2seq": seq2seq, "causal": causal}
# min_new_tokens keeps a random model from stopping at </s> after one token and making the comparison trivial.
FIXED_LENGTH = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS}


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "strategy",
    [{"do_sample": False}, {"do_sample": False, "num_beams": 4}, {"do_sample": True, "top_k": 0}],
    ids=["greedy", "beam4", "sample"],
)
def test_cached_generation_equals_uncached(kind, variant, strategy):
    model, inputs = BUILDERS[kind](variant)
    results = []
    for use_cache in (True, False):
        torch.manual_seed(1234)  # sampling draws the same random numbers in both runs
        results.append(model.generate(**inputs, **strategy, **FIXED_LENGTH, use_cache=use_cache))
    assert torch.equal(*results)


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("variant", ["paper", "modern"])
def test_static_cache_equals_dynamic_cache(kind, variant):
    model, inputs = BUILDERS[kind](variant)
    dynamic = model.generate(**inputs, do_sample=False, **FIXED_LENGTH)
    static = model.generate(**inputs, do_sample=False, **FIXED_LENGTH, cache_implementation="static",
                            return_dict_in_generate=True)
    cache = getattr(static, CACHE_NAME)
    assert isinstance(cache.self_attention_cache if kind == "seq2seq" else cache, StaticCache)
    assert torch.equal(dynamic, static.sequences)


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_every_cached_step_equals_a_full_forward_over_the_prefix(kind, variant, cache_implementation):
    """The logits generate() used at step t must be those of an uncached pass over everything before it; a wrong
    position offset for the new token (sinusoidal, learned or rotary) would show up here from step 1 on."""
    model, inputs = BUILDERS[kind](variant)
    out = model.generate(**inputs, do_sample=False, **FIXED_LENGTH, cache_implementation=cache_implementation,
                         return_dict_in_generate=True, output_logits=True)
    step_logits = torch.stack(out.logits, dim=1)  # (B, new tokens, V)
    with torch.no_grad():
        if kind == "seq2seq":
            full = model(**inputs, decoder_input_ids=out.sequences[:, :-1]).logits
        else:
            prompt_length = inputs["input_ids"].shape[1]
            mask = torch.cat([inputs["attention_mask"], torch.ones_like(out.sequences[:, prompt_length:])], dim=1)
            # Left padding: a row's positions count its real tokens only, as generate() derives them from the mask.
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            full = model(input_ids=out.sequences[:, :-1], attention_mask=mask[:, :-1],
                         position_ids=position_ids[:, :-1]).logits
            full = full[:, prompt_length - 1 :]
    torch.testing.assert_close(step_logits, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_stepwise_cache_api_matches_full_forward(variant):
    """The same check through forward() with the cache, one target token at a time."""
    model, inputs = seq2seq(variant)
    target = random_ids(model.config, 3, 5, seed=2)
    with torch.no_grad():
        full = model(**inputs, decoder_input_ids=target).logits
        encoder_outputs = model.get_encoder()(**inputs)
        past, steps = None, []
        for t in range(target.shape[1]):
            out = model(encoder_outputs=encoder_outputs, attention_mask=inputs["attention_mask"],
                        decoder_input_ids=target[:, t : t + 1], **{CACHE_NAME: past}, use_cache=True)
            past = getattr(out, CACHE_NAME)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "strategy", [{"do_sample": False}, {"do_sample": False, "num_beams": 4}], ids=["greedy", "beam4"]
)
def test_causal_lm_left_padded_batch_equals_one_prompt_at_a_time(variant, strategy):
    model, inputs = causal(variant)
    batched = model.generate(**inputs, **strategy, **FIXED_LENGTH)
    for row in range(inputs["input_ids"].shape[0]):
        prompt = inputs["input_ids"][row][inputs["attention_mask"][row].bool()][None]
        alone = model.generate(input_ids=prompt, **strategy, **FIXED_LENGTH)
        assert torch.equal(batched[row, -NEW_TOKENS:], alone[0, -NEW_TOKENS:]), f"row {row}"


def test_seq2seq_padded_batch_equals_one_source_at_a_time():
    model, inputs = seq2seq("modern")
    batched = model.generate(**inputs, do_sample=False, **FIXED_LENGTH)
    for row in range(inputs["input_ids"].shape[0]):
        source = inputs["input_ids"][row][inputs["attention_mask"][row].bool()][None]
        assert torch.equal(batched[row], model.generate(input_ids=source, do_sample=False, **FIXED_LENGTH)[0])


@pytest.mark.parametrize("strategy", [{"num_beams": 1}, {"num_beams": 4}], ids=["greedy", "beam4"])
@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_cross_attention_keys_and_values_are_projected_once(strategy, cache_implementation):
    model, inputs = seq2seq("paper")
    calls = []
    projections = [layer.encoder_attn.k_proj for layer in model.model.decoder.layers]
    projections += [layer.encoder_attn.v_proj for layer in model.model.decoder.layers]
    hooks = [projection.register_forward_hook(lambda *_: calls.append(1)) for projection in projections]
    out = model.generate(**inputs, do_sample=False, **strategy, **FIXED_LENGTH,
                         cache_implementation=cache_implementation, return_dict_in_generate=True)
    for hook in hooks:
        hook.remove()
    assert out.sequences.shape[1] == NEW_TOKENS + 1
    assert len(calls) == 2 * model.config.decoder_layers  # one k and one v projection per layer, for all 6 steps
    assert all(getattr(out, CACHE_NAME).is_updated.values())


def test_generation_config_uses_the_special_tokens():
    model, inputs = seq2seq("paper")
    config: VaswaniConfig = model.config
    assert model.generation_config.decoder_start_token_id == config.decoder_start_token_id
    assert model.generation_config.eos_token_id == config.eos_token_id
    assert model.generation_config.pad_token_id == config.pad_token_id
    tokens = model.generate(**inputs, do_sample=False, max_new_tokens=3)
    assert (tokens[:, 0] == config.decoder_start_token_id).all()


@pytest.mark.parametrize("kind", BUILDERS)
def test_normal_use_raises_no_deprecation_notice(kind):
    """A training step and generate() (greedy and beam, transformers' loop and the lean one, dynamic and static
    cache) use each name as the installed transformers release expects it: no deprecation warning, and none of
    transformers' once-per-process notices (`past_key_values` is deprecated from 5.24 on)."""
    model, inputs = BUILDERS[kind]("paper")
    logging.Logger.warning_once.cache_clear()  # notices already given earlier in this process would not repeat
    with CaptureLogger(transformers_logging.get_logger("transformers")) as logs, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.train()
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        model.eval()
        for options in ({"num_beams": 1}, {"num_beams": 2}, {"num_beams": 2, "cache_implementation": "static"}):
            model.generate(**inputs, do_sample=False, max_new_tokens=3, **options)
            if kind == "seq2seq":
                model.generate(**inputs, max_new_tokens=3, custom_generate=vaswani.decoding.decode, **options)
    notices = [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert not notices and "deprecated" not in logs.out, (notices, logs.out)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("num_beams", [1, 4])
def test_the_lean_loop_builds_no_mask_per_step_and_decodes_as_with_them(monkeypatch, attn_implementation, num_beams):
    """A decoding step of one token on a growing cache needs no causal mask, and the sources' mask is built once
    per batch: on a CPU, building them took a measurable share of every step. The outputs stay transformers'."""
    import vaswani.modeling_vaswani as modeling

    model, inputs = seq2seq("paper")
    model.config._attn_implementation = attn_implementation
    options = {**inputs, "num_beams": num_beams, **FIXED_LENGTH}
    expected = model.generate(**options, lean_decoding=False)
    built = []
    for name in ("create_causal_mask", "create_bidirectional_mask"):
        original = getattr(modeling, name)

        def counted(*args, original=original, name=name, **kwargs):
            if name == "create_causal_mask" or kwargs.get("encoder_hidden_states") is not None:  # not the encoder's
                built.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(modeling, name, counted)

    got = model.generate(**options, lean_decoding=True)

    assert torch.equal(got, expected)
    assert built == [], built  # the decoder builds no mask at any step
