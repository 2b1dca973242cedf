"""transformers' generation tests (`GenerationTesterMixin`, tests/generation/test_utils.py of its repository), written
in their image for the two generative classes: the test names are the mixin's, and so are the calls and assertions
of the ones that apply to an encoder-decoder and a decoder-only language model.

The release's sdist does not ship that file, so tests/test_upstream_suite.py stands in an empty mixin
(docs/upstream-suite.md); without this module a broken stock call (`forward(input_ids, position_ids=...)` with no
decoder inputs, as `test_custom_4d_attention_mask` makes it) would go unseen. Left out, as the mixin leaves them out
for such a model or as transformers 5 moved them out of the library: group, constrained and contrastive beam search
and DoLa (Hub `custom_generate` recipes now), quantized and offloaded caches, head masking, and the tests that need
an accelerator, flash attention or torch.compile.

`generate()` decodes greedy and beam search of the translation model with the lean loop on a CPU
(`generation_vaswani`) and hands everything else to transformers' loop; these tests hold both to the mixin's
contracts. Configs are tiny (width 16, 2 + 2 layers, 4 heads; prompts of 7 tokens, batch 2), as the mixin's are.
"""

import dataclasses
import inspect
import unittest

import pytest
import torch
from transformers import GenerationMixin
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache, StaticCache
from transformers.generation import (
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
)

from conftest import FIRST_ORDINARY_ID
from vaswani import VaswaniConfig, VaswaniForCausalLM, VaswaniForConditionalGeneration
from vaswani.modeling_vaswani import CACHE_NAME, shift_tokens_right

pytestmark = pytest.mark.usefixtures("single_thread")


@dataclasses.dataclass
class GenerationModelTester:
    """A tiny config and a batch of prompts, after the upstream suite's tester (tests/test_upstream_suite.py)."""

    is_encoder_decoder: bool
    batch_size: int = 13
    seq_length: int = 7
    vocab_size: int = 99
    hidden_size: int = 16
    num_hidden_layers: int = 2
    num_attention_heads: int = 4

    def get_config(self, **overrides) -> VaswaniConfig:
        return VaswaniConfig(
            vocab_size=self.vocab_size, d_model=self.hidden_size, encoder_layers=self.num_hidden_layers,
            decoder_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads, d_ff=4 * self.hidden_size,
            max_position_embeddings=100, dropout=0.0, is_encoder_decoder=self.is_encoder_decoder, **overrides,
        )

    def prepare_config_and_inputs_for_common(self, **overrides):
        generator = torch.Generator().manual_seed(0)
        shape = (self.batch_size, self.seq_length)
        input_ids = torch.randint(FIRST_ORDINARY_ID, self.vocab_size, shape, generator=generator)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        if self.is_encoder_decoder:
            decoder_input_ids = torch.randint(FIRST_ORDINARY_ID, self.vocab_size, shape, generator=generator)
            inputs.update(decoder_input_ids=decoder_input_ids, decoder_attention_mask=torch.ones_like(input_ids))
        return self.get_config(**overrides), inputs


