"""The one translation path: engines that turn batches of token ids into translations, and `translate`, which
cuts a list of sentences into token-budget batches, runs them through an engine and returns the translations in
input order, with the number of sources it truncated.

Every caller goes through `translate`: `vaswani.evaluation` (BLEU during and after training), `vaswani.export`
(the CTranslate2 export), `vaswani.file_translation` (which adds chunks, resume and processes) and the scripts.
So one rule decides how sources are truncated and how the output length is limited, whichever engine runs. The
benchmarks time the engines' own calls below the decoding to text: `generate_token_ids` and
`CTranslate2Engine.generate_ids`.

Engines are built by `vaswani.loading` (`load_engine`, `engine_for_model`), which decides device, precision and
loop; each reads the decoding settings it is not given from the model's `generation_config` (`decoding_settings`),
which training writes (`write_decoding_defaults`). An engine has `max_source_length` (None: no limit), `positions`
(what that limit counts, for the warning), `continuous`, `encode(sentences, truncate=False)` and
`translate_batch(batch of token ids) → strings`:

* `TorchEngine`: a transformers model's `generate()` (a Vaswani or converted model, fp32, bf16 or int8, any
  decoding loop), truncating sources where the model's positions end (`generation_limits`); or, with `slots`,
  `generation_vaswani.decode_in_slots`, an engine that is `continuous`: it takes every sentence in one batch and
  keeps its own batch full;
* `CTranslate2Engine`: a model exported by `vaswani.export` (`vaswani.loading.load_ctranslate2`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
from transformers import GenerationConfig

from .batching import token_budget_batches
# OUTPUT_SLACK: the length rule's slack, under this module's name too.
from .configuration_vaswani import OUTPUT_SLACK, length_options, longest_output, output_limit  # noqa: F401
from .generation_vaswani import decode_in_slots, slots_cover

# Per device type, the slots that `TorchEngine` decodes in when not told (`slots=None`); a device type not listed
# decodes in batches.
DEFAULT_SLOTS: dict[str, int] = {}


class Engine(Protocol):
    max_source_length: int | None
    positions: str
    continuous: bool  # whether `translate_batch` takes every sentence at once and keeps its own batch full
    settings: dict  # what decides its outputs (beams, length limit, precision…), for a resumed run to compare

    def encode(self, sentences: Sequence[str], truncate: bool = False) -> list[list[int]]: ...

    def translate_batch(self, batch: list[list[int]]) -> list[str]: ...


def decoding_settings(generation_config, **overrides) -> dict:
    """The settings an engine decodes with: each of `overrides` that is not None, and where `num_beams` or
    `max_new_tokens` is not given, the `generation_config`'s (sampling without a beam count: one beam). A
    `max_new_tokens` that neither gives is left out: the engines then allow each source's length plus
    `OUTPUT_SLACK`. Every other `generate()` option not given, `generate()` itself takes from the generation
    config."""
    settings = {name: value for name, value in overrides.items() if value is not None}
    if "num_beams" not in settings:
        settings["num_beams"] = 1 if settings.get("do_sample") else generation_config.num_beams or 1
    if "max_new_tokens" not in settings and generation_config.max_new_tokens is not None:
        settings["max_new_tokens"] = generation_config.max_new_tokens
    return settings


def write_decoding_defaults(generation_config, *, num_beams: int, length_penalty: float | None,
                            max_new_tokens: int | None = None, max_length: int | None = None) -> None:
    """Write the decoding settings a model is evaluated with into its `generation_config`, so that every later
    decoding uses them: our engines (`decoding_settings`), and a stock `generate()` or `pipeline` (remote-code users).
    `length_penalty` is beam search's (transformers refuses it beside greedy search, so one beam drops it).
    `max_new_tokens` None keeps the one length rule of the engines (each source's length plus `OUTPUT_SLACK`), which
    `generate()` cannot express; it then needs `max_length`, the longest output the model allows (its
    `config.max_position_embeddings`), in place of `generate()`'s default of 20 tokens."""
    if max_new_tokens is None and max_length is None:
        raise ValueError("without max_new_tokens, give max_length (the model's max_position_embeddings): a stock "
                         "generate() would stop at 20 tokens.")
    generation_config.num_beams = num_beams
    generation_config.length_penalty = length_penalty if num_beams > 1 else None
    generation_config.max_new_tokens = max_new_tokens
    generation_config.max_length = None if max_new_tokens is not None else max_length


def generation_limits(model, max_new_tokens: int | None) -> tuple[int | None, int | None]:
    """(max_source_length, max_new_tokens) that a model with learned positions can take: sources are truncated to
    its `max_position_embeddings` and the output stops there. Sinusoidal and rotary positions have no limit."""
    longest = longest_output(model.config)
    if longest is None:
        return None, max_new_tokens
    return model.config.max_position_embeddings, longest if max_new_tokens is None else min(max_new_tokens, longest)


class TorchEngine:
    """Batches of token ids → translations with `model.generate()`, decoding as `decoding_settings` says (the
    arguments, else the model's `generation_config`). `max_new_tokens` unset by both allows the batch's
    longest source plus 50 tokens (the paper's limit; a batch holds sentences of similar length, so that is close
    to the per-sentence rule); `max_source_length` is where sources are truncated, by default where the model's
    positions end. Whatever the caller asks, no output runs past a learned position table
    (`generation_limits`; sinusoidal and rotary positions have no end).

    With `slots=S` the engine decodes continuously (`generation_vaswani.decode_in_slots`): S sentences side by
    side, each finished one replaced at once by the next, so `translate` hands it all sentences as one stream
    (`continuous`) and each output gets the paper's limit for its own source (its length plus 50 tokens). Each
    output is then what `generate()` gives that sentence alone. For the options that the slots do not cover
    (`slots_cover`: logits processors, several outputs per sentence…) the engine decodes batches as without slots.
    `slots=None` takes `DEFAULT_SLOTS` for the model's device type, 0 decodes in batches. Built by
    `vaswani.loading` (which checks that the tokenizer fits the model)."""

    positions = "learned positions"

    def __init__(self, model, tokenizer, *, max_source_length: int | None = None, slots: int | None = None,
                 **decoding_overrides):
        self.model, self.tokenizer = model.eval(), tokenizer
        table, self.longest_output = generation_limits(model, None)
        self.max_source_length = table if max_source_length is None else max_source_length
        self.options = decoding_settings(model.generation_config, **decoding_overrides)
        self.max_new_tokens = self.options.pop("max_new_tokens", None)
        if slots is None:
            slots = DEFAULT_SLOTS.get(model.device.type)
        self.slots = slots if slots and slots_cover(model, **self.options) else None

    @property
    def continuous(self) -> bool:
        """Whether `translate_batch` takes any number of sentences and keeps its own batch full."""
        return self.slots is not None

    @property
    def settings(self) -> dict:
        return {"engine": "pytorch", "length_penalty": self.model.generation_config.length_penalty, **self.options,
                "max_new_tokens": self.max_new_tokens, "precision": str(self.model.dtype).removeprefix("torch.")}

    def encode(self, sentences: Sequence[str], truncate: bool = False) -> list[list[int]]:
        return encode(self.tokenizer, sentences, self.max_source_length if truncate else None)

    def translate_batch(self, batch: list[list[int]]) -> list[str]:
        if self.continuous:
            limits = [output_limit(len(ids), self.max_new_tokens, self.longest_output) for ids in batch]
            with torch.inference_mode():
                outputs = decode_in_slots(self.model, batch, limits, slots=self.slots, **self.options)
            eos = self.options.get("eos_token_id", self.model.generation_config.eos_token_id)
            generated = [output_ids(output[1:], eos) for output in outputs]
            return self.tokenizer.batch_decode(generated, skip_special_tokens=True)
        padded = self.tokenizer.pad({"input_ids": batch}, return_tensors="pt")
        input_ids = padded["input_ids"].to(self.model.device)  # (batch, longest source in batch)
        limit = output_limit(input_ids.shape[1], self.max_new_tokens, self.longest_output)
        generated = generate_token_ids(self.model, input_ids, padded["attention_mask"].to(self.model.device),
                                       max_new_tokens=limit, **self.options)
        return self.tokenizer.batch_decode(generated, skip_special_tokens=True)


def generate_token_ids(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       **generate_kwargs) -> list[list[int]]:
    """`model.generate()` on a padded batch of sources, returning each sentence's generated token ids: without the
    decoder start token, and up to its end of sentence (not included; what follows it in the batch's tensor is only
    the filler of a finished row). With `eos_token_id=None` nothing ends a sentence, and all `max_new_tokens` ids of
    every row are returned: the forced length under which the benchmarks compare engines on identical work."""
    if "max_new_tokens" in generate_kwargs and model.config.is_encoder_decoder:
        generate_kwargs |= length_options(generate_kwargs.pop("max_new_tokens"))
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    rows = output[:, 1:].tolist()  # the first column is the decoder start token
    eos = generate_kwargs.get("eos_token_id", model.generation_config.eos_token_id)
    return [output_ids(row, eos) for row in rows]


def output_ids(row: list[int], eos: int | list[int] | None) -> list[int]:
    """A generated row up to its first end of sentence `eos` (not included), or whole when `eos` is None."""
    if eos is None:
        return row
    stops = set(eos if isinstance(eos, list) else [eos])
    return next((row[:i] for i, token in enumerate(row) if token in stops), row)


class CTranslate2Engine:
    """The same for a model exported by `vaswani.export` (`load_ctranslate2`), through
    `ctranslate2.Translator.translate_batch`. Sources are truncated to `max_source_length` (default: the exported
    position table, the tokenizer's `model_max_length` as `load_ctranslate2` sets it), and no output is longer
    than that table. Greedy outputs equal `TorchEngine`'s. Beam search ends by CTranslate2's rule, once
    `num_beams` hypotheses have finished, which can stop before transformers' default (early_stopping=False)
    would, so some beam outputs differ (benchmarks/results/export-ctranslate2-cpu.md). `num_beams` and
    `max_new_tokens` not given are the exported model's `generation_config`'s (`decoding_settings`)."""

    positions = "exported positions"
    continuous = False
    SETTINGS = ("num_beams", "max_new_tokens", "max_source_length", "min_decoding_length")  # what it can be given

    def __init__(self, translator, tokenizer, generation_config=None, *, num_beams: int | None = None,
                 max_new_tokens: int | None = None, max_source_length: int | None = None,
                 min_decoding_length: int | None = None):
        """`min_decoding_length`: CTranslate2 masks the end of sentence until each output has that many tokens (with
        `max_new_tokens` the same, every output is exactly that long). `generation_config` None: generate()'s
        defaults (one beam, the length rule)."""
        settings = decoding_settings(generation_config or GenerationConfig(), num_beams=num_beams,
                                     max_new_tokens=max_new_tokens)
        self.translator, self.tokenizer, self.num_beams = translator, tokenizer, settings["num_beams"]
        self.max_new_tokens, self.min_decoding_length = settings.get("max_new_tokens"), min_decoding_length or 0
        self.max_source_length = max_source_length or tokenizer.model_max_length

    @property
    def settings(self) -> dict:
        return {"engine": "ctranslate2", "num_beams": self.num_beams, "max_new_tokens": self.max_new_tokens,
                "precision": self.translator.compute_type}

    def encode(self, sentences: Sequence[str], truncate: bool = False) -> list[list[int]]:
        return encode(self.tokenizer, sentences, self.max_source_length if truncate else None)

    def translate_batch(self, batch: list[list[int]]) -> list[str]:
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in self.generate_ids(batch)]

    def generate_ids(self, batch: list[list[int]]) -> list[list[int]]:
        """Each sentence's generated token ids (CTranslate2 leaves out the decoder start token and the end of
        sentence), as `generate_token_ids` gives them for a transformers model."""
        sources = [self.tokenizer.convert_ids_to_tokens(ids) for ids in batch]
        limit = output_limit(max(map(len, sources)), self.max_new_tokens,
                             self.tokenizer.model_max_length)  # the decoder start token takes position 0
        results = self.translator.translate_batch(sources, beam_size=self.num_beams, max_decoding_length=limit,
                                                  min_decoding_length=self.min_decoding_length,
                                                  max_batch_size=len(batch))
        return [self.tokenizer.convert_tokens_to_ids(result.hypotheses[0]) for result in results]


