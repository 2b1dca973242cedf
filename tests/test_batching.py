"""batching.py: token-budget batches for training (`TokenBatchSampler`, shape buckets) and translation."""

import itertools
import random
import tracemalloc

import numpy as np
import pytest
import torch
from datasets import Dataset

from vaswani.batching import (
    TokenBatchSampler,
    batch_positions,
    bucket_lengths,
    example_lengths,
    pad_to_shape,
    padded_lengths,
    token_budget_batches,
)
from vaswani.data import load_translation_dataset
from vaswani.tokenization import tokenize_translation_dataset
from data_helpers import isolated_caches, made_up_pairs, small_tokenizer, write_tsv  # noqa: F401 (fixtures)


def random_lengths(count: int = 2000, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 60) for _ in range(count)]


def test_batches_respect_the_token_budget_and_cover_every_example_once():
    lengths = random_lengths()
    sampler = TokenBatchSampler(lengths, max_tokens=256, seed=3)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert all(len(b) * max(lengths[i] for i in b) <= 256 for b in batches)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    # Grouping by length is the point: padding should be a small share of what is computed.
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert sum(lengths) / padded > 0.9


def test_batches_are_deterministic_per_seed_and_epoch():
    lengths = random_lengths()

    def batches(seed, epoch):
        sampler = TokenBatchSampler(lengths, max_tokens=256, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert batches(0, 0) == batches(0, 0)
    assert batches(0, 0) != batches(0, 1)
    assert batches(0, 0) != batches(1, 0)
    ordered = list(TokenBatchSampler(lengths, max_tokens=256, shuffle=False))
    flat = [i for b in ordered for i in b]
    assert [lengths[i] for i in flat] == sorted(lengths)


# 16-bit keys, over several of the chunks the order is worked out in, and wider keys.
@pytest.mark.parametrize("longest,examples", [(40, 600_000), (70_000, 20_000)])
def test_an_epochs_batches_are_its_permutation_sorted_stably_by_length_then_shuffled(longest, examples):
    """The rule every run's batches follow, spelled out: a change of how it is computed (a faster sort, less memory)
    must keep each epoch's batches, so that a run's losses stay step for step what they were."""
    lengths = np.random.default_rng(5).integers(1, longest, size=examples)
    sampler = TokenBatchSampler(lengths, max_tokens=max(256, longest), seed=2)
    sampler.set_epoch(3)
    rng = np.random.default_rng((2, 3))
    permutation = rng.permutation(len(lengths))
    order = permutation[np.lexsort([lengths[permutation]])]
    cut = np.split(order, sampler._starts[1:])
    assert list(sampler) == [cut[position].tolist() for position in rng.permutation(len(cut))]
    assert len(list(TokenBatchSampler([], max_tokens=256))) == len(TokenBatchSampler([], max_tokens=256)) == 0
    with pytest.raises(ValueError, match="one length per example"):
        TokenBatchSampler([[3, 4], [5, 6]], max_tokens=256)


def test_an_epoch_of_millions_of_examples_is_ordered_in_little_more_memory_than_its_order():
    """Each process of a run holds its sampler: at WMT's 36M pairs, what it takes beside the lengths decides whether
    a run fits. Counted by tracemalloc (NumPy's allocations, the same on every CPU): building the batches takes
    under 3 bytes an example (the sort keys), and an epoch's order under 12 (the permutation and the order, 4 each,
    the keys, and fixed-size chunks); with a padded, sorted copy and a whole-epoch argsort they took 20 and 17."""
    examples = 8_000_000
    lengths = np.random.default_rng(0).integers(1, 120, size=examples).astype(np.int32)
    tracemalloc.start()
    try:
        sampler = TokenBatchSampler(lengths, max_tokens=4000, seed=0, num_replicas=2)
        building = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        next(iter(sampler))
        ordering = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert building < 3 * examples + (8 << 20) and ordering < 12 * examples + (16 << 20), (building, ordering)


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_budget_counts_the_padding_to_a_multiple(replicas):
    """With the collator's `pad_to_multiple_of`, a batch computes its size times its longest length rounded up to
    the multiple: that, not the unpadded size, stays within the budget, and translation's batches follow the rule."""
    lengths = random_lengths()
    sampler = TokenBatchSampler(lengths, max_tokens=256, seed=2, num_replicas=replicas, pad_to_multiple_of=8)
    batches = list(sampler)
    assert len(batches) % replicas == 0
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    padded = [len(b) * -(-max(lengths[i] for i in b) // 8) * 8 for b in batches]
    assert max(padded) <= 256
    # Without the multiple the same budget holds more examples: batches that padding would push over it.
    unpadded = list(TokenBatchSampler(lengths, max_tokens=256, seed=2, num_replicas=replicas))
    assert max(len(b) * -(-max(lengths[i] for i in b) // 8) * 8 for b in unpadded) > 256
    assert len(unpadded) < len(batches)
    assert list(padded_lengths([1, 8, 9, 16], 8)) == [8, 8, 16, 16] and list(padded_lengths([3, 9], None)) == [3, 9]
    for batch in token_budget_batches(lengths, max_tokens=256, pad_to_multiple_of=8):
        assert len(batch) * -(-max(lengths[i] for i in batch) // 8) * 8 <= 256


@pytest.mark.parametrize("replicas", [1, 3])
def test_shape_buckets_declare_a_few_shapes_within_the_budget(replicas):
    """With shape buckets every batch fits one of at most N declared (rows, length) shapes, and padded up to it
    (rows and length) still holds at most the budget's tokens; every example is in one batch, once."""
    lengths = random_lengths()
    sampler = TokenBatchSampler(lengths, max_tokens=256, seed=1, num_replicas=replicas, pad_to_multiple_of=8,
                                shape_buckets=4)
    buckets = sampler.shape_buckets
    assert len(buckets.shapes) == 4 and list(buckets.lengths) == sorted(buckets.lengths)
    assert all(length % 8 == 0 for length in buckets.lengths) and buckets.lengths[-1] == 64  # 60, padded to 8
    batches = list(sampler)
    assert len(batches) % replicas == 0
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    shapes = [buckets.shape(max(lengths[i] for i in b)) for b in batches]
    assert set(shapes) == set(buckets.shapes)
    assert all(len(b) <= rows and rows * length <= 256 for b, (rows, length) in zip(batches, shapes))
    assert TokenBatchSampler(lengths, max_tokens=256).shape_buckets is None


def test_bucket_lengths_pad_an_epoch_least():
    """The chosen lengths are those of fewest padded tokens among every choice of as many (found by trying all)."""
    rng = random.Random(4)
    lengths = [rng.choice([3, 5, 6, 9, 12, 17, 20, 21, 30]) for _ in range(300)]

    def padded(buckets):
        return int(padded_lengths(lengths, None, buckets).sum())

    distinct = sorted(set(lengths))
    for count in (1, 2, 3, 4):
        chosen = bucket_lengths(lengths, count)
        best = min(padded([*others, 30]) for others in itertools.combinations(distinct[:-1], count - 1))
        assert len(chosen) == count and chosen[-1] == 30 and padded(chosen) == best
    assert list(bucket_lengths(lengths, 20)) == distinct  # no more buckets than lengths
    assert list(bucket_lengths([7, 9, 10], 2, pad_to_multiple_of=8)) == [8, 16]
    assert bucket_lengths([], 3).size == 0
    with pytest.raises(ValueError, match="longer than the longest bucket"):
        padded_lengths([5, 40], None, [8, 16])


def test_padding_a_batch_to_its_shape_adds_examples_the_loss_ignores():
    batch = {"input_ids": torch.tensor([[5, 6, 2], [7, 2, 0]]), "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
             "labels": torch.tensor([[8, 2], [9, -100]])}
    padded = pad_to_shape(batch, 4, 5, {"input_ids": 0, "attention_mask": 0, "labels": -100})
    assert padded["input_ids"].tolist() == [[5, 6, 2, 0, 0], [7, 2, 0, 0, 0], [0] * 5, [0] * 5]
    # A padding row sees one token, so that no attention row is entirely masked.
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert padded["labels"].tolist() == [[8, 2, -100, -100, -100], [9, -100, -100, -100, -100], [-100] * 5, [-100] * 5]
    with pytest.raises(ValueError, match="No padding value for the batch's 'labels'"):
        pad_to_shape(batch, 4, 5, {"input_ids": 0, "attention_mask": 0})
    with pytest.raises(ValueError, match=r"does not fit \(1, 5\)"):
        pad_to_shape(batch, 1, 5, {"input_ids": 0, "attention_mask": 0, "labels": -100})


def test_an_example_longer_than_the_budget_once_padded_is_refused():
    TokenBatchSampler([10, 49, 20], max_tokens=50)
    with pytest.raises(ValueError, match="56 tokens padded.*longer than max_tokens=50"):
        TokenBatchSampler([10, 49, 20], max_tokens=50, pad_to_multiple_of=8)


def test_an_example_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="longer than max_tokens=50"):
        TokenBatchSampler([10, 51, 20], max_tokens=50)


def test_sampler_drives_a_dataloader(small_tokenizer):
    pairs = made_up_pairs(100)
    tokenized = tokenize_translation_dataset(
        Dataset.from_dict({"source": [p[0] for p in pairs], "target": [p[1] for p in pairs]}), small_tokenizer
    )
    sampler = TokenBatchSampler(example_lengths(tokenized), max_tokens=128)

    def collate(rows):
        return small_tokenizer.pad([{"input_ids": r["input_ids"]} for r in rows], return_tensors="pt")

    loader = torch.utils.data.DataLoader(tokenized, batch_sampler=sampler, collate_fn=collate)
    shapes = [batch["input_ids"].shape for batch in loader]
    assert len(shapes) == len(sampler) and sum(s[0] for s in shapes) == len(pairs)
    assert all(s[0] * s[1] <= 128 for s in shapes)


# --------------------------------------------------------------------------------------------------
# At scale: the fast cut, several processes, lengths from Arrow


def greedy_batches(sorted_lengths, max_tokens):
    """The greedy cut example by example, as `TokenBatchSampler` describes it: the reference for its fast one."""
    batches, batch = [], []
    for index, length in enumerate(sorted_lengths):
        if batch and (len(batch) + 1) * length > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(index)
    return batches + [batch] if batch else batches


@pytest.mark.parametrize("max_tokens", [60, 61, 256, 1000])
def test_the_cut_worked_out_per_length_is_the_greedy_cut(max_tokens):
    lengths = random_lengths(5000, seed=max_tokens) + [60] * 50 + [1] * 300
    ordered = list(TokenBatchSampler(lengths, max_tokens=max_tokens, shuffle=False))
    order = [i for batch in ordered for i in batch]
    sorted_lengths = [lengths[i] for i in order]
    assert [len(batch) for batch in ordered] == [len(batch) for batch in greedy_batches(sorted_lengths, max_tokens)]


@pytest.mark.parametrize("replicas", [2, 3, 8])
def test_batches_for_several_processes_come_in_a_multiple_of_their_number(replicas):
    lengths = random_lengths(1001)
    sampler = TokenBatchSampler(lengths, max_tokens=256, seed=1, num_replicas=replicas)
    batches = list(sampler)
    assert len(batches) == len(sampler) and len(batches) % replicas == 0
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(lengths[i] for i in b) <= 256 for b in batches)
    single = TokenBatchSampler(lengths, max_tokens=256, seed=1)
    assert len(single) <= len(sampler) < len(single) + replicas


def test_example_lengths_come_from_arrow_as_numbers(small_tokenizer, tmp_path):
    path = write_tsv(tmp_path / "pairs.tsv", made_up_pairs(200))
    train = load_translation_dataset(data_file=path, validation_fraction=0.1, test_fraction=0.1)["train"]
    tokenized = tokenize_translation_dataset(train.select(range(10, 90)), small_tokenizer)
    lengths = example_lengths(tokenized)
    expected = [max(len(s), len(t)) for s, t in zip(tokenized["input_ids"][:], tokenized["labels"][:])]
    assert lengths.dtype == "int32" and lengths.tolist() == expected
    sources, targets = example_lengths(tokenized, sides=True)  # what packing needs: each side's own
    assert sources.tolist() == [len(s) for s in tokenized["input_ids"][:]]
    assert targets.tolist() == [len(t) for t in tokenized["labels"][:]]


def test_batch_positions_count_each_side_padded_to_its_longest_in_the_batch():
    """Two batches, [0, 1] and [2]: each side padded to its longest there (then to a multiple, as the collator)."""
    batches, sources, targets = [[0, 1], [2]], [3, 5, 2], [4, 1, 7]
    real, computed = batch_positions(batches, sources, targets)
    assert real.tolist() == [10, 12] and computed.tolist() == [2 * 5 + 2, 2 * 4 + 7]
    assert batch_positions(batches, sources, targets, pad_to_multiple_of=4)[1].tolist() == [2 * 8 + 4, 2 * 4 + 8]