class GenerationTesterMixin:
    """The checks of transformers' mixin of that name that apply to this model; `model_tester` and
    `all_generative_model_classes` come from the test case, as upstream."""

    model_tester: GenerationModelTester
    all_generative_model_classes: tuple = ()
    max_new_tokens = 3

    # Inputs and generate() calls, as the mixin makes them ------------------------------------------------------------

    def prepare_config_and_inputs_for_generate(self, batch_size=2, **overrides):
        """Two prompts, no decoder inputs (generation starts from the decoder's start token), and no end-of-sequence
        token: every call then generates exactly `max_new_tokens`, which the length checks rely on."""
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common(**overrides)
        config.eos_token_id = None
        config.forced_eos_token_id = None
        return config, {name: value[:batch_size] for name, value in inputs.items()
                        if name not in ("decoder_input_ids", "decoder_attention_mask")}

    def _get_logits_processor_kwargs(self, do_sample=False):
        kwargs = {"bad_words_ids": [[1, 0]], "repetition_penalty": 1.2, "remove_invalid_values": True}
        if do_sample:
            kwargs.update(top_k=10, top_p=0.7, temperature=0.7)
        return kwargs

    def _get_beam_kwargs(self, num_return_sequences=1):
        return {"early_stopping": False, "length_penalty": 2.0, "num_beams": 2,
                "num_return_sequences": num_return_sequences}

    def _generate(self, model, inputs_dict, do_sample=False, **kwargs):
        torch.manual_seed(0)
        return model.generate(do_sample=do_sample, max_new_tokens=self.max_new_tokens,
                              **self._get_logits_processor_kwargs(do_sample), **kwargs, **inputs_dict)

    def _dict_outputs(self, use_cache):
        return {"output_scores": True, "output_logits": True, "output_hidden_states": True,
                "output_attentions": True, "return_dict_in_generate": True, "use_cache": use_cache}

    def _expected_length(self, model, inputs_dict) -> int:
        start = 1 if model.config.is_encoder_decoder else inputs_dict["input_ids"].shape[-1]
        return start + self.max_new_tokens

    def _model(self, model_class, config):
        return model_class(config).eval()

    # Output checks ---------------------------------------------------------------------------------------------------

    def _check_outputs(self, output, config, use_cache=False, num_return_sequences=1, num_beams=1):
        input_batch_size = output.sequences.shape[0] // num_return_sequences
        internal_batch_size = input_batch_size * (num_beams if num_beams > 1 else num_return_sequences)
        seq_length = self.model_tester.seq_length
        gen_len = output.sequences.shape[-1] - (1 if config.is_encoder_decoder else seq_length)

        vocab_size = config.get_text_config(decoder=True).vocab_size
        self.assertEqual(len(output.scores), gen_len)
        self.assertEqual([s.shape for s in output.scores], [(internal_batch_size, vocab_size)] * gen_len)
        self.assertEqual([s.shape for s in output.logits], [(internal_batch_size, vocab_size)] * gen_len)

        if config.is_encoder_decoder:
            encoder_attention = (input_batch_size, config.num_attention_heads, seq_length, seq_length)
            self.assertEqual([a.shape for a in output.encoder_attentions],
                             [encoder_attention] * config.encoder_layers)
            self.assertEqual([h.shape for h in output.encoder_hidden_states],
                             [(input_batch_size, seq_length, config.d_model)] * (config.encoder_layers + 1))
            attentions, hidden_states, min_length = output.decoder_attentions, output.decoder_hidden_states, 1
        else:
            # With a cache, the first step reads the whole prompt, as a step without one does: skipped.
            attentions, hidden_states = output.attentions, output.hidden_states
            if use_cache:
                attentions, hidden_states = attentions[1:], hidden_states[1:]
            min_length = seq_length + 1 if use_cache else seq_length
        max_length = output.sequences.shape[-1]
        self.assertEqual(len(attentions), max_length - min_length)
        self.assertEqual(len(hidden_states), max_length - min_length)
        for step, (step_attentions, step_hidden_states) in enumerate(zip(attentions, hidden_states)):
            target_length = 1 if use_cache else min_length + step
            expected = (internal_batch_size, config.num_attention_heads, target_length, min_length + step)
            self.assertEqual([a.shape for a in step_attentions], [expected] * config.decoder_layers)
            self.assertEqual([h.shape for h in step_hidden_states],
                             [(internal_batch_size, target_length, config.d_model)] * (config.decoder_layers + 1))

        cache = getattr(output, CACHE_NAME)
        if not use_cache:
            self.assertIsNone(cache)
            return
        self._check_past_key_values_for_generate(internal_batch_size, cache, max_length - 1, config)

    def _check_past_key_values_for_generate(self, batch_size, cache, seq_length, config):
        self.assertIsInstance(cache, Cache)
        if isinstance(cache, EncoderDecoderCache):
            cache = cache.self_attention_cache
        expected = (batch_size, config.num_key_value_heads or config.num_attention_heads, seq_length,
                    config.d_model // config.num_attention_heads)
        self.assertEqual([layer.keys.shape for layer in cache.layers], [expected] * config.decoder_layers)
        self.assertEqual([layer.values.shape for layer in cache.layers], [expected] * config.decoder_layers)

    # The tests -------------------------------------------------------------------------------------------------------

    def test_greedy_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs_dict = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            output = self._generate(model, inputs_dict, num_beams=1)
            self.assertEqual(output.shape[-1], self._expected_length(model, inputs_dict))

    def test_greedy_generate_dict_outputs(self):
        self._check_dict_outputs(num_beams=1, use_cache=False)

    def test_greedy_generate_dict_outputs_use_cache(self):
        self._check_dict_outputs(num_beams=1, use_cache=True)

    def test_sample_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs_dict = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            output = self._generate(model, inputs_dict, do_sample=True, num_beams=1, num_return_sequences=1)
            self.assertEqual(output.shape[-1], self._expected_length(model, inputs_dict))

    def test_sample_generate_dict_output(self):
        self._check_dict_outputs(num_beams=1, use_cache=False, do_sample=True, num_return_sequences=2)

    def test_beam_search_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs_dict = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            output = self._generate(model, inputs_dict, **self._get_beam_kwargs())
            self.assertEqual(output.shape[-1], self._expected_length(model, inputs_dict))

    def test_beam_search_generate_dict_output(self):
        self._check_dict_outputs(num_beams=2, use_cache=False)

    def test_beam_search_generate_dict_outputs_use_cache(self):
        self._check_dict_outputs(num_beams=2, use_cache=True)

    def test_beam_sample_generate(self):
        for model_class in self.all_generative_model_classes:
            config, inputs_dict = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            output = self._generate(model, inputs_dict, do_sample=True, **self._get_beam_kwargs())
            self.assertEqual(output.shape[-1], self._expected_length(model, inputs_dict))

    def test_beam_sample_generate_dict_output(self):
        self._check_dict_outputs(num_beams=2, use_cache=False, do_sample=True)

    def _check_dict_outputs(self, num_beams, use_cache, do_sample=False, num_return_sequences=1):
        """The `*_dict_output(s)` tests: scores, logits, attentions, hidden states and the cache of each step, with
        the output class of the decoding method. Eager attention: sdpa returns no attention weights."""
        for model_class in self.all_generative_model_classes:
            config, inputs_dict = self.prepare_config_and_inputs_for_generate(attn_implementation="eager")
            model = self._model(model_class, config)
            beam_kwargs = self._get_beam_kwargs(num_return_sequences) if num_beams > 1 else {
                "num_beams": 1, "num_return_sequences": num_return_sequences}
            output = self._generate(model, inputs_dict, do_sample=do_sample, **beam_kwargs,
                                    **self._dict_outputs(use_cache))
            self.assertEqual(output.sequences.shape[-1], self._expected_length(model, inputs_dict))
            encoder_decoder = model.config.is_encoder_decoder
            if num_beams > 1:
                expected = GenerateBeamEncoderDecoderOutput if encoder_decoder else GenerateBeamDecoderOnlyOutput
            else:
                expected = GenerateEncoderDecoderOutput if encoder_decoder else GenerateDecoderOnlyOutput
            self.assertIsInstance(output, expected)
            self._check_outputs(output, model.config, use_cache=use_cache, num_return_sequences=num_return_sequences,
                                num_beams=num_beams)

    def test_generate_without_input_ids(self):
        config, _ = self.prepare_config_and_inputs_for_generate()
        self.assertIsNotNone(config.bos_token_id)
        for model_class in self.all_generative_model_classes:
            model = self._model(model_class, config)
            output = model.generate(do_sample=False, max_new_tokens=self.max_new_tokens, remove_invalid_values=True)
            self.assertIsNotNone(output)

    def test_assisted_decoding_matches_greedy_search(self):
        """Assisted decoding, with the model as its own assistant and with another one, gives greedy search's
        tokens (transformers checks the scores where the tokens part); one prompt, as assisted decoding takes."""
        for model_class in self.all_generative_model_classes:
            config, inputs_dict = self.prepare_config_and_inputs_for_generate(batch_size=1)
            model = self._model(model_class, config)
            kwargs = {"eos_token_id": -1, "max_new_tokens": 4, "num_beams": 1, "do_sample": False,
                      "output_scores": True, "return_dict_in_generate": True, "use_cache": True,
                      **self._get_logits_processor_kwargs()}
            greedy = model.generate(**kwargs, **inputs_dict)
            for assistant in (model, self._model(model_class, config)):
                assistant.generation_config.num_assistant_tokens = 2
                assistant.generation_config.num_assistant_tokens_schedule = "constant"
                assisted = model.generate(**kwargs, **inputs_dict, assistant_model=assistant)
                self._check_similar_generate_outputs(greedy, assisted)

    def _check_similar_generate_outputs(self, output_1, output_2, atol=1e-5, rtol=1e-5):
        """The mixin's rule: the same tokens, or the same scores up to the first token where they part."""
        if torch.equal(output_1.sequences, output_2.sequences):
            return
        prompt_length = output_1.sequences.shape[1] - len(output_1.scores)
        for row in range(output_1.sequences.shape[0]):
            matches = output_1.sequences[row] == output_2.sequences[row]
            if matches.all():
                continue
            step = int(matches.int().argmin()) - prompt_length
            torch.testing.assert_close(output_1.scores[step][row], output_2.scores[step][row], atol=atol, rtol=rtol)

    def test_left_padding_compatibility(self):
        """A decoder-only model's next-token logits do not change when the prompt is left-padded (by 32 tokens, with
        positions counted from the first real token); an encoder-decoder pads its sources on the right."""
        for model_class in self.all_generative_model_classes:
            config, inputs_dict = self.prepare_config_and_inputs_for_generate()
            if config.is_encoder_decoder:
                self.skipTest("an encoder-decoder pads on the right")
            model = self._model(model_class, config)
            input_ids, attention_mask = inputs_dict["input_ids"], inputs_dict["attention_mask"]

            def next_logits(ids, mask):
                position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
                with torch.no_grad():
                    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1]

            padding = torch.full((input_ids.shape[0], 32), config.pad_token_id)
            padded = next_logits(torch.cat((padding, input_ids), 1),
                                 torch.cat((torch.zeros_like(padding), attention_mask), 1))
            torch.testing.assert_close(next_logits(input_ids, attention_mask), padded, rtol=1e-5, atol=1e-5)

    def test_past_key_values_format(self):
        """A forward pass with `use_cache` returns transformers' cache classes, one layer per decoder layer, keys and
        values (batch, kv heads, length, head_dim); an encoder-decoder's also holds the cross-attention's."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            model = self._model(model_class, config)
            with torch.no_grad():
                cache = getattr(model(**inputs, use_cache=True), CACHE_NAME)
            batch_size, seq_length = (inputs.get("decoder_input_ids", inputs["input_ids"])).shape
            self._check_past_key_values_for_generate(batch_size, cache, seq_length, config)
            if config.is_encoder_decoder:
                self.assertIsInstance(cache, EncoderDecoderCache)
                source_length = inputs["input_ids"].shape[1]
                expected = (batch_size, config.num_attention_heads, source_length,
                            config.d_model // config.num_attention_heads)
                self.assertEqual([layer.keys.shape for layer in cache.cross_attention_cache.layers],
                                 [expected] * config.decoder_layers)

    def test_generate_from_inputs_embeds(self):
        """A decoder-only model generates from `inputs_embeds` the tokens it generates from the ids they embed, and
        other tokens from other embeddings (greedy and beam search); an encoder-decoder's encoder takes embeddings
        natively."""
        for model_class in self.all_generative_model_classes:
            config, inputs_dict = self.prepare_config_and_inputs_for_generate()
            if config.is_encoder_decoder:
                continue
            # Embeddings stand in for the ids only where the model does not scale them (the paper's √d_model).
            config.scale_embedding = False
            model = self._model(model_class, config)
            input_ids = inputs_dict.pop("input_ids")
            for num_beams in (1, 2):
                kwargs = {"return_dict_in_generate": True, "output_scores": True, "num_beams": num_beams,
                          "do_sample": False, "max_new_tokens": 5, "min_new_tokens": 5}
                from_ids = model.generate(input_ids, **kwargs, **inputs_dict)
                self.assertEqual(from_ids.sequences.shape, (input_ids.shape[0], input_ids.shape[1] + 5))
                inputs_embeds = model.get_input_embeddings()(input_ids)
                from_embeds = model.generate(input_ids, inputs_embeds=inputs_embeds, **kwargs, **inputs_dict)
                self._check_similar_generate_outputs(from_ids, from_embeds)
                from_random = model.generate(input_ids, inputs_embeds=torch.rand_like(inputs_embeds), **kwargs,
                                             **inputs_dict)
                for step in range(len(from_random.scores)):
                    self.assertFalse(torch.allclose(from_embeds.scores[step], from_random.scores[step]))
                without_ids = model.generate(inputs_embeds=inputs_embeds, **kwargs, **inputs_dict)
                from_embeds.sequences = from_embeds.sequences[:, inputs_embeds.shape[1]:]
                self._check_similar_generate_outputs(without_ids, from_embeds)

    def test_generate_continue_from_past_key_values(self):
        """Generating 3 tokens, then 1 more from the returned cache, gives the tokens and the cache of generating 4
        at once. An encoder-decoder continues its decoder inputs; their attention mask, grown by the new tokens, tells
        generate() which of them the cache already holds."""
        for model_class in self.all_generative_model_classes:
            config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
            model = self._model(model_class, config)
            model.generation_config.pad_token_id = model.generation_config.eos_token_id = -1
            model.generation_config.forced_eos_token_id = None
            model.generation_config.use_cache = True

            at_once = model.generate(**inputs, do_sample=False, max_new_tokens=4, return_dict_in_generate=True)
            first = model.generate(**inputs, do_sample=False, max_new_tokens=3, return_dict_in_generate=True)
            continued = dict(inputs)
            continued[CACHE_NAME] = getattr(first, CACHE_NAME)
            ids, mask = ("decoder_input_ids", "decoder_attention_mask") if config.is_encoder_decoder else (
                "input_ids", "attention_mask")
            continued[ids] = first.sequences
            continued[mask] = torch.nn.functional.pad(inputs[mask], (0, first.sequences.shape[-1] - inputs[mask].shape[1]),
                                                      value=1)
            then = model.generate(**continued, do_sample=False, max_new_tokens=1, return_dict_in_generate=True)

            self.assertEqual(at_once.sequences.tolist(), then.sequences.tolist())
            for cache_1, cache_2 in zip(self._caches(getattr(at_once, CACHE_NAME)),
                                        self._caches(getattr(then, CACHE_NAME))):
                for layer_1, layer_2 in zip(cache_1.layers, cache_2.layers):
                    torch.testing.assert_close(layer_1.keys, layer_2.keys)
                    torch.testing.assert_close(layer_1.values, layer_2.values)

    @staticmethod
    def _caches(cache):
        if isinstance(cache, EncoderDecoderCache):
            return [cache.self_attention_cache, cache.cross_attention_cache]
        return [cache]

    def test_generate_with_static_cache(self):
        """A static cache generates what a dynamic one does (20 tokens), and has the shape it was made for."""
        for model_class in self.all_generative_model_classes:
            config, inputs_dict = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            kwargs = {"max_new_tokens": 20, "return_dict_in_generate": True, "output_scores": True, "use_cache": True}
            static = model.generate(**kwargs, **inputs_dict, cache_implementation="static")
            cache = getattr(static, CACHE_NAME)
            self_attention = cache.self_attention_cache if config.is_encoder_decoder else cache
            self.assertIsInstance(self_attention, StaticCache)
            max_cache_len = 1 + 20 if config.is_encoder_decoder else inputs_dict["input_ids"].shape[-1] + 20
            # A static cache holds as many positions as generate() will write.
            self.assertGreaterEqual(self_attention.layers[0].keys.shape[-2], max_cache_len - 1)
            self.assertEqual(self_attention.layers[0].keys.shape[0], inputs_dict["input_ids"].shape[0])
            dynamic = model.generate(**kwargs, **inputs_dict)
            dynamic_self_attention = getattr(dynamic, CACHE_NAME)
            if config.is_encoder_decoder:
                dynamic_self_attention = dynamic_self_attention.self_attention_cache
            self.assertIsInstance(dynamic_self_attention, DynamicCache)
            self._check_similar_generate_outputs(dynamic, static)

    def test_generate_methods_with_logits_to_keep(self):
        for model_class in self.all_generative_model_classes:
            self.assertIn("logits_to_keep", inspect.signature(model_class.forward).parameters)
            config, inputs_dict = self.prepare_config_and_inputs_for_generate()
            model = self._model(model_class, config)
            kwargs = {"max_new_tokens": 10, "do_sample": False}
            with_all_logits = model.generate(**kwargs, **inputs_dict, logits_to_keep=0)
            without_all_logits = model.generate(**inputs_dict, **kwargs)
            self.assertEqual(with_all_logits.tolist(), without_all_logits.tolist())

    def test_inherits_generation_mixin(self):
        for model_class in self.all_generative_model_classes:
            self.assertIn(GenerationMixin, model_class.__bases__)

    def test_custom_4d_attention_mask(self):
        """Three rows that share a prefix, passed with `position_ids`, and the same tokens as one row whose three last
        tokens share a position and do not see each other (a 4D float mask): the last tokens' next-token
        distributions agree. The stock call passes a decoder-only model's tokens as `input_ids`; an encoder-decoder's
        decoder tokens are its decoder inputs (as transformers' T5 tests pass them), beside one source."""
        prefix = [10, 11, 12]
        rows = torch.tensor([prefix + [13], prefix + [14], prefix + [15]])
        shared = torch.tensor([prefix + [13, 14, 15]])
        allowed = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 1]])
        mask = allowed.eq(0)[None, None].float() * torch.finfo(torch.float32).min
        for model_class in self.all_generative_model_classes:
            for attn_implementation in ("eager", "sdpa"):
                config, inputs = self.model_tester.prepare_config_and_inputs_for_common(
                    attn_implementation=attn_implementation)
                model = self._model(model_class, config)
                if config.is_encoder_decoder:
                    source = inputs["input_ids"][:1]
                    separate = {"input_ids": source.expand(3, -1), "decoder_input_ids": rows}
                    together = {"input_ids": source, "decoder_input_ids": shared, "decoder_attention_mask": mask}
                else:
                    separate = {"input_ids": rows}
                    together = {"input_ids": shared, "attention_mask": mask}
                with torch.no_grad():
                    # The stock call itself, whatever the model: only input_ids and position_ids.
                    self.assertEqual(model.forward(rows, position_ids=torch.arange(4).expand(3, -1)).logits.shape,
                                     (3, 4, config.get_text_config(decoder=True).vocab_size))
                    logits = model(**separate, position_ids=torch.arange(4).expand(3, -1)).logits
                    shared_logits = model(**together, position_ids=torch.tensor([[0, 1, 2, 3, 3, 3]])).logits
                torch.testing.assert_close(logits[:, -1].softmax(-1), shared_logits[0, -3:].softmax(-1),
                                           rtol=1e-3, atol=1e-4)


