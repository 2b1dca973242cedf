"""What the tests of the decoding loops (test_decoding, test_decoding_static) share: the sentences and searches they
decode, the model variants, the tiny trained model, and generate() with either loop."""

import pytest
import torch

import vaswani.generation_vaswani as generation_vaswani

from tiny_translation_model import SOURCES, build_model_and_tokenizer


# Uneven lengths, so that the batch is padded and sentences finish at different steps.
SENTENCES = SOURCES + ["the cat", "a tree under the bird"]
# Tokens that the tiny model writes often, so that banning them changes its translations.
BAD_WORDS = [[40], [62, 55]]
# The options among SEARCHES that generate() turns into logits processors.
LOGITS_PROCESSORS = {"no_repeat_ngram_size", "bad_words_ids", "forced_eos_token_id"}
# Every option of greedy and beam search that changes which hypotheses are kept or when decoding stops.
SEARCHES = [
    dict(num_beams=1),
    dict(num_beams=1, max_new_tokens=5),
    dict(num_beams=1, max_length=7),
    dict(num_beams=1, no_repeat_ngram_size=2),  # a logits processor
    dict(num_beams=1, bad_words_ids=BAD_WORDS),
    dict(num_beams=1, forced_eos_token_id=1, max_new_tokens=6),
    dict(num_beams=1, eos_token_id=None, max_new_tokens=12),
    dict(num_beams=4),
    dict(num_beams=5),
    dict(num_beams=3, length_penalty=0.6),
    dict(num_beams=4, early_stopping=True),
    dict(num_beams=4, early_stopping=False, length_penalty=2.0),
    dict(num_beams=4, early_stopping="never", length_penalty=1.5),
    dict(num_beams=5, early_stopping=True, length_penalty=0.0),
    dict(num_beams=4, num_return_sequences=3),
    dict(num_beams=5, num_return_sequences=5, early_stopping="never"),
    dict(num_beams=4, max_new_tokens=5),
    dict(num_beams=4, max_length=7),
    dict(num_beams=4, no_repeat_ngram_size=2),
    dict(num_beams=4, bad_words_ids=BAD_WORDS),
    dict(num_beams=5, forced_eos_token_id=1, max_new_tokens=6),
    dict(num_beams=2, eos_token_id=None, max_new_tokens=12),
]
VARIANTS = {
    "paper": {},
    "modern": dict(norm_first=True, norm_type="rmsnorm", position_embedding_type="rope", ffn_activation="swiglu",
                   num_key_value_heads=2),
    "mqa-learned": dict(num_key_value_heads=1, position_embedding_type="learned"),
}


@pytest.fixture(scope="module")
def trained():
    return build_model_and_tokenizer()


def generate_both(model, batch, cuda_graphs=False, **search):
    """generate() with transformers' loop and with the lean one (checked to have run: not a silent fallback)."""
    if "max_length" not in search:
        search = {"max_new_tokens": 20, **search}
    loops = ("_greedy", "_beam", "_greedy_static", "_beam_static")
    originals = {name: getattr(generation_vaswani, name) for name in loops}
    ran = []
    try:
        for name, original in originals.items():
            setattr(generation_vaswani, name, lambda *a, _f=original, _n=name, **k: ran.append(_n) or _f(*a, **k))
        # As generate() itself (under inference_mode, host reads escape test_decoding_static's HOST_READS check).
        with torch.no_grad():
            reference = model.generate(**batch, **search, lean_decoding=False)
            assert ran == []
            lean = model.generate(**batch, **search, cuda_graphs=cuda_graphs)
    finally:
        for name, original in originals.items():
            setattr(generation_vaswani, name, original)
    assert len(ran) == 1, ran
    return reference, lean
