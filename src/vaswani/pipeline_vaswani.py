"""A `pipeline("translation")` for encoder-decoder models; transformers v5 removed its built-in one.

This file ships next to every checkpoint (Hub custom code), so it imports only torch and transformers. It is
reachable two ways:

* after `import vaswani`, which calls `register_pipeline()`: `pipeline("translation", model=model,
  tokenizer=tokenizer)`;
* from a checkpoint saved after `vaswani.hub.attach_translation_pipeline`, whose config.json names this file under
  `custom_pipelines`: `pipeline("translation", model="user/repo", trust_remote_code=True)`, which needs no
  `vaswani` package. transformers insists on `trust_remote_code=True` for such a checkpoint even when the package
  is imported, unless the class is given: `pipeline(..., pipeline_class=VaswaniTranslationPipeline)`.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForSeq2SeqLM, Pipeline, StoppingCriteriaList
from transformers.pipelines import PIPELINE_REGISTRY, REMOVED_TASKS

from .configuration_vaswani import check_tokenizer_fits, length_options, longest_output, output_limit
from .generation_vaswani import SentenceLimits

TASK = "translation"



def sentence_limit_options(limits: list[int], device: torch.device) -> dict:
    """`generate()`'s arguments for a batch of sentences whose outputs may have `limits[i]` new tokens each: the
    longest as `max_length` (`length_options`) and, only where the limits differ, `SentenceLimits` stopping each
    sentence at its own, so that its output does not depend on its neighbours'. The pipeline and
    `vaswani.translation.generate_token_ids` both decode through it."""
    options = length_options(max(limits))
    if len(set(limits)) > 1:
        lengths = torch.tensor(limits, device=device) + 1  # and the decoder start token
        options["stopping_criteria"] = StoppingCriteriaList([SentenceLimits(lengths)])
    return options

class VaswaniTranslationPipeline(Pipeline):
    """Text in one language to text in another: `pipe("a sentence")` or `pipe(["one", "two"], batch_size=2)`.

    Returns `[{"translation_text": ...}]` for a string (one entry per returned sequence) and a list of those for a
    list of strings, flattened to one dict per input when a single sequence is returned per input, as the
    pipeline of transformers v4 did. Keyword arguments that `generate` understands (`num_beams`,
    `max_new_tokens`, ...) are passed to it, at construction or per call, on top of the model's generation config;
    `truncation` (default True) truncates inputs to the tokenizer's `model_max_length`. Where neither gives
    `max_new_tokens` (or the call a `max_length`), each output runs to the package's one length rule for its own
    source (`configuration_vaswani.output_limit`: its length plus 50 tokens, within the positions), whatever else is
    in its batch (`generation_vaswani.SentenceLimits`).
    """

    _pipeline_calls_generate = True
    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_video_processor = False
    _load_feature_extractor = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_tokenizer_fits(self.model, self.tokenizer)

    def _sanitize_parameters(self, truncation=None, **generate_kwargs):
        preprocess_params = {} if truncation is None else {"truncation": truncation}
        return preprocess_params, generate_kwargs, {}

    def __call__(self, inputs, **kwargs):
        results = super().__call__(inputs, **kwargs)
        if isinstance(inputs, list) and all(len(result) == 1 for result in results):
            return [result[0] for result in results]
        return results

    def preprocess(self, text: str, truncation: bool = True) -> dict:
        encoded = self.tokenizer(text, truncation=truncation, return_tensors="pt")
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def _forward(self, model_inputs: dict, **generate_kwargs) -> dict:
        batch_size = model_inputs["input_ids"].shape[0]
        options = self._generate_options(generate_kwargs)
        configs = (self.model.generation_config, options.get("generation_config"))
        if not {"max_new_tokens", "max_length", "stopping_criteria"} & options.keys() and \
                all(config is None or config.max_new_tokens is None for config in configs):
            longest = longest_output(self.model.config)
            limits = [output_limit(length, None, longest) for length in model_inputs["attention_mask"].sum(1).tolist()]
            options |= sentence_limit_options(limits, model_inputs["input_ids"].device)
        output_ids = self.model.generate(**model_inputs, **options)
        # (batch * num_return_sequences, length) -> (batch, num_return_sequences, length), so that the pipeline's
        # un-batching hands each input all of its sequences.
        return {"output_ids": output_ids.reshape(batch_size, -1, output_ids.shape[-1])}

    def _generate_options(self, generate_kwargs: dict) -> dict:
        """This call's `generate()` options on top of those given at construction and the pipeline's defaults.

        transformers 5.20 and later collect them in `Pipeline._prepare_generate_kwargs`. 5.19 has no such method:
        its `Pipeline.__init__` folds the construction options and `_default_generation_config` into
        `self.generation_config`, which `generate()` takes along with this call's options (they win over it).
        """
        if hasattr(self, "_prepare_generate_kwargs"):
            return self._prepare_generate_kwargs(generate_kwargs)
        return {"generation_config": self.generation_config, **generate_kwargs}

    def postprocess(self, model_outputs: dict) -> list[dict[str, str]]:
        texts = self.tokenizer.batch_decode(model_outputs["output_ids"][0], skip_special_tokens=True)
        return [{"translation_text": text.strip()} for text in texts]


def register_pipeline() -> None:
    """Make `pipeline("translation", ...)` build a `VaswaniTranslationPipeline` in this process.

    transformers v5 lists "translation" among removed tasks and rejects it before consulting the registry, so the
    entry is also taken out of `REMOVED_TASKS`; no other task is affected. Calling this twice is harmless.
    """
    registered = PIPELINE_REGISTRY.supported_tasks.get(TASK, {})
    if registered.get("impl") is not VaswaniTranslationPipeline:
        PIPELINE_REGISTRY.register_pipeline(
            TASK, pipeline_class=VaswaniTranslationPipeline, pt_model=AutoModelForSeq2SeqLM, type="text"
        )
    REMOVED_TASKS.pop(TASK, None)
