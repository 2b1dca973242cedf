#!/usr/bin/env bash
# Checkpoint averaging (§6.1) on the main job's recipe: a timed run writing a checkpoint every SAVE_SECONDS whose
# final model is the average of the last AVERAGE checkpoints (train_translation.py --average_last_checkpoints), then
# the same test sentences translated by the last checkpoint alone. Test BLEU/chrF (beam 4, all references) of both.
#
#   TRAIN_SECONDS=240 SAVE_SECONDS=30 AVERAGE=5 TEST_SENTENCES=500 bash benchmarks/checkpoint_averaging.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUTPUT_DIR:-outputs/checkpoint-averaging}
mkdir -p "$(dirname "$out")"
export OUTPUT_DIR=$out TRAIN_SECONDS=${TRAIN_SECONDS:-240} TEST_SENTENCES=${TEST_SENTENCES:-500}
bash scripts/main_job.sh --save_interval_seconds "${SAVE_SECONDS:-30}" --average_last_checkpoints "${AVERAGE:-5}" \
  "$@" > "$out.log" 2>&1 || { tail -20 "$out.log"; exit 1; }
last=$(ls -d "$out"/checkpoint-* | sort -t- -k2 -n | tail -1)
python3 scripts/evaluate_bleu.py --model "$last" --max_samples "$TEST_SENTENCES" --num_beams 4 \
  --output_file "$out/last-checkpoint-test.json" > /dev/null
python3 - "$out" "$last" <<'PY'
import json, sys
out, last = sys.argv[1:]
averaged, single = json.load(open(f"{out}/metrics.json")), json.load(open(f"{out}/last-checkpoint-test.json"))
steps = [json.load(open(f"{path}/trainer_state.json"))["global_step"]
         for path in sorted(__import__("glob").glob(f"{out}/checkpoint-*"), key=lambda p: int(p.rsplit("-", 1)[1]))]
print(json.dumps({
    "train_steps": averaged["train_steps"], "checkpoint_steps": steps, "averaged_checkpoints": averaged["averaged_checkpoints"],
    "test_sentences": averaged["test_sentences"],
    "last_checkpoint": {"checkpoint": last.rsplit("/", 1)[1], "bleu": round(single["bleu"], 2), "chrf": round(single["chrf"], 2)},
    "average": {"bleu": round(averaged["test_bleu"], 2), "chrf": round(averaged["test_chrf"], 2)},
}, indent=2))
PY
