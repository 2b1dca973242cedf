"""One loader for every tool (`vaswani.loading`): the device and the precision decided once, before the weights are
read, and a library that never imports the command-line layer. Then the checkpoints every loader refuses (damaged or
missing weights, a tokenizer that does not fit, another model type), one test each, and what no loader ever runs
(pickles, remote code). docs/reliability.md is their table."""

import ast
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import huggingface_hub
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, BertConfig, BertModel, pipeline

from conftest import fails_with_one_line, script_main, subprocess_env
from hub_stub import HubStub
from tiny_translation_model import SOURCES
from vaswani import VaswaniConfig, VaswaniForConditionalGeneration, loading
from vaswani.configuration_vaswani import decoder_start_token_id, tokenizer_fingerprint
from vaswani.evaluation import translate
from vaswani.loading import load_translator
from vaswani.tokenization_vaswani import BYTE_TOKENS, SPECIAL_TOKENS, VaswaniTokenizer, train_tokenizer
from vaswani.training import ModelArguments
from vaswani.training import build_model_and_tokenizer as build_model_and_tokenizer_for_training
from vaswani.translation import translate as translate_with
from vaswani.decoding_settings import write_decoding_defaults

REPO = Path(__file__).resolve().parents[1]

# Every module of the package but the command-line layer itself.
LIBRARY_MODULES = sorted(path.stem for path in (REPO / "src" / "vaswani").glob("*.py")
                         if path.stem not in ("__init__", "__main__", "cli"))


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


def test_the_default_precision_is_auto_with_the_checkpoints_beams_and_int8_keeps_fp32(checkpoint, monkeypatch):
    """One meaning for every tool: no precision given is "auto", for the beams the checkpoint decodes with."""
    monkeypatch.setattr(loading, "cpu_multiplies_bf16", lambda: True)
    monkeypatch.setattr(loading, "CPU_BF16_MIN_D_MODEL", {"greedy": 10**6, "beam": 1})
    seen = from_pretrained_dtypes(monkeypatch)
    loading.load_translator(str(checkpoint), "cpu", num_beams=4)
    loading.load_translator(str(checkpoint), "cpu")  # the checkpoint's generation config: greedy
    loading.load_engine(str(checkpoint), device="cpu", num_beams=4)
    loading.load_translator(str(checkpoint), "cpu", dtype="auto", int8=True, num_beams=4)
    assert seen == [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]


def test_an_engine_is_loaded_with_one_check_and_decodes_with_the_checkpoints_settings_unless_told(
        checkpoint, tmp_path, monkeypatch):
    path = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, path)
    model = AutoModelForSeq2SeqLM.from_pretrained(path)
    write_decoding_defaults(model.generation_config, num_beams=3, length_penalty=0.5, max_new_tokens=6)
    model.generation_config.save_pretrained(path)
    checks = []
    original = loading.check_tokenizer_fits
    monkeypatch.setattr(loading, "check_tokenizer_fits", lambda *args: checks.append(1) or original(*args))

    engine = loading.load_engine(str(path), device="cpu", slots=0)

    assert len(checks) == 1 and engine.model.device == torch.device("cpu") and not engine.continuous
    assert (engine.decoding.num_beams, engine.decoding.length_penalty, engine.decoding.max_new_tokens) == (3, 0.5, 6)
    assert translate_with(engine, SOURCES).texts == translate(model, tokenizer_of(path), SOURCES, num_beams=3,
                                                              length_penalty=0.5, max_new_tokens=6)
    told = loading.load_engine(str(path), device="cpu", num_beams=1, max_new_tokens=4, length_penalty=None)
    assert told.decoding.generate_options() == {"num_beams": 1, "do_sample": False}
    assert told.decoding.max_new_tokens == 4
    sampled = loading.load_engine(str(path), device="cpu", do_sample=True).decoding
    assert (sampled.do_sample, sampled.num_beams) == (True, 1)
    assert loading.engine_for_model(model, tokenizer_of(path)).settings == engine.settings


def tokenizer_of(path):
    return AutoTokenizer.from_pretrained(path)


