#!/usr/bin/env bash
# The main job, end to end on CPU: set up, train a small En→Fr Transformer on the Tatoeba fra-eng corpus within a
# time budget, report multi-reference BLEU/chrF/TER on the held-out test split, translate the seed sentences and
# write attention heatmaps. Corpus: $VASWANI_FRA_ENG, else ../shared/data/fra-eng/fra_eng.tsv.gz, else a download.
# Knobs (environment): OUTPUT_DIR, TRAIN_SECONDS, TEST_SENTENCES.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

OUTPUT_DIR=${OUTPUT_DIR:-outputs/en-fr-small}
TRAIN_SECONDS=${TRAIN_SECONDS:-480}
TEST_SENTENCES=${TEST_SENTENCES:-1000}
rm -rf "$OUTPUT_DIR"

python3 scripts/train_translation.py \
  --preset small --vocab_size 8000 \
  --output_dir "$OUTPUT_DIR" \
  --max_train_time "$TRAIN_SECONDS" --num_train_epochs 50 \
  --max_tokens_per_batch 6000 --paper_recipe --warmup_steps 800 \
  --eval_strategy no --save_strategy no --logging_steps 50 --report_to tensorboard \
  --predict_with_generate --generation_num_beams 4 --per_device_eval_batch_size 64 \
  --max_test_samples "$TEST_SENTENCES" --seed 0

echo "== Seed sentences =="
python3 scripts/translate.py --model "$OUTPUT_DIR" --num_beams 4 "I lost." "I'm calm." "I'm home."

echo "== Attention heatmaps =="
python3 scripts/visualize_attention.py --model "$OUTPUT_DIR" --source "I'm calm." --output_dir "$OUTPUT_DIR/attention"

echo "Done: model, tokenizer, model card and metrics in $OUTPUT_DIR (data: Tatoeba via manythings.org, CC-BY 2.0)."
