#!/usr/bin/env python
"""Train (or fine-tune) a Vaswani En→Fr translator; every Seq2SeqTrainingArguments flag works.

    python scripts/train_translation.py --preset small --output_dir outputs/en-fr --max_train_time 600
    torchrun --nproc_per_node 8 scripts/train_translation.py ...     # DDP; with --fsdp, FSDP2 (GPUs only)

SIGTERM or SIGINT (a preempted job) writes a checkpoint at the next step and exits with status 143 or 130, printing
the command that resumes the run. A second run on the same --output_dir is refused while this one runs.
"""

import contextlib
import json
import logging
import sys
from pathlib import Path

from transformers import HfArgumentParser

from vaswani.cli import user_errors_exit
from vaswani.inference import keep_freed_cpu_memory
from vaswani.peers import ending_process_group
from vaswani.training import DataArguments, ModelArguments, VaswaniTrainingArguments, run_training

from shared_corpus import SHARED_CORPUS  # beside this script


@user_errors_exit
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = HfArgumentParser((ModelArguments, DataArguments, VaswaniTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    data_args.default_corpus = str(SHARED_CORPUS)
    # The package's own messages (what was read, trained or reused from the cache) at the Trainer's --log_level.
    logging.basicConfig(format="[%(name)s] %(message)s")
    logging.getLogger("vaswani").setLevel(training_args.get_process_log_level())
    if training_args.device.type == "cpu":  # process-wide, hence here: no page faults on the large tensors of a step
        keep_freed_cpu_memory(largest_block_mib=None)
    # The Trainer prints its progress logs on stdout; keep stdout for the final metrics, which scripts parse.
    with ending_process_group(), contextlib.redirect_stdout(sys.stderr):
        # The model card records the command line as this script received it.
        metrics = run_training(model_args, data_args, training_args, command=[Path(__file__).name, *argv])
    if training_args.process_index == 0:
        print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
