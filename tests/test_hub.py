"""Model card contents, checkpoint completeness checks, and a real push → download round trip through huggingface_hub's
own client against a local stand-in for the Hub (tests/hub_stub.py)."""

import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from hub_stub import HubStub
from huggingface_hub import ModelCard
from tiny_translation_model import SOURCES

from vaswani.files import exclusive
from vaswani.hub import (
    REPO_ID_PLACEHOLDER,
    TATOEBA_ATTRIBUTION,
    attach_translation_pipeline,
    missing_checkpoint_files,
    push_to_hub,
    write_model_card,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "someone/vaswani-tiny-en-fr"
TOKEN = "hf_stand_in_token"


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_models):
    return tiny_models()


@pytest.fixture
def checkpoint(model_and_tokenizer, tmp_path):
    """A saved checkpoint as training leaves it, including files that must stay local."""
    model, tokenizer = model_and_tokenizer
    directory = tmp_path / "en-fr"
    attach_translation_pipeline(model, directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    write_model_card(directory, metrics={"test_bleu": 12.345, "test_chrf": 30.1, "test_ter": 80.0, "epoch": 3.0})
    (directory / "optimizer.pt").write_bytes(b"optimizer state")
    (directory / "checkpoint-10").mkdir()
    (directory / "checkpoint-10" / "config.json").write_text("{}")
    return directory


@pytest.fixture
def push_cli():
    """scripts/push_to_hub.py's `main`, run in this process (its `__main__` guard is not triggered)."""
    return runpy.run_path(str(REPO_ROOT / "scripts" / "push_to_hub.py"))["main"]


def test_model_card_metadata_and_text(tmp_path):
    signatures = {"bleu": "nrefs:var|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"}
    path = write_model_card(
        tmp_path,
        metrics={"test_bleu": 41.237, "test_chrf": 60.5, "test_ter": 45.0, "train_runtime": 120.5,
                 "test_signatures": signatures},
        repo_id="someone/model",
        training_command="python scripts/train_translation.py --preset base",
    )
    card = ModelCard.load(path)
    assert card.data.language == ["en", "fr"] and card.data.license == "apache-2.0"
    assert card.data.pipeline_tag == "translation" and "translation" in card.data.tags
    results = {result.metric_type: result for result in card.data.eval_results}
    assert {name: result.metric_value for name, result in results.items()} == {"bleu": 41.24, "chrf": 60.5, "ter": 45.0}
    assert results["bleu"].task_type == "translation" and results["bleu"].dataset_split == "test"
    assert TATOEBA_ATTRIBUTION in card.text and "CC-BY 2.0" in card.text
    assert 'AutoModelForSeq2SeqLM.from_pretrained("someone/model", trust_remote_code=True)' in card.text
    assert 'pipeline("translation", model="someone/model", trust_remote_code=True)' in card.text
    assert "python scripts/train_translation.py --preset base" in card.text
    assert r"| BLEU | 41.24 | `nrefs:var\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:2.6.0` |" in card.text
    assert "| train_runtime | 120.5 |" in card.text


def test_model_card_without_metrics_has_no_model_index(tmp_path):
    card = ModelCard.load(write_model_card(tmp_path))
    assert card.data.eval_results is None and "## Evaluation" not in card.text
    assert REPO_ID_PLACEHOLDER in card.text  # filled in by push_to_hub once the repository is known


def test_incomplete_checkpoints_are_refused(checkpoint, tmp_path):
    assert missing_checkpoint_files(checkpoint) == []
    (checkpoint / "tokenizer_config.json").unlink()
    (checkpoint / "pipeline_vaswani.py").unlink()  # named by config.json's custom_pipelines
    assert missing_checkpoint_files(checkpoint) == ["tokenizer_config.json", "pipeline_vaswani.py"]
    with pytest.raises(FileNotFoundError, match="missing: tokenizer_config.json, pipeline_vaswani.py"):
        push_to_hub(checkpoint, REPO_ID)
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        push_to_hub(tmp_path / "nowhere", REPO_ID)


def test_push_cli_reports_a_missing_directory_in_one_line(push_cli, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        push_cli(["--model_dir", str(tmp_path / "nowhere"), "--repo_id", REPO_ID])
    assert exit_info.value.code != 0
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and "model directory not found" in stderr


def test_push_then_load_back_through_the_hub_stand_in(checkpoint, model_and_tokenizer, push_cli, monkeypatch, capsys):
    model, tokenizer = model_and_tokenizer
    with HubStub() as hub:
        # HfApi reads the endpoint when constructed and the Xet switch when uploading, so patching both suffices
        # for the upload; the download below runs in a fresh process configured through the environment.
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        push_cli(["--model_dir", str(checkpoint), "--repo_id", REPO_ID, "--token", TOKEN, "--private"])
        assert capsys.readouterr().out.strip().startswith(f"{hub.endpoint}/{REPO_ID}/commit/")

        assert hub.unhandled == []
        assert hub.authorizations == {f"Bearer {TOKEN}"}
        assert hub.repos[REPO_ID]["private"] and len(hub.commits) == 1
        uploaded = hub.files(REPO_ID)
        local = {path.name: path.read_bytes() for path in checkpoint.iterdir() if path.is_file()}
        del local["optimizer.pt"]  # training state stays local, as does checkpoint-10/
        local["custom_generate/generate.py"] = (checkpoint / "custom_generate" / "generate.py").read_bytes()
        readme = local.pop("README.md").decode().replace(REPO_ID_PLACEHOLDER, REPO_ID).encode()
        assert uploaded.pop("README.md") == readme
        assert uploaded == local
        assert {"config.json", "model.safetensors", "tokenizer.json", "pipeline_vaswani.py"} <= set(uploaded)

        inputs = tokenizer(SOURCES, padding=True, return_tensors="pt")
        decoder_input_ids = torch.tensor([[model.config.decoder_start_token_id, 5, 6, 7]] * len(SOURCES))
        with torch.no_grad():
            expected_logits = model(**inputs, decoder_input_ids=decoder_input_ids).logits
        expected_ids = model.generate(**inputs, num_beams=1, max_new_tokens=8)
        script = f"""
import json, sys, torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
model = AutoModelForSeq2SeqLM.from_pretrained({REPO_ID!r}, trust_remote_code=True).eval()
assert "vaswani" not in sys.modules, "the shipped model code must not import the vaswani package"
tokenizer = AutoTokenizer.from_pretrained({REPO_ID!r}, trust_remote_code=True)
inputs = tokenizer({SOURCES!r}, padding=True, return_tensors="pt")
with torch.no_grad():
    logits = model(**inputs, decoder_input_ids=torch.tensor({decoder_input_ids.tolist()!r})).logits
generated = model.generate(**inputs, num_beams=1, max_new_tokens=8)
translator = pipeline("translation", model={REPO_ID!r}, trust_remote_code=True, device="cpu")
print(json.dumps({{"input_ids": inputs["input_ids"].tolist(), "logits": logits.tolist(),
                   "generated": generated.tolist(), "model_module": type(model).__module__,
                   "tokenizer_module": type(tokenizer).__module__, "pipeline_module": type(translator).__module__,
                   "generate_module": model.generate.func.__module__}}))
"""
        hub_home = checkpoint.parent / "fresh_hf_home"  # empty cache: every file must come from the stand-in
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(hub_home)}
        env.pop("HF_HUB_OFFLINE", None), env.pop("HF_TOKEN", None)
        completed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert completed.returncode == 0, completed.stderr[-3000:]
        assert hub.unhandled == []

    loaded = json.loads(completed.stdout.strip().splitlines()[-1])
    assert loaded["input_ids"] == inputs["input_ids"].tolist()
    assert torch.equal(torch.tensor(loaded["logits"]), expected_logits)
    assert loaded["generated"] == expected_ids.tolist()
    # All three came from the code files in the repository, not from an installed package.
    assert all(loaded[f"{kind}_module"].startswith("transformers_modules.") for kind in ("model", "tokenizer", "pipeline"))
    assert loaded["generate_module"].endswith(".custom_generate.generate")  # generate() is the repository's


# A push cut off, a directory being written, the same push twice ----------------------------------------------------


def stand_in_env(hub: HubStub, home: Path) -> dict:
    """The environment of a process that pushes to the stand-in: its endpoint, no Xet, an empty cache, no token."""
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(home),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HUB_OFFLINE", None), env.pop("HF_TOKEN", None)
    return env


def uploadable(checkpoint: Path) -> dict[str, bytes]:
    """What the repository must hold after a complete push of `checkpoint` (README.md as the push leaves it)."""
    files = {path.name: path.read_bytes() for path in checkpoint.iterdir() if path.is_file() and path.suffix != ".pt"}
    files["custom_generate/generate.py"] = (checkpoint / "custom_generate" / "generate.py").read_bytes()
    return files


def use_stand_in(monkeypatch, hub: HubStub) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)


