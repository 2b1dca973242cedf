"""The command-line layer (`vaswani.cli`): the scripts that decode share one set of engine flags, leave every decoding
setting to the checkpoint unless told, and build their engine through `vaswani.engine_choice.load_default_engine`
alone."""

import argparse
import ast
from pathlib import Path

import pytest
from conftest import script_main

import vaswani.cli as cli
from vaswani.loading import DTYPES

REPO = Path(__file__).resolve().parents[1]
DECODING_SCRIPTS = ["translate", "evaluate_bleu"]


class Built(Exception):
    """Raised in place of loading: what the script asked the factory for is in `kwargs`."""

    def __init__(self, kwargs):
        super().__init__()
        self.kwargs = kwargs


def engine_request(monkeypatch, tmp_path, script: str, *flags: str) -> dict:
    """The keyword arguments `script` gives `load_default_engine` for `flags` (and the arguments it needs to get there)."""
    def record(model_dir, **kwargs):
        raise Built({"model_dir": model_dir, **kwargs})

    monkeypatch.setattr(cli, "load_default_engine", record)
    source, reference = tmp_path / "src.en", tmp_path / "ref.fr"
    source.write_text("I'm calm.\n")
    reference.write_text("Je suis calme.\n")
    needed = ["hello"] if script == "translate" else ["--source_file", str(source), "--reference_file", str(reference)]
    with pytest.raises(Built) as built:
        script_main(script)(["--model", "some/model", *needed, *flags])
    return built.value.kwargs


@pytest.mark.parametrize("script", DECODING_SCRIPTS)
def test_decoding_settings_left_out_are_the_checkpoints(script, monkeypatch, tmp_path):
    asked = engine_request(monkeypatch, tmp_path, script)
    assert asked["num_beams"] is asked["max_new_tokens"] is asked["length_penalty"] is None
    assert (asked["dtype"], asked["decoding"], asked["slots"], asked["ctranslate2"]) == ("auto", "auto", None, None)
    assert "int8" not in asked  # the scripts' int8 is CTranslate2's (benchmarks/results/int8-cpu-decision.md)
    # Nothing is timed while translating: the engine is the recorded choice's or the fixed rule's.
    assert "sentences" not in asked and asked["choice"] is None
    asked = engine_request(monkeypatch, tmp_path, script, "--num_beams", "2", "--max_new_tokens", "9",
                           "--length_penalty", "0.4", "--dtype", "float32", "--device", "cpu")
    assert (asked["num_beams"], asked["max_new_tokens"], asked["length_penalty"], asked["dtype"], asked["device"]) == \
        (2, 9, 0.4, "float32", "cpu")


@pytest.mark.parametrize("script", DECODING_SCRIPTS)
def test_both_scripts_take_the_same_precisions_and_refuse_a_count_below_one(script, monkeypatch, tmp_path, capsys):
    for dtype in ["auto", *DTYPES]:
        assert engine_request(monkeypatch, tmp_path, script, "--dtype", dtype)["dtype"] == dtype
    for flags in (["--dtype", "float16"], ["--num_beams", "0"], ["--max_new_tokens", "-3"]):
        with pytest.raises(SystemExit) as exit_info:
            script_main(script)(["--model", "some/model", *flags])
        assert exit_info.value.code == 2 and flags[0] in capsys.readouterr().err


def test_positive_int_names_what_is_wrong():
    assert cli.positive_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="must be positive, got 0"):
        cli.positive_int("0")


def test_no_script_gives_a_decoding_setting_a_number_and_none_builds_an_engine_itself():
    """What decodes is the checkpoint's to say (its generation_config.json): a numeric default on a flag such as
    --num_beams would override it silently. And every engine comes from `vaswani.loading`."""
    decoding = {"--num_beams", "--max_new_tokens", "--length_penalty", "--temperature", "--top_k", "--top_p"}
    engines = {"TorchEngine", "CTranslate2Engine", "Translator"}
    files = [*sorted((REPO / "scripts").glob("*.py")), REPO / "src" / "vaswani" / "cli.py"]
    numbered, built = [], []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in engines:
                built.append(f"{path.name}: {name}")
            flags = {arg.value for arg in node.args if isinstance(arg, ast.Constant)}
            default = next((keyword.value for keyword in node.keywords if keyword.arg == "default"), None)
            if name == "add_argument" and flags & decoding and isinstance(default, ast.Constant) and \
                    isinstance(default.value, int | float) and not isinstance(default.value, bool):
                numbered.append(f"{path.name}: {sorted(flags)} = {default.value}")
    assert numbered == [] and built == []