def test_each_engine_refuses_the_others_settings_before_loading(checkpoint, tmp_path):
    export = tmp_path / "ct2"
    export.mkdir()
    (export / "model.bin").write_bytes(b"")  # found a CTranslate2 directory by this file alone
    for options, named in [({"int8": True}, "--int8"), ({"dtype": "bfloat16"}, "--dtype"), ({"slots": 2}, "--slots"),
                           ({"no_repeat_ngram_size": 2, "decoding": "lean"}, "--decoding, --no_repeat_ngram_size")]:
        with pytest.raises(ValueError, match=f"^{named}: the PyTorch engine's"):
            loading.load_engine(str(export), **options)
    with pytest.raises(ValueError, match=r"--compute_type is CTranslate2's: add --ctranslate2 \(--ctranslate2 "
                       "--compute_type int8 decodes"):
        loading.load_engine(str(checkpoint), compute_type="int8")


def test_one_rule_decides_where_the_decoder_starts(checkpoint):
    """<s> where the tokenizer has one (a new model's config default is VaswaniTokenizer's), else the pad token
    (Marian's tokenizers); every loader holds a model to it (`check_tokenizer_fits`)."""
    tokenizer = tokenizer_of(checkpoint)
    assert decoder_start_token_id(tokenizer) == tokenizer.bos_token_id == VaswaniConfig().decoder_start_token_id
    assert decoder_start_token_id(SimpleNamespace(bos_token_id=None, pad_token_id=58100)) == 58100


def test_a_named_precision_is_refused_with_int8_before_any_file_is_read(tmp_path):
    with pytest.raises(ValueError, match="int8=True quantizes fp32 weights; .* --ctranslate2 --compute_type int8"):
        loading.load_translator(str(tmp_path / "not-there"), "cpu", dtype="bfloat16", int8=True)


def test_auto_device_is_a_gpu_when_there_is_one_and_each_process_takes_its_own(monkeypatch):
    assert loading.choose_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loading.choose_device("auto") == loading.choose_device(None) == torch.device("cpu")
    assert loading.choose_device("auto", local_rank=1) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loading.choose_device("auto") == torch.device("cuda")
    assert loading.choose_device("auto", local_rank=1) == torch.device("cuda:1")
    assert loading.choose_device("cuda:0", local_rank=1) == torch.device("cuda:0")


# Checkpoints ----------------------------------------------------------------------------------------------------------


def damaged_copy(good: Path, tmp_path: Path, damage) -> Path:
    path = tmp_path / "damaged"
    shutil.copytree(good, path)
    damage(path)
    return path


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def first_key(tensors, part: str) -> str:
    return next(key for key in tensors if part in key)


def drop_tensor(path):
    edit_tensors(path, lambda t: t.pop(first_key(t, "fc1.weight")))


def misshape_tensor(path):
    edit_tensors(path, lambda t: t.__setitem__(first_key(t, "fc1.weight"), torch.zeros(3, 3)))


def add_tensor(path):
    edit_tensors(path, lambda t: t.__setitem__("model.extra.weight", torch.zeros(3)))


