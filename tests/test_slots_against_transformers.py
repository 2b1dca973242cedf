"""Decoding in slots, through the public engine (`vaswani.loading.engine_for_model` with `slots`), against
transformers' own loop (`generate(..., lean_decoding=False)`) on each sentence alone. Not against the lean loop:
the slots share its beam bookkeeping, so a bug in a shared piece would give both the same wrong output."""

import pytest
import torch

from vaswani.configuration_vaswani import longest_output, output_limit
from vaswani.loading import engine_for_model
from vaswani.translation import translate

from decoding_helpers import SENTENCES, trained  # noqa: F401 (the `trained` fixture)

# More sentences than slots, of uneven lengths, so that slots are refilled while others decode.
SLOT_SENTENCES = SENTENCES + ["dog", "the mat sat on the cat under a bird", "a cat ran under the tree"]
# Greedy and beam search with every stopping rule; `NO_END`: only the padding token (which the model never writes)
# ends a sentence, so each runs to its own limit, its source's length plus the slack; `max_new_tokens`: one limit for
# all, which some reach and some do not; `FIRST_TOKEN`: the token the first sentence starts with is an end of
# sentence too, so that it stops at once.
FIRST_TOKEN, NO_END = "the first sentence's first token", "the padding token"
SEARCHES = [
    dict(num_beams=1),
    dict(num_beams=1, eos_token_id=FIRST_TOKEN),
    dict(num_beams=1, eos_token_id=NO_END),
    dict(num_beams=1, max_new_tokens=4),
    dict(num_beams=4),
    dict(num_beams=4, eos_token_id=FIRST_TOKEN),
    dict(num_beams=3, length_penalty=0.6),
    dict(num_beams=4, early_stopping=True),
    dict(num_beams=4, early_stopping=False, length_penalty=2.0),
    dict(num_beams=4, early_stopping="never", length_penalty=1.5),
    dict(num_beams=5, early_stopping=True, length_penalty=0.0),
    dict(num_beams=4, max_new_tokens=4),
    dict(num_beams=2, eos_token_id=NO_END),
]


def transformers_alone(model, tokenizer, sentence: str, **search) -> str:
    """`sentence`'s translation by transformers' own loop on it alone, with the engines' length rule
    (`output_limit`: the source's length plus the slack unless `max_new_tokens` says, within the positions), up to
    its end of sentence."""
    batch = tokenizer([sentence], return_tensors="pt")
    search = dict(search)
    limit = output_limit(batch["input_ids"].shape[1], search.pop("max_new_tokens", None), longest_output(model.config))
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=limit, lean_decoding=False, **search)[0, 1:].tolist()
    eos = search.get("eos_token_id", model.generation_config.eos_token_id)
    stops = set(eos if isinstance(eos, list) else [eos])
    output = next((output[:i] for i, token in enumerate(output) if token in stops), output)
    return tokenizer.decode(output, skip_special_tokens=True).strip()


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_slots_translate_each_sentence_as_transformers_loop_does_alone(trained, search):
    """Whatever the slot count, each sentence's translation is the one transformers' loop gives it alone, among
    them sentences that stop at the first step (the token one sentence starts with made an end of sentence, where
    the search stops at one) and sentences that reach their length limit."""
    model, tokenizer = trained
    if search.get("eos_token_id") == FIRST_TOKEN:
        with torch.no_grad():
            first = model.generate(**tokenizer([SLOT_SENTENCES[0]], return_tensors="pt"), num_beams=1,
                                   max_new_tokens=1, lean_decoding=False)[0, 1].item()
        search = dict(search, eos_token_id=[tokenizer.eos_token_id, first])
    elif search.get("eos_token_id") == NO_END:
        search = dict(search, eos_token_id=[tokenizer.pad_token_id])
    reference = [transformers_alone(model, tokenizer, sentence, **search) for sentence in SLOT_SENTENCES]
    if search["num_beams"] == 1 and tokenizer.eos_token_id in search.get("eos_token_id", ()):
        assert reference[0] == ""  # stopped at its first token
    assert len(set(reference)) >= 3  # translations, not one repeated output
    for slots in (1, 3, 16):
        engine = engine_for_model(model, tokenizer, slots=slots, **search)
        assert engine.continuous, "the engine fell back to batches: nothing was decoded in slots"
        assert translate(engine, SLOT_SENTENCES).texts == reference, slots
