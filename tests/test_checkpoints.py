"""Checkpoint averaging (vaswani.checkpoints, scripts/average_checkpoints.py): the exact float32 mean, tied weights
kept tied, a complete checkpoint that loads through from_pretrained and as remote code in a fresh process, and
refusals that name the difference; an output never written over an input or a run's checkpoint, and a damaged
checkpoint named in one line by every reader."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM

from conftest import (WITHOUT_THE_PACKAGE, fails_with_one_line, other_names, padded_batch, random_ids,
                      run_without_the_package, script_main, snapshot, tiny_config)
from vaswani import VaswaniForConditionalGeneration
from vaswani.averaging import average_checkpoints
from vaswani.checkpoints import average_state_dicts, last_checkpoints, load_average
from vaswani.training import check_resumed_weights
from vaswani.tokenization_vaswani import train_tokenizer

TEXTS = ["I have two cats.", "J'ai deux chats !", "We see three dogs today.", "Nous voyons trois chiens."] * 10


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=300)


def write_run(run_dir, tokenizer, steps=(10, 20, 30), **overrides):
    """A run directory as training leaves it: checkpoint-N directories with weights, tokenizer and trainer state.
    Returns the models, oldest first."""
    models = []
    for step in steps:
        torch.manual_seed(step)
        model = VaswaniForConditionalGeneration(tiny_config(vocab_size=300, **overrides)).eval()
        path = run_dir / f"checkpoint-{step}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": step / 10}))
        models.append(model)
    return models


def test_the_average_is_the_exact_float32_mean_and_stays_tied(tmp_path, tokenizer):
    models = write_run(tmp_path / "run", tokenizer)
    (tmp_path / "run" / "checkpoint-40").mkdir()  # being written (no trainer_state.json): not a checkpoint to average
    models[0].save_pretrained(tmp_path / "run")  # the run's final model, beside its checkpoints
    output = tmp_path / "average"
    averaged = average_checkpoints([tmp_path / "run"], output, last=2)

    stored = load_file(output / "model.safetensors")
    expected = {name: ((a.double() + b.double()) / 2).float()
                for (name, a), b in zip(models[1].state_dict().items(), models[2].state_dict().values())}
    assert stored.keys() <= expected.keys()
    for name, tensor in stored.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    loaded = AutoModelForSeq2SeqLM.from_pretrained(output).eval()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # Shared embeddings and the output projection are one tensor, stored once and averaged once.
    assert loaded.lm_head.weight is loaded.model.decoder.embed_tokens.weight is loaded.model.encoder.embed_tokens.weight
    assert averaged.lm_head.weight is averaged.model.decoder.embed_tokens.weight

    files = set(os.listdir(output))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
            "configuration_vaswani.py", "modeling_vaswani.py", "tokenization_vaswani.py",
            "pipeline_vaswani.py"} <= files
    assert not [name for name in files if name.startswith(".tmp-")]
    card = (output / "README.md").read_text()
    assert "## Checkpoint averaging" in card and "checkpoint-20 (step 20" in card and "checkpoint-30 (step 30" in card
    assert "checkpoint-10" not in card


def test_twenty_checkpoints_average_to_the_correctly_rounded_mean(tmp_path):
    """The big models' 20 checkpoints: sums in float64, so the mean is the exact one rounded once to float32, where
    float32 sums would round at every addition (and bf16 checkpoints give a float32 average)."""
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(64, generator=generator) * 10 ** torch.randint(-3, 4, (64,), generator=generator)
              for _ in range(20)]
    paths = []
    for index, value in enumerate(values):
        paths.append(str(tmp_path / str(index)))
        os.mkdir(paths[-1])
        dtype = torch.bfloat16 if index % 2 else torch.float32
        values[index] = value.to(dtype)
        save_file({"w": values[index]}, os.path.join(paths[-1], "model.safetensors"))
    expected = (torch.stack([value.double() for value in values]).sum(0) / 20).float()
    average = average_state_dicts(paths)["w"]
    assert average.dtype == torch.float32 and torch.equal(average, expected)


def test_a_list_of_checkpoints_averages_in_any_order(tmp_path, tokenizer):
    write_run(tmp_path / "run", tokenizer)
    checkpoints = [str(tmp_path / "run" / f"checkpoint-{step}") for step in (30, 10)]
    assert last_checkpoints(checkpoints) == checkpoints
    forward, backward = average_state_dicts(checkpoints), average_state_dicts(checkpoints[::-1])
    assert all(torch.equal(forward[name], backward[name]) for name in forward)
    with pytest.raises(ValueError, match="3 checkpoints asked for, but only 2 found"):
        last_checkpoints(checkpoints, 3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory"):
        last_checkpoints([tmp_path / "empty"])
    (tmp_path / "empty" / "checkpoint-5").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint-N directory"):
        last_checkpoints([tmp_path / "empty"])


REMOTE = WITHOUT_THE_PACKAGE + """
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

