"""vaswani: the Transformer of "Attention Is All You Need" as a first-class transformers model.

Importing the package registers the classes with the transformers Auto* factories, so checkpoints load with
`AutoModelForSeq2SeqLM.from_pretrained(path_or_repo)` and no remote code. Every saved checkpoint also carries the
module files and an `auto_map`, so it loads with `trust_remote_code=True` where this package is not installed.
"""

import transformers
from transformers import AutoConfig, AutoTokenizer

from . import modeling_vaswani
from .configuration_vaswani import VaswaniConfig
from .modeling_vaswani import (
    VaswaniEncoderModel,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForSequenceClassification,
    VaswaniModel,
    VaswaniPreTrainedModel,
)
from .pipeline_vaswani import VaswaniTranslationPipeline, register_pipeline
from .tokenization_vaswani import VaswaniTokenizer

# Which class each Auto factory builds: the table the shipped model file writes into every checkpoint's auto_map,
# so registration here and remote-code loading elsewhere cannot disagree.
AUTO_CLASSES = {
    name: (getattr(transformers, name), getattr(modeling_vaswani, class_name))
    for name, class_name in VaswaniPreTrainedModel._auto_map.items()
}

AutoConfig.register(VaswaniConfig.model_type, VaswaniConfig, exist_ok=True)
VaswaniConfig.register_for_auto_class()
for _name, (_auto, _model_class) in AUTO_CLASSES.items():
    _auto.register(VaswaniConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_name)
AutoTokenizer.register(VaswaniConfig, tokenizer_class=VaswaniTokenizer, exist_ok=True)
register_pipeline()  # pipeline("translation", model=..., tokenizer=...)

__all__ = [
    "VaswaniConfig",
    "VaswaniPreTrainedModel",
    "VaswaniModel",
    "VaswaniForConditionalGeneration",
    "VaswaniForCausalLM",
    "VaswaniEncoderModel",
    "VaswaniForSequenceClassification",
    "VaswaniTokenizer",
    "VaswaniTranslationPipeline",
]
