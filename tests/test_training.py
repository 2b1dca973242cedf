"""The training script end to end on a small synthetic corpus (`vaswani.training.run_training`): single process,
then DDP with two CPU processes; what it writes, how it evaluates, and the models it trains."""

import io
import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

import vaswani.data
import vaswani.evaluation
import vaswani.inference
import vaswani.loading
import vaswani.training
from conftest import free_port, script_main
from training_script import SCRIPTS, run_script, synthetic_corpus, train_args, train_in_this_process


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 30-step run of the training script, in this process (what it prints, not its process, is tested)."""
    root = tmp_path_factory.mktemp("train")
    corpus = synthetic_corpus(root / "corpus.tsv")
    output_dir = root / "model"
    stdout = train_in_this_process(*train_args(corpus, output_dir, "--max_tokens_per_batch", "400"))
    return corpus, output_dir, stdout


@pytest.mark.slow
def test_training_writes_a_complete_checkpoint(trained):
    _, output_dir, stdout = trained
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "configuration_vaswani.py", "modeling_vaswani.py", "README.md",
                 "metrics.json", "training_args.json", "pipeline_vaswani.py", "tokenization_vaswani.py"):
        assert (output_dir / name).is_file(), name
    assert not any(p.suffix in (".bin", ".pt", ".pth") for p in output_dir.iterdir())
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert 1 <= metrics["test_sentences"] <= 20 and 0.0 <= metrics["test_bleu"] <= 100.0
    assert metrics["train_loss"] > 0
    # The tokenizer learned from every pair of this small corpus, both sides; the card says so.
    assert metrics["tokenizer_training_sentences"] > 0
    assert f"trained on {metrics['tokenizer_training_sentences']:,} sentences" in (output_dir / "README.md").read_text()
    # The printed metrics are the saved ones: the number in the report comes from the evaluation.
    assert json.loads(stdout[stdout.index("{"):])["test_bleu"] == metrics["test_bleu"]


@pytest.mark.slow
def test_trained_checkpoint_loads_and_translates(trained):
    _, output_dir, _ = trained
    model = AutoModelForSeq2SeqLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert type(model).__name__ == "VaswaniForConditionalGeneration"
    assert model.generation_config.num_beams == 2
    assert model.generation_config.length_penalty == 0.6  # --generation_length_penalty's default, the paper's α
    # No --generation_max_length: the one length rule (each source's length + 50) for the package's engines, and the
    # position table's end for a stock generate(), which needs a max_length.
    assert model.generation_config.max_new_tokens is None
    assert model.generation_config.max_length == model.config.max_position_embeddings
    batch = tokenizer(["I have two cats."], return_tensors="pt")
    output = model.generate(**batch, max_new_tokens=10)
    assert output.shape[0] == 1


@pytest.mark.slow
def test_translate_and_visualize_scripts(trained, tmp_path, capsys, monkeypatch):
    _, output_dir, _ = trained
    # Sentences as arguments, then from stdin, then the attention maps, through the scripts' `main` in this process.
    script_main("translate")(["--model", str(output_dir), "--num_beams", "2", "--max_new_tokens", "12",
                              "I have one dog.", "I have five books."])
    assert len(capsys.readouterr().out.strip().splitlines()) == 2
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"I have one cat.\n"), encoding="utf-8"))
    script_main("translate")(["--model", str(output_dir), "--num_beams", "1", "--max_new_tokens", "8"])
    assert len(capsys.readouterr().out.strip().splitlines()) == 1
    script_main("visualize_attention")(["--model", str(output_dir), "--source", "I have two dogs.",
                                        "--output_dir", str(tmp_path / "maps")])
    pngs = sorted((tmp_path / "maps").glob("*.png"))
    # tiny preset: 2 encoder + 2 decoder layers → encoder, decoder-self and cross maps per layer
    assert len(pngs) == 6 and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


@pytest.mark.slow
def test_evaluate_bleu_script_on_files(trained, tmp_path, capsys):
    _, output_dir, _ = trained
    (tmp_path / "src.en").write_text("I have one cat.\nI have two dogs.\n")
    (tmp_path / "ref1.fr").write_text("J'ai un chat.\nJ'ai deux chiens.\n")
    (tmp_path / "ref2.fr").write_text("\nJ'ai deux chiens !\n")
    script_main("evaluate_bleu")(["--model", str(output_dir), "--source_file", str(tmp_path / "src.en"),
                                  "--reference_file", str(tmp_path / "ref1.fr"), "--reference_file",
                                  str(tmp_path / "ref2.fr"), "--num_beams", "2"])
    scores = json.loads(capsys.readouterr().out)
    assert scores["sentences"] == 2 and {"bleu", "chrf", "ter"} <= scores.keys()


def test_training_on_a_cpu_reuses_freed_memory_of_any_size(tmp_path, monkeypatch):
    """train_translation.py sets up glibc to reuse freed memory of any size before it trains on a CPU (the logits of
    a step are hundreds of MiB, and page-faulting them fresh each step cost about a fifth of the step's time)."""
    calls = []  # the real call would change this test process' malloc for good
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: calls.append(
        largest_block_mib))
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=100)
    script_main("train_translation")(train_args(corpus, tmp_path / "out", "--max_steps", "1", "--max_test_samples", "2",
                                                "--generation_num_beams", "1", "--use_cpu", "true"))
    assert calls == [None]


