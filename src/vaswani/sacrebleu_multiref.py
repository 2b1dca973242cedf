"""An `evaluate` metric module: corpus BLEU, chrF and TER with a variable number of references per sentence.

The numbers are `vaswani.evaluation.score_corpus`'s, hence those of `scripts/evaluate_bleu.py` (sacreBLEU's
defaults). The Hub's `sacrebleu` and `chrf` modules compute the same scores but refuse sentences with different
numbers of references, which a Tatoeba-style test set has, and `evaluate.load("sacrebleu")` fetches and runs their
code from the Hub. This module ships inside the package and is loaded from its path, offline:

    from vaswani.evaluator import load_metric         # evaluate.load(<path of this file>)
    scores = load_metric().compute(predictions=["le chat"], references=[["le chat", "un chat"]])

and it is the metric to give `vaswani.evaluator.TranslationEvaluator` (evaluate's translation evaluator) over a
translation pipeline.
"""

import datasets
import evaluate

from vaswani.evaluation import score_corpus

_DESCRIPTION = (
    "Corpus BLEU, chrF and TER (sacreBLEU's defaults: 13a tokenization for BLEU, character 6-grams for chrF, tercom "
    "tokenization for TER), each 0-100 (TER lower is better). Every prediction may have its own number of references."
)
_KWARGS_DESCRIPTION = """
Args:
    predictions: list of translations (detokenized strings).
    references: one reference string per prediction, or a list of reference strings per prediction; the lists
        may differ in length.
Returns:
    bleu, chrf, ter: floats, as `vaswani.evaluation.score_corpus` and `scripts/evaluate_bleu.py` give them.
"""
_CITATION = """
@inproceedings{post-2018-call,
    title = "A Call for Clarity in Reporting {BLEU} Scores",
    author = "Post, Matt",
    booktitle = "Proceedings of the Third Conference on Machine Translation: Research Papers",
    year = "2018",
    url = "https://www.aclweb.org/anthology/W18-6319",
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SacrebleuMultiref(evaluate.Metric):
    def _info(self):
        # Only floats in the result, so that the evaluator's bootstrap strategy can resample every key; the
        # sacreBLEU signatures are in `score_corpus`'s result and in evaluate_bleu.py's report.
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
                ),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
            reference_urls=["https://github.com/mjpost/sacrebleu"],
        )

    def _compute(self, predictions, references):
        scores = score_corpus(predictions, references)
        return {name: scores[name] for name in ("bleu", "chrf", "ter")}
