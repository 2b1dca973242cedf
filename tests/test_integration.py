"""The model as a transformers citizen: Auto classes, remote code in a fresh process, resizing, gradient
checkpointing, dtypes, and gradient accumulation through the real `Trainer`."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    Trainer,
    TrainingArguments,
)

import vaswani
from conftest import WITHOUT_THE_PACKAGE, padded_batch, random_ids, tiny_config
from vaswani import (
    VaswaniConfig,
    VaswaniEncoderModel,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForSequenceClassification,
    VaswaniModel,
)

pytestmark = pytest.mark.usefixtures("single_thread")

AUTO_FACTORIES = {
    "AutoModel": (AutoModel, VaswaniModel),
    "AutoModelForSeq2SeqLM": (AutoModelForSeq2SeqLM, VaswaniForConditionalGeneration),
    "AutoModelForCausalLM": (AutoModelForCausalLM, VaswaniForCausalLM),
    "AutoModelForSequenceClassification": (AutoModelForSequenceClassification, VaswaniForSequenceClassification),
}


# Auto classes and remote code --------------------------------------------------------------------------------------


@pytest.mark.parametrize("auto_name", AUTO_FACTORIES)
def test_auto_classes_build_and_load_vaswani_models(auto_name, tmp_path):
    auto_class, expected = AUTO_FACTORIES[auto_name]
    config = tiny_config()
    assert isinstance(AutoConfig.for_model("vaswani"), VaswaniConfig)
    assert type(auto_class.from_config(config)) is expected
    VaswaniForConditionalGeneration(config).save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), VaswaniConfig)
    # With the package imported the registered classes are used, not the copied module files.
    assert type(auto_class.from_pretrained(tmp_path)) is expected


def test_save_pretrained_ships_the_code_and_a_complete_auto_map(tmp_path):
    VaswaniForConditionalGeneration(tiny_config()).save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {"configuration_vaswani.py", "modeling_vaswani.py", "config.json", "model.safetensors"} <= files
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_vaswani.VaswaniConfig"
    # Every Auto class, whatever head was saved; and the package registers exactly those.
    for name, (_, model_class) in AUTO_FACTORIES.items():
        assert auto_map[name] == f"modeling_vaswani.{model_class.__name__}"
    assert set(vaswani.AUTO_CLASSES) == set(AUTO_FACTORIES)


REMOTE_SCRIPT = WITHOUT_THE_PACKAGE + textwrap.dedent(
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel, AutoModelForSeq2SeqLM

    checkpoint, work = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)  # as in the parent test: the same reduction order, so bit-identical results
    inputs = load_file(os.path.join(work, "inputs.safetensors"))
    model = AutoModelForSeq2SeqLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    assert type(model).__name__ == "VaswaniForConditionalGeneration"
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    base = AutoModel.from_pretrained(checkpoint, trust_remote_code=True).eval()
    assert type(base).__name__ == "VaswaniModel"
    with torch.no_grad():
        logits = model(**inputs).logits
        hidden = base(**inputs).last_hidden_state
    tokens = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                            max_new_tokens=5, min_new_tokens=5, do_sample=False)
    save_file({"logits": logits, "hidden": hidden, "tokens": tokens}, os.path.join(work, "outputs.safetensors"))
    """
)


