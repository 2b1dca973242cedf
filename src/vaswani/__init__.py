"""vaswani: the Transformer of Vaswani et al. (2017) as a transformers model."""
