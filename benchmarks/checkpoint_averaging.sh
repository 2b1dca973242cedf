#!/usr/bin/env bash
# Checkpoint averaging (§6.1) on the main job's recipe, a checkpoint every SAVE_SECONDS, the final model the average
# of the last AVERAGE: test BLEU/chrF (beam 4, all references) of the last checkpoint alone and of the averages of its
# last 2 … AVERAGE (scripts/average_checkpoints.py), as JSON.
#
#   TRAIN_SECONDS=240 SAVE_SECONDS=30 AVERAGE=5 TEST_SENTENCES=500 bash benchmarks/checkpoint_averaging.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUTPUT_DIR:-outputs/checkpoint-averaging}
average=${AVERAGE:-5}
mkdir -p "$(dirname "$out")"
export OUTPUT_DIR=$out TRAIN_SECONDS=${TRAIN_SECONDS:-240} TEST_SENTENCES=${TEST_SENTENCES:-500}
bash scripts/main_job.sh --save_interval_seconds "${SAVE_SECONDS:-30}" --average_last_checkpoints "$average" \
  "$@" > "$out.log" 2>&1 || { tail -20 "$out.log"; exit 1; }
last=$(ls -d "$out"/checkpoint-* | awk -F- '{print $NF, $0}' | sort -n | tail -1 | cut -d' ' -f2-)
evaluate() { python3 scripts/evaluate_bleu.py --model "$1" --max_samples "$TEST_SENTENCES" --num_beams 4 \
  --output_file "$2" > /dev/null; }
evaluate "$last" "$out/test-last-1.json"
for n in $(seq 2 $((average - 1))); do
  python3 scripts/average_checkpoints.py --inputs "$out" --last "$n" --output_dir "$out-average-$n" --force > /dev/null
  evaluate "$out-average-$n" "$out/test-last-$n.json"
done
python3 - "$out" "$average" <<'PY'
import glob, json, sys
out, average = sys.argv[1], int(sys.argv[2])
final = json.load(open(f"{out}/metrics.json"))
steps = sorted(json.load(open(f"{path}/trainer_state.json"))["global_step"] for path in glob.glob(f"{out}/checkpoint-*"))
rows = {n: json.load(open(f"{out}/test-last-{n}.json")) for n in range(1, average)}
rows[average] = {"bleu": final["test_bleu"], "chrf": final["test_chrf"]}
print(json.dumps({
    "train_steps": final["train_steps"], "train_loss": round(final["train_loss"], 3), "checkpoint_steps": steps,
    "test_sentences": final["test_sentences"],
    "test": [{"checkpoints_averaged": n, "steps": steps[-n:], "bleu": round(rows[n]["bleu"], 2),
              "chrf": round(rows[n]["chrf"], 2)} for n in sorted(rows)],
}, indent=2))
PY