def test_trust_remote_code_in_a_fresh_process_without_the_package(tmp_path):
    config = tiny_config(norm_first=True, position_embedding_type="rope", num_key_value_heads=2)
    model = VaswaniForConditionalGeneration(config).eval()
    checkpoint, work = tmp_path / "checkpoint", tmp_path / "work"
    work.mkdir()
    model.save_pretrained(checkpoint)
    source, source_mask = padded_batch(config, [7, 4], seed=1)
    inputs = {"input_ids": source, "attention_mask": source_mask, "decoder_input_ids": random_ids(config, 2, 5)}
    save_file(inputs, work / "inputs.safetensors")

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    # -I: isolated mode, no user site-packages, no PYTHON* variables, no script directory or cwd on sys.path.
    result = subprocess.run(
        [sys.executable, "-I", "-c", REMOTE_SCRIPT, str(checkpoint), str(work)],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = load_file(work / "outputs.safetensors")
    with torch.no_grad():
        assert torch.equal(remote["logits"], model(**inputs).logits)
        assert torch.equal(remote["hidden"], model.model(**inputs).last_hidden_state)
    expected_tokens = model.generate(input_ids=source, attention_mask=source_mask, max_new_tokens=5,
                                     min_new_tokens=5, do_sample=False)
    assert torch.equal(remote["tokens"], expected_tokens)


def test_translation_checkpoint_encoder_loads_into_the_encoder_heads(tmp_path):
    """The encoder keeps its `encoder.` key prefix in every head, so a trained translator's encoder is reused as is."""
    translator = VaswaniForConditionalGeneration(tiny_config())
    translator.save_pretrained(tmp_path)
    expected = translator.model.encoder.state_dict()
    for model_class, encoder_of in [(VaswaniEncoderModel, lambda m: m.encoder),
                                    (VaswaniForSequenceClassification, lambda m: m.model.encoder)]:
        loaded = model_class.from_pretrained(tmp_path)
        state = encoder_of(loaded).state_dict()
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(state[key], value), f"{model_class.__name__}: {key}"


# Embeddings --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": False}, {"share_embeddings": False},
     {"share_embeddings": False, "tie_word_embeddings": False}],
    ids=["shared_tied", "shared_untied", "unshared_tied", "unshared_untied"],
)
def test_resize_token_embeddings_seq2seq(overrides):
    config = tiny_config(**overrides)
    model = VaswaniForConditionalGeneration(config).eval()
    old_encoder = model.model.encoder.embed_tokens.weight.detach().clone()
    old_head = model.lm_head.weight.detach().clone()
    model.resize_token_embeddings(config.vocab_size + 21)
    new_size = model.config.vocab_size
    assert new_size == 120
    encoder, decoder = model.model.encoder.embed_tokens, model.model.decoder.embed_tokens
    assert encoder.weight.shape == decoder.weight.shape == model.lm_head.weight.shape == (120, config.d_model)
    assert (encoder.weight is decoder.weight) == config.share_embeddings
    assert (model.lm_head.weight is decoder.weight) == config.tie_word_embeddings
    assert torch.equal(encoder.weight[:99], old_encoder)  # old rows kept
    assert torch.equal(model.lm_head.weight[:99], old_head)
    # The new ids are usable on both sides and are scored by the output projection.
    new_ids = torch.tensor([[110, 5, 119, 6]])
    with torch.no_grad():
        logits = model(input_ids=new_ids, decoder_input_ids=new_ids).logits
    assert logits.shape == (1, 4, 120) and torch.isfinite(logits).all()
    if config.tie_word_embeddings:
        torch.testing.assert_close(model.lm_head.weight[110], decoder.weight[110])


@pytest.mark.parametrize("tied", [True, False])
def test_resize_token_embeddings_causal_lm(tied):
    model = VaswaniForCausalLM(tiny_config(tie_word_embeddings=tied))
    model.resize_token_embeddings(120)
    assert model.model.embed_tokens.weight.shape == model.lm_head.weight.shape == (120, 32)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model(input_ids=torch.tensor([[119, 4]])).logits.shape == (1, 2, 120)


# Training machinery ------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize(
    "model_class", [VaswaniForConditionalGeneration, VaswaniForCausalLM, VaswaniForSequenceClassification]
)
@pytest.mark.parametrize(
    "variant", [{}, {"norm_first": True, "position_embedding_type": "rope"}], ids=["paper", "pre_rope"]
)
def test_gradient_checkpointing_gives_the_same_gradients(model_class, variant):
    config = tiny_config(**variant)
    source, source_mask = padded_batch(config, [7, 5], seed=1)
    inputs = {"input_ids": source, "attention_mask": source_mask}
    if model_class is VaswaniForConditionalGeneration:
        inputs["labels"] = random_ids(config, 2, 4, seed=2)
    elif model_class is VaswaniForCausalLM:
        inputs["labels"] = source.masked_fill(source_mask == 0, -100)
    else:
        inputs["labels"] = torch.tensor([0, 1])

    def gradients(enable: str | None) -> tuple[dict, int]:
        torch.manual_seed(0)
        model = model_class(config).train()
        if enable is not None:
            getattr(model, enable)()
            # Newer transformers renamed the property (the old name warns); older supported releases have only the old.
            name = ("is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing")
                    else "is_gradient_checkpointing")
            assert getattr(model, name)
        # The layer's forward is checkpointed below its module hooks, so count a submodule: it runs again in backward.
        calls = []
        first_layer = next(m for m in model.modules() if type(m).__name__.endswith("Layer"))
        first_layer.self_attn.register_forward_hook(lambda *_: calls.append(1))
        model(**inputs).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}, len(calls)

    plain, plain_calls = gradients(None)
    # `activation_checkpointing_enable` is the newer name (what Trainer(gradient_checkpointing=True) calls where it
    # exists); `gradient_checkpointing_enable` the older one, since then its deprecated alias.
    enablers = [name for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable") if hasattr(model_class, name)]
    assert "gradient_checkpointing_enable" in enablers
    for enable in enablers:
        checkpointed, checkpointed_calls = gradients(enable)
        assert checkpointed_calls == 2 * plain_calls  # the layer really ran again during backward
        assert plain.keys() == checkpointed.keys()
        for name in plain:
            torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_layers_are_not_split_across_devices():
    from vaswani import modeling_vaswani

    no_split = VaswaniForConditionalGeneration._no_split_modules
    assert set(no_split) == {"VaswaniEncoderLayer", "VaswaniDecoderLayer"}
    assert all(hasattr(modeling_vaswani, name) for name in no_split)


@pytest.mark.parametrize("model_class", [VaswaniForConditionalGeneration, VaswaniForCausalLM])
def test_bfloat16_forward_and_generate(model_class, tmp_path):
    config = tiny_config(norm_first=True)
    model = model_class(config).eval()
    model.save_pretrained(tmp_path)
    half = model_class.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert half.dtype == torch.bfloat16
    ids, mask = padded_batch(config, [6, 4], seed=1, side="left" if model_class is VaswaniForCausalLM else "right")
    extra = {"decoder_input_ids": random_ids(config, 2, 3)} if model_class is VaswaniForConditionalGeneration else {}
    with torch.no_grad():
        logits = half(input_ids=ids, attention_mask=mask, **extra).logits
        reference = model(input_ids=ids, attention_mask=mask, **extra).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    valid = mask.bool() if model_class is VaswaniForCausalLM else torch.ones(2, 3, dtype=torch.bool)
    torch.testing.assert_close(logits.float()[valid], reference[valid], atol=0.1, rtol=0.05)
    assert half.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False).shape[0] == 2


