"""Which engine the scripts decode with (`vaswani.engine_choice`, scripts/choose_engine.py): the same command on one
machine writes the same file, whatever ran before it; the choice is made once, by an explicit step, written beside
the weights and read on the machine and settings it was made for; elsewhere a fixed rule decides and says so."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import greedy_checkpoint, interrupted_after, script_main
from tiny_translation_model import SOURCES

import vaswani.engine_choice as engine_choice
import vaswani.export
import vaswani.generation_vaswani
import vaswani.machine
from vaswani.engine_choice import CHOICE_FILE, choose_engine, load_default_engine
from vaswani.inference import PackedLinear, cpu_packs_linear_weights

# More sentences than a run once needed to time the engines on itself (128).
SENTENCES = [f"{SOURCES[i % len(SOURCES)]} {i}" for i in range(160)]


def timed_as(monkeypatch, seconds: dict[str, float]) -> list[str]:
    """Make each engine's timing (`engine_choice.time_engine`, whose real figures depend on the CPU and its load)
    give `seconds`; returns the engines asked for, in order."""
    asked = []

    def time_engine(model_dir, engine, threads, decoding, sentences_file, batches, export_dir=None):
        asked.append(engine)
        names = ["ctranslate2"] if engine == "ctranslate2" else ["pytorch", "pytorch-unpacked"]
        return {name: seconds[name] for name in names if name in seconds}

    monkeypatch.setattr(engine_choice, "time_engine", time_engine)
    return asked


def chosen(path, **options) -> tuple[str, str]:
    """The engine the scripts build for the checkpoint in `path` on the CPU: its kind and the choice's reason."""
    engine = load_default_engine(str(path), device="cpu", **options)
    packed = any(isinstance(module, PackedLinear) for module in getattr(engine, "model", torch.nn.Module()).modules())
    kind = engine.settings["engine"] + ("" if engine.settings["engine"] == "ctranslate2" or packed
                                        or not cpu_packs_linear_weights() else "-unpacked")
    return kind, engine.choice["reason"]


def test_the_same_command_writes_the_same_file_twice_from_a_copy_and_after_the_engines_are_timed(checkpoint, tmp_path,
                                                                                                  capsys):
    """translate.py with an output file, on one machine: run twice, on a copy of the checkpoint (new modification
    times), and after scripts/choose_engine.py timed the engines (for real, each in a process of its own: the one
    part of this test over a few seconds), the file is the same byte for byte between runs of one command, and the
    engine the same. A translation itself times nothing and writes nothing beside the model."""
    path = greedy_checkpoint(checkpoint, tmp_path / "model")
    lines = tmp_path / "in.en"
    lines.write_text("".join(f"{sentence}\n" for sentence in SENTENCES), encoding="utf-8")

    def command(model: Path, output: str) -> tuple[bytes, str, str]:
        """The output file's bytes, the engine (its line up to the device) and the choice (the line's end)."""
        script_main("translate")(["--model", str(model), "--device", "cpu", "--input_file", str(lines),
                                  "--output_file", str(tmp_path / output)])
        engine = [line for line in capsys.readouterr().err.splitlines() if line.startswith("engine: ")]
        assert len(engine) == 1, engine
        kind, _, choice = engine[0].replace(str(model), "MODEL").partition("; chosen: ")
        return (tmp_path / output).read_bytes(), kind.partition(" on cpu")[0], choice

    files = sorted(item.name for item in path.iterdir())
    first, again = command(path, "1.fr"), command(path, "2.fr")
    shutil.copytree(path, tmp_path / "copy", copy_function=shutil.copy)  # new modification times
    copied = command(tmp_path / "copy", "3.fr")
    assert first == again == copied and first[0].count(b"\n") == len(SENTENCES)
    assert first[2].startswith("pytorch by the fixed rule: no choice for this machine")
    assert sorted(item.name for item in path.iterdir()) == files  # nothing timed, nothing recorded

    script_main("choose_engine")(["--model", str(path), "--input_file", str(lines)])
    assert capsys.readouterr().out.startswith("engine: ")
    records = json.loads((path / CHOICE_FILE).read_text())["records"]
    assert len(records) == 1 and records[0]["machine"] == vaswani.machine.machine(torch.get_num_threads())
    engines = {"pytorch", "pytorch-unpacked"} if cpu_packs_linear_weights() else {"pytorch"}
    assert set(records[0]["seconds"]) == engines | {"ctranslate2"}  # greedy: CTranslate2 follows it
    assert records[0]["engine"] == min(records[0]["seconds"], key=records[0]["seconds"].get)
    assert records[0]["sample"].startswith(f"{len(SENTENCES)} sentences, batches of 4,096 tokens")

    timed, timed_again = command(path, "4.fr"), command(path, "5.fr")
    shutil.copytree(path, tmp_path / "copy-timed", copy_function=shutil.copy)
    timed_copy = command(tmp_path / "copy-timed", "6.fr")
    assert timed == timed_again == timed_copy
    assert timed[2].startswith(f"{records[0]['engine']} by the record for this machine in MODEL/{CHOICE_FILE} (")


