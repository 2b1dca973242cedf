"""One loader for every tool (`vaswani.loading`): the device and the precision decided once, before the weights are
read, and a library that never imports the command-line layer."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from vaswani import loading
from vaswani.file_translation import Processes

LIBRARY_MODULES = ["convert", "data", "decoding", "evaluation", "evaluator", "export", "file_translation", "files",
                   "hub", "inference", "loading", "tokenization", "training", "visualize"]


def test_the_library_never_imports_the_command_line_layer():
    imports = "; ".join(f"import vaswani.{name}" for name in LIBRARY_MODULES)
    check = f"import sys; {imports}; print('vaswani.cli' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def from_pretrained_dtypes(monkeypatch) -> list:
    """The dtype of every `from_pretrained` call the loader makes from now on."""
    seen = []
    original = AutoModelForSeq2SeqLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("dtype"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForSeq2SeqLM, "from_pretrained", classmethod(spy))
    return seen


@pytest.mark.parametrize(("native", "num_beams", "chosen"), [
    (True, 4, torch.bfloat16),  # wide enough for beam search
    (True, 1, torch.float32),  # too narrow for greedy
    (False, 4, torch.float32),  # no bf16 products on this CPU
])
def test_dtype_auto_comes_from_the_config_before_the_weights_are_read(checkpoint, monkeypatch, native, num_beams,
                                                                       chosen):
    monkeypatch.setattr(loading, "cpu_multiplies_bf16", lambda: native)
    monkeypatch.setattr(loading, "CPU_BF16_MIN_D_MODEL", {"greedy": 10**6, "beam": 1})
    seen = from_pretrained_dtypes(monkeypatch)
    model, _ = loading.load_translator(str(checkpoint), "cpu", dtype="auto", num_beams=num_beams)
    assert seen == [chosen]  # loaded once, in the chosen precision: no cast afterwards
    assert model.dtype == chosen


def test_the_default_precision_is_fp32_on_a_cpu_and_int8_keeps_fp32(checkpoint, monkeypatch):
    monkeypatch.setattr(loading, "cpu_multiplies_bf16", lambda: True)
    seen = from_pretrained_dtypes(monkeypatch)
    loading.load_translator(str(checkpoint), "cpu")
    loading.load_translator(str(checkpoint), "cpu", dtype="auto", int8=True, num_beams=4)
    assert seen == [torch.float32, torch.float32]


def test_a_named_precision_is_refused_with_int8_before_any_file_is_read(tmp_path):
    with pytest.raises(ValueError, match="--int8 quantizes fp32 weights"):
        loading.load_translator(str(tmp_path / "not-there"), "cpu", dtype="bfloat16", int8=True)


def test_auto_device_is_a_gpu_when_there_is_one_and_each_process_takes_its_own(monkeypatch):
    assert loading.choose_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loading.choose_device("auto") == loading.choose_device(None) == torch.device("cpu")
    assert Processes(1, 2, 1).device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loading.choose_device("auto") == torch.device("cuda")
    assert Processes(1, 2, 1).device("auto") == "cuda:1"
    assert Processes(1, 2, 1).device("cuda:0") == "cuda:0"
