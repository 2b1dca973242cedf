"""Inputs the model refuses, and lengths it runs past (`vaswani.modeling_vaswani`), one test each: token ids and labels
outside the vocabulary, empty batches, positions past those it learned. Configuration values are tested in
test_configuration.py. docs/reliability.md is their table."""

import pytest
import torch

from conftest import tiny_config

from vaswani import VaswaniForConditionalGeneration


# Tokens --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [99, 1000, -1])
def test_token_ids_outside_the_vocabulary_are_a_value_error(bad_id):
    model = VaswaniForConditionalGeneration(tiny_config())  # vocab_size 99
    input_ids = torch.tensor([[5, bad_id, 6]])
    with pytest.raises(ValueError, match=f"Token id {bad_id} is outside the vocabulary"):
        model(input_ids=input_ids, decoder_input_ids=torch.tensor([[3]]))


def test_labels_outside_the_vocabulary_are_a_value_error():
    model = VaswaniForConditionalGeneration(tiny_config())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(input_ids=torch.tensor([[5, 6]]), labels=torch.tensor([[7, 120]]))


@pytest.mark.parametrize("shape", [(0, 5), (2, 0)], ids=["no-rows", "no-tokens"])
def test_empty_batches_are_a_value_error(shape):
    model = VaswaniForConditionalGeneration(tiny_config())
    with pytest.raises(ValueError, match="empty"):
        model(input_ids=torch.zeros(shape, dtype=torch.long), decoder_input_ids=torch.full((shape[0], 1), 3))


def test_learned_positions_refuse_longer_inputs():
    model = VaswaniForConditionalGeneration(tiny_config(position_embedding_type="learned", max_position_embeddings=16))
    long = torch.randint(4, 99, (1, 17))
    with pytest.raises(ValueError, match="17 positions is longer than the 16 learned positions"):
        model(input_ids=long, decoder_input_ids=long[:, :4])


@pytest.mark.parametrize("positions", ["sinusoidal", "rope"])
def test_sinusoidal_and_rotary_positions_extend_past_max_position_embeddings(positions):
    model = VaswaniForConditionalGeneration(tiny_config(position_embedding_type=positions, max_position_embeddings=16))
    model.eval()
    long = torch.randint(4, 99, (1, 40))
    logits = model(input_ids=long, decoder_input_ids=long).logits
    assert logits.shape == (1, 40, 99) and torch.isfinite(logits).all()
    output = model.generate(input_ids=long[:, :10], max_new_tokens=30, min_new_tokens=30, num_beams=1)
    assert output.shape[1] == 31
