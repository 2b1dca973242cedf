"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on CPU: two gloo processes train each model family sharded, beside an
unsharded copy fed the same global batch, and compare losses, gradients and outputs; save and reload the sharded
model both ways (distributed checkpoint, consolidated `model.safetensors`); train in bf16 mixed precision. The
Trainer gives FSDP only on GPUs, so these checks call FSDP2 directly, wrapped as transformers and accelerate wrap a
model: one FSDP unit per `_no_split_modules` block (here every encoder and decoder layer), then the root.

This file is also the worker: one `torchrun` launch runs every check and writes its measurements to a JSON file,
and the tests assert on them, so the processes start once.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import WITHOUT_THE_PACKAGE, random_ids, script_main, tiny_config
from vaswani import (
    VaswaniConfig,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForSequenceClassification,
)
from vaswani.modeling_vaswani import shift_tokens_right

WORLD_SIZE = 2
STEPS = 3
GLOBAL_BATCH = 4  # split evenly between the ranks, so the mean of their losses is the loss of the whole batch

# name: (model class, config). Dropout is off: the sharded and the unsharded model must compute the same function.
FAMILIES = {
    "paper": (VaswaniForConditionalGeneration, lambda: tiny_config()),  # shared and tied embeddings
    "separate_vocabularies": (
        VaswaniForConditionalGeneration,
        lambda: tiny_config(share_embeddings=False, tie_word_embeddings=False, decoder_vocab_size=77),
    ),
    "separate_vocabularies_tied_output": (
        VaswaniForConditionalGeneration,  # the output projection is the decoder's own embedding
        lambda: tiny_config(share_embeddings=False, decoder_vocab_size=77),
    ),
    "modern_decoder_only": (
        VaswaniForCausalLM,
        lambda: VaswaniConfig.modern(vocab_size=99, d_model=32, decoder_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, d_ff=64, max_position_embeddings=64),
    ),
    "encoder_only": (VaswaniForSequenceClassification, lambda: tiny_config(num_labels=3)),
}
WRAPPINGS = ("no_split_modules", "accelerate")
MIXED_PRECISION_FAMILIES = ("paper", "modern_decoder_only")


# The worker (run under torchrun) ------------------------------------------------------------------------------------


def shard_by_no_split_modules(model, **fsdp_kwargs):
    """transformers' and accelerate's transformer-based wrapping: each `_no_split_modules` block is an FSDP unit, and
    the root unit holds the rest (embeddings, tied output projection, final norms)."""
    from torch.distributed.fsdp import fully_shard

    blocks = [module for module in model.modules() if type(module).__name__ in model._no_split_modules]
    assert blocks, "no module matches _no_split_modules"
    for block in blocks:
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model