def test_the_model_card_records_the_command_line_the_script_received(tmp_path, monkeypatch):
    """The script passes its own command line down to the model card (the package reads none), also when its `main`
    is called with arguments in another program's process, as here."""
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=100)
    argv = train_args(corpus, tmp_path / "out", "--max_steps", "1", "--max_test_samples", "2",
                      "--generation_num_beams", "1", "--use_cpu")
    script_main("train_translation")(argv)
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"```bash\ntrain_translation.py {shlex.join(argv)}\n```" in card, card


def test_bf16_on_a_cpu_trains_under_autocast_and_reports_the_float32_model(tmp_path, monkeypatch):
    """--bf16 --use_cpu --attn_implementation eager (the main job's recipe on CPUs with native bf16): the steps run
    under bf16 autocast with the chosen attention, batches are not padded to multiples of 8 (a GPU habit that only
    adds work on a CPU), and the test report decodes without autocast, as the saved float32 weights do."""
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    collators, training, evaluation = [], [], []
    real_collator = vaswani.training.DataCollatorForSeq2Seq

    def collator(*args, **kwargs):
        collators.append(kwargs.get("pad_to_multiple_of"))
        return real_collator(*args, **kwargs)

    real_build = vaswani.training.build_model_and_tokenizer

    def build(*args, **kwargs):
        model, tokenizer = real_build(*args, **kwargs)
        model.lm_head.register_forward_hook(
            lambda module, inputs, output: (training if module.training else evaluation).append(
                (output.dtype, model.config._attn_implementation)))
        return model, tokenizer

    monkeypatch.setattr(vaswani.training, "DataCollatorForSeq2Seq", collator)
    monkeypatch.setattr(vaswani.training, "build_model_and_tokenizer", build)
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=100)
    script_main("train_translation")(train_args(
        corpus, tmp_path / "out", "--max_steps", "2", "--max_test_samples", "2", "--generation_num_beams", "1",
        "--bf16", "--use_cpu", "--attn_implementation", "eager"))
    assert collators == [None]
    assert set(training) == {(torch.bfloat16, "eager")} and len(training) == 2
    assert evaluation and {dtype for dtype, _ in evaluation} == {torch.float32}
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["dtype"] == "float32" and "attn_implementation" not in json.dumps(saved)


