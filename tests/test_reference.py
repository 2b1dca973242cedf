"""Exactness against an implementation nobody here wrote: `torch.nn.Transformer`.

Our weights are copied into `nn.Transformer` and both are fed the same embedded inputs (our token embedding ×
√d_model + sinusoidal positions), with source padding and the causal target mask. The encoder and decoder outputs
must agree to float32 rounding, for the paper's post-norm layout and for pre-norm.
"""

import pytest
import torch
from torch import nn

from conftest import padded_batch, tiny_config
from vaswani import VaswaniModel

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    # nn.Transformer's encoder fast path packs padded batches into (prototype) nested tensors; not our concern.
    pytest.mark.filterwarnings("ignore:.*nested.tensor:UserWarning"),
]


def causal_mask(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).triu(1)  # True above the diagonal: the future is masked


def copy_attention(ours, theirs: nn.MultiheadAttention) -> None:
    # nn.MultiheadAttention packs the three input projections into one matrix, rows ordered q, k, v.
    theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
    theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
    theirs.out_proj.weight.copy_(ours.o_proj.weight)
    theirs.out_proj.bias.copy_(ours.o_proj.bias)


def copy_norm(ours: nn.LayerNorm, theirs: nn.LayerNorm) -> None:
    theirs.weight.copy_(ours.weight)
    theirs.bias.copy_(ours.bias)


def copy_feed_forward(ours, theirs) -> None:
    theirs.linear1.load_state_dict(ours.fc1.state_dict())
    theirs.linear2.load_state_dict(ours.fc2.state_dict())


def reference_transformer(model: VaswaniModel) -> nn.Transformer:
    config = model.config
    reference = nn.Transformer(
        d_model=config.d_model,
        nhead=config.num_attention_heads,
        num_encoder_layers=config.encoder_layers,
        num_decoder_layers=config.decoder_layers,
        dim_feedforward=config.d_ff,
        dropout=0.0,
        activation="relu",
        layer_norm_eps=config.layer_norm_eps,
        batch_first=True,
        norm_first=config.norm_first,
    ).eval()
    with torch.no_grad():
        for ours, theirs in zip(model.encoder.layers, reference.encoder.layers):
            copy_attention(ours.self_attn, theirs.self_attn)
            copy_feed_forward(ours.mlp, theirs)
            copy_norm(ours.self_attn_layer_norm, theirs.norm1)
            copy_norm(ours.final_layer_norm, theirs.norm2)
        for ours, theirs in zip(model.decoder.layers, reference.decoder.layers):
            copy_attention(ours.self_attn, theirs.self_attn)
            copy_attention(ours.encoder_attn, theirs.multihead_attn)
            copy_feed_forward(ours.mlp, theirs)
            copy_norm(ours.self_attn_layer_norm, theirs.norm1)
            copy_norm(ours.encoder_attn_layer_norm, theirs.norm2)
            copy_norm(ours.final_layer_norm, theirs.norm3)
        if config.norm_first:
            # Pre-norm needs a norm after the last layer; nn.Transformer's stack norms are exactly ours.
            copy_norm(model.encoder.layer_norm, reference.encoder.norm)
            copy_norm(model.decoder.layer_norm, reference.decoder.norm)
        else:
            # nn.Transformer always adds a LayerNorm after each stack. In the paper's post-norm layout the last layer
            # already ends in "Add & Norm", so a second norm is not part of the model (§3.1): remove it.
            reference.encoder.norm = nn.Identity()
            reference.decoder.norm = nn.Identity()
    return reference


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_matches_torch_nn_transformer(norm_first, implementation):
    config = tiny_config(norm_first=norm_first, encoder_layers=3, decoder_layers=2)  # post-norm, sinusoidal, ReLU
    model = VaswaniModel(config).eval()
    model.set_attn_implementation(implementation)
    reference = reference_transformer(model)

    source, source_mask = padded_batch(config, [9, 7, 4], seed=1)
    target, target_mask = padded_batch(config, [6, 3, 5], seed=2)
    with torch.no_grad():
        ours = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target,
                     decoder_attention_mask=target_mask)
        embedded_source, _ = model.encoder.embed(source, None, None)
        embedded_target, _ = model.decoder.embed(target, None, None)
        source_padding = source_mask == 0  # nn.Transformer's key_padding_mask: True where padded
        causal = causal_mask(target.shape[1])
        memory = reference.encoder(embedded_source, src_key_padding_mask=source_padding)
        theirs = reference.decoder(
            embedded_target, memory, tgt_mask=causal, tgt_is_causal=True,
            tgt_key_padding_mask=target_mask == 0, memory_key_padding_mask=source_padding,
        )
    # Padded positions are never read (and nn.Transformer's fast path zeroes them); compare the real ones.
    valid_source, valid_target = source_mask.bool(), target_mask.bool()
    torch.testing.assert_close(ours.encoder_last_hidden_state[valid_source], memory[valid_source], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.last_hidden_state[valid_target], theirs[valid_target], atol=1e-5, rtol=0)


def test_reference_comparison_is_sensitive():
    """The comparison above must be able to fail: one perturbed weight breaks the agreement."""
    model = VaswaniModel(tiny_config()).eval()
    reference = reference_transformer(model)
    with torch.no_grad():
        reference.decoder.layers[0].multihead_attn.in_proj_weight[0, 0] += 0.1
        source, source_mask = padded_batch(model.config, [6, 4], seed=1)
        target, _ = padded_batch(model.config, [5, 5], seed=2)
        ours = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target).last_hidden_state
        memory = reference.encoder(model.encoder.embed(source, None, None)[0], src_key_padding_mask=source_mask == 0)
        theirs = reference.decoder(
            model.decoder.embed(target, None, None)[0], memory, memory_key_padding_mask=source_mask == 0,
            tgt_mask=causal_mask(5), tgt_is_causal=True,
        )
    assert not torch.allclose(ours, theirs, atol=1e-4)