class VaswaniForConditionalGenerationGenerationTest(GenerationTesterMixin, unittest.TestCase):
    all_generative_model_classes = (VaswaniForConditionalGeneration,)

    def setUp(self):
        self.model_tester = GenerationModelTester(is_encoder_decoder=True)


class VaswaniForCausalLMGenerationTest(GenerationTesterMixin, unittest.TestCase):
    all_generative_model_classes = (VaswaniForCausalLM,)

    def setUp(self):
        self.model_tester = GenerationModelTester(is_encoder_decoder=False)


def test_encoder_inputs_alone_are_read_by_the_decoder_shifted_right():
    """transformers' encoder-decoders (BART, T5) answer a call without decoder inputs or labels by reading the source
    shifted right; the stock test calls (`test_custom_4d_attention_mask`'s `forward(input_ids, position_ids=...)`)
    rely on it. A model with a target vocabulary of its own cannot, and says what to pass."""
    config = GenerationModelTester(is_encoder_decoder=True).get_config()
    model = VaswaniForConditionalGeneration(config).eval()
    input_ids = torch.randint(FIRST_ORDINARY_ID, config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    shifted = shift_tokens_right(input_ids, config.pad_token_id, config.decoder_start_token_id)
    positions = torch.arange(5).expand(3, -1) + 1
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, model(input_ids, decoder_input_ids=shifted).logits,
                                   rtol=0, atol=0)
        torch.testing.assert_close(model(input_ids, position_ids=positions).logits,
                                   model(input_ids, decoder_input_ids=shifted, position_ids=positions).logits,
                                   rtol=0, atol=0)
    separate = VaswaniForConditionalGeneration(
        GenerationModelTester(is_encoder_decoder=True).get_config(share_embeddings=False, decoder_vocab_size=50))
    with pytest.raises(ValueError, match="target vocabulary of its own"):
        separate(input_ids)
