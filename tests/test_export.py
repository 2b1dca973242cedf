"""The CTranslate2 exporter (`vaswani.export`, `scripts/export_ctranslate2.py`): the exported model must score and
translate exactly like the PyTorch model, for every architecture variant CTranslate2 can express."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig
from conftest import fails_with_one_line, interrupted_after, other_names, script_main, snapshot
from tiny_translation_model import SOURCES, TARGETS, build_tokenizer

from vaswani import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani.evaluation import translate
import vaswani.engine_timing
import vaswani.export
import vaswani.generation_vaswani
from vaswani.export import (TIMINGS_SUFFIX, cached_export, export_path, export_source,
                            export_to_ctranslate2, load_default_engine)
from vaswani.inference import PackedLinear, cpu_packs_linear_weights
from vaswani.loading import load_engine
from vaswani.translation import translate as translate_with

ctranslate2 = pytest.importorskip("ctranslate2")


def tokens(tokenizer, texts, target=False):
    """What a CTranslate2 user passes: the tokenizer's tokens, the source with its </s>; a target without it (the
    translator appends </s> when scoring)."""
    if target:
        return [tokenizer.convert_ids_to_tokens(tokenizer(text_target=t)["input_ids"])[:-1] for t in texts]
    return [tokenizer.convert_ids_to_tokens(tokenizer(s)["input_ids"]) for s in texts]


def torch_log_probs(model, tokenizer, sources, targets) -> list[torch.Tensor]:
    """Each target token's log-probability under teacher forcing, </s> included."""
    batch = tokenizer(sources, text_target=targets, return_tensors="pt", padding=True)
    with torch.inference_mode():
        log_probs = model(**batch).logits.float().log_softmax(-1)
    labels = batch["labels"]
    picked = log_probs.gather(-1, labels[..., None])[..., 0]
    return [row[label != tokenizer.pad_token_id] for row, label in zip(picked, labels)]


VARIANTS = {
    "paper": {},
    "pre-norm": {"norm_first": True},
    "rmsnorm-swiglu-no-bias": {"norm_first": True, "norm_type": "rmsnorm", "ffn_activation": "swiglu", "bias": False},
    "gelu-learned-positions": {"ffn_activation": "gelu", "position_embedding_type": "learned"},
    "geglu-mqa-unscaled": {"ffn_activation": "geglu", "num_key_value_heads": 1, "scale_embedding": False},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_exported_model_scores_every_token_like_pytorch(variant, tmp_path):
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=len(tokenizer), **VARIANTS[variant])).eval()
    translator = ctranslate2.Translator(export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer))

    scored = translator.score_batch(tokens(tokenizer, SOURCES), tokens(tokenizer, TARGETS, target=True))

    for expected, result in zip(torch_log_probs(model, tokenizer, SOURCES, TARGETS), scored):
        assert len(result.log_probs) == len(expected)
        torch.testing.assert_close(torch.tensor(result.log_probs), expected, atol=1e-4, rtol=1e-4)


def test_exported_model_translates_like_generate(trained, tmp_path):
    """Greedy decoding gives the same translations, </s> included. Beam search is compared through its scores
    (`test_exported_model_scores_every_token_like_pytorch`), not its outputs: the two libraries end a search by
    different rules (CTranslate2 once `beam_size` hypotheses have finished; transformers, with its default
    early_stopping=False, once no running beam can beat the finished ones), so either may return a hypothesis the
    other never finished. Seen on this toy model: "un chien a cou" against "un chien a couru"."""
    model, tokenizer = trained
    translator = ctranslate2.Translator(export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer))
    batch = tokenizer(SOURCES, return_tensors="pt", padding=True)
    with torch.inference_mode():
        expected = tokenizer.batch_decode(model.generate(**batch, num_beams=1, max_new_tokens=16),
                                          skip_special_tokens=True)

    results = translator.translate_batch(tokens(tokenizer, SOURCES), beam_size=1, max_decoding_length=16)

    hypotheses = [tokenizer.convert_tokens_to_string(r.hypotheses[0]) for r in results]
    assert hypotheses == expected
    assert len(set(hypotheses)) > 1  # the model's translations depend on the input


