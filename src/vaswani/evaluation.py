"""Translation quality: corpus BLEU, chrF and TER with several references per sentence, and `translate` for a model.

All scores come from sacreBLEU (Post, 2018, "A Call for Clarity in Reporting BLEU Scores") with its default
settings: detokenized text in, 13a tokenization for BLEU, chrF with character order 6 and no word n-grams, TER
with tercom tokenization. Those defaults are exactly what `evaluate.load("sacrebleu")` and `evaluate.load("chrf")`
use, since those metric modules are thin wrappers that call `sacrebleu.corpus_bleu` and `CHRF().corpus_score`.
`score_corpus` calls sacreBLEU directly rather than through those modules because (a) they are scripts fetched
from the Hub at run time, so they would fail offline and execute downloaded code, and (b) they reject a variable
number of references per sentence, which a Tatoeba-style test set needs (many English sentences have several
accepted French translations, and not all the same number). For `evaluate.evaluator("translation")`, the package
ships its own metric module with `score_corpus`'s numbers, loaded from its path (`vaswani.evaluator`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from sacrebleu.metrics import BLEU, CHRF, TER

from .loading import engine_for_model
from .translation import translate as run_translation

References = Sequence[str] | Sequence[Sequence[str]]
"""One reference string per hypothesis, or a sequence of references per hypothesis (their number may vary)."""

# Label and generated-token positions that hold no token are filled with this by the data collator and by
# Seq2SeqTrainer when it pads generations from different batches to one length.
IGNORE_INDEX = -100


def reference_streams(references: References, num_hypotheses: int) -> list[list[str | None]]:
    """Turn per-hypothesis references into sacreBLEU's reference streams.

    sacreBLEU wants one stream per reference "slot": stream k holds the k-th reference of every hypothesis. When
    hypotheses have different numbers of references, the shorter lists are padded with `None`, which sacreBLEU
    drops per sentence. Padding with `""` instead would be wrong: an empty string is a real, empty reference that
    shifts BLEU's closest reference length and TER's average reference length.
    """
    if len(references) != num_hypotheses:
        raise ValueError(f"got {num_hypotheses} hypotheses but {len(references)} reference entries; they must align")
    per_hypothesis = [[refs] if isinstance(refs, str) else list(refs) for refs in references]
    for index, refs in enumerate(per_hypothesis):
        if not refs or not all(isinstance(ref, str) for ref in refs):
            raise ValueError(f"hypothesis {index} needs at least one reference string, got {refs!r}")
    num_streams = max(len(refs) for refs in per_hypothesis)
    return [[refs[k] if k < len(refs) else None for refs in per_hypothesis] for k in range(num_streams)]


def score_corpus(hypotheses: Sequence[str], references: References) -> dict:
    """Corpus BLEU, chrF and TER (all 0-100; TER lower is better) and the sacreBLEU signature of each.

    The signatures (e.g. `nrefs:var|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`) are what a paper or
    model card should quote next to the numbers, so that they can be compared.
    """
    if not hypotheses:
        raise ValueError("cannot score an empty corpus")
    streams = reference_streams(references, len(hypotheses))
    hypotheses = list(hypotheses)
    result, signatures = {}, {}
    for name, metric in (("bleu", BLEU()), ("chrf", CHRF()), ("ter", TER())):
        result[name] = metric.corpus_score(hypotheses, streams).score
        signatures[name] = str(metric.get_signature())
    result["signatures"] = signatures
    return result


def build_compute_metrics(
    tokenizer, references: References | None = None
) -> Callable[[object], dict[str, float]]:
    """A `compute_metrics` for `Seq2SeqTrainer(..., args=Seq2SeqTrainingArguments(predict_with_generate=True))`.

    The trainer hands it the generated token ids and the label ids of the whole evaluation set, in dataset order.
    With `references` (aligned with the evaluation dataset, one string or a list of strings per example) those are
    the references; without, the decoded labels are the single reference of each example.
    Returns `{"bleu", "chrf", "ter"}`; the trainer logs them as `eval_bleu`, etc.
    """
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; it is needed to decode the -100 padding of predictions")

    def decode(token_ids: np.ndarray) -> list[str]:
        token_ids = np.where(token_ids == IGNORE_INDEX, pad_token_id, token_ids)
        return [text.strip() for text in tokenizer.batch_decode(token_ids, skip_special_tokens=True)]

    def compute_metrics(eval_pred) -> dict[str, float]:
        hypotheses = decode(eval_pred.predictions)
        refs = references if references is not None else decode(eval_pred.label_ids)
        scores = score_corpus(hypotheses, refs)
        return {name: scores[name] for name in ("bleu", "chrf", "ter")}

    return compute_metrics


def translate(
    model,
    tokenizer,
    sentences: Sequence[str],
    *,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    **engine_options,
) -> list[str]:
    """Translate `sentences` with `model.generate`, returning one string per sentence in the input order: the
    package's one translation path (`vaswani.translation.translate`) with the engine `vaswani.loading.engine_for_model`
    builds, in batches of `batch_size` sentences, longest first. `engine_options`: `num_beams`, `max_new_tokens`
    (default: the model's generation config's; without one there, each source's own length plus 50 tokens, the
    paper's output-length limit, within the positions), `max_source_length` (default: where the model's positions
    end, as `DecodingSettings` decides for every caller; a truncation is reported on stderr), `slots` and `generate()`'s options (None: the
    generation config's). `device` moves the model there first;
    by default the model's own device is used. The model's training mode is restored afterwards, so that this can
    run in the middle of training.
    """
    if not sentences:
        return []
    if device is not None:
        model.to(device)
    was_training = model.training
    try:
        engine = engine_for_model(model, tokenizer, **engine_options)
        return run_translation(engine, sentences, max_sentences=batch_size).texts
    finally:
        model.train(was_training)


def evaluate_model(model, tokenizer, sources: Sequence[str], references: References, **translate_kwargs) -> dict:
    """Translate `sources` and score them against `references` (one or several per source).

    Returns `score_corpus`'s dict (`bleu`, `chrf`, `ter`, `signatures`) plus `hypotheses`, the translations in
    source order. `translate_kwargs` go to `translate` (batch size, beams, generation options).
    """
    hypotheses = translate(model, tokenizer, sources, **translate_kwargs)
    return {**score_corpus(hypotheses, references), "hypotheses": hypotheses}
