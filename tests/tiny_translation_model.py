"""A tiny, randomly initialised seq2seq model and a word-level tokenizer, built offline, for the plumbing tests of
evaluation, the translation pipeline and Hub upload/download. Their outputs are meaningless but deterministic.

The model is a transformers `MarianMTModel` only because those tests were written before the Vaswani model
existed; `build_model` is the single place to change to run them on `VaswaniForConditionalGeneration`.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import MarianConfig, MarianMTModel, PreTrainedTokenizerFast

WORDS = "the a cat dog bird sat ran flew on under mat tree le la chat chien oiseau assis couru sur sous tapis".split()
SPECIAL_TOKENS = ["<pad>", "<unk>", "</s>"]  # ids 0, 1, 2
SOURCES = ["the cat sat on the mat", "a dog ran", "the bird flew under a tree", "cat", "the dog sat on a mat"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer that appends `</s>` to every sequence and decodes by joining with spaces."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    backend.decoder = decoders.WordPiece(prefix="##")  # with no "##" pieces this simply joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")


def build_model(vocab_size: int, seed: int = 0):
    """A 1+1-layer, d_model 16 encoder-decoder in eval mode whose translations differ from one input to another.

    At the usual 0.02 initialisation scale an untrained model gives every input the same translation, and the tests
    could not see sentences being mixed up; hence the large `init_std`. The tests check that outputs differ.
    """
    torch.manual_seed(seed)
    # SWITCH TO VASWANI: replace the two lines below with a tiny `VaswaniConfig` and `VaswaniForConditionalGeneration`.
    config = MarianConfig(vocab_size=vocab_size, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, forced_eos_token_id=2, init_std=1.0)  # fmt: skip
    model = MarianMTModel(config)
    return model.eval()


def build_model_and_tokenizer(seed: int = 0):
    tokenizer = build_tokenizer()
    return build_model(len(tokenizer), seed), tokenizer