def test_int8_export_from_a_checkpoint_directory(trained, checkpoint, tmp_path):
    model, tokenizer = trained
    output = export_to_ctranslate2(checkpoint, tmp_path / "ct2", quantization="int8")

    fp32_bytes = sum(p.numel() * 4 for p in model.parameters() if p is not model.lm_head.weight)
    assert (Path(output) / "model.bin").stat().st_size < 0.6 * fp32_bytes  # int8 matrices, fp32 norms and biases
    translator = ctranslate2.Translator(output, compute_type="int8")
    # Greedy on both sides: CTranslate2's default is beam_size=2, whose outputs differ from greedy search's even in fp32.
    results = translator.translate_batch(tokens(tokenizer, SOURCES), max_decoding_length=16, beam_size=1)
    with torch.inference_mode():
        fp32 = model.generate(**tokenizer(SOURCES, return_tensors="pt", padding=True), max_new_tokens=16, num_beams=1)
    expected = tokenizer.batch_decode(fp32, skip_special_tokens=True)
    agree = sum(tokenizer.convert_tokens_to_string(r.hypotheses[0]) == e for r, e in zip(results, expected))
    assert agree >= 4  # int8 rounding may flip a near-tie in one of five sentences


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"position_embedding_type": "rope"}, "no rotary positions"),
        ({"num_attention_heads": 4, "num_key_value_heads": 2}, "2 key/value heads for 4 query heads"),
    ],
)
def test_refuses_what_ctranslate2_cannot_express(tmp_path, overrides, message):
    tokenizer = build_tokenizer()
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=len(tokenizer), **overrides))
    with pytest.raises(ValueError, match=message):
        export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    assert not (tmp_path / "ct2").exists()


def test_refuses_a_tokenizer_of_another_size(tmp_path):
    tokenizer = build_tokenizer()
    model = VaswaniForConditionalGeneration(VaswaniConfig.tiny(vocab_size=len(tokenizer) + 5))
    with pytest.raises(ValueError, match="export the tokenizer the model was trained with"):
        export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)


def test_export_script(checkpoint, tmp_path, capsys):
    export = script_main("export_ctranslate2")

    export(["--model", str(checkpoint), "--output_dir", str(tmp_path / "ct2"),
                 "--quantization", "int8"])

    assert (tmp_path / "ct2" / "model.bin").is_file() and (tmp_path / "ct2" / "shared_vocabulary.json").is_file()
    assert str(tmp_path / "ct2") in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # an existing directory is a user error without --force
        export(["--model", str(checkpoint), "--output_dir", str(tmp_path / "ct2")])
    assert exit_info.value.code == 2


def test_the_exported_directory_translates_like_evaluation_translate(trained, tmp_path):
    model, tokenizer = trained
    export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    engine = load_engine(str(tmp_path / "ct2"))  # the tokenizer travels with the export, found by its model.bin
    assert engine.settings["engine"] == "ctranslate2"

    # Greedy, where the two libraries' outputs are equal (beam search may stop differently: see above).
    got = translate_with(engine, SOURCES, max_sentences=2, warn=False).texts

    assert got == translate(model, tokenizer, SOURCES, batch_size=2, num_beams=1)