# Gradient accumulation through the Trainer -------------------------------------------------------------------------


def _examples(model_class, config, count: int) -> list[dict]:
    """Examples with very different label lengths: a per-micro-batch mean would weight their tokens unequally."""
    lengths = [2, 9, 4, 7][:count]
    examples = []
    for i, length in enumerate(lengths):
        ids = random_ids(config, 1, length, seed=100 + i)[0]
        if model_class is VaswaniForConditionalGeneration:
            examples.append({"input_ids": random_ids(config, 1, 3 + i, seed=200 + i)[0], "labels": ids})
        else:
            examples.append({"input_ids": ids, "labels": ids})
    return examples


def _collate(examples: list[dict]) -> dict:
    """Right-pad inputs with pad id 0 (masked) and labels with -100 (ignored)."""
    def pad(key, value):
        longest = max(len(e[key]) for e in examples)
        return torch.stack([torch.nn.functional.pad(e[key], (0, longest - len(e[key])), value=value) for e in examples])

    lengths = torch.tensor([len(e["input_ids"]) for e in examples])
    input_ids = pad("input_ids", 0)
    attention_mask = (torch.arange(input_ids.shape[1])[None] < lengths[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": pad("labels", -100)}


def _train_one_update(model_class, config, examples, batch_size, accumulation, output_dir) -> dict:
    torch.manual_seed(0)
    model = model_class(config)
    args = TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
        max_steps=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, report_to="none", save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=_collate)
    assert trainer.model_accepts_loss_kwargs  # so the Trainer passes num_items_in_batch to forward()
    trainer.train()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _manual_update(model_class, config, examples, learning_rate=0.5) -> dict:
    """The update the paper's loss implies: one SGD step on the mean over all label tokens of the whole batch."""
    torch.manual_seed(0)
    model = model_class(config).train()
    batch = _collate(examples)
    model(**batch).loss.backward()
    with torch.no_grad():
        return {name: p - learning_rate * p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_class", [VaswaniForConditionalGeneration, VaswaniForCausalLM])
def test_trainer_gradient_accumulation_equals_one_big_batch(model_class, tmp_path):
    config = tiny_config()
    count = 4
    examples = _examples(model_class, config, count)
    big_batch = _train_one_update(model_class, config, examples, count, 1, tmp_path / "big")
    accumulated = _train_one_update(model_class, config, examples, 1, count, tmp_path / "accumulated")
    expected = _manual_update(model_class, config, examples)
    for name in big_batch:
        torch.testing.assert_close(accumulated[name], big_batch[name], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(big_batch[name], expected[name], atol=1e-5, rtol=0, msg=name)

    # Sensitivity: averaging per-example means (what ignoring num_items_in_batch would do) gives another update.
    torch.manual_seed(0)
    model = model_class(config).train()
    for example in examples:
        (model(**_collate([example])).loss / count).backward()
    with torch.no_grad():
        naive = {name: p - 0.5 * p.grad for name, p in model.named_parameters()}
    assert any(not torch.allclose(naive[name], expected[name], atol=1e-4) for name in expected)


# torch.compile -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", [{}, {"position_embedding_type": "learned"}, {
    "norm_first": True, "norm_type": "rmsnorm", "position_embedding_type": "rope", "ffn_activation": "swiglu",
    "num_key_value_heads": 2}], ids=["paper", "learned_positions", "modern"])
@pytest.mark.parametrize("model_class", [VaswaniForConditionalGeneration, VaswaniForCausalLM])
def test_forward_compiles_without_graph_breaks(model_class, variant):
    """`_can_compile_fullgraph = True` is a promise: the whole forward must trace as one graph, also while decoding
    with a static cache. The "eager" backend runs dynamo's tracing without inductor's code generation (seconds, not
    minutes, on CPU); a graph break raises under fullgraph=True."""
    config = tiny_config(**variant)
    model = model_class(config).eval()
    ids, mask = padded_batch(config, [6, 4], seed=1, side="left" if model_class is VaswaniForCausalLM else "right")
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                              do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                            do_sample=False, cache_implementation="static")
    assert torch.equal(tokens, expected)
