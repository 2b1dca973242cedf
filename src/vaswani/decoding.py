"""The lean decoding loop under its package name. The code lives in `generation_vaswani`, which ships with every
checkpoint; `VaswaniForConditionalGeneration.generate()` already decodes with it wherever it returns transformers'
outputs, so this module is for models whose class does not: a model loaded from a checkpoint saved before it
existed, or any model a benchmark compares it on.

    vaswani.decoding.use_lean_decoding(model)                     # every later generate() call
    vaswani.decoding.use_lean_decoding(model, cuda_graphs=True)   # with CUDA graphs (see generation_vaswani)
"""

import functools

from .generation_vaswani import decode, generate

__all__ = ["decode", "generate", "use_lean_decoding"]


def use_lean_decoding(model, cuda_graphs: bool = False):
    """Make every later `model.generate()` call go through `generation_vaswani.generate` (the lean loop where it
    gives transformers' outputs), with CUDA graphs if `cuda_graphs`; return `model`. Per instance, like
    transformers' own loading of a checkpoint's `custom_generate/generate.py`."""
    options = {"cuda_graphs": True} if cuda_graphs else {}
    model.generate = functools.partial(generate, model=model, **options)
    return model
