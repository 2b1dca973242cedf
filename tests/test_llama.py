"""The decoder-only model as a stock `LlamaForCausalLM` and back (vaswani.convert): equal logits on left-padded
batches, equal greedy and sampled generation (cached), refusals that name the field, and whole checkpoints that load
without remote code where `import vaswani` fails."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import (SCRIPTS, WITHOUT_THE_PACKAGE, fails_with_one_line, other_names, padded_batch,
                      run_without_the_package, script_main, snapshot)
from vaswani import VaswaniConfig, VaswaniForCausalLM, VaswaniForConditionalGeneration
from vaswani.convert import from_llama, to_llama
from vaswani.tokenization_vaswani import train_tokenizer

TEXTS = ["I have two cats.", "J'ai deux chats !", "We see three dogs today.", "Nous voyons trois chiens."] * 10


def modern_config(**overrides) -> VaswaniConfig:
    """The modern preset, tiny: pre-RMSNorm, RoPE, SwiGLU, GQA, no biases, a scaled and tied embedding."""
    return VaswaniConfig.modern(**{"vocab_size": 99, "d_model": 32, "decoder_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "d_ff": 48, "max_position_embeddings": 64,
                                   "rope_theta": 500.0, **overrides})


def random_llama(**overrides) -> LlamaForCausalLM:
    config = LlamaConfig(**{"vocab_size": 99, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 64,
                            "rms_norm_eps": 1e-5, "pad_token_id": 0, "bos_token_id": 3, "eos_token_id": 1,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 123.0}, **overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped norm name would show
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.5 * torch.rand_like(parameter))
    return model


def assert_same_model(expected, model, config):
    """Same logits on a left-padded batch, same cached greedy and sampled continuations."""
    input_ids, attention_mask = padded_batch(config, [7, 4, 6], seed=1, side="left")
    with torch.no_grad():
        want = expected(input_ids=input_ids, attention_mask=attention_mask).logits
        got = model(input_ids=input_ids, attention_mask=attention_mask).logits
    mask = attention_mask.bool()
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    settings = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 8, "min_new_tokens": 8,
                "pad_token_id": 0, "use_cache": True}
    assert torch.equal(expected.generate(**settings, do_sample=False), model.generate(**settings, do_sample=False))
    sampled = []
    for candidate in (expected, model):
        torch.manual_seed(7)
        sampled.append(candidate.generate(**settings, do_sample=True, top_k=0, temperature=1.5))
    assert torch.equal(*sampled)


@pytest.mark.parametrize("overrides", [
    {},  # the preset: scaled, tied embedding
    {"tie_word_embeddings": False},
    {"scale_embedding": False},
    {"bias": True},
    {"ffn_activation": "geglu", "num_key_value_heads": 4},
    {"num_key_value_heads": 1, "attention_dropout": 0.1},
])
def test_to_llama_and_back_compute_the_same_model(overrides, single_thread):
    config = modern_config(**overrides)
    model = VaswaniForCausalLM(config).eval()
    llama = to_llama(model)
    assert type(llama) is LlamaForCausalLM
    assert_same_model(model, llama, config)
    back = from_llama(llama)
    assert type(back) is VaswaniForCausalLM
    assert_same_model(llama, back, config)


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": True, "num_key_value_heads": 4},
    {"attention_bias": True, "mlp_bias": True, "hidden_act": "gelu"},
])
def test_from_llama_computes_what_llama_computes(overrides, single_thread):
    llama = random_llama(**overrides)
    model = from_llama(llama)
    assert model.config.rope_theta == 123.0 and model.config.layer_norm_eps == 1e-5
    assert model.config.label_smoothing == 0.0  # Llama's loss is the plain cross-entropy
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == llama.config.tie_word_embeddings
    assert_same_model(llama, model, model.config)
    labels = padded_batch(model.config, [6, 6], seed=2)[0]
    model.train(), llama.train()
    torch.testing.assert_close(model(input_ids=labels, labels=labels).loss, llama(input_ids=labels, labels=labels).loss)


@pytest.mark.parametrize("overrides, message", [
    ({"norm_first": False}, "VaswaniConfig.norm_first=False"),
    ({"norm_type": "layernorm"}, "VaswaniConfig.norm_type='layernorm'"),
    ({"position_embedding_type": "learned"}, "VaswaniConfig.position_embedding_type='learned'"),
    ({"position_embedding_type": "sinusoidal"}, "VaswaniConfig.position_embedding_type='sinusoidal'"),
    ({"ffn_activation": "gelu"}, "VaswaniConfig.ffn_activation='gelu'"),
    ({"ffn_activation": "relu"}, "VaswaniConfig.ffn_activation='relu'"),
    ({"final_logits_bias": True}, "VaswaniConfig.final_logits_bias=True"),
    ({"dropout": 0.1}, "VaswaniConfig.dropout=0.1"),
    ({"activation_dropout": 0.1}, "VaswaniConfig.activation_dropout=0.1"),
])
def test_to_llama_refuses_what_llama_cannot_express(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        to_llama(VaswaniForCausalLM(modern_config(**overrides)))


def test_to_llama_refuses_a_translation_model():
    with pytest.raises(ValueError, match="not a VaswaniForConditionalGeneration"):
        to_llama(VaswaniForConditionalGeneration(modern_config()))


@pytest.mark.parametrize("overrides, message", [
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type'\\]='linear'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type'\\]='dynamic'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor'\\]=0.5"),
    ({"head_dim": 16}, "LlamaConfig.head_dim=16"),
    ({"hidden_act": "relu"}, "LlamaConfig.hidden_act='relu'"),
    ({"attention_bias": True}, "LlamaConfig.attention_bias=True and mlp_bias=False"),
])
def test_from_llama_refuses_what_the_model_cannot_express(overrides, message):
    with pytest.raises(ValueError, match=message):
        from_llama(random_llama(**overrides))


FRESH_PROCESS = WITHOUT_THE_PACKAGE + """
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