def shard_as_accelerate_does(model):
    """The Trainer's FSDP2 wrapping on GPUs, accelerate's `fsdp2_prepare_model`, called directly: accelerate refuses
    its FSDP plugin on a CPU."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    # The attributes of an Accelerator that fsdp2_prepare_model reads (`device` since accelerate 1.16).
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                  is_main_process=dist.get_rank() == 0, torch_device_mesh=None,
                                  device=torch.device("cpu"))
    return fsdp2_prepare_model(accelerator, model)


SHARD = {"no_split_modules": shard_by_no_split_modules, "accelerate": shard_as_accelerate_does}


def global_batch(model_class, config, seed: int) -> dict:
    """The same batch on every rank. Labels hold no -100, so both halves count the same number of target tokens."""
    ids = random_ids(config, GLOBAL_BATCH, 7, seed)
    if model_class is VaswaniForCausalLM:
        return {"input_ids": ids, "labels": ids}
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 5:] = attention_mask[2, 3:] = 0
    batch = {"input_ids": ids.masked_fill(attention_mask == 0, config.pad_token_id), "attention_mask": attention_mask}
    if model_class is VaswaniForSequenceClassification:
        return {**batch, "labels": torch.arange(GLOBAL_BATCH) % config.num_labels}
    labels = random_ids(config, GLOBAL_BATCH, 6, seed + 1000) % config.target_vocab_size
    return {**batch, "labels": labels.clamp(min=4)}  # ordinary tokens of the (possibly smaller) target vocabulary


def this_ranks_half(batch: dict) -> dict:
    return {name: tensor.chunk(dist.get_world_size())[dist.get_rank()] for name, tensor in batch.items()}


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def new_model(family: str, seed: int = 0):
    model_class, config = FAMILIES[family]
    torch.manual_seed(seed)
    return model_class, model_class(config()).train()


def forward_inputs(model_class, config, batch: dict) -> dict:
    """The batch without labels: the inputs of a forward pass whose logits are compared."""
    inputs = {name: tensor for name, tensor in batch.items() if name != "labels"}
    if model_class is VaswaniForConditionalGeneration:
        inputs["decoder_input_ids"] = shift_tokens_right(batch["labels"], config.pad_token_id,
                                                         config.decoder_start_token_id)
    return inputs


def output_of(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**inputs).logits.float()


def sharded_against_unsharded(family: str, wrapping: str) -> dict:
    """STEPS AdamW steps of the sharded model (each rank on its half of the batch) and of an unsharded copy (on the
    whole batch): the loss of every step, the largest gradient difference relative to the largest gradient, and the
    largest difference of the trained models' logits."""
    model_class, model = new_model(family)
    reference = copy.deepcopy(model)
    SHARD[wrapping](model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    sharded_parameters = dict(model.named_parameters())
    losses, reference_losses, gradient_errors = [], [], []
    for step in range(STEPS):
        batch = global_batch(model_class, model.config, seed=step)
        loss = model(**this_ranks_half(batch)).loss
        loss.backward()
        losses.append(mean_over_ranks(loss))
        reference_loss = reference(**batch).loss
        reference_loss.backward()
        reference_losses.append(reference_loss.item())
        error = largest = 0.0
        for name, parameter in reference.named_parameters():
            gradient = sharded_parameters[name].grad.full_tensor()
            error = max(error, (gradient - parameter.grad).abs().max().item())
            largest = max(largest, parameter.grad.abs().max().item())
        gradient_errors.append(error / largest)
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    inputs = forward_inputs(model_class, model.config, global_batch(model_class, model.config, seed=STEPS))
    logits_error = (output_of(model, inputs) - output_of(reference, inputs)).abs().max().item()
    return {"losses": losses, "reference_losses": reference_losses, "gradient_errors": gradient_errors,
            "logits_error": logits_error}


def train_steps(model, optimizer, model_class, config, seeds) -> list[float]:
    losses = []
    for seed in seeds:
        loss = model(**this_ranks_half(global_batch(model_class, config, seed))).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses


def checkpoint_round_trips(family: str, directory: Path) -> dict:
    """Train a step, save a sharded checkpoint (model and optimizer, `torch.distributed.checkpoint`), train two more;
    a new sharded model that loads the checkpoint must train those two steps with the same losses. Then a consolidated
    save, as the Trainer writes one under FSDP, which `from_pretrained` must load to the sharded model's logits."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    model_class, model = new_model(family)
    shard_by_no_split_modules(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, model_class, model.config, seeds=[0])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / "sharded"))
    continued = train_steps(model, optimizer, model_class, model.config, seeds=[1, 2])

    _, restored = new_model(family, seed=1)  # other initial weights, which the checkpoint must replace
    shard_by_no_split_modules(restored)
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    model_state, optimizer_state = get_state_dict(restored, restored_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory / "sharded"))
    set_state_dict(restored, restored_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    resumed = train_steps(restored, restored_optimizer, model_class, model.config, seeds=[1, 2])

    # What the Trainer saves under FSDP: the full state dict, gathered on rank 0, written by `save_pretrained`.
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    inputs = forward_inputs(model_class, model.config, global_batch(model_class, model.config, seed=STEPS))
    sharded_logits = output_of(model, inputs)  # a collective: every rank runs it
    result = {"continued_losses": continued, "resumed_losses": resumed}
    if dist.get_rank() == 0:
        torch.save({"inputs": inputs, "logits": sharded_logits}, directory / "expected.pt")
        try:
            model.save_pretrained(directory / "consolidated", state_dict=full_state)
            loaded = model_class.from_pretrained(directory / "consolidated")
            config = json.loads((directory / "consolidated" / "config.json").read_text())
            result.update({
                "files": sorted(path.name for path in (directory / "consolidated").iterdir()),
                "auto_map": config["auto_map"],
                "architectures": config["architectures"],
                "logits_error": (output_of(loaded, inputs) - sharded_logits).abs().max().item(),
            })
        except Exception as error:  # reported by the test; raising here would leave the other rank waiting
            result["consolidated_error"] = f"{type(error).__name__}: {error}"
    dist.barrier()
    return result


def mixed_precision_against_float32(family: str) -> dict:
    """The same steps sharded in fp32 and sharded with bf16 parameters and fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    losses = {}
    for name, kwargs in (("float32", {}), ("bfloat16", {"mp_policy": policy})):
        model_class, model = new_model(family)
        shard_by_no_split_modules(model, **kwargs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[name] = train_steps(model, optimizer, model_class, model.config, seeds=range(STEPS))
        losses[f"{name}_parameter_dtype"] = str(next(model.parameters()).dtype)  # the sharded fp32 master copy
    return losses


def worker(output: Path) -> None:
    dist.init_process_group("gloo")
    results = {}

    def record(key, check, *args):
        try:
            results[key] = check(*args)
        except ImportError as error:  # an older accelerate, without FSDP2
            results[key] = {"skip": str(error)}
        except Exception as error:  # raised on every rank alike; recorded for the test, the other checks still run
            results[key] = {"error": f"{type(error).__name__}: {error}"}

    for wrapping in WRAPPINGS:
        for family in FAMILIES:
            record(f"train/{wrapping}/{family}", sharded_against_unsharded, family, wrapping)
    for family in FAMILIES:
        directory = output / "checkpoints" / family
        record(f"checkpoint/{family}", checkpoint_round_trips, family, directory)
    for family in MIXED_PRECISION_FAMILIES:
        record(f"mixed_precision/{family}", mixed_precision_against_float32, family)
    if dist.get_rank() == 0:
        (output / "results.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


# The tests -----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    output = tmp_path_factory.mktemp("fsdp")
    # PYTHONFAULTHANDLER: a rank that dies of a signal (an abort in native code) prints where it was in Python.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD_SIZE),
               __file__, str(output)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    return {**json.loads((output / "results.json").read_text()), "output": str(output)}


def result(fsdp, key: str) -> dict:
    if "skip" in fsdp[key]:
        pytest.skip(fsdp[key]["skip"])
    assert "error" not in fsdp[key], fsdp[key]["error"]
    return fsdp[key]


# accelerate (1.15, 1.16) gives the input embedding and the output projection units of their own, together only when
# they are one tensor. Here the output projection is tied to the decoder's embedding, not to the encoder's (the input
# embedding), so the decoder's embedding stays in the root unit: one parameter in two units, which torch refuses.
# accelerate 1.6 (the oldest supported) keeps them in one unit, and the case trains as the others do. So that case may
# fail only with torch's refusal: another error (accelerate 1.16 reading an attribute the stand-in accelerator lacked)
# cannot pass for it.
ACCELERATE_SPLITS_THE_TIE = ("separate_vocabularies_tied_output", "accelerate")
TRAINING_CASES = [(family, wrapping) for wrapping in WRAPPINGS for family in FAMILIES]


@pytest.mark.parametrize(("family", "wrapping"), TRAINING_CASES)
def test_sharded_training_equals_unsharded(fsdp, family, wrapping):
    error = fsdp[f"train/{wrapping}/{family}"].get("error", "")
    if (family, wrapping) == ACCELERATE_SPLITS_THE_TIE and error:
        assert "shared with a parameter already managed by another FSDP group" in error, error
        pytest.xfail(f"accelerate puts a tied parameter in two FSDP units: {error}")
    measured = result(fsdp, f"train/{wrapping}/{family}")
    assert measured["losses"] == pytest.approx(measured["reference_losses"], rel=1e-6, abs=1e-6)
    assert max(measured["gradient_errors"]) < 1e-5, measured["gradient_errors"]
    assert measured["logits_error"] < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoint_resumes_with_the_same_losses(fsdp, family):
    measured = result(fsdp, f"checkpoint/{family}")
    assert measured["resumed_losses"] == pytest.approx(measured["continued_losses"], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_consolidated_save_loads_with_the_same_logits(fsdp, family):
    """A sharded model's full state dict, saved by `save_pretrained`, is a complete checkpoint of the model class (not
    of the subclass FSDP2 swaps in, which torch defines): its code, auto_map and architectures, and the same logits."""
    measured = result(fsdp, f"checkpoint/{family}")
    assert "consolidated_error" not in measured, measured["consolidated_error"]
    model_class = FAMILIES[family][0]
    assert {"model.safetensors", "config.json", "modeling_vaswani.py", "configuration_vaswani.py"} <= set(
        measured["files"]), measured["files"]
    assert not any(name.startswith("_fsdp") or name.endswith((".bin", ".pt", ".distcp")) for name in measured["files"])
    assert measured["architectures"] == [model_class.__name__]
    assert all(target.startswith("modeling_vaswani.Vaswani") for name, target in measured["auto_map"].items()
               if name != "AutoConfig"), measured["auto_map"]
    assert measured["logits_error"] < 1e-5


def test_consolidated_save_loads_as_remote_code_without_the_package(fsdp):
    """What a Hub user without the package loads from a checkpoint saved under FSDP: the model's own code."""
    directory = Path(fsdp["output"]) / "checkpoints" / "paper"
    script = WITHOUT_THE_PACKAGE + f"""
import torch
from transformers import AutoModelForSeq2SeqLM
model = AutoModelForSeq2SeqLM.from_pretrained({str(directory / "consolidated")!r}, trust_remote_code=True).eval()
expected = torch.load({str(directory / "expected.pt")!r})
with torch.no_grad():
    error = (model(**expected["inputs"]).logits - expected["logits"]).abs().max().item()
print(type(model).__module__, error)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_MODULES_CACHE": str(directory / "modules")})
    assert run.returncode == 0, run.stderr[-3000:]
    module, error = run.stdout.split()
    assert module.startswith("transformers_modules.") and module.endswith("modeling_vaswani")
    assert float(error) < 1e-5


@pytest.mark.parametrize("family", MIXED_PRECISION_FAMILIES)
def test_bf16_mixed_precision_stays_near_float32(fsdp, family):
    measured = result(fsdp, f"mixed_precision/{family}")
    assert measured["bfloat16_parameter_dtype"] == "torch.float32"  # sharded master weights stay fp32
    # bf16 keeps 8 bits of mantissa (a relative error of 2^-9 per rounding); over a tiny model's few steps the loss
    # moves by well under 1%.
    assert measured["bfloat16"] == pytest.approx(measured["float32"], rel=1e-2)
    assert measured["bfloat16"] != measured["float32"]  # the policy took effect


@pytest.mark.parametrize("fsdp_flags", [["--fsdp"], ["--fsdp", "--fsdp_config", '{"version": 2}'],
                                        ["--fsdp", "full_shard auto_wrap"]])
def test_training_script_refuses_fsdp_on_cpus(tmp_path, capsys, fsdp_flags):
    """The Trainer would train with DDP where FSDP was asked for; the script says so in one line and stops, before it
    reads the corpus or writes anything."""
    output_dir = tmp_path / "model"
    with pytest.raises(SystemExit) as stopped:
        script_main("train_translation")(["--preset", "tiny", "--corpus", str(tmp_path / "unread.tsv"), "--output_dir",
                                          str(output_dir), "--use_cpu", "true", "--report_to", "none", *fsdp_flags])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --fsdp:") and "DDP" in lines[0], lines
    assert not output_dir.exists()


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
