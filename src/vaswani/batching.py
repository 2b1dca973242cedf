"""Token-budget batches: examples of similar length, at most a given number of tokens (padding included) per
batch. For training (`TokenBatchSampler`), in a shuffled order that every process and every resumed run shares,
optionally padded up to a few declared shapes (`ShapeBuckets`, `pad_to_shape`); for translation
(`token_budget_batches`), longest first. Several pairs a row, every batch of one shape: `packing`."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Sampler

if TYPE_CHECKING:  # datasets (and pandas with it) takes half a second to import; translation never needs it
    from datasets import Dataset


def example_lengths(tokenized: Dataset, batch_size: int = 1 << 16, sides: bool = False) -> np.ndarray:
    """Per example, the longer of source and target (32-bit: 4 bytes an example, at WMT's tens of millions), what
    `TokenBatchSampler` needs to bound both sides; with `sides`, both, as a (2, examples) array of source and target
    lengths (what `PackedBatchSampler` packs by). Read from the Arrow lists' lengths a batch at a time, without
    turning token ids into Python objects."""
    import pyarrow.compute as pc

    batches = tokenized.select_columns(["input_ids", "labels"]).with_format("arrow").iter(batch_size)
    pairs = ((pc.list_value_length(batch["input_ids"]).to_numpy(), pc.list_value_length(batch["labels"]).to_numpy())
             for batch in batches)
    if sides:
        lengths = [np.stack(pair) for pair in pairs]
        return np.concatenate(lengths, axis=1).astype(np.int64) if lengths else np.zeros((2, 0), dtype=np.int64)
    return np.concatenate([np.zeros(0, np.int32), *(np.maximum(*pair) for pair in pairs)]).astype(np.int32)


def round_up(lengths, multiple: int | None):
    """`lengths` (a number or an array) rounded up to a multiple of `multiple`, as `DataCollatorForSeq2Seq` and
    tokenizers' `pad` pad them; None or 1: unchanged. The one rounding of every width and budget here and in
    `packing`."""
    if not multiple or multiple <= 1:
        return lengths
    return -(-lengths // multiple) * multiple


def padded_lengths(lengths: Sequence[int], pad_to_multiple_of: int | None = None,
                   buckets: Sequence[int] | None = None) -> np.ndarray:
    """The length each example takes in a padded batch whose longest example it is: its own, rounded up to a
    multiple of `pad_to_multiple_of` where the collator pads so (as `DataCollatorForSeq2Seq` and tokenizers'
    `pad` do), then, with `buckets` (ascending lengths, `bucket_lengths`), up to the smallest of them that holds it.
    A batch of n examples computes n times the largest of these on each side: the one rule by which every token
    budget here is counted, so that a budget bounds what the device computes."""
    lengths = round_up(np.asarray(lengths, dtype=np.int64), pad_to_multiple_of)
    if buckets is not None and len(buckets):
        buckets = np.asarray(buckets, dtype=np.int64)
        index = np.searchsorted(buckets, lengths)
        if lengths.size and index.max() == len(buckets):
            raise ValueError(f"An example of {lengths.max()} tokens is longer than the longest bucket, {buckets[-1]}.")
        lengths = buckets[index]
    return lengths


def batch_positions(batches: Sequence[Sequence[int]], source_lengths: Sequence[int], target_lengths: Sequence[int],
                    pad_to_multiple_of: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The positions `batches` (lists of example indices) hold and the positions they compute, per side (source,
    target): each side of a batch padded to its longest example (`padded_lengths`), as the collator pads it. The
    padding's share of the work is then 1 - held / computed."""
    real, computed = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64)
    for side, lengths in enumerate((np.asarray(source_lengths), np.asarray(target_lengths))):
        for batch in batches:
            chosen = lengths[np.asarray(batch, dtype=np.int64)]
            real[side] += chosen.sum()
            computed[side] += len(chosen) * int(padded_lengths(chosen, pad_to_multiple_of).max(initial=0))
    return real, computed


