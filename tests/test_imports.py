"""What a command-line tool imports as it starts. Every tool pays for `import vaswani` (transformers' modeling stack,
which registering the Auto classes needs); on top of that, a tool that neither trains nor reads a corpus imports no
training or plotting library before the one function that uses it does."""

import subprocess
import sys

import transformers.trainer

from conftest import SCRIPTS, subprocess_env
from vaswani import checkpoints

# The tools that neither train nor read a corpus, in the order they are imported below.
TOOLS = ["translate", "export_ctranslate2", "visualize_attention", "average_checkpoints", "push_to_hub",
         "convert_llama", "convert_marian"]
# What none of them may import as it starts: datasets (with pandas and pyarrow, about half a second), which only
# training and corpus reading use (`vaswani.batching` imports it for `example_lengths` alone); transformers.trainer,
# which imports datasets too; matplotlib, which only `vaswani.visualize.plot_attention` draws with; evaluate, which
# only `vaswani.evaluator` uses; ctranslate2, which only an engine that decodes with it (or exports to it) needs.
DEFERRED = ["datasets", "transformers.trainer", "matplotlib", "evaluate", "ctranslate2"]

CHECK = f"""
import importlib, sys
sys.path.insert(0, {str(SCRIPTS)!r})
for name in ["vaswani", *{TOOLS!r}]:
    importlib.import_module(name)
    loaded = [module for module in {DEFERRED!r} if module in sys.modules]
    if loaded:
        raise SystemExit(f"importing {{name}} imported {{', '.join(loaded)}}")
"""


def test_tools_that_neither_train_nor_read_a_corpus_start_without_what_only_other_commands_use():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300,
                            env=subprocess_env())
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_trainer_state_file_is_named_as_the_trainer_names_it():
    """`vaswani.checkpoints` names the file itself so as not to import transformers.trainer."""
    assert checkpoints.TRAINER_STATE_NAME == transformers.trainer.TRAINER_STATE_NAME