def retrained(checkpoint: Path, model_and_tokenizer) -> None:
    """Replace the weights in `checkpoint` by other ones, as a later training run would, with a large file beside
    them so that an upload of the whole does not fit in the sockets' buffers."""
    model, _ = model_and_tokenizer
    state = {name: tensor + 1 for name, tensor in model.state_dict().items()}
    model.save_pretrained(checkpoint, state_dict=state)
    (checkpoint / "test_translations.txt").write_bytes(os.urandom(12 << 20).hex().encode()[: 24 << 20])


def test_a_push_whose_connection_drops_leaves_the_last_revision_and_completes_when_run_again(
        checkpoint, push_cli, monkeypatch, capsys):
    with HubStub(cut_commits=1) as hub:
        use_stand_in(monkeypatch, hub)
        argv = ["--model_dir", str(checkpoint), "--repo_id", REPO_ID, "--token", TOKEN]
        with pytest.raises(SystemExit) as exit_info:
            push_cli(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.count("\n") == 1
        assert hub.incomplete_commits == 1 and hub.commits == [] and hub.files(REPO_ID) == {}
        push_cli(argv)
        assert hub.files(REPO_ID) == uploadable(checkpoint) and len(hub.commits) == 1


@pytest.mark.slow
def test_a_push_killed_mid_upload_leaves_the_last_revision_and_completes_when_run_again(
        checkpoint, model_and_tokenizer, push_cli, monkeypatch, tmp_path):
    with HubStub() as hub:
        use_stand_in(monkeypatch, hub)
        argv = ["--model_dir", str(checkpoint), "--repo_id", REPO_ID, "--token", TOKEN]
        push_cli(argv)
        first = dict(hub.files(REPO_ID))
        retrained(checkpoint, model_and_tokenizer)

        hub.stall_commits = True
        pushing = subprocess.Popen([sys.executable, str(REPO_ROOT / "scripts" / "push_to_hub.py"), *argv],
                                   env=stand_in_env(hub, tmp_path / "home"), stderr=subprocess.PIPE)
        try:
            assert hub.commit_arriving.wait(60), pushing.stderr.read()[-2000:] if pushing.poll() is not None else ""
        finally:
            pushing.kill()  # SIGKILL: no handler runs, the upload stops where it is
            pushing.wait()
        hub.stall_commits = False
        hub.release.set()
        for _ in range(100):  # the stand-in reads what reached it, then finds the body cut short
            if hub.incomplete_commits:
                break
            time.sleep(0.05)
        assert pushing.returncode == -signal.SIGKILL
        assert hub.incomplete_commits == 1 and len(hub.commits) == 1
        assert hub.files(REPO_ID) == first  # the revision before the push, whole

        push_cli(argv)
        assert hub.files(REPO_ID) == uploadable(checkpoint) and len(hub.commits) == 2


def test_pushing_the_same_model_again_uploads_nothing(checkpoint, push_cli, monkeypatch, capsys):
    with HubStub() as hub:
        use_stand_in(monkeypatch, hub)
        argv = ["--model_dir", str(checkpoint), "--repo_id", REPO_ID, "--token", TOKEN]
        push_cli(argv)
        first_url = capsys.readouterr().out.strip()
        uploaded = dict(hub.files(REPO_ID))
        push_cli(argv)
        assert capsys.readouterr().out.strip() == first_url  # the revision the first push made
        assert len(hub.commits) == 1 and hub.files(REPO_ID) == uploaded
        (checkpoint / "metrics.json").write_text('{"test_bleu": 1.0}')
        push_cli(argv)
        assert len(hub.commits) == 2 and hub.commits[-1]["paths"] == ["metrics.json"]  # only what changed


def test_a_directory_another_process_is_writing_is_refused_in_one_line(checkpoint, tmp_path):
    with HubStub() as hub:
        # A training run holds its output directory's lock (`files.exclusive`) until its final model is written; this
        # process holds it here, for the pushing process.
        with exclusive(checkpoint):
            pushed = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "push_to_hub.py"), "--model_dir",
                                     str(checkpoint), "--repo_id", REPO_ID, "--token", TOKEN],
                                    env=stand_in_env(hub, tmp_path / "home"), capture_output=True, text=True,
                                    timeout=120)
        assert pushed.returncode == 2, pushed.stderr[-2000:]
        assert pushed.stderr.count("\n") == 1
        assert pushed.stderr.startswith(f"error: {checkpoint} is being written by another process (process "
                                        f"{os.getpid()})"), pushed.stderr
        assert hub.repos == {} and hub.commits == []