checkpoint, work = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()  # no trust_remote_code
assert type(model).__name__ == "LlamaForCausalLM" and type(model).__module__.startswith("transformers.models.llama")
tokenizer = AutoTokenizer.from_pretrained(checkpoint)
assert type(tokenizer).__module__.startswith("transformers."), type(tokenizer)
inputs = load_file(os.path.join(work, "inputs.safetensors"))
with torch.no_grad():
    logits = model(**inputs).logits
tokens = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
ids = torch.tensor(tokenizer("I have two cats.")["input_ids"])
save_file({"logits": logits, "tokens": tokens, "ids": ids}, os.path.join(work, "outputs.safetensors"))
"""


def test_llama_checkpoint_loads_without_remote_code_and_converts_back(tmp_path, single_thread):
    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    config = modern_config(vocab_size=len(tokenizer))
    model = VaswaniForCausalLM(config).eval()
    source = tmp_path / "vaswani"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    exported = tmp_path / "llama"
    script_main("convert_llama")(["--model", str(source), "--output_dir", str(exported)])

    files = sorted(path.name for path in exported.iterdir())
    assert not [name for name in files if name.endswith(".py")], files  # no code files
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    for name in files:
        if name.endswith(".json"):
            assert "auto_map" not in (exported / name).read_text() and "Vaswani" not in (exported / name).read_text()
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    work = tmp_path / "work"
    work.mkdir()
    input_ids, attention_mask = padded_batch(config, [5, 3], seed=3, side="left")
    save_file({"input_ids": input_ids, "attention_mask": attention_mask}, work / "inputs.safetensors")
    run_without_the_package(FRESH_PROCESS, str(exported), str(work), work=work, home=tmp_path / "hf_home")
    remote = load_file(work / "outputs.safetensors")
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
    mask = attention_mask.bool()
    torch.testing.assert_close(remote["logits"][mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(remote["tokens"], model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                                        max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                                        pad_token_id=0))
    assert remote["ids"].tolist() == tokenizer("I have two cats.")["input_ids"]

    # And back: a Vaswani checkpoint (with its module files) from the Llama one, by the same command.
    back = tmp_path / "back"
    script_main("convert_llama")(["--model", str(exported), "--output_dir", str(back)])
    assert (back / "modeling_vaswani.py").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(loaded) is VaswaniForCausalLM
    assert_same_model(model, loaded, config)
    assert AutoTokenizer.from_pretrained(back)("I have two cats.")["input_ids"] == remote["ids"].tolist()


def test_a_bf16_llama_checkpoint_converts_to_a_bf16_vaswani_one(tmp_path, single_thread):
    llama = random_llama(tie_word_embeddings=True)
    llama.to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    script_main("convert_llama")(["--model", str(tmp_path / "llama"), "--output_dir", str(tmp_path / "vaswani")])
    stored = load_file(tmp_path / "llama" / "model.safetensors")
    converted = load_file(tmp_path / "vaswani" / "model.safetensors")
    assert {tensor.dtype for tensor in converted.values()} == {torch.bfloat16}
    assert torch.equal(converted["model.layers.0.self_attn_layer_norm.weight"],
                       stored["model.layers.0.input_layernorm.weight"])
    assert torch.equal(converted["model.embed_tokens.weight"], stored["model.embed_tokens.weight"])


def test_convert_command_refuses_a_translation_checkpoint(tmp_path):
    VaswaniForConditionalGeneration(modern_config()).save_pretrained(tmp_path / "translator")
    with pytest.raises(SystemExit) as exit_info:
        script_main("convert_llama")(["--model", str(tmp_path / "translator"), "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "out").exists()
    assert (SCRIPTS / "convert_llama.py").is_file()


def test_a_conversion_never_writes_over_its_source(tmp_path, capsys):
    """Refused before the source is read, with or without --force."""
    source = tmp_path / "run" / "llama"
    random_llama().save_pretrained(source)
    before = snapshot(tmp_path / "run")
    for kind, output in {**other_names(source, tmp_path), "holding it": tmp_path / "run"}.items():
        error = fails_with_one_line(script_main("convert_llama"), ["--model", str(source), "--output_dir",
                                                                   str(output), "--force"], capsys, "the input")
        assert "--force" not in error, kind
    assert snapshot(tmp_path / "run") == before
