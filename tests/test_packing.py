"""Packed sequences: several sentence pairs a row (`packing.PackedSeq2SeqCollator`) train the translation model
exactly as the same pairs unpacked do, for every variant; the decoder-only model does the same on transformers'
own `DataCollatorWithFlattening` rows."""

import itertools

import pytest
import torch
from torch.nn import functional as F
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration
from vaswani.packing import PackedSeq2SeqCollator, PackedShape, next_fit_rows
from vaswani.modeling_vaswani import packed_attention_mask, sequence_starts
from conftest import FIRST_ORDINARY_ID, tiny_config


def made_up_pairs(count: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """Tokenized pairs of 1-9 source and 1-9 target tokens, as `tokenize_translation_dataset` gives them."""
    generator = torch.Generator().manual_seed(seed)

    def ids():
        length = int(torch.randint(1, 10, (1,), generator=generator))
        return torch.randint(FIRST_ORDINARY_ID, vocab_size, (length,), generator=generator).tolist()

    return [{"input_ids": ids(), "labels": ids()} for _ in range(count)]


class PadOnly:
    """What `DataCollatorForSeq2Seq` needs of a tokenizer to pad token ids."""

    pad_token_id, padding_side, model_input_names = 0, "right", ["input_ids", "attention_mask"]

    def pad(self, features, return_tensors="pt", **kwargs):
        longest = max(len(f["input_ids"]) for f in features)
        return {"input_ids": torch.tensor([f["input_ids"] + [0] * (longest - len(f["input_ids"])) for f in features]),
                "attention_mask": torch.tensor([[1] * len(f["input_ids"]) + [0] * (longest - len(f["input_ids"]))
                                                for f in features])}


def unpacked(pairs: list[dict]) -> dict:
    return DataCollatorForSeq2Seq(PadOnly(), return_tensors="pt")([dict(p) for p in pairs])


def per_pair_losses(logits, labels, smoothing):
    """Each pair's summed label-smoothed cross-entropy, from logits (rows, T, V) and labels (rows, T) laid out per
    row; `spans` are (row, start, length) per pair."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                           label_smoothing=smoothing, reduction="none").view(labels.shape)


def loss_and_gradients(model, batch):
    model.zero_grad()
    output = model(**batch)
    output.loss.backward()
    return output, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


VARIANTS = list(itertools.product([False, True], ["sinusoidal", "learned", "rope"], [4, 2], [True, False]))


@pytest.mark.parametrize("norm_first,positions,kv_heads,tied", VARIANTS,
                         ids=[f"{'pre' if n else 'post'}-{p}-{'mha' if k == 4 else 'gqa'}-{'tied' if t else 'untied'}"
                              for n, p, k, t in VARIANTS])
def test_packed_pairs_train_as_the_same_pairs_unpacked(norm_first, positions, kv_heads, tied, single_thread):
    """Per-pair losses (label-smoothed, in training mode), the batch loss and every gradient of a packed batch equal
    those of the same pairs padded one a row, within float32 rounding."""
    config = tiny_config(norm_first=norm_first, position_embedding_type=positions, num_key_value_heads=kv_heads,
                         tie_word_embeddings=tied, share_embeddings=tied)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(config).train()
    pairs = made_up_pairs(11, config.vocab_size)
    shape = PackedShape(rows=4, source_length=24, target_length=24)
    packed = PackedSeq2SeqCollator(shape, config.pad_token_id)(pairs)
    packed_output, packed_gradients = loss_and_gradients(model, packed)
    plain_output, plain_gradients = loss_and_gradients(model, unpacked(pairs))

    torch.testing.assert_close(packed_output.loss, plain_output.loss, rtol=1e-5, atol=1e-6)
    assert packed_gradients.keys() == plain_gradients.keys()
    for name, gradient in packed_gradients.items():
        torch.testing.assert_close(gradient, plain_gradients[name], rtol=1e-4, atol=1e-6, msg=name)
    smoothing = config.label_smoothing
    packed_losses = per_pair_losses(packed_output.logits, packed["labels"], smoothing)
    plain_losses = per_pair_losses(plain_output.logits, unpacked(pairs)["labels"], smoothing)
    starts = next_fit_rows([len(p["input_ids"]) for p in pairs], [len(p["labels"]) for p in pairs], shape)
    row, offset = -1, 0
    for index, pair in enumerate(pairs):
        if index in starts:
            row, offset = row + 1, 0
        length = len(pair["labels"])
        torch.testing.assert_close(packed_losses[row, offset: offset + length], plain_losses[index, :length],
                                   rtol=1e-5, atol=1e-5)
        offset += length


def test_packed_rows_hold_each_pair_with_its_own_positions_and_decoder_start(single_thread):
    config = tiny_config()
    pairs = [{"input_ids": [5, 6, 2], "labels": [7, 2]}, {"input_ids": [8, 2], "labels": [9, 10, 2]},
             {"input_ids": [11, 12, 13, 2], "labels": [14, 2]}]
    batch = PackedSeq2SeqCollator(PackedShape(rows=2, source_length=6, target_length=6), config.pad_token_id)(pairs)
    pad = config.pad_token_id
    assert batch["input_ids"].tolist() == [[5, 6, 2, 8, 2, pad], [11, 12, 13, 2, pad, pad]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert batch["labels"].tolist() == [[7, 2, 9, 10, 2, -100], [14, 2, -100, -100, -100, -100]]
    assert batch["decoder_position_ids"].tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 0, 0, 0, 0]]
    model = VaswaniForConditionalGeneration(config)
    start = config.decoder_start_token_id
    shifted = model.prepare_decoder_input_ids_from_labels(batch["labels"], batch["decoder_position_ids"])
    # Each target reads <start> first, not the end of the target before it.
    assert shifted[0].tolist() == [start, 7, start, 9, 10, start]
    with pytest.raises(ValueError, match="take 3 rows"):
        PackedSeq2SeqCollator(PackedShape(rows=2, source_length=4, target_length=6), pad)(pairs)


def test_the_packed_mask_keeps_attention_within_each_pair():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])  # two sequences, then a padding position
    starts = sequence_starts(positions)
    assert starts.tolist() == [[True, False, False, True, False, True]]
    mask = packed_attention_mask(positions, positions, torch.tensor([[1, 1, 1, 1, 1, 0]]), causal=True)[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    # The padding query, with nothing of its own to see, sees everything rather than nothing (no NaN).
    assert torch.equal(mask, expected)
    cross = packed_attention_mask(positions, torch.tensor([[0, 1, 0, 1, 2]]), None, causal=False)[0, 0]
    assert cross[:3].tolist() == [[True, True, False, False, False]] * 3
    assert cross[3:5].tolist() == [[False, False, True, True, True]] * 2


def test_packing_is_asked_for_by_both_positions_and_positions_alone_are_the_decoders():
    """Both position_ids and decoder_position_ids pack; either alone gives the positions of the decoder's tokens, as
    before packing existed and as transformers' common tests pass them (`test_custom_4d_attention_mask` calls
    `forward(input_ids, position_ids=...)`): the logits of positions 0…T-1 are those of no positions at all, and
    shifted positions change them."""
    config = tiny_config()
    model = VaswaniForConditionalGeneration(config).eval()
    batch = PackedSeq2SeqCollator(PackedShape(3, 20, 20), config.pad_token_id)(made_up_pairs(3, config.vocab_size))
    source, target = batch["input_ids"], batch["labels"].clamp(min=FIRST_ORDINARY_ID)
    plain = model(input_ids=source, decoder_input_ids=target).logits
    counted = torch.arange(target.shape[1]).expand_as(target)
    for name in ("position_ids", "decoder_position_ids"):
        assert torch.equal(model(input_ids=source, decoder_input_ids=target, **{name: counted}).logits, plain), name
        shifted = model(input_ids=source, decoder_input_ids=target, **{name: counted + 2}).logits
        assert not torch.allclose(shifted, plain), name
    packed = model(**batch).logits
    assert not torch.allclose(packed, model(**{k: v for k, v in batch.items() if k != "position_ids"}).logits)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="need sdpa or eager"):
        model(**batch)


def test_a_model_trained_packed_generates_as_one_trained_unpacked(single_thread):
    """Steps on packed batches and on the same pairs unpacked leave the same weights, so the same translations:
    packing changes how a batch is laid out, nothing the model learns. (Plain SGD: Adam would scale the float32
    noise of gradients that are zero in exact arithmetic, such as the key biases', up to whole steps.)"""
    config = tiny_config(attn_implementation="eager")  # the eager attention takes the packed mask too
    torch.manual_seed(0)
    models = [VaswaniForConditionalGeneration(config).train() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    collate = PackedSeq2SeqCollator(PackedShape(rows=3, source_length=30, target_length=30), config.pad_token_id)
    for model, layout in zip(models, (collate, unpacked)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(3):
            model(**layout(made_up_pairs(8, config.vocab_size, seed=step))).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for name, weight in models[0].state_dict().items():
        torch.testing.assert_close(weight, models[1].state_dict()[name], rtol=1e-4, atol=1e-5, msg=name)
    sources = unpacked(made_up_pairs(4, config.vocab_size, seed=9))
    outputs = [model.eval().generate(input_ids=sources["input_ids"], attention_mask=sources["attention_mask"],
                                     max_new_tokens=8, num_beams=2) for model in models]
    assert torch.equal(outputs[0], outputs[1])


DECODER_VARIANTS = [("sinusoidal", "sdpa", False, 4), ("learned", "eager", True, 2), ("rope", "sdpa", True, 2),
                    ("rope", "eager", False, 4), ("learned", "sdpa", False, 1)]


@pytest.mark.parametrize("positions,attention,norm_first,kv_heads", DECODER_VARIANTS)
def test_the_decoder_only_model_trains_on_transformers_flattened_rows(positions, attention, norm_first, kv_heads,
                                                                      single_thread):
    """`DataCollatorWithFlattening` (one row, position_ids restarting at each sequence, as Llama trains on it):
    the same loss and gradients as the sequences padded one a row."""
    config = tiny_config(position_embedding_type=positions, norm_first=norm_first, num_key_value_heads=kv_heads,
                         attn_implementation=attention)
    torch.manual_seed(0)
    model = VaswaniForCausalLM(config).train()
    sequences = [pair["input_ids"] + pair["labels"] for pair in made_up_pairs(6, config.vocab_size, seed=3)]
    flattened = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": ids} for ids in sequences])
    assert set(flattened) == {"input_ids", "labels", "position_ids"}
    longest = max(map(len, sequences))
    padded = {"input_ids": torch.tensor([ids + [config.pad_token_id] * (longest - len(ids)) for ids in sequences]),
              "attention_mask": torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for ids in sequences]),
              "labels": torch.tensor([ids + [-100] * (longest - len(ids)) for ids in sequences])}
    flat_output, flat_gradients = loss_and_gradients(model, flattened)
    plain_output, plain_gradients = loss_and_gradients(model, padded)
    torch.testing.assert_close(flat_output.loss, plain_output.loss, rtol=1e-5, atol=1e-6)
    for name, gradient in flat_gradients.items():
        torch.testing.assert_close(gradient, plain_gradients[name], rtol=1e-4, atol=1e-6, msg=name)