def test_a_recorded_choice_holds_for_its_machine_thread_count_and_decoding_settings_only(checkpoint, tmp_path,
                                                                                          monkeypatch):
    pytest.importorskip("ctranslate2")
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    timed_as(monkeypatch, {"pytorch": 2.0, "pytorch-unpacked": 1.0, "ctranslate2": 3.0})
    choice = choose_engine(str(path), SENTENCES, max_tokens=4096)
    fastest = "pytorch-unpacked" if cpu_packs_linear_weights() else "pytorch"
    assert choice.engine == fastest and chosen(path)[0] == fastest
    assert chosen(path, num_beams=1)[0] == fastest  # the checkpoint's own setting, given: the same settings
    kind, reason = chosen(path, max_new_tokens=5)
    assert kind == "pytorch" and reason.startswith("the fixed rule: no choice for this machine and these settings")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert chosen(path)[1].startswith("the fixed rule")
    finally:
        torch.set_num_threads(threads)
    with monkeypatch.context() as elsewhere:
        elsewhere.setattr(vaswani.machine, "cpu_name", lambda: "Another CPU")
        assert chosen(path)[1].startswith("the fixed rule")
    # A CPU rehearsing CUDA decides as a GPU does; PyTorch-only options decide for PyTorch.
    with monkeypatch.context() as rehearsing:
        rehearsing.setattr(vaswani.generation_vaswani, "rehearsing_cuda", True)
        assert chosen(path)[1] == "the fixed rule: on cpu, the PyTorch engine"
    assert chosen(path, slots=0) == ("pytorch", "--slots, the PyTorch engine's")
    # Timed again: this machine's record replaced, another machine's kept.
    with monkeypatch.context() as elsewhere:
        elsewhere.setattr(vaswani.machine, "cpu_name", lambda: "Another CPU")
        choose_engine(str(path), SENTENCES, max_tokens=4096)
    timed_as(monkeypatch, {"pytorch": 1.0, "pytorch-unpacked": 2.0, "ctranslate2": 0.5})
    choose_engine(str(path), SENTENCES, max_tokens=4096)
    records = json.loads((path / CHOICE_FILE).read_text())["records"]
    assert [record["engine"] for record in records] == [fastest, "ctranslate2"]
    assert chosen(path)[0] == "ctranslate2"