def bucket_lengths(lengths: Sequence[int], count: int, pad_to_multiple_of: int | None = None) -> np.ndarray:
    """At most `count` lengths, ascending, to pad examples up to (`padded_lengths`), chosen so that an epoch's padded
    tokens are fewest: each example takes the smallest one that holds it, so the longest is the longest example's.
    An exact dynamic programme over the distinct padded lengths (a few hundred at most): the fewest padded tokens
    of the examples up to each length with j buckets, the last one at that length."""
    values, counts = _padded_histogram(np.asarray(lengths, dtype=np.int64), pad_to_multiple_of)
    below = np.concatenate([[0], np.cumsum(counts)]).astype(np.float64)  # below[i]: examples shorter than values[i]
    cost = values * below[1:]  # with one bucket: every example up to values[i] padded to it
    choices = []
    # Exactly min(count, distinct lengths) buckets: splitting a bucket never adds padding.
    for _ in range(1, min(count, len(values))):
        # joined[p, i]: the previous bucket at values[p], the next at values[i] (p < i; otherwise impossible).
        joined = cost[:, None] + values[None, :] * (below[None, 1:] - below[1:, None])
        joined[np.tril_indices(len(values))] = np.inf
        choices.append(joined.argmin(axis=0))
        cost = joined.min(axis=0)
    chosen = [len(values) - 1] if values.size else []
    for previous in reversed(choices):
        chosen.append(int(previous[chosen[-1]]))
    return values[sorted(chosen)]


@dataclass(frozen=True)
class ShapeBuckets:
    """The declared (rows, length) shapes every training batch is padded up to: a batch whose longest example takes
    `length` tokens (after the collator's padding, on the longer side) takes the shape of the smallest bucket length
    that holds it, with that bucket's rows, on both sides. A compiled step then has one static graph per shape, which
    can all be compiled (and recorded as CUDA graphs) before training, at the cost of the padding."""

    lengths: tuple[int, ...]  # ascending
    rows: tuple[int, ...]  # the rows of the bucket of each length

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return list(zip(self.rows, self.lengths))

    def shape(self, length: int) -> tuple[int, int]:
        """(rows, length) of the bucket of a batch whose longer side is `length` tokens wide."""
        index = bisect_left(self.lengths, length)
        if index == len(self.lengths):
            raise ValueError(f"A batch {length} tokens wide is wider than the widest shape bucket, {self.lengths[-1]}.")
        return self.rows[index], self.lengths[index]


