"""The model must actually learn: reverse a sequence of 3-8 digits, to >= 99% exact match with greedy decoding.

Reversal needs content-based attention over the whole source and correct positions on both sides (copying could
be solved by attending to "the same position"). It is learned for the paper's layout (post-LayerNorm, sinusoidal
positions, ReLU, shared and tied embeddings scaled by √d_model, label smoothing 0.1) and for `modern()`, each as a
translation model (source → reversed target) and as a decoder-only language model ("<s> digits SEP" → reversed
digits). Tiny widths, fresh random data every step (so no dropout is needed), Adam with the paper's β2 = 0.98 and
ε = 1e-9, linear warm-up then linear decay. Seeds are fixed; each run takes well under a minute on one CPU thread.
"""

import time

import pytest
import torch
from torch.nn import functional as F

from vaswani import VaswaniConfig, VaswaniForCausalLM, VaswaniForConditionalGeneration

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

PAD, EOS, BOS, SEP, FIRST_DIGIT = 0, 1, 3, 14, 4  # digits 0-9 are ids 4-13
MIN_LENGTH, MAX_LENGTH = 3, 8
BATCH_SIZE, LEARNING_RATE = 64, 3e-3
STEPS = {"seq2seq": 400, "causal": 800}  # the decoder-only model must also learn where the prompt ends
TEST_SEQUENCES = 500


def task_config(preset: str) -> VaswaniConfig:
    sizes = {"vocab_size": 16, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "num_attention_heads": 4,
             "d_ff": 128, "max_position_embeddings": 32, "dropout": 0.0}
    if preset == "paper":
        return VaswaniConfig.base(**sizes)
    return VaswaniConfig.modern(**sizes, num_key_value_heads=2)


def digit_sequences(count: int, generator: torch.Generator) -> list[torch.Tensor]:
    lengths = torch.randint(MIN_LENGTH, MAX_LENGTH + 1, (count,), generator=generator)
    return [torch.randint(0, 10, (int(length),), generator=generator) + FIRST_DIGIT for length in lengths]


def pad(sequences: list[torch.Tensor], value: int, left: bool = False) -> torch.Tensor:
    longest = max(len(s) for s in sequences)
    return torch.stack([F.pad(s, (longest - len(s), 0) if left else (0, longest - len(s)), value=value)
                        for s in sequences])


def target(digits: torch.Tensor) -> torch.Tensor:
    return torch.cat([digits.flip(0), torch.tensor([EOS])])


def prompt(digits: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.tensor([BOS]), digits, torch.tensor([SEP])])


def training_batch(kind: str, sequences: list[torch.Tensor]) -> dict:
    if kind == "seq2seq":
        sources = pad([torch.cat([s, torch.tensor([EOS])]) for s in sequences], PAD)
        return {"input_ids": sources, "attention_mask": sources.ne(PAD).long(),
                "labels": pad([target(s) for s in sequences], -100)}
    # Decoder-only: the whole "<s> digits SEP reversed </s>" is read; only the continuation is scored.
    texts = [torch.cat([prompt(s), target(s)]) for s in sequences]
    labels = [torch.cat([torch.full((len(s) + 2,), -100), target(s)]) for s in sequences]
    return {"input_ids": pad(texts, PAD), "attention_mask": pad([torch.ones_like(t) for t in texts], 0),
            "labels": pad(labels, -100)}


def train(model, kind: str) -> float:
    steps = STEPS[kind]
    warmup = steps // 10
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.98), eps=1e-9)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, (steps - step) / (steps - warmup))
    )
    generator = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    model.train()
    for _ in range(steps):
        loss = model(**training_batch(kind, digit_sequences(BATCH_SIZE, generator))).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    return time.perf_counter() - start


def exact_match(model, kind: str) -> float:
    """Greedy generation on held-out sequences; a hit needs every digit and the final </s>."""
    sequences = digit_sequences(TEST_SEQUENCES, torch.Generator().manual_seed(99))
    model.eval()
    with torch.no_grad():
        if kind == "seq2seq":
            sources = pad([torch.cat([s, torch.tensor([EOS])]) for s in sequences], PAD)
            generated = model.generate(input_ids=sources, attention_mask=sources.ne(PAD).long(),
                                       max_new_tokens=MAX_LENGTH + 1, do_sample=False)[:, 1:]  # drop the start token
        else:
            prompts = [prompt(s) for s in sequences]
            prompt_ids = pad(prompts, PAD, left=True)  # batched prompts of different lengths: left padding
            prompt_mask = pad([torch.ones_like(p) for p in prompts], 0, left=True)
            generated = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                                       max_new_tokens=MAX_LENGTH + 1, do_sample=False)[:, prompt_ids.shape[1]:]
    hits = 0
    for digits, tokens in zip(sequences, generated):
        expected = target(digits)
        hits += len(tokens) >= len(expected) and torch.equal(tokens[: len(expected)], expected)
    return hits / len(sequences)


@pytest.mark.parametrize("preset", ["paper", "modern"])
@pytest.mark.parametrize("kind", ["seq2seq", "causal"])
def test_learns_to_reverse_digit_sequences(kind, preset, record_property):
    """Up to a minute on a slow CPU: 400 or 800 training steps are what the model needs to learn the task."""
    torch.manual_seed(0)
    config = task_config(preset)
    model = (VaswaniForConditionalGeneration if kind == "seq2seq" else VaswaniForCausalLM)(config)
    assert model.config.label_smoothing == 0.1 and model.config.norm_first == (preset == "modern")
    seconds = train(model, kind)
    accuracy = exact_match(model, kind)
    record_property("train_seconds", round(seconds, 1))
    print(f"{kind}/{preset}: exact match {accuracy:.3f} after {STEPS[kind]} steps, {seconds:.1f} s of training")
    assert accuracy >= 0.99