def test_evaluate_bleu_script_with_ctranslate2(trained, checkpoint, tmp_path, capsys):
    model, tokenizer = trained
    export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    (tmp_path / "src.en").write_text("\n".join(SOURCES) + "\n")
    (tmp_path / "ref.fr").write_text("\n".join(TARGETS) + "\n")
    files = ["--source_file", str(tmp_path / "src.en"), "--reference_file", str(tmp_path / "ref.fr"), "--device", "cpu",
             "--num_beams", "1"]  # greedy: equal outputs, hence equal scores (beam search may stop differently)
    evaluate = script_main("evaluate_bleu")

    evaluate(["--model", str(checkpoint), "--no-ctranslate2", *files])
    pytorch = json.loads(capsys.readouterr().out)
    evaluate(["--model", str(tmp_path / "ct2"), "--ctranslate2", *files])
    exported = json.loads(capsys.readouterr().out)

    assert exported["engine"] == "ctranslate2 float32" and pytorch["engine"] == "pytorch float32"
    assert exported["bleu"] == pytorch["bleu"] and exported["chrf"] == pytorch["chrf"]
    evaluate(["--model", str(checkpoint), "--ctranslate2", *files])  # a checkpoint: through its cached export
    cached = json.loads(capsys.readouterr().out)
    assert cached["engine"] == "ctranslate2 float32" and cached["bleu"] == pytorch["bleu"]


def greedy_checkpoint(checkpoint, path, **generation):
    """A copy of `checkpoint` whose generation config decodes greedily (or as `generation` says)."""
    shutil.copytree(checkpoint, path)
    model = VaswaniForConditionalGeneration.from_pretrained(path)
    model.generation_config.num_beams, model.generation_config.length_penalty = 1, None
    for name, value in generation.items():
        setattr(model.generation_config, name, value)
    model.generation_config.save_pretrained(path)
    return path


FASTEST = {"ctranslate2": {"pytorch": 2.0, "pytorch-unpacked": 3.0, "ctranslate2": 1.0},
           "pytorch": {"pytorch": 1.0, "pytorch-unpacked": 3.0, "ctranslate2": 2.0},
           "pytorch-unpacked": {"pytorch": 2.0, "pytorch-unpacked": 1.0, "ctranslate2": 3.0}}


def timed_faster(monkeypatch, engine: str) -> list:
    """Make `engine` the one timed fastest on this machine (`vaswani.engine_timing.engine_seconds`, whose real timing
    depends on the CPU and its load); returns a list of (checkpoint, sentences, whether CTranslate2 was timed too)
    asked about."""
    asked = []

    def seconds(model_dir, timings_file, source, decoding=None, sentences=None, export=None):
        asked.append((model_dir, sentences, export is not None))
        return {name: value for name, value in FASTEST[engine].items() if export or name != "ctranslate2"}

    monkeypatch.setattr(vaswani.export, "engine_seconds", seconds)
    return asked


def test_on_a_cpu_the_scripts_translate_a_checkpoint_with_its_cached_export_and_say_so(checkpoint, tmp_path, capsys,
                                                                                       monkeypatch):
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    timed = timed_faster(monkeypatch, "ctranslate2")
    translate_script = script_main("translate")

    translate_script(["--model", str(path), "--device", "cpu", *SOURCES])
    exported = capsys.readouterr()
    translate_script(["--model", str(path), "--device", "cpu", "--no-ctranslate2", *SOURCES])
    pytorch = capsys.readouterr()

    engine_lines = [line for line in exported.err.splitlines() if line.startswith("engine: ")]
    assert engine_lines == [f"engine: CTranslate2 float32 on cpu, the cached export of {path} "
                            f"({load_default_engine(str(path), device='cpu').path})"]
    pytorch_lines = [line for line in pytorch.err.splitlines() if line.startswith("engine: ")]
    packed = " with oneDNN-packed linear layers" if cpu_packs_linear_weights() else ""
    assert pytorch_lines == [f"engine: PyTorch float32{packed} on cpu"]
    assert exported.out == pytorch.out and exported.out.count("\n") == len(SOURCES)
    # The engines would be timed on the run's own sentences: its arguments, or its input file's first chunk.
    lines = tmp_path / "in.txt"
    lines.write_text("".join(f"{source}\n" for source in SOURCES * 3), encoding="utf-8")
    translate_script(["--model", str(path), "--device", "cpu", "--input_file", str(lines), "--chunk_lines", "4"])
    assert [(path, sentences) for path, sentences, _ in timed if sentences] == \
        [(str(path), SOURCES)] * 2 + [(str(path), SOURCES[:4])]