def pad_to_shape(batch: Mapping[str, torch.Tensor], rows: int, length: int,
                 pad_values: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """A collated batch of (rows, length) tensors padded up to `rows` × `length`: new columns and rows with each
    tensor's value in `pad_values`, except that the attention masks (`*attention_mask`, padded with 0) show the
    first position of a new row. A new row is a padding example: its labels are all ignored (-100 for `labels`), so
    it adds nothing to the loss, to the Trainer's count of label tokens or to the gradients; its one visible token
    keeps its attention rows from being entirely masked, which can give NaN under sdpa's kernels (0 × NaN is NaN)."""
    padded = {}
    for name, tensor in batch.items():
        if name not in pad_values:
            raise ValueError(f"No padding value for the batch's {name!r}; pass one in pad_values.")
        if tensor.dim() != 2 or tensor.shape[0] > rows or tensor.shape[1] > length:
            raise ValueError(f"The batch's {name!r} of shape {tuple(tensor.shape)} does not fit ({rows}, {length}).")
        full = tensor.new_full((rows, length), pad_values[name])
        full[: tensor.shape[0], : tensor.shape[1]] = tensor
        if name.endswith("attention_mask"):
            full[tensor.shape[0]:, 0] = 1
        padded[name] = full
    return padded


def token_budget_batches(lengths: Sequence[int], max_tokens: int | None, max_sentences: int | None = None,
                         pad_to_multiple_of: int | None = None) -> list[list[int]]:
    """Indices into `lengths`, longest first, cut into batches of at most `max_tokens` padded tokens (a batch's
    size times its longest length, `padded_lengths`) and at most `max_sentences` sentences (None: no bound). A
    sentence longer than `max_tokens` is a batch of its own. Longest first, so that running out of memory, if it
    happens, happens on the first batch."""
    padded = padded_lengths(lengths, pad_to_multiple_of).tolist()
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    for index in order:
        batch = batches[-1] if batches else None
        fits = batch is not None and (max_sentences is None or len(batch) < max_sentences) and (
            max_tokens is None or (len(batch) + 1) * padded[batch[0]] <= max_tokens)
        if fits:
            batch.append(index)
        else:
            batches.append([index])
    return batches


class TokenBatchSampler(Sampler[list[int]]):
    """Batches of similar-length examples holding at most `max_tokens` tokens each, padding included.

    The paper batched "sentence pairs ... by approximate sequence length", about 25,000 source and 25,000
    target tokens per batch (Section 5.1): a budget in tokens rather than sentences keeps the work per step
    roughly constant, and grouping by length wastes little on padding. With `lengths` from
    `example_lengths`, `len(batch) * max(padded lengths in batch) <= max_tokens` bounds both padded sides; give
    the collator's `pad_to_multiple_of`, if it pads so, and the bound holds after that padding too
    (`padded_lengths`).

    Examples are sorted by length, ties broken at random, cut greedily into batches, and the batches are
    shuffled. The order depends only on `seed` and the epoch given to `set_epoch`, so every process of a
    distributed run and every resumed run sees the same batches. Use as `DataLoader(dataset,
    batch_sampler=sampler, collate_fn=...)`.

    With `num_replicas` processes, each taking every `num_replicas`-th batch (as Accelerate's batch-sampler
    sharding does), the count of batches is made a multiple of `num_replicas` by halving the largest batches:
    otherwise the sharding would repeat batches from the start to even out the processes, and the epoch would
    hold some examples twice.

    With `shape_buckets` (a count), examples are padded up to that many lengths (`bucket_lengths`) and batches cut by
    those: every batch of a bucket length has at most as many rows as its largest, which the budget bounds, and
    `shape_buckets` becomes the `ShapeBuckets` the batches are padded up to (`pad_to_shape`); otherwise it is None.
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, shuffle: bool = True, seed: int = 0,
                 num_replicas: int = 1, pad_to_multiple_of: int | None = None, shape_buckets: int | None = None):
        lengths = np.asarray(lengths)
        if lengths.ndim != 1:
            raise ValueError(f"lengths of shape {lengths.shape}: give one length per example, its longer side.")
        longest = int(lengths.max()) if lengths.size else 0
        self.lengths = lengths.astype(np.int32 if longest < 2**31 else np.int64, copy=False)
        # The lengths as the order's key: numpy sorts 16-bit keys by radix, in linear time.
        self._keys = self.lengths.astype(np.uint16) if longest < 2**16 else self.lengths
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        buckets = bucket_lengths(self.lengths, shape_buckets, pad_to_multiple_of) if shape_buckets else None
        # Batch boundaries depend only on the sorted padded lengths, which ties do not change: they are fixed, and
        # worked out from how many examples take each padded length (padded lengths sort as the lengths do).
        widths, counts = _padded_histogram(self.lengths, pad_to_multiple_of, buckets)
        if widths.size and widths[-1] > max_tokens:
            padded = padded_lengths(self.lengths, pad_to_multiple_of, buckets)
            too_long = np.flatnonzero(padded > max_tokens)
            raise ValueError(f"{too_long.size} examples (e.g. index {too_long[0]}, {padded[too_long[0]]} tokens "
                             f"padded) are longer than max_tokens={max_tokens}; truncate them or raise max_tokens.")
        self._starts = _even_out(_greedy_starts(widths, counts, max_tokens), len(self.lengths), num_replicas)
        self.shape_buckets = None
        if buckets is not None and widths.size:
            # A batch's length is its last (longest) example's; its bucket's rows, the most any batch of it has.
            ends = np.append(self._starts[1:], len(self.lengths))
            last = widths[np.searchsorted(np.cumsum(counts), ends - 1, side="right")]
            sizes = ends - self._starts
            rows = {int(width): int(sizes[last == width].max()) for width in np.unique(last)}
            self.shape_buckets = ShapeBuckets(tuple(rows), tuple(rows.values()))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> "TokenBatchSampler":
        """Accelerate passes the epoch of a batch sampler it shards between processes to the wrapped sampler's
        `.sampler.set_epoch`, not to the sampler itself: this way the epoch reaches the batches there too."""
        return self

    def _batch(self, order: np.ndarray, position: int) -> list[int]:
        """The `position`-th batch of `order` (examples sorted stably by length): a slice, so that an epoch's million
        batches are not a million arrays at once."""
        end = self._starts[position + 1] if position + 1 < len(self._starts) else len(order)
        return order[self._starts[position]:end].tolist()

    def batches_by_length(self) -> list[list[int]]:
        """Every batch of an epoch, shortest examples first: the batches without the shuffling (whose sizes and
        lengths, so the shapes they pad to, are those of every epoch)."""
        order = _ordered_by_key(np.arange(len(self.lengths)), self._keys)
        return [self._batch(order, position) for position in range(len(self._starts))]

    def __iter__(self) -> Iterator[list[int]]:
        if not self.shuffle:
            yield from self.batches_by_length()
            return
        rng = np.random.default_rng((self.seed, self.epoch))
        # The permutation of an int32 range is `rng.permutation(examples)`'s, in half the memory.
        index_type = np.int32 if len(self.lengths) < 2**31 else np.int64
        order = _ordered_by_key(rng.permutation(np.arange(len(self.lengths), dtype=index_type)), self._keys)
        for position in rng.permutation(len(self._starts)).tolist():
            yield self._batch(order, position)

    def __len__(self) -> int:
        return len(self._starts)


def _padded_histogram(lengths: np.ndarray, pad_to_multiple_of: int | None = None,
                      buckets: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The distinct padded lengths of `lengths` (`padded_lengths`), ascending, and how many examples take each:
    counted per length, so that tens of millions of examples need no padded or sorted copy."""
    counts = _bincount(lengths)
    present = np.flatnonzero(counts)
    widths = padded_lengths(present, pad_to_multiple_of, buckets)  # non-decreasing, as the lengths
    values, first = np.unique(widths, return_index=True)
    return values, np.add.reduceat(counts[present], first) if present.size else np.zeros(0, dtype=np.int64)


def _bincount(values: np.ndarray, minlength: int = 0, chunk: int = 1 << 18) -> np.ndarray:
    """`np.bincount(values, minlength=minlength)`, a chunk at a time: bincount makes a 64-bit copy of what it counts."""
    counts = np.zeros(max(minlength, int(values.max()) + 1 if len(values) else 0), dtype=np.int64)
    for start in range(0, len(values), chunk):
        counts += np.bincount(values[start:start + chunk], minlength=len(counts))
    return counts


def _ordered_by_key(indices: np.ndarray, keys: np.ndarray, chunk: int = 1 << 18) -> np.ndarray:
    """`indices[np.argsort(keys[indices], kind="stable")]` for small non-negative integer `keys`, a chunk of indices
    at a time: each index goes straight to its place in its key's run, so an epoch of tens of millions of examples
    needs no whole-epoch argsort (8 bytes an example) beside its order."""
    top = int(keys.max()) + 1 if keys.size else 1
    counts = np.zeros(top, dtype=np.int64)
    for start in range(0, len(indices), chunk):
        counts += np.bincount(keys[indices[start:start + chunk]], minlength=top)
    cursor = np.cumsum(counts) - counts  # where the next index of each key goes
    order = np.empty_like(indices)
    for start in range(0, len(indices), chunk):
        part = indices[start:start + chunk]
        by_key = np.argsort(keys[part], kind="stable")
        part_keys = keys[part[by_key]]
        part_counts = np.bincount(part_keys, minlength=top)
        within = np.arange(len(part)) - (np.cumsum(part_counts) - part_counts)[part_keys]  # rank within its key's run
        order[cursor[part_keys] + within] = part[by_key]
        cursor += part_counts
    return order


def _greedy_starts(widths: np.ndarray, counts: np.ndarray, max_tokens: int) -> np.ndarray:
    """Where each batch starts in the examples sorted by padded length (`counts[i]` of them `widths[i]` long) under
    the greedy cut: each new example is the longest of its batch so far, and joins it while (batch size + 1) * its
    length <= max_tokens. Worked out per length (a few hundred at most), not per example, so millions of examples
    take milliseconds."""
    total = int(counts.sum())
    starts, size, position = [], 0, 0
    for length, count in zip(widths.tolist(), counts.tolist()):
        capacity = max_tokens // length if length > 0 else total
        if size and size >= capacity:  # the open batch is full at this length
            size = 0
        if size == 0:
            starts.append(position)
        joined = min(count, capacity - size)
        size += joined
        rest = count - joined
        if rest:
            starts.extend(range(position + joined, position + count, capacity))
            size = rest - (rest - 1) // capacity * capacity
        position += count
    return np.asarray(starts, dtype=np.int64)


def _even_out(starts: np.ndarray, total: int, num_replicas: int) -> np.ndarray:
    """Halve the largest batches until their count is a multiple of `num_replicas` (never more than
    num_replicas - 1 halvings; a half of a batch within the budget is within it too). Batches of one example
    cannot be halved: with too few examples to even out, the sharding's repeats stay."""
    starts = starts.tolist()
    while len(starts) % num_replicas:
        sizes = np.diff([*starts, total])
        largest = int(np.argmax(sizes))
        if sizes[largest] < 2:
            break
        starts.insert(largest + 1, starts[largest] + int(sizes[largest]) // 2)
    return np.asarray(starts, dtype=np.int64)