def test_ctranslate2_is_timed_only_where_it_gives_the_checkpoints_translations(checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("ctranslate2")
    asked = timed_as(monkeypatch, {"pytorch": 2.0, "pytorch-unpacked": 3.0, "ctranslate2": 1.0})
    beams = greedy_checkpoint(checkpoint, tmp_path / "beams", num_beams=3)  # transformers' early_stopping=False
    assert choose_engine(str(beams), SENTENCES, max_tokens=4096).engine == "pytorch" and asked == ["pytorch"]
    assert choose_engine(str(beams), SENTENCES, max_tokens=4096, early_stopping=True).engine == "ctranslate2"
    assert asked == ["pytorch", "pytorch", "ctranslate2"]
    assert chosen(beams)[0] == "pytorch" and chosen(beams, early_stopping=True)[0] == "ctranslate2"


def test_no_ctranslate2_never_exports_or_times(checkpoint, tmp_path, monkeypatch):
    """`--no-ctranslate2` takes the PyTorch engine: with a record, the faster of its layouts there; nothing is timed
    or exported, whatever the record says of CTranslate2."""
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    timed_as(monkeypatch, {"pytorch": 3.0, "pytorch-unpacked": 2.0, "ctranslate2": 1.0})
    monkeypatch.setattr(engine_choice, "cached_export", lambda *args: ("export", False))  # not timed: not needed
    choose_engine(str(path), SENTENCES, max_tokens=4096)

    def forbidden(*args, **kwargs):
        raise AssertionError("--no-ctranslate2 exported or timed an engine")

    for name in ("cached_export", "time_engine"):
        monkeypatch.setattr(engine_choice, name, forbidden)
    monkeypatch.setattr(engine_choice.subprocess, "run", forbidden)
    kind, reason = chosen(path, ctranslate2=False)
    assert kind == ("pytorch-unpacked" if cpu_packs_linear_weights() else "pytorch")
    assert reason.startswith("--no-ctranslate2 and the faster layout in the record for this machine")
    (path / CHOICE_FILE).unlink()
    assert chosen(path, ctranslate2=False) == ("pytorch", "--no-ctranslate2")
    assert not Path(vaswani.export.export_path(str(path))).exists()


def test_a_resumed_translation_decodes_with_the_choice_it_began_with_though_another_is_recorded_since(
        checkpoint, tmp_path, capsys, monkeypatch):
    """A choice recorded between a run's kill and its resume would change its engine; the resume keeps its record's
    choice, which gives the lines already written, rather than be refused. An engine chosen by flag stays the
    user's, refused where it differs from the record."""
    pytest.importorskip("ctranslate2")
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    lines = tmp_path / "in.txt"
    lines.write_text("".join(f"{source}\n" for source in SOURCES * 3), encoding="utf-8")
    output = tmp_path / "out.fr"
    argv = ["--model", str(path), "--device", "cpu", "--input_file", str(lines), "--output_file", str(output),
            "--chunk_lines", "4", "--resume"]
    with monkeypatch.context() as patch:  # stopped after its first chunk, as a kill would stop it
        interrupted_after(1, patch)
        with pytest.raises((KeyboardInterrupt, SystemExit)):
            script_main("translate")(argv)
    began = json.loads((tmp_path / "out.fr.resume.json").read_text())["settings"]["engine_choice"]
    assert began["engine"] == "pytorch" and began["reason"].startswith("the fixed rule")
    timed_as(monkeypatch, {"pytorch": 2.0, "pytorch-unpacked": 3.0, "ctranslate2": 1.0})
    choose_engine(str(path), SOURCES, max_tokens=4096)
    assert chosen(path)[0] == "ctranslate2"
    capsys.readouterr()
    script_main("translate")(argv)
    engines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("engine: ")]
    assert len(engines) == 1 and engines[0].startswith("engine: PyTorch") and "the fixed rule" in engines[0]
    assert output.read_text(encoding="utf-8").count("\n") == len(SOURCES) * 3
    with pytest.raises(SystemExit):
        script_main("translate")([*argv, "--ctranslate2"])
    assert "was started with other settings (" in capsys.readouterr().err


