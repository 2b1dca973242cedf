#!/usr/bin/env bash
# The main job, end to end on CPU: set up, train a small En→Fr Transformer on the Tatoeba fra-eng corpus within a
# time budget, report multi-reference BLEU/chrF/TER on the held-out test split, translate the seed sentences and
# write attention heatmaps. Corpus: $VASWANI_FRA_ENG, else scripts/shared_corpus.py's, else a download.
# Knobs (environment): OUTPUT_DIR, TRAIN_SECONDS, TEST_SENTENCES; arguments are passed on to train_translation.py
# after the recipe's own, so they override it (benchmarks/results/main-job-recipes.md tried recipes that way).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

OUTPUT_DIR=${OUTPUT_DIR:-outputs/en-fr-small}
TRAIN_SECONDS=${TRAIN_SECONDS:-600}
TEST_SENTENCES=${TEST_SENTENCES:-1000}
rm -rf "$OUTPUT_DIR"

# --preset auto sizes the model to this machine and budget: it times a few steps of each size in vaswani.sizing (in
# the budget) and trains the one whose steps in what is left predict the best validation BLEU
# (benchmarks/results/main-job-sizes.md), at that size's peak learning rate (vaswani.sizing.PEAK_LEARNING_RATE, which
# a --learning_rate here would override).
# On two CPU cores the budget covers about one epoch. Batches of 1,000 tokens (twice the steps of 2,000-token ones
# at nearly the same tokens/s), a 400-step warm-up to a fixed peak, then its inverse square root (the paper's
# schedule shape with Adam β2 0.98, §5.3; 400 steps against shorter and longer warm-ups), all chosen on the
# validation split (benchmarks/results/main-job-recipes.md), and no dropout, which only slows a model that sees
# each sentence about once. Label smoothing 0.1 stays (§5.4); beam 4 with length penalty 0.6 (§6.1,
# train_translation.py's default) decodes. Where the CPU multiplies bf16 faster than fp32 (AMX or AVX512-BF16, timed:
# vaswani.loading.cpu_multiplies_bf16), training runs under bf16 autocast with eager attention (in this script sdpa's
# bf16 steps are slower), which fits more steps in the budget (benchmarks/results/training-cpu-bf16-dropout0.md);
# weights stay float32. Where its bf16 products are slower, bf16 would halve the steps (cpu-bf16-products.md).
precision=()
if python3 -c "import sys, torch; from vaswani.loading import cpu_multiplies_bf16
sys.exit(torch.cuda.is_available() or not cpu_multiplies_bf16())" 2>/dev/null; then
  precision=(--bf16 --use_cpu --attn_implementation eager)
fi
python3 scripts/train_translation.py \
  --preset auto --vocab_size 8000 --config_overrides dropout=0.0 "${precision[@]}" \
  --output_dir "$OUTPUT_DIR" \
  --max_train_time "$TRAIN_SECONDS" --num_train_epochs 10 \
  --max_tokens_per_batch 1000 --lr_scheduler_type inverse_sqrt --warmup_steps 400 \
  --adam_beta2 0.98 --adam_epsilon 1e-9 --weight_decay 0.0 \
  --eval_strategy no --save_strategy no --logging_steps 50 --report_to tensorboard \
  --generation_num_beams 4 --per_device_eval_batch_size 64 \
  --max_test_samples "$TEST_SENTENCES" --seed 0 "$@"

# Which engine translates this model on this CPU, chosen once and written beside it (engine_choice.json): the engines
# that give its translations are timed on the test split's sources in translate.py's batches, and every later
# translate.py / evaluate_bleu.py run on this machine reads the choice (vaswani.engine_choice). On a GPU they decode
# there, so nothing is timed.
if python3 -c "import sys, torch; sys.exit(torch.cuda.is_available())"; then
  echo "== Engine choice on this CPU =="
  python3 scripts/choose_engine.py --model "$OUTPUT_DIR"
fi

echo "== Seed sentences =="
python3 scripts/translate.py --model "$OUTPUT_DIR" --num_beams 4 "I lost." "I'm calm." "I'm home."

echo "== Attention heatmaps =="
python3 scripts/visualize_attention.py --model "$OUTPUT_DIR" --source "I'm calm." --output_dir "$OUTPUT_DIR/attention"

echo "Done: model, tokenizer, model card and metrics in $OUTPUT_DIR (data: Tatoeba via manythings.org, CC-BY 2.0)."
