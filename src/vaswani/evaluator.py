"""Measuring a translation model the way `evaluate` users do: `evaluator("translation")` over a pipeline.

    from transformers import pipeline
    from vaswani.evaluator import TranslationEvaluator, load_metric

    translator = pipeline("translation", model="outputs/en-fr", trust_remote_code=True, num_beams=4)
    data = Dataset.from_dict({"text": sources, "label": references})  # a list of references per source
    scores = TranslationEvaluator().compute(model_or_pipeline=translator, data=data, metric=load_metric())

`load_metric()` loads the package's metric module (`sacrebleu_multiref.py`, beside this file) from its path, so
nothing is fetched from the Hub; its BLEU, chrF and TER are `vaswani.evaluation.score_corpus`'s, hence
`scripts/evaluate_bleu.py`'s for the same translations. Give generation options (`num_beams`, `max_new_tokens`)
to the pipeline: evaluate 0.4.0's translation evaluator ignores `compute(generation_kwargs=...)`.

`TranslationEvaluator` is `evaluate.evaluator("translation")`'s class with two defects of evaluate 0.4 mended. Its
`prepare_pipeline` reads `transformers.TFPreTrainedModel` whenever it is given a pipeline object, and transformers
v5 has no such attribute, so the stock evaluator raises AttributeError on every pipeline (a model object or a model
name takes another branch and works). And `compute(generation_kwargs=...)` updates the class-level
`PIPELINE_KWARGS` dict in place, so one call's generation options would apply to every later evaluator in the
process; each instance here has its own copy.
"""

from __future__ import annotations

from pathlib import Path

import evaluate
from transformers import Pipeline

METRIC_PATH = Path(__file__).with_name("sacrebleu_multiref.py")


def load_metric(**kwargs) -> evaluate.EvaluationModule:
    """`evaluate.load` of the package's multi-reference BLEU/chrF/TER module, from its path (no Hub access).
    `kwargs` go to `evaluate.load` (e.g. `experiment_id`, `keep_in_memory`)."""
    return evaluate.load(str(METRIC_PATH), **kwargs)


class TranslationEvaluator(evaluate.TranslationEvaluator):
    """`evaluate.evaluator("translation")` that accepts a transformers v5 pipeline object (see the module docstring)."""

    def __init__(self, task: str = "translation", default_metric_name: str | None = None):
        super().__init__(task, default_metric_name=default_metric_name)
        self.PIPELINE_KWARGS = dict(type(self).PIPELINE_KWARGS)

    def prepare_pipeline(self, model_or_pipeline, tokenizer=None, feature_extractor=None, device=None):
        if not isinstance(model_or_pipeline, Pipeline):
            return super().prepare_pipeline(model_or_pipeline, tokenizer, feature_extractor, device)
        if model_or_pipeline.task != self.task and not model_or_pipeline.task.startswith("translation"):
            raise ValueError(f"the pipeline's task is {model_or_pipeline.task!r}; this evaluator needs {self.task!r}")
        return model_or_pipeline