def test_the_choice_step_wants_a_local_checkpoint_and_sentences(checkpoint, tmp_path, capsys):
    main = script_main("choose_engine")
    empty = tmp_path / "empty.en"
    empty.write_text("\n")
    for argv, message in ((["--model", "someone/model", "--input_file", str(empty)], "not a local checkpoint"),
                          (["--model", str(checkpoint), "--input_file", str(empty)], "no sentences to time")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_an_engine_that_cannot_be_timed_is_an_error_naming_it(checkpoint, tmp_path):
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    (tmp_path / "sentences.json").write_text(json.dumps(SOURCES))
    with pytest.raises(RuntimeError, match="Timing the ctranslate2 engine on .* failed .*: ValueError: .*holds no "
                       "CTranslate2 export"):
        engine_choice.time_engine(str(path), "ctranslate2", 1, {}, str(tmp_path / "sentences.json"),
                                  {"max_tokens": 4096}, str(tmp_path / "no-export"))


def test_a_sample_spreads_over_the_lengths_of_the_sentences():
    sentences = [word * length for length in range(1, 1001) for word in ("a",)] + ["", "  "]
    sample = engine_choice.choice_sample(sentences, count=10)
    assert len(sample) == len(set(sample)) == 10 and [len(s) for s in sample] == [51 + 100 * i for i in range(10)]
    assert engine_choice.choice_sample(sentences[:5], count=10) == sentences[:5]


def test_a_machine_names_the_cpus_generation_where_its_name_is_only_the_vendors_line(tmp_path, monkeypatch):
    """Under a hypervisor two AMD generations can both be "AMD EPYC"; their family numbers tell them apart, so a
    choice made on one is not the other's."""
    def cpuinfo(family):
        path = tmp_path / f"cpuinfo-{family}"
        block = f"processor\t: {{}}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: 2\n" \
                "model name\t: AMD EPYC\nflags\t\t: fpu avx2\n\n"
        path.write_text(block.format(0) + block.format(1).replace(f": {family}", ": 99"))
        return str(path)

    zen4, zen5 = cpuinfo(25), cpuinfo(26)
    assert vaswani.machine.cpu_name(zen4) == "AMD EPYC (family 25, model 2)"  # the first processor's block
    assert vaswani.machine.cpu_name(zen5) == "AMD EPYC (family 26, model 2)"
    (tmp_path / "no-numbers").write_text("model name\t: Some CPU\n")
    assert vaswani.machine.cpu_name(str(tmp_path / "no-numbers")) == "Some CPU"
    keys, real = [], vaswani.machine.cpu_name
    for path in (zen4, zen5):
        with monkeypatch.context() as patched:
            patched.setattr(vaswani.machine, "cpu_name", lambda path=path: real(path))
            keys.append(vaswani.machine.machine(2))
    assert keys[0]["cpu"] != keys[1]["cpu"] and {**keys[0], "cpu": None} == {**keys[1], "cpu": None}


def test_the_timing_processes_are_started_as_the_package_runs(checkpoint, tmp_path, monkeypatch):
    """Each engine is timed by `python -m vaswani.engine_choice` (a process of its own), on the sample and batches
    given."""
    pytest.importorskip("ctranslate2")
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    spawned = []

    def run(command, **options):
        spawned.append(command)
        sentences = json.loads(Path(command[command.index("--sentences") + 1]).read_text())
        assert sentences == engine_choice.choice_sample(SENTENCES)
        engine = command[command.index("--engine") + 1]
        return subprocess.CompletedProcess(command, 0, json.dumps({"seconds": {engine: 1.0}}), "")

    monkeypatch.setattr(engine_choice.subprocess, "run", run)
    monkeypatch.setattr(engine_choice, "cached_export", lambda *args: (str(tmp_path / "export"), True))
    choose_engine(str(path), SENTENCES, max_tokens=512, max_sentences=8)
    assert [command[:3] for command in spawned] == [[engine_choice.sys.executable, "-m", "vaswani.engine_choice"]] * 2
    assert [json.loads(command[command.index("--batches") + 1]) for command in spawned] == \
        [{"max_tokens": 512, "max_sentences": 8}] * 2