checkpoint, work = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
model = AutoModelForSeq2SeqLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True)
assert type(tokenizer).__name__ == "VaswaniTokenizer"
inputs = load_file(os.path.join(work, "inputs.safetensors"))
with torch.no_grad():
    logits = model(**inputs).logits
save_file({"logits": logits, "ids": torch.tensor(tokenizer("I have two cats.")["input_ids"])},
          os.path.join(work, "outputs.safetensors"))
"""


def test_the_average_loads_as_remote_code_without_the_package(tmp_path, tokenizer, single_thread):
    write_run(tmp_path / "run", tokenizer)
    output = tmp_path / "average"
    script_main("average_checkpoints")(["--inputs", str(tmp_path / "run"), "--last", "3", "--output_dir", str(output)])
    model = AutoModelForSeq2SeqLM.from_pretrained(output).eval()
    config = model.config
    source, source_mask = padded_batch(config, [6, 3], seed=1)
    inputs = {"input_ids": source, "attention_mask": source_mask, "decoder_input_ids": random_ids(config, 2, 4)}
    work = tmp_path / "work"
    work.mkdir()
    save_file(inputs, work / "inputs.safetensors")
    run_without_the_package(REMOTE, str(output), str(work), work=work, home=tmp_path / "hf_home")
    remote = load_file(work / "outputs.safetensors")
    with torch.no_grad():
        assert torch.equal(remote["logits"], model(**inputs).logits)
    assert remote["ids"].tolist() == tokenizer("I have two cats.")["input_ids"]


def test_checkpoints_of_different_models_are_refused(tmp_path, tokenizer):
    write_run(tmp_path / "a", tokenizer, steps=(10,))
    write_run(tmp_path / "b", tokenizer, steps=(20,), d_ff=128)
    with pytest.raises(ValueError, match=r"config d_ff=128, .* has 64"):
        average_checkpoints([tmp_path / "a" / "checkpoint-10", tmp_path / "b" / "checkpoint-20"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_checkpoints_with_different_tokenizers_are_refused(tmp_path, tokenizer):
    write_run(tmp_path / "a", tokenizer, steps=(10,))
    other = train_tokenizer(["Something else entirely, in other words."] * 10, vocab_size=300)
    write_run(tmp_path / "b", other, steps=(20,))
    with pytest.raises(SystemExit) as exit_info:  # a user error: one line, status 2
        script_main("average_checkpoints")(["--inputs", str(tmp_path / "a" / "checkpoint-10"),
                                            str(tmp_path / "b" / "checkpoint-20"),
                                            "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    with pytest.raises(ValueError, match="has another tokenizer"):
        average_checkpoints([tmp_path / "a" / "checkpoint-10", tmp_path / "b" / "checkpoint-20"], tmp_path / "out")


def test_tensors_of_different_shapes_or_names_are_refused(tmp_path):
    for name, tensors in (("a", {"w": torch.zeros(2, 3), "b": torch.zeros(3)}),
                          ("b", {"w": torch.zeros(3, 2), "b": torch.zeros(3)}),
                          ("c", {"w": torch.zeros(2, 3)})):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
    with pytest.raises(ValueError, match=r"w has shape \(3, 2\) in .*b but \(2, 3\) in .*a"):
        average_state_dicts([str(tmp_path / "a"), str(tmp_path / "b")])
    with pytest.raises(ValueError, match=r"c lacks b, which .*a has"):
        average_state_dicts([str(tmp_path / "a"), str(tmp_path / "c")])
    with pytest.raises(ValueError, match=r"a has a tensor b that .*c lacks"):
        average_state_dicts([str(tmp_path / "c"), str(tmp_path / "a")])


def test_averaging_onto_an_input_is_refused_with_or_without_force(tmp_path, tokenizer, capsys):
    write_run(tmp_path / "run", tokenizer)
    (tmp_path / "run" / "checkpoint-30" / "optimizer.pt").write_bytes(b"the run's optimizer state")
    before = snapshot(tmp_path / "run")
    inputs = [str(tmp_path / "run" / "checkpoint-20"), str(tmp_path / "run" / "checkpoint-30")]
    outputs = {**other_names(tmp_path / "run" / "checkpoint-30", tmp_path), "the run": tmp_path / "run"}
    for kind, output in outputs.items():
        for force in ([], ["--force"]):
            error = fails_with_one_line(script_main("average_checkpoints"),
                                        ["--inputs", *inputs, "--output_dir", str(output), *force], capsys,
                                        "the input")
            assert "--force" not in error and "choose another output" in error, kind
    # The run as the only input: its checkpoints are the inputs, and the run holds them.
    fails_with_one_line(script_main("average_checkpoints"), ["--inputs", str(tmp_path / "run"), "--output_dir",
                                                             str(tmp_path / "run"), "--force"], capsys, "the input")
    assert snapshot(tmp_path / "run") == before


def test_force_never_replaces_another_runs_checkpoint_and_replaces_anything_else_whole(tmp_path, tokenizer, capsys):
    write_run(tmp_path / "run", tokenizer, steps=(10, 20))
    write_run(tmp_path / "other", tokenizer, steps=(5,))
    before = snapshot(tmp_path / "other")
    inputs = ["--inputs", str(tmp_path / "run")]
    for output in (tmp_path / "other" / "checkpoint-5", tmp_path / "other"):
        error = fails_with_one_line(script_main("average_checkpoints"), [*inputs, "--output_dir", str(output),
                                                                         "--force"], capsys,
                                    f"{output} is a checkpoint or run directory of a training run")
        assert "--force" not in error and "Choose another directory" in error
    assert snapshot(tmp_path / "other") == before
    old = tmp_path / "old"
    old.mkdir()
    (old / "stale.bin").write_bytes(b"of an earlier model")
    fails_with_one_line(script_main("average_checkpoints"), [*inputs, "--output_dir", str(old)], capsys, "--force")
    script_main("average_checkpoints")([*inputs, "--output_dir", str(old), "--force"])
    assert not (old / "stale.bin").exists() and (old / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "other", "run"]  # no staging directory left


def truncate_weights(checkpoint):
    data = (checkpoint / "model.safetensors").read_bytes()
    (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])


def remove_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()


DAMAGE = {"truncated": (truncate_weights, "The weights in {} are truncated or corrupted (model.safetensors: "),
          "missing": (remove_weights, "{} has no model.safetensors")}


def average_script(run, checkpoint, tmp_path, capsys, message):
    fails_with_one_line(script_main("average_checkpoints"), ["--inputs", str(run), "--output_dir",
                                                             str(tmp_path / "average")], capsys, message)
    assert not (tmp_path / "average").exists()


def average_into_a_model(run, checkpoint, tmp_path, capsys, message):  # training's final average
    model = VaswaniForConditionalGeneration(tiny_config(vocab_size=300))
    with pytest.raises((ValueError, FileNotFoundError), match=message.replace("(", r"\(")):
        load_average(model, [str(run / "checkpoint-10"), str(checkpoint)])


def load_for_translation(run, checkpoint, tmp_path, capsys, message):
    fails_with_one_line(script_main("translate"), ["--model", str(checkpoint), "--device", "cpu", "a cat"], capsys,
                        message)


def resume_training(run, checkpoint, tmp_path, capsys, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message.replace("(", r"\(")):
        check_resumed_weights(str(checkpoint))


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("reader", [average_script, average_into_a_model, load_for_translation, resume_training])
def test_a_damaged_checkpoint_is_named_in_one_line_by_every_reader(tmp_path, tokenizer, capsys, reader, damage):
    write_run(tmp_path / "run", tokenizer, steps=(10, 20))
    newest = tmp_path / "run" / "checkpoint-20"
    DAMAGE[damage][0](newest)
    reader(tmp_path / "run", newest, tmp_path, capsys, DAMAGE[damage][1].format(newest))
