#!/usr/bin/env bash
# Every GPU measurement in one unattended command, most valuable first. Each stage writes its results as it
# finishes. A stage is given only the time left in the budget (BUDGET_SECONDS, default 540), so a timeout loses only
# the stage it cut short.
#
#   bash benchmarks/gpu_session.sh                 # the plan, below
#   bash benchmarks/gpu_session.sh --dry_run       # the same plan at tiny sizes on any machine (CPU included): checks
#                                                  #   every package, path and argument before GPU time is spent
#   bash benchmarks/gpu_session.sh STAGE …         # chosen stages only, in order
#
# The plan, each stage alone on the GPU: `training` (bench_training.py's step-rate probe: base, bf16, 4,000, 12,000
# and 25,000-token batches, 30 s a setting, Vaswani eager and compiled against Marian), `training-graphs` (the same at
# 4,000 and 12,000 tokens on train_translation.py --shape_buckets 4's batches, compiled with CUDA graphs; a stage of
# its own so that its compilations cannot cost the probe its results), `quality` (gpu_quality.py: 300 s of base,
# beam-4 test BLEU), `translation-trained` (bench_translation.py on the quality run's model, beam 4, batch 256,
# 3,000 test sentences to their end: generate(), the lean loop, CUDA graphs, the slots, Marian) and `tests` (pytest
# -m gpu). The plan is longer than one call, so a session runs it in three: `quality-prepare training`,
# `training-graphs quality`, then `translation-trained tests`. Other stages: translation, translation-compiled,
# translation-batch1, scaling, profile, attention (random weights).
#
# Results go to $RESULTS_DIR (default benchmarks/results), logs beside them; with $ARCHIVE set, the results folder is
# also packed into that .tar.gz after every stage (a device machine returns few files). Wheels in .whl/
# (benchmarks/gpu_prepare.sh gathers them, and the corpus) are installed into a scratch directory first
# (INSTALL_WHEELS=0 skips them, for a dry run on a machine whose Python is not the device's).
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
if [ "${1:-}" = --dry_run ]; then dry_run=1; shift; fi
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(plan)
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
BUDGET_SECONDS=${BUDGET_SECONDS:-540}
ARCHIVE=${ARCHIVE:-}
mkdir -p "$RESULTS_DIR"