def test_a_resumed_translation_decodes_with_the_engine_it_began_with_though_the_other_is_now_timed_faster(
        checkpoint, tmp_path, capsys, monkeypatch):
    """Timed anew on resuming (another thread count, a busier machine), the other engine can win; the resume keeps
    the engine its record names, which gives the lines already written, rather than be refused for a change of
    engine. An engine chosen by flag stays the user's, refused where it differs from the record."""
    pytest.importorskip("ctranslate2")
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    lines = tmp_path / "in.txt"
    lines.write_text("".join(f"{source}\n" for source in SOURCES * 3), encoding="utf-8")
    translate_script = script_main("translate")
    names = {"pytorch": "engine: PyTorch", "ctranslate2": "engine: CTranslate2"}
    for first, later in (("pytorch", "ctranslate2"), ("ctranslate2", "pytorch")):
        output = tmp_path / f"{first}.fr"
        argv = ["--model", str(path), "--device", "cpu", "--input_file", str(lines), "--output_file", str(output),
                "--chunk_lines", "4", "--resume"]
        timed_faster(monkeypatch, first)
        with monkeypatch.context() as patch:  # stopped after its first chunk, as a kill would stop it
            interrupted_after(1, patch)
            with pytest.raises((KeyboardInterrupt, SystemExit)):
                translate_script(argv)
        recorded = json.loads((tmp_path / f"{first}.fr.resume.json").read_text())
        assert recorded["chunks"] == 1 and recorded["settings"]["engine"] == first
        capsys.readouterr()
        timed_faster(monkeypatch, later)
        translate_script(argv)
        engines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("engine: ")]
        assert len(engines) == 1 and engines[0].startswith(names[first]), engines
        assert output.read_text(encoding="utf-8").count("\n") == len(SOURCES) * 3
        if first == "pytorch":
            with pytest.raises(SystemExit):
                translate_script([*argv, "--ctranslate2"])
            assert "was started with other settings (" in capsys.readouterr().err


