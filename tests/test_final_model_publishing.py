"""The final model published into a run directory (`vaswani.files.staged_directory` with `last`, as
`run_directory.save_final` calls it): the staged model gets the directory's checkpoints, logs and other files as hard
links and replaces the directory whole, so a failure or a kill at any point leaves the old final model whole or the
new one, never a mix of the two."""

import os
import signal
import time

import pytest
from conftest import Forked, snapshot

from vaswani import files
from vaswani.files import STAGING_PREFIX, staged_directory

NEW = {"config.json": "new config", "model.safetensors": "new weights", "custom_generate/generate.py": "new code"}


def run_directory(root):
    """A run directory that holds an old final model, a checkpoint, logs, a user's note and a crash's remains."""
    run = root / "run"
    for name, text in {"config.json": "old config", "model.safetensors": "old weights",
                       "custom_generate/generate.py": "old code", "custom_generate/old_only.py": "old only",
                       "checkpoint-2/trainer_state.json": "{}", "checkpoint-2/model.safetensors": "checkpoint",
                       "runs/events.out": "log", "notes.txt": "mine", f"{STAGING_PREFIX}checkpoint-3/x": "remains",
                       }.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    (run / "latest").symlink_to("checkpoint-2")
    return run


def publish(run):
    with staged_directory(run, last="config.json") as staging:
        for name, text in NEW.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_text(text)
        assert (run / "config.json").read_text() == "old config"  # nothing changes while the model is written


def test_the_final_model_replaces_the_run_directory_whole_with_its_other_entries_linked(tmp_path):
    run = run_directory(tmp_path)
    checkpoint_inode = (run / "checkpoint-2" / "model.safetensors").stat().st_ino
    os.chmod(run, 0o750)
    publish(run)
    after = snapshot(run)
    assert {name: after[name].decode() for name in NEW} == NEW
    assert after["checkpoint-2/model.safetensors"] == b"checkpoint" and after["notes.txt"] == b"mine"
    assert after["runs/events.out"] == b"log" and os.readlink(run / "latest") == "checkpoint-2"
    # Carried over as links, not copies: a checkpoint of many gigabytes costs no space and no time.
    assert (run / "checkpoint-2" / "model.safetensors").stat().st_ino == checkpoint_inode
    assert not any(name.startswith(STAGING_PREFIX) for name in after)  # a crash's remains are left behind
    assert "custom_generate/old_only.py" not in after  # the model's own directories are its new ones whole
    assert os.stat(run).st_mode & 0o777 == 0o750
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no staging directory left


def failing(name, original=None, after: int = 0):
    """A stand-in for the function `name` that runs `original` `after` times, then fails (as a kill would stop it)."""
    calls = []

    def call(*args, **kwargs):
        calls.append(args)
        if len(calls) > after:
            raise RuntimeError(f"failure injected in {name}")
        return original(*args, **kwargs)
    return call


@pytest.mark.parametrize("where", ["writing", "linking", "copying a directory", "syncing", "moving a file in",
                                   "swapping"])
def test_a_failure_anywhere_in_publishing_leaves_the_old_final_model_whole(tmp_path, monkeypatch, where):
    run = run_directory(tmp_path)
    before = snapshot(run)
    if where == "writing":
        monkeypatch.setitem(NEW, "model.safetensors", None)  # write_text(None): a TypeError in the writer's block
    elif where == "linking":
        monkeypatch.setattr(files.os, "link", failing("link", os.link, after=2))
    elif where == "copying a directory":
        monkeypatch.setattr(files.shutil, "copytree", failing("copytree"))
    elif where == "moving a file in":  # where the files were moved in one by one, a mix of old and new followed
        monkeypatch.setattr(files.os, "replace", failing("replace", os.replace, after=1))
    elif where == "syncing":
        monkeypatch.setattr(files, "sync_tree", failing("sync_tree"))
    else:
        monkeypatch.setattr(files, "exchange", failing("exchange"))
    if where == "moving a file in":
        publish(run)  # a directory replaced whole moves no file in, so none can fail half-way
        assert {name: (run / name).read_text() for name in NEW} == NEW
        return
    with pytest.raises((RuntimeError, TypeError)):
        publish(run)
    assert snapshot(run) == before
    assert sorted(os.listdir(tmp_path)) == ["run"]
    monkeypatch.undo()
    publish(run)  # and the next publish succeeds
    assert (run / "config.json").read_text() == "new config"


def test_a_kill_while_publishing_leaves_the_old_final_model_whole(tmp_path, tmp_path_factory):
    """SIGKILL of a real process in the middle of publishing (while the checkpoints are being linked): the run
    directory holds the old final model whole; the staging directory left beside it is removed by the next publish."""
    run = run_directory(tmp_path)
    before = snapshot(run)
    linking, link, calls = tmp_path_factory.mktemp("marker") / "linking", os.link, []  # tmp_path's entries are checked

    def slow_link(*args, **kwargs):
        calls.append(args)
        link(*args, **kwargs)
        if len(calls) == 2:
            linking.touch()
            time.sleep(60)

    def publish_slowly():
        files.os.link = slow_link
        publish(run)

    process = Forked(publish_slowly)  # a process of its own, forked from this one
    try:
        deadline = time.monotonic() + 60
        while not linking.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert snapshot(run) == before
    assert any(name.startswith(STAGING_PREFIX) for name in os.listdir(tmp_path))  # the crash's staging directory
    publish(run)
    assert (run / "config.json").read_text() == "new config" and sorted(os.listdir(tmp_path)) == ["run"]


@pytest.mark.parametrize("why", ["no hard links", "a mount point", "the working directory"])
def test_a_run_directory_that_cannot_be_replaced_whole_gets_the_files_one_by_one(tmp_path, monkeypatch, why):
    """Where the directory cannot be replaced (a mount point, the process' working directory) or its filesystem
    makes no hard links, the staged files move in one by one, `config.json` last, beside the other entries."""
    run = run_directory(tmp_path)
    if why == "no hard links":
        monkeypatch.setattr(files.os, "link", lambda *a, **k: (_ for _ in ()).throw(PermissionError(1, "no links")))
    elif why == "a mount point":
        monkeypatch.setattr(files.os.path, "ismount", lambda path: os.fspath(path) == os.fspath(run))
    else:
        monkeypatch.chdir(run)
    moved, replace = [], os.replace
    monkeypatch.setattr(files.os, "replace", lambda source, target: (moved.append(os.path.basename(target)),
                                                                     replace(source, target)))
    publish(run)
    assert [name for name in moved if not name.startswith(STAGING_PREFIX)][-1] == "config.json"
    after = snapshot(run)
    assert {name: after[name].decode() for name in NEW} == NEW
    assert after["checkpoint-2/model.safetensors"] == b"checkpoint" and after["notes.txt"] == b"mine"
    assert not any(name.startswith(f"{STAGING_PREFIX}staged") for name in after)
    assert sorted(os.listdir(tmp_path)) == ["run"]