if [ "${INSTALL_WHEELS:-1}" = 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
    # datasets 5 needs pyarrow ≥ 24; where the machine's pyarrow is older, datasets 4.0 (our floor) and its pins.
    wheels=(.whl/*.whl)
    if compgen -G ".whl/datasets4/*.whl" > /dev/null &&
        ! python3 -c "import sys, pyarrow; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null; then
        wheels=($(ls .whl/*.whl | grep -v -E '/(datasets|dill|multiprocess|fsspec)-') .whl/datasets4/*.whl)
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${wheels[@]}" || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
python3 - <<'EOF' || exit 1
import importlib
import torch
for name in ("torch", "transformers", "tokenizers", "datasets", "accelerate", "evaluate", "sacrebleu", "pyarrow", "safetensors"):
    print(name, importlib.import_module(name).__version__)
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
EOF

left() { echo $((BUDGET_SECONDS - SECONDS)); }
publish() {  # pack the results folder into $ARCHIVE (atomically: a kill mid-way leaves the last complete pack)
    [ -n "$ARCHIVE" ] || return 0
    tar -czf "$ARCHIVE.$BASHPID" -C "$RESULTS_DIR" . && mv -f "$ARCHIVE.$BASHPID" "$ARCHIVE"
}
run() {  # run a command under a time limit (seconds), logging its output; return its exit status
    local limit=$1 log=$2
    shift 2
    if [ "$limit" -le 5 ]; then echo "skipped, no time left: $*" | tee -a "$log"; return 1; fi
    echo "\$ $* (limit ${limit} s)" >> "$log"
    timeout --kill-after 10 "$limit" "$@" 2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
}
at_most() { local a=$1 b=$2; echo $((a < b ? a : b)); }
device_args=() dry=()  # what a dry run adds to the benchmarks' and the GPU scripts' arguments
[ $dry_run = 1 ] && device_args=(--device cpu --threads 2) dry=(--dry_run)

stage() {
    local stage=$1 log="$RESULTS_DIR/gpu-$1.log"
    echo "== $stage at ${SECONDS} s, $(left) s left" | tee -a "$log"
    case $stage in
        tests)  # CUDA-only tests; without CUDA they are all skipped (the dry run checks only that they collect)
            # -v: each result is in the log as it happens, should a crash end the run; the compiled CUDA graphs
            # (which segfaulted inductor's launcher on the last GPU) run last, alone.
            run "$(at_most 300 "$(left)")" "$log" python3 -m pytest -v -m gpu tests/ -k "not (cuda_graphs and compiled)" \
                -p no:cacheprovider
            local first=$?
            run "$(at_most 120 "$(left)")" "$log" python3 -m pytest -v -m gpu tests/ \
                -k "cuda_graphs and compiled" -p no:cacheprovider && [ $first = 0 ] ;;
        quality-prepare)
            run "$(left)" "$log" python3 benchmarks/gpu_quality.py --prepare_only "${dry[@]}" ;;
        quality)
            run "$(left)" "$log" python3 benchmarks/gpu_quality.py --results_dir "$RESULTS_DIR" "${dry[@]}" ;;
        training)
            local size=(--sizes base --batch_tokens 4000,12000,25000 --steps 10 --seconds_per_setting 30
                        --engines vaswani-compiled,vaswani,marian)
            [ $dry_run = 1 ] && size=(--sizes tiny --batch_tokens 256,512 --steps 1 --warmup_steps 1
                                      --seconds_per_setting 1 --engines vaswani-compiled,vaswani,marian)
            # About 5 minutes: at each budget the three engines take turns until Marian, the slowest, has had 30 s.
            run "$(at_most 480 "$(left)")" "$log" python3 benchmarks/bench_training.py "${device_args[@]}" \
                --results_dir "$RESULTS_DIR" "${size[@]}" ;;
        training-graphs)  # without CUDA (the dry run) the -graphs engine is skipped; the bucketed batches are not
            local size=(--sizes base --batch_tokens 4000,12000 --steps 10 --seconds_per_setting 30)
            [ $dry_run = 1 ] && size=(--sizes tiny --batch_tokens 256,512 --steps 1 --seconds_per_setting 1)
            # About 7 minutes: 4 static compilations per budget in the warm-up, then 30 s of Marian per budget. 4 is
            # where bucketing stops adding padding on this corpus; the report's settings give each padding fraction.
            run "$(at_most 480 "$(left)")" "$log" python3 benchmarks/bench_training.py "${device_args[@]}" \
                --results_dir "$RESULTS_DIR" "${size[@]}" --shape_buckets 4 \
                --engines vaswani-compiled-graphs,vaswani-compiled,marian --output_name "training-graphs-{device}" ;;
        translation-trained)  # the quality run's model, as users translate; random weights if it has none
            # Every engine runs in its own process (--keep_going), so one that crashes costs only its own rows; each
            # row counts the translations identical to the lean loop's.
            local model=() engines=vaswani,vaswani-lean,vaswani-graphs,vaswani-slots,marian
            local work=(--num_sentences 3000 --batch_sizes 256)
            [ -f "$RESULTS_DIR/gpu-quality-selected.txt" ] && model=(--model "$(cat "$RESULTS_DIR/gpu-quality-selected.txt")")
            # The dry run: tiny (64 positions), and no CUDA graphs on a CPU.
            [ $dry_run = 1 ] && engines=vaswani,vaswani-lean,vaswani-slots,marian \
                work=(--num_sentences 32 --batch_sizes 8 --max_new_tokens 40)
            run "$(left)" "$log" python3 benchmarks/bench_translation.py "${device_args[@]}" --results_dir "$RESULTS_DIR" \
                "${model[@]}" "${work[@]}" --beams 4 --stopping eos --engines $engines --keep_going \
                --output_name "translation-trained-{device}" ;;
        translation|translation-compiled|translation-batch1)  # random weights, forced length (earlier sessions' rows)
            local engines=vaswani,vaswani-hfloop graphs=vaswani-graphs test=eager
            [ "$stage" = translation-compiled ] && engines=vaswani-compiled graphs=vaswani-graphs-compiled test=compiled
            if run "$(at_most 150 "$(left)")" "$log" python3 -m pytest -q -m gpu tests/ \
                   -k "cuda_graphs and $test" -p no:cacheprovider; then
                engines=$engines,$graphs
            fi
            local options=(--batch_sizes 256,32 --output_name "$stage-{device}")
            [ "$stage" = translation-batch1 ] && options=(--batch_sizes 1 --batch1_sentences 100 --output_name "$stage-{device}")
            run "$(at_most 420 "$(left)")" "$log" python3 benchmarks/bench_translation.py --results_dir "$RESULTS_DIR" \
                "${options[@]}" --engines $engines,marian --keep_going ;;
        profile) run "$(left)" "$log" python3 benchmarks/bench_training.py --results_dir "$RESULTS_DIR" \
                     --output_name training-profile --sizes tiny,base --steps 3 --profile ;;
        attention)  # the base training step under each SDPA kernel (the last profile's largest item), then flex
            local kernel
            for kernel in efficient cudnn math; do
                run "$(at_most 150 "$(left)")" "$log" python3 benchmarks/bench_training.py --results_dir "$RESULTS_DIR" \
                    --sizes base --steps 10 --sdpa_backend $kernel --output_name training-sdpa-$kernel || false
            done
            run "$(at_most 150 "$(left)")" "$log" python3 benchmarks/bench_training.py --results_dir "$RESULTS_DIR" \
                --sizes base --steps 10 --engines vaswani-compiled,vaswani-compiled-flex,marian \
                --output_name training-flex-{device} || false ;;
        scaling) run "$(at_most 150 "$(left)")" "$log" python3 benchmarks/bench_scaling.py --results_dir "$RESULTS_DIR" \
                     --lengths 64,256,1024,4096 --steps 3 ;;
        *) echo "unknown stage $stage" | tee -a "$log"; false ;;
    esac
    local status=$?
    echo "== $stage: exit $status at ${SECONDS} s" | tee -a "$log"
    publish
    return $status
}

status=0
for name in "${stages[@]}"; do
    if [ "$name" = plan ]; then
        for planned in quality-prepare training training-graphs quality translation-trained tests; do
            stage $planned || status=1
        done
    else
        stage "$name" || status=1
    fi
done
publish
echo "== done at ${SECONDS} s, exit $status"
exit $status