def truncate_weights(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def corrupt_weights(path):
    data = bytearray((path / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header
    (path / "model.safetensors").write_bytes(bytes(data))


def pickle_weights_only(path):
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()


def test_missing_tensor_is_listed_by_from_pretrained_and_refused_by_the_cli(good_checkpoint, tmp_path):
    path = damaged_copy(good_checkpoint, tmp_path, drop_tensor)
    # The library keeps transformers' contract: the load report lists the key (and it is newly initialised).
    _, info = VaswaniForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert any("fc1.weight" in key for key in info["missing_keys"])
    # The tools never translate with random weights.
    with pytest.raises(ValueError, match="missing keys: .*fc1.weight"):
        load_translator(str(path), "cpu")


def test_unexpected_tensor_is_refused_by_the_cli(good_checkpoint, tmp_path):
    path = damaged_copy(good_checkpoint, tmp_path, add_tensor)
    with pytest.raises(ValueError, match="unexpected keys: model.extra.weight"):
        load_translator(str(path), "cpu")


@pytest.mark.parametrize(
    "damage, library_error, library_message, cli_message",
    [
        (misshape_tensor, RuntimeError, "ignore_mismatched_sizes", "do not have the shapes its config.json gives"),
        (truncate_weights, SafetensorError, "incomplete metadata", "truncated or corrupted"),
        (corrupt_weights, SafetensorError, "deserializing header", "truncated or corrupted"),
    ],
    ids=["mismatched-shape", "truncated", "corrupted"],
)
def test_damaged_weights_are_an_error(good_checkpoint, tmp_path, damage, library_error, library_message, cli_message):
    path = damaged_copy(good_checkpoint, tmp_path, damage)
    with pytest.raises(library_error, match=library_message):
        VaswaniForConditionalGeneration.from_pretrained(path)
    with pytest.raises(ValueError, match=cli_message):
        load_translator(str(path), "cpu")


def test_pickled_weights_are_never_read_by_the_tools(good_checkpoint, tmp_path):
    path = damaged_copy(good_checkpoint, tmp_path, pickle_weights_only)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_translator(str(path), "cpu")


@pytest.fixture(scope="module")
def bert_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert") / "bert"
    BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(path)
    return path


def test_checkpoint_of_another_model_type_is_refused_by_the_cli(bert_checkpoint):
    with pytest.raises(ValueError, match="holds a 'bert' model, not a Vaswani one"):
        load_translator(str(bert_checkpoint), "cpu")


def test_checkpoint_of_another_model_type_is_refused_by_from_pretrained(bert_checkpoint):
    with pytest.raises(ValueError, match="model_type"):
        VaswaniForConditionalGeneration.from_pretrained(bert_checkpoint)


def test_missing_or_incomplete_model_directory_is_one_line(good_checkpoint, tmp_path, capsys):
    nowhere = str(tmp_path / "nowhere")
    fails_with_one_line(script_main("evaluate_bleu"), ["--model", nowhere, "--corpus", str(tmp_path / "none.tsv")],
                        capsys, "does not exist")  # the corpus is read first
    fails_with_one_line(script_main("visualize_attention"), ["--model", nowhere, "--source", "hi", "--output_dir",
                                                             str(tmp_path / "maps")], capsys, "does not exist")
    assert not (tmp_path / "maps").exists()
    translate_main = script_main("translate")
    fails_with_one_line(translate_main, ["--model", nowhere, "hi"], capsys, "does not exist")
    (tmp_path / "empty").mkdir()
    fails_with_one_line(translate_main, ["--model", str(tmp_path / "empty"), "hi"], capsys, "has no config.json")
    no_weights = damaged_copy(good_checkpoint, tmp_path, lambda p: (p / "model.safetensors").unlink())
    fails_with_one_line(translate_main, ["--model", str(no_weights), "hi"], capsys, "damaged has no model.safetensors")


# A model and a tokenizer that do not belong together, incomplete checkpoints ------------------------------------------


def weights_only_copy(good: Path, tmp_path: Path) -> Path:
    """What a user holds who copied a checkpoint's weights and forgot the rest."""
    path = tmp_path / "weights-only"
    path.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(good / name, path)
    return path


def test_a_directory_without_tokenizer_files_is_an_error_naming_them(good_checkpoint, tmp_path, capsys):
    path = weights_only_copy(good_checkpoint, tmp_path)
    for load in (AutoTokenizer.from_pretrained, VaswaniTokenizer.from_pretrained):
        with pytest.raises(FileNotFoundError, match="tokenizer.json and tokenizer_config.json are missing"):
            load(path)
    (tmp_path / "src.en").write_text("the cat\n")
    (tmp_path / "ref.fr").write_text("le chat\n")
    fails_with_one_line(script_main("translate"), ["--model", str(path), "the cat"], capsys,
                        "weights-only has no Vaswani tokenizer: tokenizer.json and tokenizer_config.json are missing")
    fails_with_one_line(script_main("evaluate_bleu"), ["--model", str(path), "--source_file", str(tmp_path / "src.en"),
                                                       "--reference_file", str(tmp_path / "ref.fr")], capsys,
                        "tokenizer.json and tokenizer_config.json are missing")
    shutil.copy(good_checkpoint / "tokenizer_config.json", path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json is missing"):
        AutoTokenizer.from_pretrained(path)
    # Built without files on purpose, the tokenizer still spells text byte by byte.
    assert len(VaswaniTokenizer()) == len(SPECIAL_TOKENS) + len(BYTE_TOKENS)


def test_a_hub_repository_without_tokenizer_files_is_an_error_naming_them(good_checkpoint, tmp_path):
    weights_only = weights_only_copy(good_checkpoint, tmp_path)
    repo_id = "someone/weights-only"
    with HubStub() as hub:
        api = huggingface_hub.HfApi(endpoint=hub.endpoint, token="hf_stand_in_token")
        with patch.object(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True):
            api.create_repo(repo_id)
            api.upload_folder(folder_path=str(weights_only), repo_id=repo_id)
        code = f"""
import vaswani
from transformers import AutoTokenizer
try:
    AutoTokenizer.from_pretrained({repo_id!r})
except FileNotFoundError as error:
    print("refused:", error)
"""
        env = {**subprocess_env(), "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1",
               "HF_HOME": str(tmp_path / "hf_home")}
        env.pop("HF_HUB_OFFLINE"), env.pop("HF_TOKEN", None)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"refused: {repo_id} has no Vaswani tokenizer: tokenizer.json and tokenizer_config.json are missing" in \
        result.stdout


def set_json(path: Path, **values) -> None:
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def tokenizer_of_another_checkpoint(path: Path) -> None:
    """The tokenizer files of a run with a larger vocabulary (400 tokens against the model's 320)."""
    words = [f"mot{i} word{i * 7}" for i in range(300)]
    train_tokenizer(words * 2, vocab_size=400).save_pretrained(path)


def same_size_tokenizer_of_another_checkpoint(path: Path) -> None:
    """A model trained as the training script does, which records its tokenizer in config.json, beside the
    tokenizer of another run: as many tokens, the same special ids."""
    set_json(path / "config.json", tokenizer_fingerprint=tokenizer_fingerprint(AutoTokenizer.from_pretrained(path)))
    words = [f"mot{i} word{i * 7}" for i in range(300)]
    other = train_tokenizer(words * 2, vocab_size=320)
    assert len(other) == len(AutoTokenizer.from_pretrained(path))
    other.save_pretrained(path)


def config_vocabulary_smaller_than_the_tokenizer(path: Path) -> None:
    """Weights and config of a 300-token model beside the 320-token tokenizer: the weights fit their config."""
    VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=300)).save_pretrained(path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (tokenizer_of_another_checkpoint, "token ids up to 399, but the model's vocabulary holds vocab_size=320"),
        (same_size_tokenizer_of_another_checkpoint, "is not the one the model was trained with"),
        (config_vocabulary_smaller_than_the_tokenizer,
         "token ids up to 319, but the model's vocabulary holds vocab_size=300"),
        (lambda p: set_json(p / "config.json", pad_token_id=2),
         "The tokenizer's pad id is 0, but the model's config.json has pad_token_id=2"),
        (lambda p: set_json(p / "generation_config.json", eos_token_id=2),
         "The tokenizer's eos id is 1, but the model's generation_config.json has eos_token_id=2"),
        (lambda p: set_json(p / "generation_config.json", decoder_start_token_id=0),
         "The tokenizer's decoder-start id is 3, but the model's generation_config.json has decoder_start_token_id=0"),
    ],
    ids=["tokenizer-of-another-checkpoint", "same-size-tokenizer-of-another-checkpoint", "config-vocabulary-too-small",
         "pad-id", "eos-id", "decoder-start-id"],
)
def test_a_tokenizer_that_does_not_fit_the_model_is_refused_by_every_loader(good_checkpoint, tmp_path, capsys,
                                                                           damage, message):
    path = damaged_copy(good_checkpoint, tmp_path, damage)
    with pytest.raises(ValueError, match=message):
        load_translator(str(path), "cpu")
    fails_with_one_line(script_main("translate"), ["--model", str(path), "--num_beams", "1", "the cat"], capsys,
                        message)
    model = VaswaniForConditionalGeneration.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with pytest.raises(ValueError, match=message):
        pipeline("translation", model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=message):
        translate(model, tokenizer, ["the cat"], num_beams=1)


def test_a_new_model_records_its_tokenizer_and_loads_with_it(good_checkpoint, tmp_path):
    model, tokenizer = build_model_and_tokenizer_for_training(
        ModelArguments(preset="tiny", tokenizer_name_or_path=str(good_checkpoint)), lambda: iter(()))
    assert model.config.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    model.save_pretrained(tmp_path / "new")
    tokenizer.save_pretrained(tmp_path / "new")
    _, loaded = load_translator(str(tmp_path / "new"), "cpu")
    assert tokenizer_fingerprint(loaded) == model.config.tokenizer_fingerprint


def test_fine_tuning_with_a_tokenizer_that_does_not_fit_is_refused(good_checkpoint, tmp_path):
    path = damaged_copy(good_checkpoint, tmp_path, lambda p: set_json(p / "config.json", pad_token_id=2))
    with pytest.raises(ValueError, match="pad id is 0, but the model's config.json has pad_token_id=2"):
        build_model_and_tokenizer_for_training(ModelArguments(model_name_or_path=str(path)), lambda: iter(()))


def test_a_model_that_is_a_file_is_one_line(good_checkpoint, tmp_path, capsys):
    weights = str(good_checkpoint / "model.safetensors")
    message = f"--model {weights} is a file; give the checkpoint directory"
    fails_with_one_line(script_main("translate"), ["--model", weights, "the cat"], capsys, message)
    fails_with_one_line(script_main("visualize_attention"), ["--model", weights, "--source", "the cat", "--output_dir",
                                                             str(tmp_path / "maps")], capsys, message)
    assert not (tmp_path / "maps").exists()


def test_a_checkpoint_without_generation_config_or_with_a_missing_shard_is_refused_by_the_tools(good_checkpoint,
                                                                                               tmp_path, capsys):
    no_generation_config = damaged_copy(good_checkpoint, tmp_path, lambda p: (p / "generation_config.json").unlink())
    fails_with_one_line(script_main("translate"), ["--model", str(no_generation_config), "the cat"], capsys,
                        "damaged has no generation_config.json, which holds the decoding settings")
    sharded = tmp_path / "sharded"
    VaswaniForConditionalGeneration.from_pretrained(good_checkpoint).save_pretrained(sharded, max_shard_size="20KB")
    AutoTokenizer.from_pretrained(good_checkpoint).save_pretrained(sharded)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2
    load_translator(str(sharded), "cpu")  # complete: it loads
    shards[1].unlink()
    fails_with_one_line(script_main("translate"), ["--model", str(sharded), "the cat"], capsys,
                        f"sharded lacks 1 of the {len(shards)} weight shards that model.safetensors.index.json lists "
                        f"({shards[1].name}); copy the whole checkpoint directory again")


# Safety --------------------------------------------------------------------------------------------------------------


def python_files():
    return sorted((REPO / "src" / "vaswani").glob("*.py")) + sorted((REPO / "scripts").glob("*.py"))


def test_nothing_in_the_package_loads_pickles():
    unsafe_modules = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = {alias.name.split(".")[0] for alias in node.names}
                names.add((getattr(node, "module", None) or "").split(".")[0])
                assert not names & unsafe_modules, f"{path.name}:{node.lineno} imports {names & unsafe_modules}"
            if isinstance(node, ast.Call):
                callee = ast.unparse(node.func)
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if callee.endswith("torch.load"):
                    assert keywords.get("weights_only") == "True", f"{path.name}:{node.lineno}: {callee}"
                if callee.endswith("np.load") or callee.endswith("numpy.load"):
                    assert keywords.get("allow_pickle") in (None, "False"), f"{path.name}:{node.lineno}"


def test_loading_a_checkpoint_needs_remote_code_only_without_the_package(good_checkpoint):
    code = f"""
from transformers import AutoModelForSeq2SeqLM
try:
    AutoModelForSeq2SeqLM.from_pretrained({str(good_checkpoint)!r}, trust_remote_code=False)
except ValueError as error:
    print("without vaswani:", "trust_remote_code" in str(error))
import vaswani
model = AutoModelForSeq2SeqLM.from_pretrained({str(good_checkpoint)!r})
print("with vaswani:", type(model).__module__)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env=subprocess_env(), cwd="/")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "without vaswani: True" in result.stdout
    assert "with vaswani: vaswani.modeling_vaswani" in result.stdout


def test_tools_never_run_remote_code(good_checkpoint, tmp_path):
    path = damaged_copy(good_checkpoint, tmp_path, lambda p: None)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForSeq2SeqLM": "evil.Model"}
    (path / "config.json").write_text(json.dumps(config))
    (path / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    model, _ = load_translator(str(path), "cpu")
    assert type(model).__module__ == "vaswani.modeling_vaswani"


def test_a_cpu_rehearsing_cuda_takes_the_decisions_a_gpu_takes(monkeypatch):
    """VASWANI_REHEARSE_CUDA=1, read once at import, makes the CPU take CUDA's branches wherever a CPU can run them:
    bf16 by default, the lean loop as for CUDA graphs behind the scripts, transformers' loop behind generate(), the
    slots' sync interval; without it, the CPU's own."""
    from vaswani import generation_vaswani

    cpu = torch.device("cpu")
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=32))
    for rehearsing, kind, dtype, loop, lean in ((True, "cuda", torch.bfloat16, "graphs", False),
                                                (False, "cpu", torch.float32, "auto", True)):
        monkeypatch.setattr(generation_vaswani, "rehearsing_cuda", rehearsing)
        assert generation_vaswani.runs_as(cpu) == kind and generation_vaswani.runs_as("meta") == "meta"
        assert loading.choose_dtype("auto", cpu, d_model=64, cpu_bf16=False) == dtype
        assert loading.decoding_loop("auto", cpu) == loop
        assert generation_vaswani._lean_by_default(model) is lean
    read = subprocess.run([sys.executable, "-c", "from vaswani.generation_vaswani import runs_as; print(runs_as('cpu'))"],
                          capture_output=True, text=True, env={**subprocess_env(), "VASWANI_REHEARSE_CUDA": "1"})
    assert read.stdout.strip() == "cuda", read.stderr


@pytest.mark.parametrize(("flags", "speedups", "chosen"), [
    (True, [1.6, 1.7, 1.6], True),  # bf16 instructions, its products faster (as on an AMD EPYC with AVX512-BF16)
    (True, [0.53, 0.54, 0.55], False),  # its products slower (an Intel Xeon with AVX512-BF16, no AMX)
    (True, [1.3, 1.1, 1.3], False),  # faster, but one round within the margin: not enough to change translations
    (False, [2.0, 2.0, 2.0], False),  # no bf16 instructions: not timed
])
def test_a_cpu_multiplies_in_bf16_only_where_every_round_of_its_products_is_faster_by_the_margin(
        monkeypatch, tmp_path, flags, speedups, chosen):
    """Timed once per machine, not per process: the answer is recorded under the machine's key and read by every
    later process, whatever its own timing would say."""
    timed = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(loading, "cpu_bf16_flags", lambda: flags)

    def timing():
        timed.append(1)
        return speedups[len(timed) - 1]

    monkeypatch.setattr(loading, "bf16_product_speedup", timing)
    loading.cpu_multiplies_bf16.cache_clear()
    try:
        assert loading.cpu_multiplies_bf16() is chosen and len(timed) == loading.CPU_BF16_ROUNDS * flags
        loading.cpu_multiplies_bf16.cache_clear()  # as a new process
        speedups[:] = [1 / value for value in speedups]  # which would answer otherwise, were it timed again
        timed.clear()
        assert loading.cpu_multiplies_bf16() is chosen and not timed
        if flags:
            record = json.loads((tmp_path / "vaswani" / loading.CPU_BF16_RECORD).read_text())["records"]
            assert len(record) == 1 and record[0]["bf16"] is chosen and record[0]["machine"]["threads"] is None
    finally:
        loading.cpu_multiplies_bf16.cache_clear()


def test_the_bf16_product_timing_runs_on_this_cpu():
    speedup = loading.bf16_product_speedup(rows=64, width=32, repeats=2)
    assert math.isfinite(speedup) and speedup > 0


@pytest.mark.parametrize("num_beams", [1, 4])
def test_the_main_jobs_width_decodes_in_fp32_where_bf16_products_are_faster_and_base_in_bf16(num_beams):
    """At 256 wide, bf16 decoded no faster than the fp32 engine with either search, and changed translations; at 512
    it was the faster (loading.CPU_BF16_MIN_D_MODEL)."""
    cpu = torch.device("cpu")
    small, base = VaswaniConfig.small().d_model, VaswaniConfig.base().d_model
    assert loading.choose_dtype("auto", cpu, small, num_beams=num_beams, cpu_bf16=True) == torch.float32
    assert loading.choose_dtype("auto", cpu, base, num_beams=num_beams, cpu_bf16=True) == torch.bfloat16


def test_a_model_too_narrow_for_bf16_decodes_in_fp32_without_timing_the_cpu(monkeypatch):
    def timed():
        raise AssertionError("the CPU's products were timed for a model too narrow for bf16")

    monkeypatch.setattr(loading, "cpu_multiplies_bf16", timed)
    monkeypatch.setattr(loading, "CPU_BF16_MIN_D_MODEL", {"greedy": 512, "beam": 256})
    assert loading.choose_dtype("auto", torch.device("cpu"), d_model=256, num_beams=1) == torch.float32