def test_a_push_removes_the_weights_of_the_model_it_replaces(checkpoint, model_and_tokenizer, push_cli, monkeypatch):
    """transformers reads model.safetensors before an index of shards: a sharded model pushed over a single-file one
    must not leave the old file beside it, nor the other way round."""
    model, _ = model_and_tokenizer
    size = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    with HubStub() as hub:
        use_stand_in(monkeypatch, hub)
        argv = ["--model_dir", str(checkpoint), "--repo_id", REPO_ID, "--token", TOKEN]
        push_cli(argv)
        assert "model.safetensors" in hub.files(REPO_ID)
        (checkpoint / "model.safetensors").unlink()
        model.save_pretrained(checkpoint, max_shard_size=size // 2)
        push_cli(argv)
        assert hub.files(REPO_ID) == uploadable(checkpoint)
        assert hub.commits[-1]["deleted"] == ["model.safetensors"]
        for path in checkpoint.glob("model*.safetensors*"):
            path.unlink()
        model.save_pretrained(checkpoint)
        push_cli(argv)
        assert hub.files(REPO_ID) == uploadable(checkpoint)
        assert "model.safetensors.index.json" in hub.commits[-1]["deleted"]


def test_a_training_run_pushes_its_own_model_under_the_lock_it_holds(checkpoint, monkeypatch):
    with HubStub() as hub:
        use_stand_in(monkeypatch, hub)
        with exclusive(checkpoint):  # as run_training holds its output directory's for the whole run
            push_to_hub(checkpoint, REPO_ID, token=TOKEN)
        assert hub.files(REPO_ID) == uploadable(checkpoint)
