"""The one translation path: engines that turn batches of token ids into translations, and `translate`, which
cuts a list of sentences into token-budget batches, runs them through an engine and returns the translations in
input order, with the number of sources it truncated.

Every caller goes through `translate`: `vaswani.evaluation` (BLEU during and after training), `vaswani.export`
(the CTranslate2 export), `vaswani.file_translation` (which adds chunks, resume and processes) and the scripts.
So one rule decides how sources are truncated and how the output length is limited, whichever engine runs. The
benchmarks time the engines' own calls below the decoding to text: `generate_token_ids` and
`CTranslate2Engine.generate_ids`.

Engines are built by `vaswani.loading` (`load_engine`, `engine_for_model`), which decides device, precision and
loop, and resolves the decoding settings once (`vaswani.decoding_settings.DecodingSettings`: the checkpoint's
`generation_config`, which training writes with `write_decoding_defaults`, under the caller's overrides). An engine
has `decoding` (those settings), `max_source_length`, `positions` (what that limit counts, for the warning),
`continuous`, `encode(sentences, truncate=False)` and `translate_batch(batch of token ids) → strings`, in which each
sentence is decoded within its own output limit, so that its translation does not depend on its batch:

* `TorchEngine`: a transformers model's `generate()` (a Vaswani or converted model, fp32, bf16 or int8, any
  decoding loop); or, with `slots`, `slots.decode_in_slots`, an engine that is `continuous`: it takes every
  sentence in one batch and keeps its own batch full;
* `CTranslate2Engine`: a model exported by `vaswani.export` (`vaswani.loading.load_ctranslate2`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from .batching import token_budget_batches
# OUTPUT_SLACK: the length rule's slack, under this module's name too.
from .configuration_vaswani import OUTPUT_SLACK  # noqa: F401
from .decoding_settings import DecodingSettings, is_learned
from .pipeline_vaswani import sentence_limit_options
from .slots import decode_in_slots, slots_cover

class Engine(Protocol):
    decoding: "DecodingSettings"
    max_source_length: int | None
    positions: str
    continuous: bool  # whether `translate_batch` takes every sentence at once and keeps its own batch full
    settings: dict  # what decides its outputs (beams, length limit, precision…), for a resumed run to compare

    def encode(self, sentences: Sequence[str], truncate: bool = False) -> list[list[int]]: ...

    def translate_batch(self, batch: list[list[int]]) -> list[str]: ...


class TorchEngine:
    """Batches of token ids → translations with `model.generate()`, decoding as its `DecodingSettings` say, each
    sentence within its own output limit (`DecodingSettings.output_limit`), whatever else is in its batch: where the
    limits of a batch differ, each row stops at its own (`generation_vaswani.SentenceLimits`, which transformers'
    loop and the lean loop both follow). Sources are truncated at `max_source_length` (`translate`).

    With `slots=S` the engine decodes continuously (`slots.decode_in_slots`): S sentences side by side, each
    finished one replaced at once by the next, so `translate` hands it all sentences as one stream (`continuous`).
    Each output is then what `generate()` gives that sentence alone. For the options that the slots do not cover
    (`slots_cover`: logits processors, several outputs per sentence…) the engine decodes batches as without slots.
    Without `slots` the engine decodes in batches: slots measured slower than batches on a CPU and than the lean loop
    as CUDA graphs on a GPU (benchmarks/results/README.md). Built by
    `vaswani.loading` (which checks that the tokenizer fits the model)."""

    # Why the scripts chose this engine (`vaswani.engine_choice.EngineChoice.record`); None where a caller built it.
    choice: dict | None = None

    def __init__(self, model, tokenizer, decoding: DecodingSettings, *, slots: int | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.decoding = dataclasses.replace(decoding, precision=str(model.dtype).removeprefix("torch."))
        self.slots = slots if slots and slots_cover(model, **self.decoding.generate_options()) else None

    @property
    def positions(self) -> str:
        return "learned positions" if is_learned(self.model.config) else "source positions"

    @property
    def description(self) -> str:
        """Which engine this is, for the one line a run logs."""
        kinds = {type(module).__name__ for module in self.model.modules()}
        linear = (" with int8 linear layers" if "Int8Linear" in kinds
                  else " with oneDNN-packed linear layers" if "PackedLinear" in kinds else "")
        return (f"PyTorch {self.decoding.precision}{linear} on "
                f"{self.model.device}{f', {self.slots} slots' if self.continuous else ''}")

    @property
    def max_source_length(self) -> int | None:
        return self.decoding.max_source_length

    @property
    def continuous(self) -> bool:
        """Whether `translate_batch` takes any number of sentences and keeps its own batch full."""
        return self.slots is not None

    @property
    def settings(self) -> dict:
        return {"engine": "pytorch", **self.decoding.record(), "engine_choice": self.choice}

    def encode(self, sentences: Sequence[str], truncate: bool = False) -> list[list[int]]:
        return encode(self.tokenizer, sentences, self.max_source_length if truncate else None)

    def translate_batch(self, batch: list[list[int]]) -> list[str]:
        limits = [self.decoding.output_limit(len(ids)) for ids in batch]
        options = self.decoding.generate_options()
        if self.continuous:
            with torch.inference_mode():
                outputs = decode_in_slots(self.model, batch, limits, slots=self.slots, **options)
            eos = options.get("eos_token_id", self.model.generation_config.eos_token_id)
            generated = [output_ids(output[1:], eos) for output in outputs]
            return self.tokenizer.batch_decode(generated, skip_special_tokens=True)
        padded = self.tokenizer.pad({"input_ids": batch}, return_tensors="pt")
        input_ids = padded["input_ids"].to(self.model.device)  # (batch, longest source in batch)
        generated = generate_token_ids(self.model, input_ids, padded["attention_mask"].to(self.model.device),
                                       max_new_tokens=limits, **options)
        return self.tokenizer.batch_decode(generated, skip_special_tokens=True)


def generate_token_ids(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                       max_new_tokens: int | list[int], **generate_kwargs) -> list[list[int]]:
    """`model.generate()` on a padded batch of sources, returning each sentence's generated token ids: without the
    decoder start token, and up to its end of sentence (not included; what follows it in the batch's tensor is only
    the filler of a finished row). `max_new_tokens`: one limit for every row, or each row's own (where they differ,
    `generation_vaswani.SentenceLimits` stops each row at its own, so that its output does not depend on its
    neighbours'). With `eos_token_id=None` nothing ends a sentence, and all `max_new_tokens` ids of every row are
    returned: the forced length under which the benchmarks compare engines on identical work."""
    limits = [max_new_tokens] * input_ids.shape[0] if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if model.config.is_encoder_decoder:
        generate_kwargs |= sentence_limit_options(limits, input_ids.device)
    else:
        generate_kwargs["max_new_tokens"] = max(limits)
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    rows = output[:, 1:].tolist()  # the first column is the decoder start token
    eos = generate_kwargs.get("eos_token_id", model.generation_config.eos_token_id)
    return [output_ids(row[:limit], eos) for row, limit in zip(rows, limits)]


def output_ids(row: list[int], eos: int | list[int] | None) -> list[int]:
    """A generated row up to its first end of sentence `eos` (not included), or whole when `eos` is None."""
    if eos is None:
        return row
    stops = set(eos if isinstance(eos, list) else [eos])
    return next((row[:i] for i, token in enumerate(row) if token in stops), row)


class CTranslate2Engine:
    """The same for a model exported by `vaswani.export` (`load_ctranslate2`), through
    `ctranslate2.Translator.translate_batch`, with the same `DecodingSettings`. Sources are truncated to
    `max_source_length` (at most the exported position table, the tokenizer's `model_max_length` as
    `load_ctranslate2` sets it), and no output is longer than that table.

    What CTranslate2 is told, so that its outputs are `TorchEngine`'s: the length penalty, applied as transformers
    applies it (score / length ** penalty, with the end of sentence counted in the length: `return_end_token`,
    removed here afterwards; `ctranslate2_length_penalty`); each sentence's own output limit (`max_decoding_length`
    counts the end of sentence as `max_new_tokens` does; it is one number per call: see `generate_ids`); the source
    limit (`max_input_length`); `min_new_tokens` (`min_decoding_length`).
    One rule it cannot follow: CTranslate2's beam search ends a sentence once `num_beams` hypotheses have finished,
    which is transformers' `early_stopping=True`; under transformers' default (`early_stopping=False`) a sentence
    goes on while a live beam could still beat a finished one, so a few beam outputs differ (the export's model card,
    `vaswani.export`, states the measured share). What it cannot do at all (sampling, `early_stopping="never"`,
    other `generate()` options) is refused by name."""

    continuous = False
    choice: dict | None = None  # as `TorchEngine.choice`
    # What a CTranslate2 model takes besides the engine's own settings (`load_engine` refuses the rest by name).
    SETTINGS = ("num_beams", "max_new_tokens", "max_source_length", "length_penalty", "early_stopping",
                "min_new_tokens")

    def __init__(self, translator, tokenizer, decoding: DecodingSettings, *, path: str | None = None,
                 export_of: str | None = None, positions: str = "exported positions"):
        self.check(decoding)
        self.translator, self.tokenizer = translator, tokenizer
        self.decoding = dataclasses.replace(decoding, precision=translator.compute_type)
        self.path, self.export_of = path, export_of  # the model's directory; the checkpoint it was exported from
        self.positions = positions  # what `max_source_length` counts, as the truncation warning names it

    @property
    def description(self) -> str:
        """Which engine this is, for the one line a run logs."""
        where = (f"the cached export of {self.export_of} ({self.path})" if self.export_of
                 else self.path or "a CTranslate2 model")
        return f"CTranslate2 {self.decoding.precision} on {self.translator.device}, {where}"

    @staticmethod
    def follows(decoding: DecodingSettings) -> bool:
        """Whether CTranslate2 decodes with these settings exactly as `generate()` does
        (tests/test_decoding_contract.py): greedy search, or beam search with `early_stopping=True`; no sampling, no
        other `generate()` option."""
        return (not decoding.options and not decoding.do_sample
                and (decoding.num_beams == 1 or decoding.early_stopping is True))

    @staticmethod
    def check(decoding: DecodingSettings) -> None:
        """Refuse in one line, naming them, the settings `decoding` holds (which a checkpoint's generation config may
        give) that CTranslate2 cannot decode with, before its model is loaded. The PyTorch engine's own options are
        refused by `vaswani.loading`, which tells them apart (`pytorch_options`)."""
        refused = [name for name, _ in decoding.options] + ["do_sample"] * decoding.do_sample
        refused += ["early_stopping='never'"] * (decoding.early_stopping == "never")
        if refused:
            raise ValueError(f"{', '.join(refused)}: not something the CTranslate2 engine can decode with; translate "
                             "with the PyTorch checkpoint instead.")

    @property
    def max_source_length(self) -> int | None:
        return self.decoding.max_source_length

    @property
    def settings(self) -> dict:
        return {"engine": "ctranslate2", **self.decoding.record(), "engine_choice": self.choice}

    def encode(self, sentences: Sequence[str], truncate: bool = False) -> list[list[int]]:
        return encode(self.tokenizer, sentences, self.max_source_length if truncate else None)

    def translate_batch(self, batch: list[list[int]]) -> list[str]:
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in self.generate_ids(batch)]

    def generate_ids(self, batch: list[list[int]]) -> list[list[int]]:
        """Each sentence's generated token ids (CTranslate2 leaves out the decoder start token; the end of sentence
        is taken off here), as `generate_token_ids` gives them for a transformers model.

        CTranslate2 takes one output limit per call. The batch is decoded once at its longest sentence's limit, and
        greedy outputs are cut at each sentence's own (greedy output up to a length does not depend on the limit). A
        beam search differs from its own limit's only at that limit's last step, where every live beam is ended. A
        sentence's search ends at the step where its `num_beams`-th hypothesis ends; fewer ended before that step,
        so one of the `num_beams` best returned ended at it. Where these all ended before the sentence's own limit,
        its search ended before that limit counted, and its translation is its own limit's. The others are decoded
        again, in one call per limit. Only a beam search over a batch with a shorter limit than its longest asks for
        more than the best hypothesis."""
        decoding = self.decoding
        limits = [decoding.output_limit(len(ids)) for ids in batch]
        longest = max(limits)
        eos = self.tokenizer.eos_token_id
        outputs: list[list[int]] = [[]] * len(batch)
        again: dict[int, list[int]] = {}
        shorter = decoding.num_beams > 1 and min(limits) < longest
        for i, hypotheses in enumerate(self.hypotheses(batch, longest, decoding.num_beams if shorter else 1)):
            if decoding.num_beams == 1 or limits[i] == longest or all(len(h) < limits[i] for h in hypotheses):
                outputs[i] = output_ids(self.tokenizer.convert_tokens_to_ids(hypotheses[0][:limits[i]]), eos)
            else:
                again.setdefault(limits[i], []).append(i)
        for limit, members in again.items():
            for i, hypotheses in zip(members, self.hypotheses([batch[i] for i in members], limit)):
                outputs[i] = output_ids(self.tokenizer.convert_tokens_to_ids(hypotheses[0]), eos)
        return outputs

    def hypotheses(self, batch: list[list[int]], limit: int, count: int = 1) -> list[list[list[str]]]:
        """Each sentence's `count` best hypotheses (at most `num_beams`) as tokens, best first, with their end of
        sentence where they reached one; at most `limit` tokens each."""
        decoding = self.decoding
        results = self.translator.translate_batch(
            [self.tokenizer.convert_ids_to_tokens(ids) for ids in batch], beam_size=decoding.num_beams,
            num_hypotheses=count, length_penalty=ctranslate2_length_penalty(decoding), patience=1,
            max_decoding_length=limit, min_decoding_length=decoding.min_new_tokens, return_end_token=True,
            max_input_length=decoding.max_source_length or 0, max_batch_size=len(batch))
        return [result.hypotheses for result in results]

# A length penalty that divides no score: length ** 1e-12 is 1.0 in float32 for any length under a million.
NO_LENGTH_PENALTY = 1e-12


def ctranslate2_length_penalty(decoding: DecodingSettings) -> float:
    """The length penalty to tell CTranslate2 for `decoding`'s. At exactly 0, CTranslate2's beam search ends a
    sentence as soon as its best live beam ends (its `allow_early_exit`), not once `num_beams` hypotheses have finished
    as transformers' `early_stopping=True` does; the two rules give different translations of some sentences. A
    penalty too small to change any score keeps the same scores under the shared rule."""
    return decoding.length_penalty if decoding.length_penalty != 0 or decoding.num_beams == 1 else NO_LENGTH_PENALTY


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
