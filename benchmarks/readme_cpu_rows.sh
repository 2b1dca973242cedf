#!/usr/bin/env bash
# The README's CPU rows, measured again on the current code and one trained main-job model (scripts/main_job.sh), on
# a machine with nothing else running: translation speed (each sentence to its end, beside forced lengths) of the
# PyTorch engine in fp32 and bf16 against Marian and CTranslate2 fp32 and int8 (the checkpoint's export); training
# tokens/s of tiny and base against Marian; test BLEU in fp32, bf16 (PyTorch) and int8 (CTranslate2, the scripts' only
# int8); scripts/translate.py's streamed file translation against the whole-file sort.
#
#   MODEL=outputs/en-fr-small THREADS=2 bash benchmarks/readme_cpu_rows.sh
# Knobs: MODEL, THREADS, SENTENCES (test sentences per measurement), RESULTS_DIR, SUFFIX (added to the result names),
# STAGES (a subset of "translation training bleu streaming", the default).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${MODEL:-outputs/en-fr-small}
threads=${THREADS:-2}
sentences=${SENTENCES:-1000}
results=${RESULTS_DIR:-benchmarks/results}
suffix=${SUFFIX:-}
stages=" ${STAGES:-translation training bleu streaming} "
export OMP_NUM_THREADS=$threads
mkdir -p "$results"

if [[ $stages == *" translation "* ]]; then
python3 benchmarks/bench_translation.py --device cpu --threads "$threads" --batch_sizes 32 --model "$model" \
  --num_sentences "$sentences" --repeats 2 --keep_freed_memory \
  --engines vaswani,vaswani-bf16,marian,marian-bf16,ct2-float32,ct2-int8 \
  --results_dir "$results" --output_name "translation-{device}-main-job-model$suffix"
fi

if [[ $stages == *" training "* ]]; then
python3 benchmarks/bench_training.py --device cpu --threads "$threads" --sizes tiny,base --batch_tokens 2048 \
  --steps 10 --keep_freed_memory --results_dir "$results" --output_name "training-{device}$suffix"
fi

if [[ $stages == *" bleu "* ]]; then
# evaluate_bleu.py's output files hold the test sources, which stay out of the repository: only the scores are kept.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
commands=()
for precision in float32 bfloat16 int8; do
  if [ "$precision" = int8 ]; then option=(--ctranslate2 --compute_type int8); else option=(--dtype "$precision"); fi
  command=(python3 scripts/evaluate_bleu.py --model "$model" --device cpu "${option[@]}" --num_beams 4
           --max_samples "$sentences" --output_file "$scratch/$precision.json")
  "${command[@]}" > /dev/null
  commands+=("$(printf '%q ' "${command[@]}")")
done
python3 - "$results/precision-bleu-cpu$suffix" "$scratch" "$model" "${commands[@]}" <<'PY'
import json, platform, subprocess, sys
import torch
name, scratch, model, *commands = sys.argv[1:]
scores = {}
for precision in ("float32", "bfloat16", "int8"):
    result = json.load(open(f"{scratch}/{precision}.json"))
    scores[precision] = {key: result[key] for key in ("bleu", "chrf", "ter", "sentences", "num_beams", "signatures")}
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
           platform.processor())
json.dump({"commands": commands, "model": model, "cpu": cpu, "torch_threads": torch.get_num_threads(),
           "torch": torch.__version__, "git_commit": commit, "results": scores}, open(f"{name}.json", "w"), indent=1)
rows = [f"| {p} | {s['bleu']:.2f} | {s['chrf']:.2f} | {s['ter']:.2f} |" for p, s in scores.items()]
text = ["# Test BLEU of one model in fp32, bf16 and int8, on a CPU", "", "```bash", *commands, "```", "",
        f"Model: `{model}`. Device: {cpu}, {torch.get_num_threads()} threads; torch {torch.__version__}; commit "
        f"{commit}. Beam 4, all references, the first {scores['float32']['sentences']} test sentences; sacreBLEU "
        f"signatures in the JSON file beside this one.", "",
        "| precision | BLEU | chrF | TER |", "|---|---|---|---|", *rows]
open(f"{name}.md", "w").write("\n".join(text) + "\n")
print("\n".join(rows))
PY
fi

if [[ $stages == *" streaming "* ]]; then
python3 benchmarks/bench_streaming.py --model "$model" --stages whole_file --threads "$threads" \
  --compare_sentences "$sentences" --repeats 2 --results_dir "$results" \
  --output_name "streaming-{device}-whole-file$suffix"
fi
