"""The one atomic writer (`vaswani.files`): files and directories are replaced whole, staging names are cleaned up,
and a failed or lost publish leaves the entry that was there; an output that is an input, by any name, is refused."""

import os
import sys

import pytest
from conftest import other_names

from vaswani import files
from vaswani.files import (STAGING_PREFIX, check_not_an_input, check_output_file, publish_files, replace_directory,
                           staged_directory, write_atomically)


def entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


def test_write_atomically_replaces_text_or_bytes_and_leaves_no_staging_file(tmp_path):
    path = tmp_path / "state.json"
    write_atomically(path, "first")
    write_atomically(path, b"second \xc3\xa9")
    assert path.read_text(encoding="utf-8") == "second é"
    assert entries(tmp_path) == ["state.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_atomically(path, "old")
    monkeypatch.setattr(files.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, "new")
    assert path.read_text() == "old"
    assert entries(tmp_path) == ["state.json"]


def test_replace_directory_swaps_a_whole_directory(tmp_path):
    target = tmp_path / "entry"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with staged_directory(target, tag="-1") as staging:
        assert staging.name.startswith(STAGING_PREFIX)
        (staging / "new.txt").write_text("new")
        assert entries(target) == ["old.txt"]  # the old entry stays whole until the new one is complete
    assert entries(target) == ["new.txt"]
    assert entries(tmp_path) == ["entry"]  # neither the staging nor the old entry is left


def test_an_error_while_staging_keeps_the_old_directory(tmp_path):
    target = tmp_path / "entry"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_directory(target) as staging:
        (staging / "half.txt").write_text("half")
        raise RuntimeError
    assert entries(target) == ["old.txt"]
    assert entries(tmp_path) == ["entry"]


def test_a_staged_set_of_files_joins_a_directory_that_keeps_its_other_entries(tmp_path):
    """With `last`, the staged files join what the target already holds (tests/test_final_model_publishing.py)."""
    target = tmp_path / "run"
    (target / "checkpoint-2").mkdir(parents=True)
    (target / "config.json").write_text("old")
    with staged_directory(target, last="config.json") as staging:
        assert staging.parent == target.parent and staging.name.startswith(STAGING_PREFIX)
        (staging / "config.json").write_text("new")
        (staging / "model.safetensors").write_text("weights")
        assert (target / "config.json").read_text() == "old"
    assert entries(target) == ["checkpoint-2", "config.json", "model.safetensors"]
    assert (target / "config.json").read_text() == "new"


def test_a_nested_staging_publishes_the_entry_its_writer_names_and_may_keep_a_failure(tmp_path):
    """With `nested`, the writer names its output itself inside the staging directory; with `remove_on_error`
    False, a failed block leaves the staging directory, as a crash would."""
    target = tmp_path / "checkpoint-4"
    with staged_directory(target, nested=True) as staging:
        (staging / "checkpoint-4").mkdir()
        (staging / "checkpoint-4" / "state.json").write_text("{}")
    assert entries(tmp_path) == ["checkpoint-4"] and entries(target) == ["state.json"]
    with pytest.raises(RuntimeError), staged_directory(tmp_path / "checkpoint-6", nested=True,
                                                       remove_on_error=False) as staging:
        raise RuntimeError
    assert entries(tmp_path) == [f"{STAGING_PREFIX}checkpoint-6", "checkpoint-4"]


def test_a_failed_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    """Where entries cannot be swapped in one step, the old one is renamed aside first and put back on a failure."""
    target, staging = tmp_path / "entry", tmp_path / "staged"
    target.mkdir()
    (target / "old.txt").write_text("old")
    staging.mkdir()
    monkeypatch.setattr(files, "exchange", lambda *a: False)
    monkeypatch.setattr(files.os, "rename", lambda *a: (_ for _ in ()).throw(OSError("no space")))
    with pytest.raises(OSError, match="no space"):
        replace_directory(staging, target)
    assert entries(target) == ["old.txt"]


def test_an_entry_another_process_published_meanwhile_stands(tmp_path, monkeypatch):
    target, staging = tmp_path / "entry", tmp_path / "staged"
    staging.mkdir()
    (staging / "ours.txt").write_text("ours")
    rename = os.rename

    def theirs_first(source, destination):
        os.mkdir(destination)
        (destination / "theirs.txt").write_text("theirs")
        rename(source, destination)  # onto a non-empty directory: refused

    monkeypatch.setattr(files.os, "rename", theirs_first)
    assert replace_directory(staging, target) is False
    assert entries(target) == ["theirs.txt"]
    assert entries(tmp_path) == ["entry"]


def test_publish_files_moves_the_marker_last_and_keeps_other_entries(tmp_path, monkeypatch):
    directory, staging = tmp_path / "run", tmp_path / "run" / ".tmp-final"
    (directory / "checkpoint-2").mkdir(parents=True)
    (directory / "config.json").write_text("old config")
    (directory / "extra").mkdir()
    (directory / "extra" / "old.py").write_text("old")
    staging.mkdir()
    for name in ("config.json", "model.safetensors", "a.json"):
        (staging / name).write_text(f"new {name}")
    (staging / "extra").mkdir()
    (staging / "extra" / "new.py").write_text("new")
    moved, replace = [], os.replace
    monkeypatch.setattr(files.os, "replace", lambda source, target: (moved.append(os.path.basename(target)),
                                                                     replace(source, target)))
    publish_files(staging, directory, last="config.json")
    assert [name for name in moved if not name.startswith(STAGING_PREFIX)][-1] == "config.json"
    assert entries(directory) == ["a.json", "checkpoint-2", "config.json", "extra", "model.safetensors"]
    assert (directory / "config.json").read_text() == "new config.json"
    assert entries(directory / "extra") == ["new.py"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fsynced descriptor through /proc")
def test_publish_files_syncs_every_file_once(tmp_path, monkeypatch):
    """Each published file's data reaches the disk before its rename, and only once (subdirectories included)."""
    directory, staging = tmp_path / "run", tmp_path / "run" / ".tmp-final"
    (staging / "extra").mkdir(parents=True)
    for path in (staging / "config.json", staging / "model.safetensors", staging / "extra" / "new.py"):
        path.write_text("new")
    synced, fsync = [], os.fsync

    def record(descriptor):
        path = os.readlink(f"/proc/self/fd/{descriptor}")
        if not os.path.isdir(path):
            synced.append(os.path.relpath(path, staging))
        fsync(descriptor)

    monkeypatch.setattr(files.os, "fsync", record)
    publish_files(staging, directory, last="config.json")
    synced_files = sorted(synced)
    assert synced_files == ["config.json", "extra/new.py", "model.safetensors"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_on_linux_a_directory_is_replaced_in_one_step(tmp_path, monkeypatch):
    """The old entry and the new one are swapped by one renameat2: the target never goes missing, nothing is renamed
    aside, and the old entry is removed afterwards."""
    target, staging = tmp_path / "entry", tmp_path / "staged"
    target.mkdir()
    (target / "old.txt").write_text("old")
    staging.mkdir()
    (staging / "new.txt").write_text("new")
    if not files.exchange(staging, target):
        pytest.skip("this filesystem cannot swap entries")
    files.exchange(staging, target)  # swapped back: the test's own probe is undone
    renamed = []
    monkeypatch.setattr(files.os, "rename", lambda *a: renamed.append(a))
    monkeypatch.setattr(files.os, "replace", lambda *a: renamed.append(a))
    assert replace_directory(staging, target) is True
    assert renamed == []
    assert entries(target) == ["new.txt"]
    assert entries(tmp_path) == ["entry"]
    with pytest.raises(FileNotFoundError):
        files.exchange(tmp_path / "missing", target)


# Outputs --------------------------------------------------------------------------------------------------------------


def test_an_output_that_is_an_input_by_any_name_is_refused(tmp_path):
    source = tmp_path / "in.en"
    source.write_text("keep me\n")
    for kind, name in other_names(source, tmp_path).items():
        with pytest.raises(ValueError, match=f"{name} is the input {source}"):
            check_output_file(name, [None, source])
        assert source.read_text() == "keep me\n", kind
    check_output_file(tmp_path / "out.fr", [source, "some/hub-model"])  # another file, and inputs not on disk


def test_a_device_or_fifo_output_is_refused_where_a_file_would_be_renamed_over_it(tmp_path):
    """A report written atomically (`evaluate_bleu.py --output_file`) would replace /dev/null itself, as root; a
    translation writes such an output as a stream (`streams=True`)."""
    (tmp_path / "null").symlink_to(os.devnull)
    os.mkfifo(tmp_path / "fifo")
    for output, kind in ((os.devnull, "a character device"), (tmp_path / "null", "a character device"),
                         (tmp_path / "fifo", "a FIFO")):
        with pytest.raises(ValueError, match=f"{output} is {kind}, not a file"):
            check_output_file(output)
        check_output_file(output, streams=True)


def test_a_directory_that_is_or_holds_an_input_is_refused(tmp_path):
    model = tmp_path / "run" / "model"
    model.mkdir(parents=True)
    for kind, name in other_names(model, tmp_path).items():
        with pytest.raises(ValueError, match="is the input"):
            check_not_an_input(name, [model])
    with pytest.raises(ValueError, match=f"{tmp_path / 'run'} holds the input {model}"):
        check_not_an_input(tmp_path / "run", [model])
    check_not_an_input(model / "export", [model])  # inside the input: the input is not replaced


def test_an_output_file_that_cannot_be_a_file_is_refused_naming_it(tmp_path):
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError, match=f"{tmp_path / 'dir'} is a directory"):
        check_output_file(tmp_path / "dir")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        check_output_file(f"{tmp_path / 'new'}{os.sep}")
    with pytest.raises(FileNotFoundError, match=f"Cannot write {tmp_path / 'nowhere' / 'out.fr'}: the directory"):
        check_output_file(tmp_path / "nowhere" / "out.fr")
    assert entries(tmp_path) == ["dir"]


def test_a_write_that_cannot_start_names_the_file_asked_for(tmp_path):
    target = tmp_path / "nowhere" / "out.fr.resume.json"
    with pytest.raises(FileNotFoundError) as error:
        write_atomically(target, "state")
    assert error.value.filename == str(target) and STAGING_PREFIX not in str(error.value)