def test_pad_to_multiple_of_pads_the_batches_and_the_token_budget_counts_it(tmp_path, monkeypatch):
    """--pad_to_multiple_of 8 reaches the collator, and the token-budget sampler counts each side rounded up to it, so
    that a batch's padded shape stays within --max_tokens_per_batch; without the flag nothing is rounded, on every
    device (on fra-eng the multiple of 8 cost 26% of a 4,000-token batch's real tokens)."""
    monkeypatch.setattr(vaswani.inference, "keep_freed_cpu_memory", lambda largest_block_mib=32: None)
    trainers = []
    real_build = vaswani.training.build_trainer

    def build(*args, **kwargs):
        trainers.append(real_build(*args, **kwargs))
        return trainers[-1]

    monkeypatch.setattr(vaswani.training, "build_trainer", build)
    corpus = synthetic_corpus(tmp_path / "corpus.tsv", pairs=100)
    for name, extra in (("plain", []), ("eight", ["--pad_to_multiple_of", "8"])):
        script_main("train_translation")(train_args(
            corpus, tmp_path / name, "--max_steps", "2", "--max_test_samples", "2", "--generation_num_beams", "1",
            "--max_tokens_per_batch", "64", *extra))
    plain, eight = trainers
    assert plain.data_collator.pad_to_multiple_of is None and eight.data_collator.pad_to_multiple_of == 8
    for trainer, multiple in ((plain, 1), (eight, 8)):
        sampler = trainer.batch_sampler
        batches = sampler.batches_by_length()
        assert all(len(batch) * -(-int(sampler.lengths[batch].max()) // multiple) * multiple <= 64
                   for batch in batches)
        collated = trainer._train_collate([trainer._train_features[i] for i in batches[-1]])
        assert collated["input_ids"].shape[1] % multiple == 0 and collated["labels"].shape[1] % multiple == 0
    assert len(eight.batch_sampler.batches_by_length()) > len(plain.batch_sampler.batches_by_length())
    with pytest.raises(SystemExit):
        script_main("train_translation")(train_args(corpus, tmp_path / "zero", "--pad_to_multiple_of", "0"))


def test_time_budget_stops_training_then_evaluates_and_saves(tmp_path):
    corpus = synthetic_corpus(tmp_path / "corpus.tsv")
    output_dir = tmp_path / "budget"
    args = train_args(corpus, output_dir, "--max_steps", "100000", "--max_train_time", "3")
    result = run_script("train_translation.py", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    runtime = json.loads(result.stdout)["train_runtime"]
    assert 3 <= metrics["train_wall_seconds"] < 60 and runtime < 60
    assert "test_bleu" in metrics and (output_dir / "model.safetensors").is_file()
    # --save_strategy no: the budget ends in the final model only, not in an extra resumable checkpoint.
    assert not list(output_dir.glob("checkpoint-*"))
    # The progress bar counts the budget's 3 seconds, not the 100,000 steps that --max_steps allows.
    assert "| 3/3 s [" in result.stderr and "/100000" not in result.stderr, result.stderr[-2000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]  # no deprecation notices in normal use


# Loud, not silent: a model trained by the script must translate sentences it never saw, through the paths users take.
# transformers 5.24 renamed the decoding cache; a model that ignored the new name decoded every step without its past
# and looped on every sentence longer than a few tokens, while every shape- and smoke-test stayed green.
COUNTS = [("two", "deux"), ("three", "trois"), ("four", "quatre"), ("five", "cinq"), ("six", "six"),
          ("seven", "sept"), ("eight", "huit"), ("nine", "neuf"), ("ten", "dix")]
OBJECTS = [("cats", "chats"), ("dogs", "chiens"), ("books", "livres"), ("cars", "voitures"), ("birds", "oiseaux"),
           ("apples", "pommes"), ("houses", "maisons"), ("trees", "arbres")]
SUBJECTS = [("I have", "J'ai"), ("We see", "Nous voyons"), ("They want", "Ils veulent")]


def counting_pairs() -> list[tuple[str, str]]:
    return [(f"{en_s} {en_n} {en_o} today.", f"{fr_s} {fr_n} {fr_o} aujourd'hui.")
            for en_s, fr_s in SUBJECTS for en_n, fr_n in COUNTS for en_o, fr_o in OBJECTS]


@pytest.fixture(scope="module")
def counting_translator(tmp_path_factory):
    root = tmp_path_factory.mktemp("counting")
    corpus = root / "corpus.tsv"
    corpus.write_text("".join(f"{en}\t{fr}\n" for en, fr in counting_pairs() * 4), encoding="utf-8")
    output_dir = root / "model"
    train_in_this_process(*train_args(corpus, output_dir, "--max_steps", "250", "--max_tokens_per_batch", "600",
                                      "--max_test_samples", "100", "--vocab_size", "500"))
    held_out = [(en, fr) for en, fr in counting_pairs()
                if vaswani.data.split_of(en, vaswani.data.VALIDATION_FRACTION, vaswani.data.TEST_FRACTION) == "test"]
    assert len(held_out) >= 4  # the split is by a hash of the source: these sentences were never trained on
    return output_dir, held_out


@pytest.mark.slow
def test_a_trained_translator_translates_unseen_sentences(counting_translator):
    """About 30 s on a slow CPU, most of it the fixture's 250 training steps (in this process): a model that has
    learned the counting corpus, so that a decoding cache that is ignored shows as wrong translations."""
    output_dir, held_out = counting_translator
    sources, references = [en for en, _ in held_out], [fr for _, fr in held_out]
    metrics = json.loads((output_dir / "metrics.json").read_text())  # the training script's own test evaluation
    assert metrics["test_bleu"] >= 90, metrics
    for decoding in ("lean", "transformers"):  # the scripts' loader: the lean loop (its default), or transformers' own
        model, tokenizer = vaswani.loading.load_translator(str(output_dir), decoding=decoding)
        batch = tokenizer(sources, return_tensors="pt", padding=True)
        for use_cache in (True, False):  # the checkpoint's own generation settings (beam search), cached or not
            output = model.generate(**batch, use_cache=use_cache)
            assert tokenizer.batch_decode(output, skip_special_tokens=True) == references, (decoding, use_cache)
        assert vaswani.evaluation.translate(model, tokenizer, sources, num_beams=1) == references, decoding


@pytest.mark.slow
def test_accelerate_launch_with_two_cpu_processes_checkpoints_resumes_and_evaluates(tmp_path):
    """`accelerate launch --num_processes 2` on CPU, as the README shows it: a run that writes checkpoints and ends
    with the final evaluation, then `--resume` from its last checkpoint to more steps. Every process of both
    launches exits cleanly (status 0, no abort at teardown), and the data is prepared once per launch. About a minute:
    two launches of three processes each (the launcher and two ranks)."""
    corpus = synthetic_corpus(tmp_path / "corpus.tsv")
    output_dir = tmp_path / "accelerate"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    # `--multi_gpu` is Accelerate's name for its torchrun launcher; `--use_cpu` keeps the processes on the CPU (gloo).
    # (Accelerate's `--cpu` would start one process, or hand several to MPI.)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port()), str(SCRIPTS / "train_translation.py")]
    common = ["--use_cpu", "--save_strategy", "steps", "--save_steps", "3", "--logging_steps", "3",
              "--max_tokens_per_batch", "300", "--log_level", "info"]

    first = subprocess.run([*launch, *train_args(corpus, output_dir, "--max_steps", "6", "--tokenizer_train_pairs", "200",
                                                 *common)], capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["train_world_size"] == 2 and metrics["tokenizer_training_sentences"] == 400

    second = subprocess.run([*launch, *train_args(corpus, output_dir, "--max_steps", "9", "--resume", *common)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "Resuming from" in second.stderr and "checkpoint-6" in second.stderr
    assert "Reusing the tokenized" in second.stderr and "Reading" not in second.stderr
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["train_world_size"] == 2 and 1 <= metrics["test_sentences"] <= 20
    assert json.loads((output_dir / "checkpoint-9" / "trainer_state.json").read_text())["global_step"] == 9
    for result in (first, second):
        assert "terminate called" not in result.stderr and "Traceback" not in result.stderr
        assert json.loads(result.stdout[result.stdout.index("{"):])["train_world_size"] == 2
    assert "Reading" in first.stderr and "Training a" in first.stderr


@pytest.mark.slow  # two runs of 5 s of training, in this process
def test_checkpoints_at_a_time_interval_and_their_average_as_the_final_model(tmp_path, caplog):
    """--save_interval_seconds writes checkpoints by the clock, through the same atomic writer; with
    --average_last_checkpoints the final model (evaluated, saved, carded) is the mean of the last ones."""
    from safetensors.torch import load_file

    from vaswani.checkpoints import average_state_dicts

    corpus = synthetic_corpus(tmp_path / "corpus.tsv")
    output_dir = tmp_path / "averaged"
    args = train_args(corpus, output_dir, "--max_steps", "100000", "--max_train_time", "5",
                      "--save_interval_seconds", "0.5", "--average_last_checkpoints", "3", "--save_total_limit", "4")
    stdout = train_in_this_process(*args)
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    assert len(checkpoints) == 4, checkpoints  # rotated by --save_total_limit, none half-written
    assert not list(output_dir.glob(".tmp-*"))
    assert all((path / "trainer_state.json").is_file() for path in checkpoints)
    states = [json.loads((path / "trainer_state.json").read_text()) for path in checkpoints]
    assert states[-1]["global_step"] == json.loads(stdout)["train_steps"]  # the last step is one of them
    final = load_file(output_dir / "model.safetensors")
    expected = average_state_dicts([str(path) for path in checkpoints[-3:]])
    assert final.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["averaged_checkpoints"] == 3 and "test_bleu" in metrics
    card = (output_dir / "README.md").read_text()
    assert "## Checkpoint averaging" in card and all(path.name in card for path in checkpoints[-3:])

    # The interval checkpoints are ordinary ones: --resume continues from the last, here as if the run had been
    # killed after it, before its final model was saved (a finished run's --resume trains nothing).
    (output_dir / "config.json").unlink()
    with caplog.at_level("INFO", logger="vaswani"):
        resumed = train_in_this_process(*args, "--resume", "--log_level", "info")
    assert f"Resuming from {checkpoints[-1]}." in caplog.text
    assert json.loads(resumed)["train_steps"] > states[-1]["global_step"]
