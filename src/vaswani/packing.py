"""Packed training batches: several sentence pairs a row, one after another on both sides, every batch of one shape
(`PackedShape`) that a token budget bounds, so that little of what a step computes is padding. `PackedBatchSampler`
packs the rows and deals them into batches; `PackedSeq2SeqCollator` lays a batch out with positions restarting at
each pair, which the model reads as packing (`modeling_vaswani.packed_attention_mask` keeps attention within each
pair)."""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Sampler

from .batching import round_up


@dataclass(frozen=True)
class PackedShape:
    """The one shape of every packed training batch: `rows` rows of `source_length` source and `target_length`
    target positions, each row holding several pairs one after another (their positions restarting at each pair,
    attention kept within it by the model: `modeling_vaswani.packed_attention_mask`)."""

    rows: int
    source_length: int
    target_length: int

    @property
    def positions(self) -> int:
        """The positions a batch computes, both sides together."""
        return self.rows * (self.source_length + self.target_length)


# Rows hold at least this many pairs of the average length: with room for only a few, the greedy cannot fill them
# (rows of one long pair waste what a short one would not fill). Fra-eng's longest pair already makes its rows this
# wide.
ROW_PAIRS = 8


def packed_shape(source_lengths: Sequence[int], target_lengths: Sequence[int], max_tokens: int,
                 pad_to_multiple_of: int | None = None) -> PackedShape:
    """The shape packed batches of at most `max_tokens` positions per side take. Rows as short as the longest
    example and `ROW_PAIRS` average ones allow, since attention computes a row's every (query, key) pair, those
    across its pairs' boundaries included; as many rows as the budget holds; the rows then widened to fill it. The
    side with more tokens in the corpus gets that width, the other one in proportion to its share of the tokens (at
    least its longest example), so that both sides fill up together: a row is full as soon as either side is. Widths
    are multiples of `pad_to_multiple_of`, where given."""
    multiple = pad_to_multiple_of if pad_to_multiple_of and pad_to_multiple_of > 1 else 1
    source, target = np.asarray(source_lengths, dtype=np.int64), np.asarray(target_lengths, dtype=np.int64)
    if not source.size:
        raise ValueError("No examples to pack.")
    longest = round_up(int(max(source.max(), target.max())), multiple)
    widest = max(longest, min(round_up(int(ROW_PAIRS * max(source.mean(), target.mean())), multiple),
                              max_tokens // multiple * multiple))
    rows = max_tokens // widest
    if rows < 1:
        raise ValueError(f"An example of {longest} tokens (padded) does not fit max_tokens={max_tokens}; truncate the "
                         "examples or raise max_tokens.")
    width = max_tokens // rows // multiple * multiple  # at least `widest`, a multiple that fits
    longer, shorter = (target, source) if target.sum() >= source.sum() else (source, target)
    # The nearest multiple to the proportional width: rounding up would pad the narrow side by up to a multiple.
    proportional = round(width * shorter.sum() / longer.sum() / multiple) * multiple
    narrow = min(width, max(round_up(int(shorter.max()), multiple), proportional))
    if longer is target:
        return PackedShape(rows, narrow, width)
    return PackedShape(rows, width, narrow)


# How much `pack_rows` weighs a row's balance between its sides against an example's size: with none, rows run out of
# room on one side while the other still has some, and about 6% of the main job's positions are padding; at 0.5,
# about 1% (both measured on fra-eng at 1,000 tokens; 1 and 2 pack a little less well).
BALANCE_WEIGHT = 0.5


def pack_rows(source_lengths: Sequence[int], target_lengths: Sequence[int], shape: PackedShape,
              seed: int = 0) -> list[np.ndarray]:
    """Every example (by index) in rows of `shape`'s widths, each row filled greedily: it starts with the largest
    example left, then takes, while any fits, the example that fits best, by its size (the shares of each side's
    width it fills) less `BALANCE_WEIGHT` times the imbalance it leaves between the two sides' free shares (so that
    neither side fills up while the other has room no example could use). Examples of equal lengths are taken in a
    random order (`seed`). A row is closed only when no example left fits it, which is what lets `next_fit_rows`
    recover the rows of a batch from its examples' order alone. Worked out over the distinct (source, target)
    lengths (a few thousand), not the examples: 150,000 pairs take a few seconds."""
    source, target = np.asarray(source_lengths, dtype=np.int64), np.asarray(target_lengths, dtype=np.int64)
    width_s, width_t = shape.source_length, shape.target_length
    if source.size and (source.max() > width_s or target.max() > width_t):
        raise ValueError(f"An example is wider than the packed rows ({width_s} source, {width_t} target positions).")
    permutation = np.random.default_rng(seed).permutation(len(source))
    cells = source[permutation] * (width_t + 1) + target[permutation]
    by_cell = permutation[np.argsort(cells, kind="stable")]  # grouped by (source, target) length, random within
    kinds, counts = np.unique(cells, return_counts=True)
    next_in_kind = np.concatenate([[0], np.cumsum(counts)[:-1]])
    share_s, share_t = kinds // (width_t + 1) / width_s, kinds % (width_t + 1) / width_t
    lengths_s, lengths_t = kinds // (width_t + 1), kinds % (width_t + 1)
    rows, left = [], len(source)
    while left:
        row, room_s, room_t = [], width_s, width_t
        while True:
            fits = (counts > 0) & (lengths_s <= room_s) & (lengths_t <= room_t)
            score = share_s + share_t - BALANCE_WEIGHT * np.abs(room_s / width_s - share_s - room_t / width_t + share_t)
            best = int(np.where(fits, score, -np.inf).argmax())
            if not fits[best]:
                break
            row.append(by_cell[next_in_kind[best]])
            next_in_kind[best] += 1
            counts[best] -= 1
            room_s, room_t, left = room_s - lengths_s[best], room_t - lengths_t[best], left - 1
        rows.append(np.asarray(row, dtype=np.int64))
    return rows


def next_fit_rows(source_lengths: Sequence[int], target_lengths: Sequence[int], shape: PackedShape) -> list[int]:
    """Where each row starts among examples in order, each row filled until the next example does not fit on either
    side: the rows `pack_rows` made, for a batch of `PackedBatchSampler`'s (whose rows come in the order they were
    made: an example of a later row did not fit an earlier one, or it would have been put there)."""
    starts, used_s, used_t = [], shape.source_length, shape.target_length  # "full": the first example opens a row
    for index, (s, t) in enumerate(zip(source_lengths, target_lengths)):
        if used_s + s > shape.source_length or used_t + t > shape.target_length:
            starts.append(index)
            used_s = used_t = 0
        used_s, used_t = used_s + s, used_t + t
    return starts


class PackedBatchSampler(Sampler[list[int]]):
    """Batches of several sentence pairs per row, all of one shape (`packed_shape`): at most `max_tokens` positions
    per side, the budget counting every position a batch computes, padding included. For `PackedSeq2SeqCollator`,
    which lays each batch's examples out in its rows (`next_fit_rows`).

    The rows are packed once (`pack_rows`, seeded); each epoch deals them out into batches of `shape.rows` rows in a
    shuffled order that depends only on `seed` and the epoch given to `set_epoch`, so that every process of a
    distributed run and every resumed run sees the same batches, and every epoch's batches mix other rows. With
    `num_replicas` processes (each taking every `num_replicas`-th batch), the count of batches is made a multiple of
    `num_replicas` by giving the last batches fewer rows (a batch has at least one), as `TokenBatchSampler` halves
    its largest: otherwise Accelerate's sharding would repeat batches to even out the processes."""

    def __init__(self, source_lengths: Sequence[int], target_lengths: Sequence[int], max_tokens: int,
                 shuffle: bool = True, seed: int = 0, num_replicas: int = 1, pad_to_multiple_of: int | None = None):
        self.source_lengths = np.asarray(source_lengths, dtype=np.int64)
        self.target_lengths = np.asarray(target_lengths, dtype=np.int64)
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.shape = packed_shape(self.source_lengths, self.target_lengths, max_tokens, pad_to_multiple_of)
        self.rows = pack_rows(self.source_lengths, self.target_lengths, self.shape, seed)
        count = -(-len(self.rows) // self.shape.rows)
        count = min(-(-count // num_replicas) * num_replicas, len(self.rows))
        sizes = np.full(count, self.shape.rows)
        missing = count * self.shape.rows - len(self.rows)
        for index in range(count - 1, -1, -1):  # the last batches give up rows, each keeping one
            taken = min(missing, self.shape.rows - 1)
            sizes[index] -= taken
            missing -= taken
        self._sizes = sizes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> "PackedBatchSampler":
        """Where Accelerate hands the epoch on (see `TokenBatchSampler.sampler`)."""
        return self

    def positions(self) -> tuple[np.ndarray, np.ndarray]:
        """The positions an epoch's batches hold and the positions they compute (every batch at its full shape), per
        side (source, target), as `batching.batch_positions` counts bucketed batches: the padding's share of the
        work is 1 - held / computed."""
        real = np.array([self.source_lengths.sum(), self.target_lengths.sum()], dtype=np.int64)
        return real, len(self) * self.shape.rows * np.array([self.shape.source_length, self.shape.target_length])

    def padding_fraction(self) -> float:
        """The share of an epoch's computed positions (both sides, every batch at its full shape) that are padding."""
        real, computed = self.positions()
        return 1 - real.sum() / computed.sum()

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """The batches of an epoch (`set_epoch`'s, by default), in the order they are trained on."""
        epoch = self.epoch if epoch is None else epoch
        order = (np.random.default_rng((self.seed, epoch)).permutation(len(self.rows)) if self.shuffle
                 else np.arange(len(self.rows)))
        # A batch's rows in the order they were packed, so that `next_fit_rows` finds them again.
        return [np.concatenate([self.rows[row] for row in np.sort(chosen)]).tolist()
                for chosen in np.split(order, np.cumsum(self._sizes)[:-1])]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches()

    def __len__(self) -> int:
        return len(self._sizes)


class PackedSeq2SeqCollator:
    """Tokenized pairs (`input_ids`, `labels`, as `DataCollatorForSeq2Seq` takes them) laid out in the rows of a
    `PackedShape`, every batch at that full shape: `input_ids` and `attention_mask` (1 on the pairs' tokens),
    `position_ids` restarting at 0 at each pair; `labels` (-100 on padding, which the loss ignores) and
    `decoder_position_ids` restarting likewise. The model makes each pair's decoder input from its labels (shifted
    right within the pair) and keeps attention within each pair (`VaswaniForConditionalGeneration`); padding gets
    position 0 and no label. The rows are `next_fit_rows`' cut of the examples in their order, which for a batch of
    `PackedBatchSampler`'s are the rows it packed. A class rather than a closure, so that loader workers can be
    handed it."""

    def __init__(self, shape: PackedShape, pad_token_id: int):
        self.shape, self.pad_token_id = shape, pad_token_id

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows, width_s, width_t = self.shape.rows, self.shape.source_length, self.shape.target_length
        sources, targets = [list(f["input_ids"]) for f in features], [list(f["labels"]) for f in features]
        starts = next_fit_rows(list(map(len, sources)), list(map(len, targets)), self.shape)
        if len(starts) > rows:
            raise ValueError(f"These {len(features)} examples take {len(starts)} rows of ({width_s}, {width_t}) "
                             f"positions; the packed shape has {rows}.")
        input_ids = np.full((rows, width_s), self.pad_token_id, dtype=np.int64)
        labels = np.full((rows, width_t), -100, dtype=np.int64)
        attention_mask = np.zeros((rows, width_s), dtype=np.int64)
        position_ids = np.zeros((rows, width_s), dtype=np.int64)
        decoder_position_ids = np.zeros((rows, width_t), dtype=np.int64)
        for row, (start, end) in enumerate(zip(starts, [*starts[1:], len(features)])):
            source = [token for ids in sources[start:end] for token in ids]
            target = [token for ids in targets[start:end] for token in ids]
            input_ids[row, : len(source)] = source
            attention_mask[row, : len(source)] = 1
            labels[row, : len(target)] = target
            position_ids[row, : len(source)] = [p for ids in sources[start:end] for p in range(len(ids))]
            decoder_position_ids[row, : len(target)] = [p for ids in targets[start:end] for p in range(len(ids))]
        batch = {"input_ids": input_ids, "attention_mask": attention_mask,
                 "position_ids": position_ids, "labels": labels, "decoder_position_ids": decoder_position_ids}
        return {name: torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)) for name, array in batch.items()}
