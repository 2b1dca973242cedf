#!/usr/bin/env bash
# One candidate recipe for the main job, judged on the first 1,000 validation sentences (BLEU/chrF, beam 4, all
# references; the test score is reported, never used to choose): the main job's training with extra
# train_translation.py arguments. Appends a JSON line to benchmarks/results/main-job-recipes.jsonl.
#
#   bash benchmarks/main_job_recipe.sh NAME [train_translation.py arguments...]
#   TRAIN_SECONDS=300 bash benchmarks/main_job_recipe.sh linear-decay --lr_scheduler_type linear --lr_decay_over_time_budget
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1; shift
out=${RECIPE_DIR:-outputs/recipes}/$name
export OUTPUT_DIR=$out TEST_SENTENCES=${TEST_SENTENCES:-1000} TRAIN_SECONDS=${TRAIN_SECONDS:-600}
start=$(date +%s)
bash scripts/main_job.sh "$@" --logging_steps 25 > "$out.log" 2>&1 || { tail -20 "$out.log"; exit 1; }
python3 scripts/evaluate_bleu.py --model "$out" --split validation --max_samples 1000 --num_beams 4 \
  --output_file "$out/validation.json" > /dev/null
python3 - "$name" "$out" "$start" "$*" <<'PY'
import json, subprocess, sys, time
name, out, start, arguments = sys.argv[1:]
train = json.load(open(f"{out}/metrics.json"))
valid = json.load(open(f"{out}/validation.json"))
config = json.load(open(f"{out}/config.json"))
row = {
    "recipe": name, "extra_arguments": arguments, "train_seconds": round(train["train_wall_seconds"]),
    "steps": round(train["train_runtime"] * train["train_steps_per_second"]),
    "steps_per_second": train["train_steps_per_second"], "train_loss": round(train["train_loss"], 3),
    "validation_bleu": round(valid["bleu"], 2), "validation_chrf": round(valid["chrf"], 2),
    "test_bleu_reported_only": round(train["test_bleu"], 2), "test_sentences": train["test_sentences"],
    "shape": {k: config[k] for k in ("d_model", "encoder_layers", "decoder_layers", "d_ff", "vocab_size")},
    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "end_to_end_seconds": round(time.time() - int(start)),
}
with open("benchmarks/results/main-job-recipes.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")
print(json.dumps(row))
PY