def test_the_default_engine_is_ctranslate2_only_where_it_gives_the_checkpoints_translations(checkpoint, tmp_path,
                                                                                            monkeypatch):
    greedy = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    timed = timed_faster(monkeypatch, "ctranslate2")
    beams = greedy_checkpoint(checkpoint, tmp_path / "beams", num_beams=3)  # transformers' early_stopping=False
    stopping = greedy_checkpoint(checkpoint, tmp_path / "stopping", num_beams=3, early_stopping=True)

    def engine(path, **options):
        return load_default_engine(str(path), device="cpu", **options).settings["engine"]

    assert engine(greedy) == "ctranslate2" and engine(stopping) == "ctranslate2"
    assert engine(beams) == "pytorch"  # CTranslate2 stops a beam search as early_stopping=True does
    assert engine(beams, early_stopping=True) == "ctranslate2"
    assert engine(greedy, ctranslate2=False) == "pytorch"
    for pytorch_only in ({"int8": True}, {"dtype": "float32"}, {"slots": 0}, {"decoding": "lean"},
                         {"no_repeat_ngram_size": 2}):
        assert engine(greedy, **pytorch_only) == "pytorch", pytorch_only
    assert engine(greedy, do_sample=True) == "pytorch"
    # Every width is timed: at 512 wide, PyTorch was the faster on two CPUs and CTranslate2 on a third.
    wide = tmp_path / "wide"
    config = AutoConfig.from_pretrained(greedy)
    config.d_model, config.d_ff = 512, 64
    VaswaniForConditionalGeneration(config).save_pretrained(wide)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (greedy / name).is_file():
            shutil.copy(greedy / name, wide / name)
    assert engine(wide) == "ctranslate2" and engine(wide, ctranslate2=False) == "pytorch"
    # CTranslate2 was timed only where it could decode: greedy, or beams that stop early.
    assert {path for path, _, ctranslate2 in timed if ctranslate2} == {str(greedy), str(stopping), str(beams), str(wide)}
    assert [ctranslate2 for path, _, ctranslate2 in timed if path == str(beams)] == [False, True]

    # A CPU rehearsing CUDA decides as a GPU does: nothing is timed.
    monkeypatch.setattr(vaswani.generation_vaswani, "rehearsing_cuda", True)
    asked = len(timed)
    assert engine(greedy, sentences=SOURCES * 64) == "pytorch" and len(timed) == asked
    monkeypatch.setattr(vaswani.generation_vaswani, "rehearsing_cuda", False)

    # Where the PyTorch engine is timed faster on this machine, it decodes: with the layers that were faster.
    timed_faster(monkeypatch, "pytorch")
    assert engine(greedy) == "pytorch" and engine(greedy, ctranslate2=True) == "ctranslate2"
    packed = load_default_engine(str(greedy), device="cpu").model
    assert any(isinstance(module, PackedLinear) for module in packed.modules()) == cpu_packs_linear_weights()
    timed_faster(monkeypatch, "pytorch-unpacked")
    unpacked = load_default_engine(str(greedy), device="cpu")
    assert unpacked.settings["engine"] == "pytorch" and "oneDNN" not in unpacked.description
    assert not any(isinstance(module, PackedLinear) for module in unpacked.model.modules())
    with pytest.raises(ValueError, match="pack=False: the PyTorch engine's"):
        load_engine(str(export_path(str(greedy))), ctranslate2=True, pack=False)


