"""Attention heatmaps: what each head of a trained translator looks at.

Three kinds, one per role of the attention operator: encoder self-attention (source × source), decoder masked
self-attention (target × target, lower triangular) and cross-attention (target × source, zero on source padding).
The weights come from the eager attention path (`output_attentions=True`), the only one that materialises them.
"""

import os

import torch

from .configuration_vaswani import length_options
from .decoding_settings import model_decoding


@torch.no_grad()
def attention_maps(model, tokenizer, source: str, target: str | None = None,
                   max_new_tokens: int | None = None) -> dict:
    """Run one source (and its translation, generated greedily unless given, as long as the package's one length
    rule allows: `max_new_tokens`, else the generation config's, else the source's length plus 50 tokens) through the
    model with `output_attentions=True`. Returns tokens and per-layer weights of shape (heads, query, key)."""
    model.eval()
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        inputs = tokenizer([source], return_tensors="pt").to(model.device)
        if target is None:
            limit = model_decoding(model, max_new_tokens=max_new_tokens).output_limit(inputs["input_ids"].shape[1])
            generated = model.generate(**inputs, num_beams=1, do_sample=False, **length_options(limit))
            decoder_input_ids = generated[:, :-1] if generated[0, -1] == model.config.eos_token_id else generated
        else:
            labels = tokenizer(text_target=[target], return_tensors="pt")["input_ids"].to(model.device)
            decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
        outputs = model(**inputs, decoder_input_ids=decoder_input_ids, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return {
        "source_tokens": source_tokens(tokenizer, inputs["input_ids"][0].tolist()),
        "target_tokens": tokenizer.convert_ids_to_tokens(decoder_input_ids[0]),
        "encoder": [a[0].float().cpu() for a in outputs.encoder_attentions],
        "decoder": [a[0].float().cpu() for a in outputs.decoder_attentions],
        "cross": [a[0].float().cpu() for a in outputs.cross_attentions],
    }


def source_tokens(tokenizer, ids: list[int]) -> list[str]:
    """The tokens of source ids. A Marian tokenizer with separate vocabularies (`separate_vocabs`) maps ids to
    target tokens in `convert_ids_to_tokens`; its source vocabulary is `get_src_vocab()`."""
    if getattr(tokenizer, "separate_vocabs", False):
        vocabulary = {index: token for token, index in tokenizer.get_src_vocab().items()}
        return [vocabulary.get(index, tokenizer.unk_token) for index in ids]
    return tokenizer.convert_ids_to_tokens(ids)


def plot_attention(maps: dict, output_dir: str, prefix: str = "attention") -> list[str]:
    """One PNG per (kind, layer), a grid of all heads. Returns the written paths."""
    # A bare Figure draws to files without pyplot: no display needed on servers or in CI, no backend chosen for the
    # whole process, and matplotlib is imported only by the one function that draws.
    from matplotlib.figure import Figure

    os.makedirs(output_dir, exist_ok=True)
    axes_tokens = {
        "encoder": (maps["source_tokens"], maps["source_tokens"]),
        "decoder": (maps["target_tokens"], maps["target_tokens"]),
        "cross": (maps["target_tokens"], maps["source_tokens"]),
    }
    titles = {"encoder": "encoder self-attention", "decoder": "decoder masked self-attention",
              "cross": "cross-attention (decoder → encoder)"}
    paths = []
    for kind, (query_tokens, key_tokens) in axes_tokens.items():
        for layer, weights in enumerate(maps[kind]):
            heads = weights.shape[0]
            cols = min(heads, 4)
            rows = -(-heads // cols)
            size = 0.35 * max(len(query_tokens), len(key_tokens)) + 1.5
            fig = Figure(figsize=(cols * size, rows * size))
            axes = fig.subplots(rows, cols, squeeze=False)
            for head in range(rows * cols):
                ax = axes[head // cols][head % cols]
                if head >= heads:
                    ax.axis("off")
                    continue
                ax.imshow(weights[head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
                ax.set_title(f"head {head}", fontsize=8)
                ax.set_xticks(range(len(key_tokens)), key_tokens, rotation=90, fontsize=6)
                ax.set_yticks(range(len(query_tokens)), query_tokens, fontsize=6)
            fig.suptitle(f"{titles[kind]}, layer {layer}")
            fig.tight_layout()
            path = os.path.join(output_dir, f"{prefix}_{kind}_layer{layer}.png")
            fig.savefig(path, dpi=100)
            paths.append(path)
    return paths
