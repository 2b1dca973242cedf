"""Packed training batches (`packing.PackedBatchSampler`, `PackedSeq2SeqCollator`) through the sampler, the
Trainer and train_translation.py --packing, and the padding fraction every run reports."""

import json
import random

import numpy as np
import pytest
import torch
from transformers import DataCollatorForSeq2Seq

import vaswani.batching
import vaswani.inference
import vaswani.packing
import vaswani.training
from vaswani.batching import TokenBatchSampler
from vaswani.packing import PackedBatchSampler, PackedShape, next_fit_rows, pack_rows, packed_shape
from test_trainer import bucketed_run, logged
from training_script import synthetic_corpus


def random_sides(count: int = 3000, seed: int = 0) -> tuple[list[int], list[int]]:
    """Source and target lengths of made-up pairs, the targets about 10% longer, as fra-eng's are."""
    rng = random.Random(seed)
    sources = [rng.randint(2, 20) for _ in range(count)]
    return sources, [max(2, round(s * 1.1) + rng.randint(-3, 3)) for s in sources]


@pytest.mark.parametrize("replicas", [1, 3])
def test_packed_batches_hold_every_example_once_in_rows_of_one_shape_within_the_budget(replicas):
    sources, targets = random_sides()
    sampler = PackedBatchSampler(sources, targets, max_tokens=400, seed=1, num_replicas=replicas)
    shape = sampler.shape
    assert shape.rows * max(shape.source_length, shape.target_length) <= 400
    assert shape.source_length < shape.target_length  # the sides' widths follow their shares of the tokens
    assert len(sampler) % replicas == 0
    packed = {tuple(sorted(row)) for row in sampler.rows}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert sorted(i for batch in batches for i in batch) == list(range(len(sources)))
        for batch in batches:
            # The collator's cut of each batch into rows is the sampler's, and fits the shape.
            starts = next_fit_rows([sources[i] for i in batch], [targets[i] for i in batch], shape)
            assert 1 <= len(starts) <= shape.rows
            rows = np.split(np.array(batch), starts[1:])
            assert {tuple(sorted(row)) for row in rows} <= packed
            assert all(sum(sources[i] for i in row) <= shape.source_length for row in rows)
            assert all(sum(targets[i] for i in row) <= shape.target_length for row in rows)
    assert sampler.batches(0) != sampler.batches(1)  # each epoch deals the rows into other batches
    assert sampler.batches(0) == PackedBatchSampler(sources, targets, 400, seed=1, num_replicas=replicas).batches(0)
    # Each epoch's last batches have fewer rows (3 batches' worth for 3 processes): a larger share of 3,000 pairs.
    assert sampler.padding_fraction() < (0.03 if replicas == 1 else 0.04)


def test_packing_fills_both_sides_of_every_row():
    """The greedy keeps each row's two sides in balance: rows close with little room on either side, where filling
    by size alone leaves one side short (with the balance weight at 0, 4.0% of these sources' positions and 3.3% of
    the targets' stay free)."""
    sources, targets = random_sides()
    shape = PackedShape(rows=6, source_length=60, target_length=66)
    rows = pack_rows(sources, targets, shape)
    assert sorted(np.concatenate(rows).tolist()) == list(range(len(sources)))
    free_s = sum(shape.source_length - sum(sources[i] for i in row) for row in rows)
    free_t = sum(shape.target_length - sum(targets[i] for i in row) for row in rows)
    assert free_s / (len(rows) * shape.source_length) < 0.02 and free_t / (len(rows) * shape.target_length) < 0.02