def test_the_engines_are_timed_once_per_machine_and_settings_each_in_a_process_of_its_own(checkpoint, tmp_path,
                                                                                          monkeypatch):
    """Which engine is faster depends on the CPU and the sentences, so both translate sentences of the first run that
    has enough, each in a new process (CTranslate2 slows down where torch's threads have run), and the seconds are
    remembered beside the export until the weights change."""
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    cache = tmp_path / "cache"
    timings = export_path(str(path), str(cache)) + TIMINGS_SUFFIX
    spawned, run, real = [], vaswani.engine_timing.subprocess.run, [True]

    def spy(command, **options):  # runs the first timing's processes; later ones answer at once, to save the time
        sentences = command[command.index("--sentences") + 1]
        spawned.append((command, json.loads(Path(sentences).read_text(encoding="utf-8"))))
        if real[0]:
            return run(command, **options)
        answer = {"pytorch": {"pytorch": 1.0}, "ctranslate2": {"ctranslate2": 2.0}}
        engine = command[command.index("--engine") + 1]
        return subprocess.CompletedProcess(command, 0, json.dumps({"seconds": answer[engine]}), "")

    monkeypatch.setattr(vaswani.engine_timing.subprocess, "run", spy)
    count = vaswani.engine_timing.CALIBRATION_SENTENCES
    many = [f"{SOURCES[i % len(SOURCES)]} {i}" for i in range(3 * count)]  # more than are timed, each its own

    def engine(**options):
        return load_default_engine(str(path), device="cpu", cache_dir=str(cache), **options).settings["engine"]

    # Too few sentences to time, and nothing timed yet: PyTorch, with no export made.
    assert engine(sentences=many[:count - 1]) == "pytorch" and engine() == "pytorch"
    assert not spawned and not Path(timings).exists() and not Path(export_path(str(path), str(cache))).exists()

    chosen = engine(sentences=many)
    assert [command[command.index("--engine") + 1] for command, _ in spawned] == ["pytorch", "ctranslate2"]
    assert all(command[:3] == [vaswani.engine_timing.sys.executable, "-m", "vaswani.engine_timing"]
               for command, _ in spawned)
    # Batches of like length from across all the sentences given, not their first ones.
    timed, lengths = spawned[0][1], sorted(map(len, many))
    assert timed == spawned[1][1] and len(timed) == count and len(set(timed)) == count and set(timed) <= set(many)
    assert [len(sentence) for sentence in timed] == sorted(map(len, timed))
    assert len(timed[-1]) >= lengths[len(lengths) * 7 // 8] and len(timed[0]) <= lengths[len(lengths) // 8]
    remembered = json.loads(Path(timings).read_text())
    assert remembered["source"] == export_source(str(path)) and len(remembered["timings"]) == 1
    seconds = remembered["timings"][0]["seconds"]
    # PyTorch with its linear layers laid out for oneDNN and with torch's own, where this torch lays them out.
    pytorch = {"pytorch", "pytorch-unpacked"} if cpu_packs_linear_weights() else {"pytorch"}
    assert set(seconds) == pytorch | {"ctranslate2"} and all(value > 0 for value in seconds.values())
    fastest = min(seconds, key=seconds.get)
    assert chosen == ("ctranslate2" if fastest == "ctranslate2" else "pytorch")
    if chosen == "pytorch":  # with the faster of its linear layers
        model = load_default_engine(str(path), device="cpu", cache_dir=str(cache)).model
        assert any(isinstance(module, PackedLinear) for module in model.modules()) == (fastest == "pytorch")
    assert remembered["timings"][0]["key"]["machine"]["threads"] == torch.get_num_threads()
    # Later runs, with sentences or without, decide from what was timed.
    assert engine() == chosen and engine(sentences=many[:3]) == chosen and len(spawned) == 2
    real[0] = False

    # Other settings, another thread count, or engines that decode otherwise, are timed anew; the first are still
    # remembered.
    with monkeypatch.context() as revised:
        revised.setattr(vaswani.engine_timing, "ENGINES_REVISION", vaswani.engine_timing.ENGINES_REVISION + 1)
        engine(sentences=many)
    assert len(spawned) == 4
    engine(max_new_tokens=5, sentences=many)
    assert len(spawned) == 6 and '"max_new_tokens": 5' in spawned[-1][0][spawned[-1][0].index("--decoding") + 1]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        engine(sentences=many)
    finally:
        torch.set_num_threads(threads)
    assert len(spawned) == 8 and spawned[-1][0][spawned[-1][0].index("--threads") + 1] == str(threads + 1)
    assert engine() == chosen and len(spawned) == 8 and len(json.loads(Path(timings).read_text())["timings"]) == 4

    # New weights: timed again, and the old timings forgotten.
    VaswaniForConditionalGeneration.from_pretrained(path).save_pretrained(path)
    assert engine() == "pytorch" and len(spawned) == 8
    engine(sentences=many)
    assert len(spawned) == 10 and len(json.loads(Path(timings).read_text())["timings"]) == 1


def test_a_timing_names_the_cpus_generation_where_its_name_is_only_the_vendors_line(tmp_path, monkeypatch):
    """Under a hypervisor two AMD generations can both be "AMD EPYC"; their family numbers tell them apart, so a
    timing taken on one is not the other's."""
    def cpuinfo(family):
        path = tmp_path / f"cpuinfo-{family}"
        block = f"processor\t: {{}}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: 2\n" \
                "model name\t: AMD EPYC\nflags\t\t: fpu avx2\n\n"
        path.write_text(block.format(0) + block.format(1).replace(f": {family}", ": 99"))
        return str(path)

    zen4, zen5 = cpuinfo(25), cpuinfo(26)
    assert vaswani.engine_timing.cpu_name(zen4) == "AMD EPYC (family 25, model 2)"  # the first processor's block
    assert vaswani.engine_timing.cpu_name(zen5) == "AMD EPYC (family 26, model 2)"
    (tmp_path / "no-numbers").write_text("model name\t: Some CPU\n")
    assert vaswani.engine_timing.cpu_name(str(tmp_path / "no-numbers")) == "Some CPU"
    keys, real = [], vaswani.engine_timing.cpu_name
    for path in (zen4, zen5):
        with monkeypatch.context() as patched:
            patched.setattr(vaswani.engine_timing, "cpu_name", lambda path=path: real(path))
            keys.append(vaswani.engine_timing.machine(2))
    assert keys[0]["cpu"] != keys[1]["cpu"] and {**keys[0], "cpu": None} == {**keys[1], "cpu": None}


def test_without_ctranslate2_only_the_pytorch_engines_are_timed(checkpoint, tmp_path, monkeypatch):
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    find_spec, version = vaswani.export.importlib.util.find_spec, vaswani.engine_timing.importlib.metadata.version

    def missing(name, *args):
        if name == "ctranslate2":
            raise vaswani.engine_timing.importlib.metadata.PackageNotFoundError(name)
        return version(name, *args)

    monkeypatch.setattr(vaswani.export.importlib.util, "find_spec",
                        lambda name, *args: None if name == "ctranslate2" else find_spec(name, *args))
    monkeypatch.setattr(vaswani.engine_timing.importlib.metadata, "version", missing)
    timed = []
    monkeypatch.setattr(vaswani.engine_timing, "time_engine", lambda model_dir, engine, *args: timed.append(engine)
                        or {"pytorch": 2.0, "pytorch-unpacked": 1.0})
    sentences = [f"{SOURCES[i % len(SOURCES)]} {i}" for i in range(vaswani.engine_timing.CALIBRATION_SENTENCES)]
    engine = load_default_engine(str(path), device="cpu", cache_dir=str(tmp_path / "cache"), sentences=sentences)
    if cpu_packs_linear_weights():
        assert timed == ["pytorch"] and not any(isinstance(m, PackedLinear) for m in engine.model.modules())
        remembered = json.loads(Path(export_path(str(path), str(tmp_path / "cache")) + TIMINGS_SUFFIX).read_text())
        assert remembered["timings"][0]["key"]["machine"]["ctranslate2"] is None
    else:  # nothing to choose between
        assert timed == []
    assert engine.settings["engine"] == "pytorch" and not Path(export_path(str(path), str(tmp_path / "cache"))).exists()


def test_a_cache_that_cannot_be_written_leaves_the_pytorch_engine_to_decode(checkpoint, tmp_path, capsys):
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    (tmp_path / "file").write_text("not a directory")
    sentences = [f"{SOURCES[i % len(SOURCES)]} {i}" for i in range(vaswani.engine_timing.CALIBRATION_SENTENCES)]
    engine = load_default_engine(str(path), device="cpu", cache_dir=str(tmp_path / "file" / "cache"),
                                 sentences=sentences)
    assert engine.settings["engine"] == "pytorch"
    assert "Not timing the engines: " in capsys.readouterr().err


def test_an_engine_that_cannot_be_timed_is_an_error_naming_it(checkpoint, tmp_path):
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    (tmp_path / "sentences.json").write_text(json.dumps(SOURCES))
    with pytest.raises(RuntimeError, match="Timing the ctranslate2 engine on .* failed .*: ValueError: .*holds no "
                       "CTranslate2 export"):
        vaswani.engine_timing.time_engine(str(path), "ctranslate2", 1, {}, str(tmp_path / "sentences.json"),
                                          str(tmp_path / "no-export"))


def test_an_export_does_torchs_work_on_one_thread_and_gives_the_count_back(checkpoint, tmp_path, monkeypatch):
    """An export starts no team of torch threads: in the process that then decodes with CTranslate2 (on torch's
    OpenMP runtime), such a team halved CTranslate2's speed (`vaswani.export.one_torch_thread`)."""
    import vaswani.export

    seen, model_spec = [], vaswani.export.model_spec
    monkeypatch.setattr(vaswani.export, "model_spec", lambda *args: seen.append(torch.get_num_threads())
                        or model_spec(*args))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        export_to_ctranslate2(str(checkpoint), str(tmp_path / "ct2"), measure_on=SOURCES[:2])
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_cached_export_is_reused_and_made_again_when_the_weights_change(checkpoint, tmp_path):
    path = greedy_checkpoint(checkpoint, tmp_path / "greedy")
    cache = tmp_path / "cache"

    first, made = cached_export(str(path), str(cache))
    again, made_again = cached_export(str(path), str(cache))
    assert made and not made_again and again == first
    weights = (Path(first) / "model.bin").stat().st_mtime_ns

    model = VaswaniForConditionalGeneration.from_pretrained(path)  # other weights, saved in place
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    model.save_pretrained(path)
    rebuilt, made = cached_export(str(path), str(cache))

    assert made and rebuilt == first and (Path(first) / "model.bin").stat().st_mtime_ns != weights
    exported = translate_with(load_default_engine(str(path), device="cpu", cache_dir=str(cache)), SOURCES).texts
    pytorch = translate_with(load_engine(str(path), device="cpu", ctranslate2=False), SOURCES).texts
    assert exported == pytorch


def test_sources_and_outputs_stay_inside_the_exported_position_table(trained, tmp_path):
    model, tokenizer = trained
    export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer, max_positions=24)
    engine = load_engine(str(tmp_path / "ct2"), num_beams=2, max_new_tokens=100)
    translator, calls = engine.translator, []

    class Recording:  # CTranslate2 fails past the table ("No position encodings are defined for positions >= 24")
        def translate_batch(self, sources, **options):
            calls.append(([len(s) for s in sources], options["max_decoding_length"]))
            return translator.translate_batch(sources, **options)

    long_source = " ".join(SOURCES * 4)  # about 90 tokens
    engine.translator = Recording()
    got = translate_with(engine, [long_source, SOURCES[0]], warn=False).texts

    assert len(got) == 2 and all(got)
    assert calls == [([24, 7], 23)]  # the PyTorch engine's limit: the table less the decoder start's position


