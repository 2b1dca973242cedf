"""One process of test_file_translation's multi-process runs: `translate_file` on each (input, output, chunk_lines)
of a plan, one after another in one process group (a launch can start one group only), with process
0's chunks slowed down so that the others finish their share of each file well before it. They must wait for it,
running, at the end of every file. To show a process that left instead, process 0 waits before its first chunk of
the last file until the others have ended (up to 5 s, which waiting processes cost the run), while they translate
their share of it: one that left is then seen to have ended."""

import json
import os
import sys
import time

import torch.distributed as dist
from transformers import AutoTokenizer

import vaswani.file_translation as file_translation
from vaswani import VaswaniForConditionalGeneration
from vaswani.loading import engine_for_model
from vaswani.peers import is_running


def main() -> None:
    checkpoint, plan = sys.argv[1], json.loads(sys.argv[2])
    engine = engine_for_model(VaswaniForConditionalGeneration.from_pretrained(checkpoint),
                              AutoTokenizer.from_pretrained(checkpoint), num_beams=1, max_new_tokens=8)
    # One group for the plan (a launch can start one only): each file's end is translate_file's barrier, and the
    # group is destroyed after the last.
    dist.init_process_group("gloo")
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda: None
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    wait_for_the_others = False

    def slow_chunk(*args, **kwargs):
        nonlocal wait_for_the_others
        deadline = time.monotonic() + (5 if wait_for_the_others else 0.2)
        while time.monotonic() < deadline and not (wait_for_the_others and not any(map(is_running, pids[1:]))):
            time.sleep(0.05)
        wait_for_the_others = False
        return chunk(*args, **kwargs)

    if dist.get_rank() == 0:
        chunk, file_translation.translate_chunk = file_translation.translate_chunk, slow_chunk
    for number, (input_file, output_file, chunk_lines) in enumerate(plan, 1):
        wait_for_the_others = number == len(plan)
        file_translation.translate_file(engine, input_file, output_file, chunk_lines=chunk_lines, progress=False)
    destroy()


if __name__ == "__main__":
    main()
