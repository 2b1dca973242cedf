"""The configuration: every impossible value refused naming its field, the presets' values from the paper."""

import pytest
import torch

from vaswani import VaswaniConfig, VaswaniForConditionalGeneration

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("d_model", {"d_model": 30}),  # not divisible by 4 heads
        ("num_key_value_heads", {"num_key_value_heads": 3}),  # does not divide 4 heads
        ("num_key_value_heads", {"num_key_value_heads": 0}),
        ("norm_type", {"norm_type": "batchnorm"}),
        ("ffn_activation", {"ffn_activation": "tanh"}),
        ("position_embedding_type", {"position_embedding_type": "alibi"}),
        ("position_embedding_type", {"position_embedding_type": "rope", "d_model": 12}),  # odd head_dim 3
        ("vocab_size", {"vocab_size": -1}),
        ("d_model", {"d_model": 0}),
        ("d_ff", {"d_ff": -5}),
        ("num_attention_heads", {"num_attention_heads": 0}),
        ("encoder_layers", {"encoder_layers": -1}),
        ("decoder_layers", {"decoder_layers": -2}),
        ("max_position_embeddings", {"max_position_embeddings": 0}),
        ("dropout", {"dropout": 1.0}),
        ("dropout", {"dropout": -0.1}),
        ("attention_dropout", {"attention_dropout": 1.5}),
        ("activation_dropout", {"activation_dropout": -0.1}),
        ("label_smoothing", {"label_smoothing": 1.0}),
        ("classifier_dropout", {"classifier_dropout": 2.0}),
        ("layer_norm_eps", {"layer_norm_eps": 0.0}),
        ("rope_theta", {"rope_theta": -1.0}),
    ],
)
def test_config_rejects_impossible_values_naming_the_field(field, overrides):
    with pytest.raises(ValueError, match=f"VaswaniConfig.{field}"):
        VaswaniConfig.tiny(**overrides)


def test_config_validates_when_loaded_from_a_dict():
    """A hand-edited config.json must fail as early as a constructor call."""
    with pytest.raises(ValueError, match="norm_type"):
        VaswaniConfig.from_dict({**VaswaniConfig.tiny().to_dict(), "norm_type": "scalenorm"})


def test_config_of_another_model_type_is_refused(tmp_path):
    """transformers only warns and would build a randomly initialised model from, say, a BERT config.json."""
    with pytest.raises(ValueError, match="model_type"):
        VaswaniConfig.from_dict({"model_type": "bert", "hidden_size": 32})
    (tmp_path / "config.json").write_text('{"model_type": "bert", "hidden_size": 32}')
    with pytest.raises(ValueError, match="model_type"):
        VaswaniForConditionalGeneration.from_pretrained(tmp_path)


def test_presets_have_the_papers_values():
    base = VaswaniConfig.base()
    assert (base.d_model, base.encoder_layers, base.decoder_layers, base.num_attention_heads, base.d_ff) == (
        512, 6, 6, 8, 2048,
    )
    assert base.num_key_value_heads == 8
    assert not base.norm_first and base.norm_type == "layernorm"
    assert base.position_embedding_type == "sinusoidal" and base.ffn_activation == "relu"
    assert base.share_embeddings and base.tie_word_embeddings and base.scale_embedding and base.bias
    assert base.dropout == 0.1 and base.label_smoothing == 0.1
    assert base.to_dict() == VaswaniConfig().to_dict()  # the defaults *are* the base model

    big = VaswaniConfig.big()
    assert (big.d_model, big.d_ff, big.num_attention_heads, big.encoder_layers, big.dropout) == (1024, 4096, 16, 6, 0.3)

    modern = VaswaniConfig.modern()
    assert modern.norm_first and modern.norm_type == "rmsnorm" and modern.position_embedding_type == "rope"
    assert modern.ffn_activation == "swiglu" and modern.num_key_value_heads == 4 and not modern.bias

    assert VaswaniConfig.big(dropout=0.1).dropout == 0.1  # overrides win over preset values
    for name in VaswaniConfig.PRESETS:
        assert isinstance(VaswaniConfig.from_preset(name), VaswaniConfig)
    with pytest.raises(ValueError, match="preset"):
        VaswaniConfig.from_preset("huge")


def test_base_model_has_the_papers_parameter_count():
    """Table 3 lists 65M parameters for the base model (with the 37k-token shared En-De vocabulary)."""
    with torch.device("meta"):
        model = VaswaniForConditionalGeneration(VaswaniConfig.base())
    count = sum(p.numel() for p in model.parameters())
    assert 60e6 < count < 66e6, count
