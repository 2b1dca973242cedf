#!/usr/bin/env bash
# The quality bar of the training issue, on one GPU: the `base` preset, a 300 s training budget, then
# multi-reference BLEU (beam 4) on the held-out fra-eng test split. Writes
# benchmarks/results/gpu_quality_<timestamp>.json with the command, BLEU/chrF/TER, steps and throughput.
# Knobs (environment): TRAIN_SECONDS (300), MAX_TOKENS (12000 per batch), WARMUP (1000), LR (7e-4), OUTPUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
TRAIN_SECONDS=${TRAIN_SECONDS:-300}
MAX_TOKENS=${MAX_TOKENS:-12000}
WARMUP=${WARMUP:-1000}
LR=${LR:-7e-4}
OUTPUT_DIR=${OUTPUT_DIR:-outputs/gpu-quality-base}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p benchmarks/results
rm -rf "$OUTPUT_DIR"

# Adam β2=0.98 and ε=1e-9 and the inverse-square-root schedule are the paper's (§5.3); with a 300 s budget the
# warm-up is shortened from 4000 steps and the peak rate set directly.
COMMAND=(python3 scripts/train_translation.py --preset base --vocab_size 16000 --output_dir "$OUTPUT_DIR"
  --max_train_time "$TRAIN_SECONDS" --num_train_epochs 1000 --bf16 --tf32 true
  --max_tokens_per_batch "$MAX_TOKENS" --learning_rate "$LR" --lr_scheduler_type inverse_sqrt
  --warmup_steps "$WARMUP" --adam_beta2 0.98 --adam_epsilon 1e-9 --weight_decay 0.0
  --eval_strategy no --save_strategy no --logging_steps 100 --report_to tensorboard
  --predict_with_generate --generation_num_beams 4 --per_device_eval_batch_size 256
  --dataloader_num_workers 2 --include_num_input_tokens_seen non_padding --seed 0)
"${COMMAND[@]}"

python3 - "$OUTPUT_DIR" "benchmarks/results/gpu_quality_${STAMP}.json" "${COMMAND[*]}" <<'PY'
import json, sys, torch, transformers
out_dir, result_path, command = sys.argv[1:]
metrics = json.load(open(f"{out_dir}/metrics.json"))
record = {
    "command": command,
    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    "torch": torch.__version__, "transformers": transformers.__version__,
    "metrics": metrics,
    "target": "multi-reference BLEU (beam 4) >= 56 on held-out fra-eng; MarianMTModel same size ~52",
}
json.dump(record, open(result_path, "w"), indent=2)
print(json.dumps(record, indent=2))
PY
