"""Publishing a trained checkpoint: the translation pipeline's code, the model card, and the upload to the Hub.

The card carries the attribution that the training data's licence requires (the fra-eng pairs are Tatoeba
sentences, CC-BY 2.0 France), so `push_to_hub` never uploads a checkpoint without one.
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import sacrebleu
from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from .checkpoints import RECOPY, check_checkpoint_files, missing_weight_files
from .files import exclusive, read_json_object, write_atomically

logger = logging.getLogger(__name__)

PIPELINE_FILE = Path(__file__).with_name("pipeline_vaswani.py")
# What `Pipeline.save_pretrained` would record for VaswaniTranslationPipeline: "impl" is "<module file>.<class>"
# inside the checkpoint, "pt" names transformers classes that can load the model.
TRANSLATION_PIPELINE_ENTRY = {
    "impl": f"{PIPELINE_FILE.stem}.VaswaniTranslationPipeline",
    "pt": ["AutoModelForSeq2SeqLM"],
    "type": "text",
}

TATOEBA_DATASET_NAME = "Tatoeba English-French sentence pairs (fra-eng, manythings.org)"
TATOEBA_ATTRIBUTION = "Tatoeba via manythings.org, CC-BY 2.0 — Attribution: www.manythings.org/anki and tatoeba.org"
# Stands for the repository id in a card written before the id is known; `push_to_hub` fills it in.
REPO_ID_PLACEHOLDER = "<namespace>/<repository>"

# Top-level files of a checkpoint directory that belong on the Hub: configs and metrics (json), weights, module
# files, the card, and vocabularies of other tokenizer types (txt, SentencePiece .model, Marian's .spm); and the
# generation code that transformers loads from `custom_generate/`. Anything in other subdirectories (Trainer
# `checkpoint-*/`, TensorBoard `runs/`) and other files (optimizer states, `training_args.bin`) stay local.
UPLOAD_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.md", "*.txt", "*.model", "*.spm"]
CUSTOM_GENERATE_FILES = ["custom_generate/generate.py"]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]

_REPORTED_METRICS = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER"}


def attach_translation_pipeline(model, save_directory: str | Path) -> None:
    """Make the checkpoint about to be saved in `save_directory` usable as
    `pipeline("translation", model=<dir or repo>, trust_remote_code=True)`.

    Records the pipeline in `model.config.custom_pipelines` (written to config.json by the next save) and copies
    pipeline_vaswani.py into `save_directory`. Call it just before `model.save_pretrained(save_directory)` or
    `trainer.save_model(save_directory)`. Every later save of the model, also as remote code without this package,
    copies the file again, because config.json names it (`VaswaniPreTrainedModel.save_pretrained`).
    """
    model.config.custom_pipelines = {"translation": dict(TRANSLATION_PIPELINE_ENTRY)}
    Path(save_directory).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PIPELINE_FILE, Path(save_directory) / PIPELINE_FILE.name)


def write_model_card(
    output_dir: str | Path,
    *,
    metrics: Mapping[str, object] | None = None,
    repo_id: str | None = None,
    model_name: str | None = None,
    languages: Sequence[str] = ("en", "fr"),
    dataset_name: str = TATOEBA_DATASET_NAME,
    dataset_type: str = "tatoeba",
    dataset_attribution: str = TATOEBA_ATTRIBUTION,
    dataset_ids: Sequence[str] = (),
    metrics_split: str = "test",
    training_command: str | None = None,
    averaged_checkpoints: Sequence[str] = (),
) -> Path:
    """Write `output_dir/README.md`: YAML metadata, what the model is, how to load it, data attribution, scores.

    `metrics` may be `evaluation.evaluate_model`'s result or the training script's metrics: BLEU/chrF/TER are
    read from `test_bleu`, `test_chrf`, `test_ter` (or `bleu`, `chrf`, `ter`) and also go into the `model-index`
    metadata that the Hub displays, with sacreBLEU's signatures from `test_signatures` (or `signatures`) if given;
    every other number is listed in a table. `languages` is (source, target).
    `model_name` (default: the repository's name, else `vaswani-<source>-<target>`) titles the card; without
    `repo_id`, the loading examples name a placeholder that `push_to_hub` replaces.
    `dataset_ids` are Hub dataset ids for the `datasets` metadata field (the manythings.org corpus has none).
    Code and weights are licensed Apache-2.0; the card states the data's own licence and attribution.
    `averaged_checkpoints` names the checkpoints whose mean the weights are (`vaswani.checkpoints`).
    """
    source, target = languages
    repo = repo_id or REPO_ID_PLACEHOLDER
    model_name = model_name or (repo_id.split("/")[-1] if repo_id else f"vaswani-{source}-{target}")
    metrics = dict(metrics or {})
    scores = {}
    for name in _REPORTED_METRICS:
        value = metrics.get(f"test_{name}", metrics.get(name))
        if isinstance(value, (int, float)):
            scores[name] = float(value)
    task_name = f"Translation {source}→{target}"
    eval_results = [
        EvalResult(task_type="translation", task_name=task_name, dataset_type=dataset_type, dataset_name=dataset_name,
                   dataset_split=metrics_split, metric_type=name, metric_name=_REPORTED_METRICS[name],
                   metric_value=round(value, 2))
        for name, value in scores.items()
    ]
    card_data = ModelCardData(
        language=list(languages),
        license="apache-2.0",
        library_name="transformers",
        pipeline_tag="translation",
        tags=["translation", "transformer", "vaswani", "encoder-decoder"],
        datasets=list(dataset_ids) or None,
        metrics=[name for name in scores] or None,
        model_name=model_name,
        eval_results=eval_results or None,
    )
    sections = [
        f"# {model_name}\n",
        f"An encoder-decoder Transformer ({_PAPER}) that translates {source} to {target}, implemented in the "
        "`vaswani` package as a transformers model.\n",
        how_to_load(repo),
        "## Training data\n",
        f"{dataset_name}.\n\n{dataset_attribution}\n\nThe sentence pairs are licensed CC-BY 2.0 France, and are "
        "credited here as that licence asks. The model's code and weights are released under Apache-2.0.\n",
    ]
    if isinstance(metrics.get("tokenizer_training_sentences"), int):
        sections.append(f"The tokenizer was trained on {metrics['tokenizer_training_sentences']:,} sentences of the "
                        "train split (both languages).\n")
    if training_command:
        sections.append(f"## Training\n\n```bash\n{training_command}\n```\n")
    if isinstance(metrics.get("model_size_choice"), str):  # `--preset auto` (vaswani.sizing)
        sections.append(f"The model's size, {metrics.get('model_size')}, was chosen for the training machine and "
                        f"time budget: {metrics['model_size_choice']}."
                        + (f" It trained at a peak learning rate of {metrics['model_size_learning_rate']:g}."
                           if isinstance(metrics.get("model_size_learning_rate"), float) else "") + "\n")
    if averaged_checkpoints:
        listed = "\n".join(f"- {name}" for name in averaged_checkpoints)
        sections.append(f"## Checkpoint averaging\n\nThe weights are the element-wise mean (in float32) of these "
                        f"{len(averaged_checkpoints)} checkpoints, as in §6.1 of the paper:\n\n{listed}\n")
    if scores:
        signatures = metrics.get("test_signatures", metrics.get("signatures"))
        sections.append(_scores_section(scores, metrics_split, signatures if isinstance(signatures, dict) else {}))
    others = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and _bare(k) not in _REPORTED_METRICS}
    if others:
        rows = "\n".join(f"| {name} | {_format(value)} |" for name, value in sorted(others.items()))
        sections.append(f"## All recorded metrics\n\n| metric | value |\n|---|---|\n{rows}\n")
    card = ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(sections))
    path = Path(output_dir) / "README.md"
    card.save(path)
    return path


def missing_checkpoint_files(model_dir: str | Path) -> list[str]:
    """Files a loadable checkpoint needs that `model_dir` lacks: config, weights (every shard), tokenizer config,
    and every module file that config.json or tokenizer_config.json names for remote code."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        return ["config.json"]
    missing = missing_weight_files(model_dir)
    if missing == [SAFE_WEIGHTS_NAME]:  # neither one file nor an index of shards
        missing = [f"{SAFE_WEIGHTS_NAME} (or {SAFE_WEIGHTS_INDEX_NAME} and its shards)"]
    if not (model_dir / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json")
    missing += [name for name in sorted(_code_files(model_dir)) if not (model_dir / name).is_file()]
    return missing


def push_to_hub(
    output_dir: str | Path,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    commit_message: str = "Upload Vaswani Transformer translation model",
) -> str:
    """Create `repo_id` if needed and upload the checkpoint in `output_dir` in one commit; returns the commit URL.

    Uploads the top-level weights, configs, tokenizer files, module files and README.md, and the generation code
    in `custom_generate/`, nothing else from subdirectories (see `UPLOAD_PATTERNS`). Raises FileNotFoundError if
    the directory or a needed file is missing, and an error naming any file that is damaged
    (`checkpoints.check_checkpoint_files`). Without a README.md, a model card without scores is written first,
    for the data attribution; a card written before the repository id was known gets it filled in. `token` defaults
    to the logged-in user's.

    A push never leaves the repository half updated: every file goes in one commit (`HfApi.upload_folder`), which the
    Hub applies whole or not at all, so a push cut off (the connection lost, the process killed) leaves the previous
    revision, and the same push run again completes it; the commit also removes weight files the new model does not
    have. Files the repository already holds unchanged are not sent again (huggingface_hub compares their hashes),
    so pushing the same model twice makes no commit. A directory that another process is writing (a training run
    holds its lock, `files.exclusive`) is refused in one line, since its files may belong to different models; a
    training run pushes its own final model under the lock it holds.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {output_dir}")
    with exclusive(output_dir):
        missing = missing_checkpoint_files(output_dir)
        if missing:
            raise FileNotFoundError(f"{output_dir} is not a complete checkpoint; missing: {', '.join(missing)}; "
                                    f"{RECOPY}.")
        check_checkpoint_files(output_dir)

        api = HfApi(token=token)
        # The Hub puts a bare name ("en-fr") under the token owner's namespace; the card should name the full id.
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        readme = output_dir / "README.md"
        if not readme.is_file():
            logger.info("No README.md in %s: writing a model card without scores.", output_dir)
            write_model_card(output_dir, repo_id=repo_id)
        elif REPO_ID_PLACEHOLDER in (text := readme.read_text(encoding="utf-8")):
            write_atomically(readme, text.replace(REPO_ID_PLACEHOLDER, repo_id))
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=output_dir,
            commit_message=commit_message,
            allow_patterns=_upload_files(output_dir),
            # Weights of the model this one replaces, in the same commit: transformers reads model.safetensors
            # before an index of shards, so an old single file beside new shards would load the old model.
            delete_patterns=WEIGHT_PATTERNS,
        )
    return commit.commit_url


def _upload_files(output_dir: Path) -> list[str]:
    """The checkpoint's files that `push_to_hub` uploads (see UPLOAD_PATTERNS), as paths relative to `output_dir`.
    Listed rather than given as patterns: huggingface_hub's patterns match across directories ("*.json" also
    matches "checkpoint-10/config.json")."""
    top_level = [path.name for path in output_dir.iterdir()
                 if path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in UPLOAD_PATTERNS)]
    return sorted(top_level) + [name for name in CUSTOM_GENERATE_FILES if (output_dir / name).is_file()]


_PAPER = "[Vaswani et al., 2017, *Attention Is All You Need*](https://arxiv.org/abs/1706.03762)"


def how_to_load(repo: str) -> str:
    """The model card's "How to use" section for `repo` (also used by `vaswani.convert` for converted models)."""
    return f"""## How to use

With the `vaswani` package installed, importing it registers the model with transformers:

```python
import vaswani
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

model = AutoModelForSeq2SeqLM.from_pretrained("{repo}")
tokenizer = AutoTokenizer.from_pretrained("{repo}")
inputs = tokenizer(["How are you?"], return_tensors="pt")
print(tokenizer.batch_decode(model.generate(**inputs, num_beams=4), skip_special_tokens=True))

translator = pipeline("translation", model=model, tokenizer=tokenizer)
print(translator(["How are you?", "I am calm."], num_beams=4))
```

Without it, the model, tokenizer and translation pipeline code that ship in this repository are used
(read them first, as with any remote code):

```python
from transformers import AutoModelForSeq2SeqLM, pipeline

model = AutoModelForSeq2SeqLM.from_pretrained("{repo}", trust_remote_code=True)
translator = pipeline("translation", model="{repo}", trust_remote_code=True)
print(translator("How are you?", num_beams=4))  # [{{'translation_text': '...'}}]
```
"""


def _scores_section(scores: dict[str, float], split: str, signatures: dict[str, str]) -> str:
    """The scores table; with sacreBLEU's signatures (as `score_corpus` returns them), the exact settings too."""
    # A signature's "|" separators would end the table cell unless escaped (GitHub-flavoured Markdown tables).
    cells = {name: f"`{signature}`".replace("|", "\\|") for name, signature in signatures.items()}
    rows = "\n".join(
        f"| {_REPORTED_METRICS[name]} | {value:.2f} | {cells.get(name, '')} |" for name, value in scores.items()
    )
    return (
        f"## Evaluation\n\nCorpus-level scores on the {split} split, computed with sacreBLEU {sacrebleu.__version__} "
        "at its default settings (BLEU: 13a tokenization, exponential smoothing; chrF: character 6-grams, β=2; "
        "TER: lower is better), against all available references of each sentence.\n\n"
        f"| metric | score | sacreBLEU signature |\n|---|---|---|\n{rows}\n"
    )


def _code_files(model_dir: Path) -> set[str]:
    """Module files named by `auto_map` / `custom_pipelines` entries ("module.Class"); entries pointing into
    another repository ("owner/repo--module.Class") are fetched from there and need no local file."""
    references = []
    for name in ("config.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.is_file():
            config = read_json_object(path, RECOPY)
            for value in config.get("auto_map", {}).values():
                references += value if isinstance(value, list) else [value]
            references += [entry["impl"] for entry in config.get("custom_pipelines", {}).values()]
    return {f"{ref.rsplit('.', 1)[0]}.py" for ref in references if ref and "--" not in ref}


def _bare(metric_name: str) -> str:
    return metric_name.removeprefix("test_")


def _format(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