def test_packed_shape_rounds_to_the_multiple_and_refuses_what_cannot_fit():
    shape = packed_shape([30] + [2] * 20, [40] + [3] * 20, max_tokens=400, pad_to_multiple_of=8)
    assert shape == PackedShape(rows=400 // 40, source_length=32, target_length=40)
    # Rows hold several pairs of the average length, however short the longest one is.
    assert packed_shape([8] * 10, [10] * 10, max_tokens=400) == PackedShape(rows=5, source_length=64, target_length=80)
    with pytest.raises(ValueError, match="does not fit max_tokens=30"):
        packed_shape([30], [40], max_tokens=30)
    with pytest.raises(ValueError, match="wider than the packed rows"):
        pack_rows([30], [41], PackedShape(1, 32, 40))


def run(monkeypatch, corpus, output_dir, *extra, device=("--use_cpu",)):
    """train_translation.py with 150-token batches (`test_trainer.bucketed_run`, without shape buckets), on the CPU
    unless `device` says otherwise: its trainer, the `ShapesSeen` of its steps, and its metrics.json."""
    trainer, seen = bucketed_run(monkeypatch, corpus, output_dir, *device, *extra, batches=())
    return trainer, seen, json.loads((output_dir / "metrics.json").read_text())


def test_packed_training_is_the_same_pairs_unpacked_step_by_step(tmp_path, monkeypatch):
    """--packing: every batch has the sampler's one shape, the loss and gradient norm of each step are those of the
    same pairs padded one a row, and the logged lines and metrics.json report the padding fraction, below the
    unpacked batches'."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    options = ("--max_steps", "8", "--logging_steps", "1", "--packing")
    trainer, steps, metrics = run(monkeypatch, corpus, tmp_path / "packed", *options)
    shape = trainer.batch_sampler.shape
    assert steps.shapes == {((shape.rows, shape.source_length), (shape.rows, shape.target_length))}
    losses, norms, padding = logged(trainer, "loss"), logged(trainer, "grad_norm"), logged(trainer, "padding_fraction")
    assert len(losses) == len(norms) == len(padding) == 8
    assert metrics["train_padding_fraction"] == pytest.approx(padding[-1], abs=1e-4)

    def unpacked(self, features):
        return DataCollatorForSeq2Seq(trainer.processing_class, return_tensors="pt")(features)

    monkeypatch.setattr(vaswani.packing.PackedSeq2SeqCollator, "__call__", unpacked)
    trainer, steps, metrics = run(monkeypatch, corpus, tmp_path / "unpacked", *options)
    assert sum(rows for (rows, _), _ in steps.shapes) > len(steps.shapes) * shape.rows  # the same pairs, one a row
    torch.testing.assert_close(logged(trainer, "loss"), losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logged(trainer, "grad_norm"), norms, rtol=1e-4, atol=1e-6)
    assert metrics["train_padding_fraction"] > padding[-1]


def test_the_padding_fraction_counts_both_sides_of_the_batches_trained_on(tmp_path, monkeypatch):
    """Without packing, the reported fraction is that of the padded batches the steps took, both sides together."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    counted = {"real": 0, "computed": 0}
    real_step = vaswani.training.VaswaniSeq2SeqTrainer.training_step

    def counting_step(self, model, inputs, num_items_in_batch=None):
        counted["real"] += int(inputs["attention_mask"].sum()) + int((inputs["labels"] != -100).sum())
        counted["computed"] += inputs["input_ids"].numel() + inputs["labels"].numel()
        return real_step(self, model, inputs, num_items_in_batch)

    monkeypatch.setattr(vaswani.training.VaswaniSeq2SeqTrainer, "training_step", counting_step)
    _, _, metrics = run(monkeypatch, corpus, tmp_path / "out", "--max_steps", "6")
    assert metrics["train_padding_fraction"] == pytest.approx(1 - counted["real"] / counted["computed"], abs=1e-9)
    assert metrics["train_padding_fraction"] > 0


def test_bucketed_batches_are_cut_by_the_longer_side_in_a_random_order_within_a_length(tmp_path, monkeypatch, capsys):
    """The trainer's batches are `TokenBatchSampler`'s over each pair's longer side, the pairs of one longer length in
    a random order, not ordered by both sides (which measured worse in the main job: results/main-job-cpu.md): the
    command line has no switch for it."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    trainer, _, _ = run(monkeypatch, corpus, tmp_path / "out", "--max_steps", "1")
    sides = vaswani.batching.example_lengths(trainer.train_dataset, sides=True)
    budget = trainer.max_tokens_per_batch
    ordered = trainer.batch_sampler.batches_by_length()
    assert ordered == TokenBatchSampler(sides.max(axis=0), budget, shuffle=False).batches_by_length()
    with pytest.raises(SystemExit):
        run(monkeypatch, corpus, tmp_path / "sides", "--max_steps", "1", "--order_by_both_sides")
    assert "--order_by_both_sides" in capsys.readouterr().err


def test_packed_batches_compile_one_graph_before_the_clock(tmp_path, monkeypatch):
    """--packing --torch_compile: one static graph, built before the clock starts; none while training."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    trainer, steps, _ = run(monkeypatch, corpus, tmp_path / "out", "--max_steps", "12", "--logging_steps", "6",
                            "--packing", "--torch_compile", "--torch_compile_backend", "eager")
    assert len(steps.shapes) == 1 and steps.graphs == {"begin": 1, "end": 1, "breaks": 0}
    assert trainer.compile_seconds > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_batches_as_cuda_graphs_train_as_eager_does(tmp_path, monkeypatch):
    """On CUDA, --packing --torch_compile_mode reduce-overhead (the one shape's step recorded as a CUDA
    graph before the clock, replayed while training) gives the losses of the uncompiled packed step."""
    from torch._dynamo.utils import counters

    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=300)
    options = ("--packing", "--max_steps", "12", "--logging_steps", "1")
    cuda = ("--dataloader_pin_memory", "true")
    trainer, steps, _ = run(monkeypatch, corpus, tmp_path / "graphs", *options, "--torch_compile",
                            "--torch_compile_mode", "reduce-overhead", device=cuda)
    assert trainer.args.device.type == "cuda" and steps.graphs["begin"] == steps.graphs["end"] == 1
    assert counters["inductor"]["cudagraph_skips"] == 0
    graphed = logged(trainer, "loss")
    trainer, _, _ = run(monkeypatch, corpus, tmp_path / "eager", *options, device=cuda)
    torch.testing.assert_close(graphed, logged(trainer, "loss"), rtol=1e-3, atol=1e-4)


def test_packing_needs_a_token_budget_and_no_shape_buckets(tmp_path):
    """The command line's arguments and the trainer refuse the same combinations, by the one check
    (`training_arguments.check_batching`)."""
    from vaswani import VaswaniConfig, VaswaniForConditionalGeneration
    from vaswani.trainer import VaswaniSeq2SeqTrainer

    arguments = vaswani.training.VaswaniTrainingArguments
    with pytest.raises(ValueError, match="needs --max_tokens_per_batch"):
        arguments(output_dir=str(tmp_path), report_to="none", packing=True)
    with pytest.raises(ValueError, match="drop --shape_buckets"):
        arguments(output_dir=str(tmp_path), report_to="none", packing=True, max_tokens_per_batch=100, shape_buckets=2)
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny())
    plain = arguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="needs --max_tokens_per_batch"):
        VaswaniSeq2SeqTrainer(model=model, args=plain, packing=True)
    with pytest.raises(ValueError, match="drop --shape_buckets"):
        VaswaniSeq2SeqTrainer(model=model, args=plain, max_tokens_per_batch=100, packing=True, shape_buckets=2)
