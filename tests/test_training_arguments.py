"""The training script's arguments (`vaswani.training_arguments`): what they refuse, before anything is written."""

import pytest

from conftest import script_main
from training_script import train_args
from vaswani.tokenization import TRUNCATION_TOKENS
from vaswani.training_arguments import DataArguments, VaswaniTrainingArguments, scheduler_name


@pytest.mark.parametrize("extra, message", [
    (["--lr_decay_over_time_budget"], "needs --max_train_time"),
    (["--lr_decay_over_time_budget", "--max_train_time", "5", "--lr_scheduler_type", "inverse_sqrt"], "linear or cosine"),
    (["--lr_decay_over_time_budget", "--max_train_time", "5", "--lr_scheduler_type", "linear", "--paper_recipe"],
     "Pass one of them"),
    (["--ema_decay", "1.5"], "between 0 and 1"),
    (["--attn_implementation", "fastest"], "Unknown --attn_implementation 'fastest'"),
    (["--average_last_checkpoints", "5"], "write some with --save_interval_seconds"),
    (["--average_last_checkpoints", "5", "--save_interval_seconds", "60", "--save_total_limit", "3"],
     "keeps fewer checkpoints"),
    (["--average_last_checkpoints", "5", "--save_interval_seconds", "60", "--ema_decay", "0.9"], "Pass one of them"),
    (["--save_interval_seconds", "0"], "must be positive"),
])
def test_schedule_and_averaging_options_refuse_what_they_cannot_do(tmp_path, extra, message, capsys):
    """In this process (a process each took 6 s to start): the script's own parsing and checks, as from a shell."""
    with pytest.raises(SystemExit) as exit_info:
        script_main("train_translation")(train_args(tmp_path / "none.tsv", tmp_path / "out", *extra))
    stderr = capsys.readouterr().err
    assert exit_info.value.code != 0 and message in stderr, stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_training_truncates_as_tokenization_does_and_names_its_schedule_plainly(tmp_path):
    """The truncation default is the package's one (`tokenization.TRUNCATION_TOKENS`); `scheduler_name`, the one
    reading of --lr_scheduler_type, gives the plain name whatever the Trainer turned the flag into."""
    assert DataArguments().max_length == TRUNCATION_TOKENS
    args = VaswaniTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, lr_scheduler_type="cosine")
    assert type(args.lr_scheduler_type).__name__ == "SchedulerType" and scheduler_name(args) == "cosine"