def encode(tokenizer, sentences: Sequence[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids of `sentences`, truncated to `max_length` by the tokenizer's own truncation (which keeps the end
    of sentence) when it is given."""
    limit = {"truncation": True, "max_length": max_length} if max_length is not None else {}
    return tokenizer(list(sentences), **limit)["input_ids"]


class Translations(NamedTuple):
    texts: list[str]  # one per sentence, in input order
    truncated: int  # sources longer than the engine's `max_source_length`, translated truncated


def translate(engine: Engine, sentences: Sequence[str], *, max_tokens: int | None = None,
              max_sentences: int | None = None, warn: bool = True) -> Translations:
    """Translate `sentences` with `engine`, in batches of at most `max_tokens` padded source tokens and
    `max_sentences` sentences (`vaswani.batching.token_budget_batches`: longest first, so that running out of
    memory, if it happens, happens on the first batch); an engine that decodes `continuous`ly gets them all in that
    order as one batch, and its slots bound its memory instead. Returns the translations, stripped, in input order,
    and how many sources were truncated; with `warn`, a truncation is also reported on stderr (`warn_truncated`; a
    caller that translates in parts passes False and reports the total once)."""
    if not sentences:
        return Translations([], 0)  # the tokenizer refuses an empty batch
    encoded = engine.encode(sentences)
    too_long = []
    if engine.max_source_length is not None:
        too_long = [i for i, ids in enumerate(encoded) if len(ids) > engine.max_source_length]
    if too_long:
        for i, ids in zip(too_long, engine.encode([sentences[i] for i in too_long], truncate=True)):
            encoded[i] = ids
    texts: list[str] = [""] * len(encoded)
    batches = token_budget_batches([len(ids) for ids in encoded], max_tokens, max_sentences)
    if engine.continuous:  # it keeps its own batch full: all sentences, longest first
        batches = [[i for batch in batches for i in batch]]
    for batch in batches:
        for i, text in zip(batch, engine.translate_batch([encoded[i] for i in batch])):
            texts[i] = text.strip()
    if warn:
        warn_truncated(engine, len(too_long))
    return Translations(texts, len(too_long))


def warn_truncated(engine: Engine, count: int) -> None:
    """The one truncation warning, on stderr, when `count` sources were longer than `engine` takes."""
    if count:
        print(f"warning: {count} sentence(s) longer than the model's {engine.max_source_length} {engine.positions} "
              "were truncated.", file=sys.stderr)