def test_the_export_never_writes_over_its_model_and_replaces_any_other_directory_whole(checkpoint, tmp_path,
                                                                                       capsys):
    model = tmp_path / "run" / "model"
    shutil.copytree(checkpoint, model)
    before = snapshot(tmp_path / "run")
    export = script_main("export_ctranslate2")
    for kind, output in {**other_names(model, tmp_path), "holding it": tmp_path / "run"}.items():
        error = fails_with_one_line(export, ["--model", str(model), "--output_dir", str(output), "--force"], capsys,
                                    "the input")
        assert "--force" not in error, kind
    assert snapshot(tmp_path / "run") == before
    old = tmp_path / "ct2"
    old.mkdir()
    (old / "stale.bin").write_bytes(b"of an earlier export")
    export(["--model", str(model), "--output_dir", str(old), "--force"])
    assert not (old / "stale.bin").exists() and (old / "model.bin").is_file()


def test_a_ctranslate2_engine_gets_the_cpu_threads_torch_has(trained, tmp_path, monkeypatch):
    """CTranslate2's own default is a fixed thread count; an engine from the factory uses the cores torch uses, so
    both engines of a comparison (and a user's --threads) get the same."""
    model, tokenizer = trained
    export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    options, real = [], ctranslate2.Translator
    monkeypatch.setattr(ctranslate2, "Translator",
                        lambda *args, **kwargs: options.append(kwargs) or real(*args, **kwargs))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = load_engine(str(tmp_path / "ct2"), device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert [option["intra_threads"] for option in options] == [1]
    assert translate_with(engine, SOURCES[:2]).texts  # the engine translates
