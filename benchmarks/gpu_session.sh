#!/usr/bin/env bash
# The GPU measurements as plans that each fit one call of a lent GPU (at most 10 minutes a call; 15 minutes of device
# time a session, the machine's start included), most valuable first. Every stage runs under its own time limit
# (LIMITS, below), the wheels' installation included, so that a plan's limits add up to its length; each stage writes
# its results as it ends and the results folder is packed then, so a timeout loses only the stage it cut.
#
#   bash benchmarks/gpu_session.sh                 # the first plan (≤ 480 s): setup quality
#   bash benchmarks/gpu_session.sh second          # the second plan (≤ 240 s): setup translation-trained kernels
#   bash benchmarks/gpu_session.sh STAGE …         # chosen stages only, in order (setup always first)
#   bash benchmarks/gpu_session.sh --dry_run …     # the same at tiny sizes on any machine, a CPU included: checks
#                                                  #   every package, path and argument before device time is spent
#   bash benchmarks/gpu_session.sh --limits …      # each stage's time limit and their sum; runs nothing
#
# Stages: `setup` (carried wheels installed, versions printed); `quality` (gpu_quality.py: 300 s of base training with
# the package's GPU defaults, bf16, TF32, torch.compile before the clock; test BLEU on the whole split and its first
# 1,000 sentences, steps, ms a step, real and padded tokens/s, train_compile_seconds); the step probe, one
# bench_training.py process per setting (PROBE_STAGES): `probe-4000` (base, 4,000-token batches, compiled against
# MarianMTModel on the same batches, PROBE_SECONDS of Marian's steps), `probe-4000-packed` (compiled, on packed rows
# against bucketed batches, each padded to multiples of 1 and 8), `probe-4000-graphs` and `probe-25000` (shape
# buckets, compiled with and without CUDA graphs against Marian on the same bucketed batches); `kernels` (the
# eager base step under SDPA's efficient, cuDNN and math kernels and under eager attention, interleaved on the same
# 20 batches, no warm-up: a first pass on shapes new to the process, then two more); `tests` (pytest -m gpu);
# `translation-trained` (bench_translation.py on the quality run's model if this machine made one, else
# $TRANSLATION_MODEL, else random weights: transformers' loop (generate()'s default on CUDA), the scripts' default
# (on CUDA the lean loop as CUDA graphs), slots with CUDA graphs, Marian; with a model, each engine's outputs compared
# with the first's). By name only, with random weights: translation, translation-compiled, translation-batch1,
# scaling, profile, attention.
#
# Results go to $RESULTS_DIR (default benchmarks/results), a log per stage beside them; with $ARCHIVE set, the results
# folder is packed into that .tar.gz after every stage (a device machine returns few files). benchmarks/gpu_prepare.sh
# makes beforehand, on any machine, what a call would otherwise spend its minutes on: the wheels (.whl/), the corpus
# (.corpus/), the benchmarks' tokenizer and the quality run's tokenized splits (benchmarks/.cache/data/).
# INSTALL_WHEELS=0 skips the wheels (the dry run's default: this machine's Python is not the device's).
# QUALITY_RECIPES picks gpu_quality.py's recipes (default dropout-0.1; dropout-0.1-eager trains with eager attention).
set -uo pipefail
cd "$(dirname "$0")/.."

# Each stage's time limit in seconds: on an H100 or H200, what it needs with a margin (benchmarks/README.md, "A lent
# GPU"); the plans' sums are what a call's timeout must cover.
declare -A LIMITS=(
    [setup]=25           # the wheels' install (12-19 s on the last GPUs) and the versions
    # 300 s of training; before it the data (9 s on the 2026-11-27 H200) and the process' start-up with the step's
    # compilation (about 115 s there: 203 s from start to a stop after 88 s of training); after it the whole test
    # split decoded and the model saved (about 25 s on the 2026-11-26 H200)
    [quality]=455
    # the batches (10 s on the 2026-11-28 H200), the compiled step's warm-up (done after 119 s there), Marian's (122 s),
    # then 20 s of Marian's steps and as many of the compiled engine's: 160 s cut it there during the timed steps
    [probe-4000]=195
    # the batches (10 s), four base models, then 3 passes over 20 batches with each attention: the first, on shapes
    # new to the process, up to 40 s if cuDNN builds its graphs at the reported pace
    [kernels]=110
    [probe-4000-packed]=150  # four batchings (bucketed and packed, padded to multiples of 1 and 8), each compiled
    [probe-4000-graphs]=150
    [probe-25000]=150
    [tests]=170          # 15 of the 18 gpu tests took 148 s on an H200; the compiled CUDA graphs get 50 s
    [translation-trained]=105  # 4 engines, each loaded and warmed in its own process, then 1,000 sentences each
    [translation]=420 [translation-compiled]=420 [translation-batch1]=420
    [scaling]=150 [profile]=300 [attention]=600
)
# The step probe's settings, one bench_training.py run each, most valuable first. The quality run fills the first
# plan alone: the base step's compilation took about 115 s on the 2026-11-27 H200, which leaves the probe no room
# beside 300 s of training (benchmarks/results/gpu-notes.md). The second plan (at most 5 minutes) has no room for the
# probe either: its compilation makes `probe-4000` 195 s alone. So the probe and `tests` run by name
# (`gpu_session.sh probe-4000`), in what a session has left after both plans, or on the next lent GPU.
# `probe-4000-packed` decides the GPU's batching: real tokens/s of packed rows against bucketed batches, each
# padded to multiples of 1 and 8 (the padding multiple, none by default, by measurement).
PROBE_STAGES=(probe-4000 probe-4000-packed probe-4000-graphs probe-25000)
PROBE_SECONDS=${PROBE_SECONDS:-20}  # each setting repeats its batches until Marian, the slowest, has trained this long
FIRST_PLAN=(setup quality)
SECOND_PLAN=(setup translation-trained kernels)
DRY_RUN_LIMIT=240

dry_run=0 limits_only=0
while [ $# -gt 0 ]; do
    case $1 in
        --dry_run) dry_run=1; shift ;;
        --limits) limits_only=1; shift ;;
        *) break ;;
    esac
done
case "${1:-first}" in
    first) stages=("${FIRST_PLAN[@]}") ;;
    second) stages=("${SECOND_PLAN[@]}") ;;
    *) stages=(setup); for name in "$@"; do [ "$name" = setup ] || stages+=("$name"); done ;;
esac
for name in "${stages[@]}"; do
    [ -n "${LIMITS[$name]:-}" ] || { echo "unknown stage $name (stages: ${!LIMITS[*]})" >&2; exit 2; }
done
if [ $limits_only = 1 ]; then
    total=0
    for name in "${stages[@]}"; do echo "$name ${LIMITS[$name]}"; total=$((total + LIMITS[$name])); done
    echo "total $total"
    exit 0
fi

RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
ARCHIVE=${ARCHIVE:-}
QUALITY_DATA=benchmarks/.cache/data  # the benchmarks' data cache, which gpu_prepare.sh fills for both
QUALITY_RECIPES=${QUALITY_RECIPES:-dropout-0.1}  # gpu_quality.py's recipes (dropout-0.1-eager: eager attention)
mkdir -p "$RESULTS_DIR"
export PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true

publish() {  # pack the results folder into $ARCHIVE (atomically: a kill mid-way leaves the last complete pack)
    [ -n "$ARCHIVE" ] || return 0
    tar -czf "$ARCHIVE.$BASHPID" -C "$RESULTS_DIR" . && mv -f "$ARCHIVE.$BASHPID" "$ARCHIVE"
}
run() {  # run a command under a time limit (seconds), logging its output; return its exit status
    local limit=$1 log=$2
    shift 2
    if [ "$limit" -le 5 ]; then echo "skipped, no time left: $*" | tee -a "$log"; return 1; fi
    echo "\$ $* (limit ${limit} s)" >> "$log"
    timeout --kill-after 5 "$limit" "$@" 2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
}
device_args=() dry=()  # what a dry run adds to the benchmarks' and the GPU scripts' arguments
[ $dry_run = 1 ] && device_args=(--device cpu --threads 2) dry=(--dry_run)

setup() {  # the carried wheels, into a scratch folder on the import path, then the versions the stages run with
    local limit=$1 log=$2
    if [ "${INSTALL_WHEELS:-$((1 - dry_run))}" = 1 ] && compgen -G ".whl/*.whl" > /dev/null; then
        # datasets 5 needs pyarrow ≥ 24; where the machine's pyarrow is older, datasets 4.0 (our floor) and its pins.
        local wheels=(.whl/*.whl) site
        if compgen -G ".whl/datasets4/*.whl" > /dev/null &&
            ! python3 -c "import sys, pyarrow; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null; then
            wheels=($(ls .whl/*.whl | grep -v -E '/(datasets|dill|multiprocess|fsspec)-') .whl/datasets4/*.whl)
        fi
        site=$(mktemp -d)
        run "$limit" "$log" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "${wheels[@]}" || return 1
        export PYTHONPATH=$PYTHONPATH:$site  # after src/ and benchmarks/, before the machine's packages
    fi
    run $((limit - SECONDS + started)) "$log" python3 - <<'EOF'
import importlib
import torch
for name in ("torch", "transformers", "tokenizers", "datasets", "accelerate", "evaluate", "sacrebleu", "pyarrow", "safetensors"):
    print(name, importlib.import_module(name).__version__)
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
import re, sys
from packaging.specifiers import SpecifierSet
supported = re.search(r'"torch([^"]+)"', open("pyproject.toml").read()).group(1)
if torch.__version__.split("+")[0] not in SpecifierSet(supported):
    sys.exit(f"error: torch {torch.__version__} is outside the package's supported range {supported} (pyproject.toml)")
EOF
}

probe_arguments() {  # bench_training.py's arguments for one step-probe setting
    local budget=${1#probe-} buckets=() engines=vaswani-compiled,marian name=training-probe
    budget=${budget%-graphs}
    budget=${budget%-packed}
    if [ "$1" = probe-4000-packed ]; then  # Marian steps on the bucketed batches only (it takes no packed rows)
        buckets=(--batchings bucketed,bucketed-8,packed,packed-8) name=training-packing
    elif [ "$1" != probe-4000 ]; then  # every engine on the bucketed batches; only -graphs pads them to their shapes
        buckets=(--shape_buckets 4) engines=vaswani-compiled-graphs,vaswani-compiled,marian name=training-graphs
    fi
    if [ $dry_run = 1 ]; then
        # Eager engines: a shared CPU takes minutes to compile even the tiny model (and the GPU tests check the
        # compiled step); the -graphs engines need CUDA.
        echo --sizes tiny --batch_tokens 256 --steps 1 --warmup_steps 1 --seconds_per_setting 1 "${buckets[@]}" \
            --engines vaswani,marian --output_name "$name-{device}-$budget"
    else
        echo --sizes base --batch_tokens "$budget" --steps 10 --seconds_per_setting "$PROBE_SECONDS" "${buckets[@]}" \
            --engines $engines --output_name "$name-{device}-$budget"
    fi
}

kernels_arguments() {  # bench_training.py's arguments for the kernels stage (a CPU has no efficient or cuDNN kernel)
    if [ $dry_run = 1 ]; then
        echo --sizes tiny --batch_tokens 256 --steps 3 --engines vaswani-math,vaswani-flash,vaswani-eager
    else
        echo --sizes base --batch_tokens 4000 --steps 20 \
            --engines vaswani-efficient,vaswani-cudnn,vaswani-math,vaswani-eager
    fi
}

stage() {
    local stage=$1 limit=${LIMITS[$1]} log="$RESULTS_DIR/gpu-$1.log" started=$SECONDS
    # A dry run checks paths and arguments, not timing: a shared CPU compiles the tiny models slower than a GPU
    # machine compiles the real ones, so each stage gets DRY_RUN_LIMIT there.
    [ $dry_run = 1 ] && limit=$DRY_RUN_LIMIT
    echo "== $stage at ${SECONDS} s, limit $limit s" | tee -a "$log"
    case $stage in
        setup) setup "$limit" "$log" ;;
        quality)  # TORCH_LOGS: each recompilation's reason in the recipe's log (the 2026-11-28 H200 run spent 122
            # of its 300 s on its first 200 steps, as two recompilations would; the report counts the graphs)
            TORCH_LOGS=${TORCH_LOGS:-recompiles} run "$limit" "$log" python3 benchmarks/gpu_quality.py \
                --results_dir "$RESULTS_DIR" --data_cache_dir "$QUALITY_DATA" --recipes "$QUALITY_RECIPES" \
                "${dry[@]}" ;;
        kernels)  # SDPA's efficient, cuDNN and math kernels and eager attention, interleaved step by step on the
            # same batches, eager; no warm-up, so the first pass meets each batch's shape for the first time (cuDNN
            # builds an attention graph per shape, hundreds of ms each by public reports) and the later passes show
            # each one's steady step. cuDNN's attention took 47% of the compiled base step in the 2026-11-23
            # profile, about 0.6 ms a call whatever the batch, as if each row's few positions filled a whole tile;
            # math and eager attention compute only the positions there are.
            run "$limit" "$log" python3 benchmarks/bench_training.py "${device_args[@]}" --results_dir "$RESULTS_DIR" \
                $(kernels_arguments) --warmup_steps 0 --passes 3 --output_name "training-kernels-{device}" ;;
        probe-*)
            run "$limit" "$log" python3 benchmarks/bench_training.py "${device_args[@]}" --results_dir "$RESULTS_DIR" \
                $(probe_arguments "$stage") ;;
        tests)  # CUDA-only tests; without CUDA they are all skipped (the dry run checks only that they collect)
            # -v: each result is in the log as it happens, should a crash end the run; the compiled CUDA graphs
            # (which segfaulted inductor's launcher on a GPU once) run last, in a process of their own.
            run $((limit - 50)) "$log" python3 -m pytest -v -m gpu tests/ -k "not (cuda_graphs and compiled)" \
                -p no:cacheprovider
            local first=$?
            run $((limit - SECONDS + started)) "$log" python3 -m pytest -v -m gpu tests/ \
                -k "cuda_graphs and compiled" -p no:cacheprovider && [ $first = 0 ] ;;
        translation-trained)  # every engine in its own process (--keep_going: a crash costs only its own rows); with a
            # model, each row counts the translations identical to the first engine's: transformers' loop, generate()'s
            # default on CUDA; then the scripts' default (`vaswani`: on CUDA the lean loop as CUDA graphs), slots
            local model=() engines=vaswani-hfloop,vaswani,vaswani-slots,marian work=(--num_sentences 1000)
            if [ -f "$RESULTS_DIR/gpu-quality-selected.txt" ]; then
                model=(--model "$(cat "$RESULTS_DIR/gpu-quality-selected.txt")")
            elif [ -n "${TRANSLATION_MODEL:-}" ]; then
                model=(--model "$TRANSLATION_MODEL")
            fi
            # The dry run: tiny, and no CUDA graphs on a CPU (the slots run step by step there).
            [ $dry_run = 1 ] && engines=vaswani,vaswani-slots,marian \
                work=(--sizes tiny --num_sentences 32 --max_new_tokens 40)
            # Random weights stop anywhere: every engine then decodes the same number of tokens (forced rows).
            local stopping=eos
            [ ${#model[@]} = 0 ] && stopping=forced
            run "$limit" "$log" python3 benchmarks/bench_translation.py "${device_args[@]}" \
                --results_dir "$RESULTS_DIR" "${model[@]}" "${work[@]}" --batch_sizes 256 --beams 4 \
                --stopping $stopping --engines $engines --keep_going --output_name "translation-trained-{device}" ;;
        translation|translation-compiled|translation-batch1)  # random weights, forced length
            local engines=vaswani,vaswani-hfloop graphs=vaswani-graphs test=eager
            [ "$stage" = translation-compiled ] && engines=vaswani-compiled graphs=vaswani-graphs-compiled test=compiled
            if run 150 "$log" python3 -m pytest -q -m gpu tests/ -k "cuda_graphs and $test" -p no:cacheprovider; then
                engines=$engines,$graphs
            fi
            local options=(--batch_sizes 256,32 --output_name "$stage-{device}")
            [ "$stage" = translation-batch1 ] && options=(--batch_sizes 1 --batch1_sentences 100 --output_name "$stage-{device}")
            run $((limit - SECONDS + started)) "$log" python3 benchmarks/bench_translation.py \
                --results_dir "$RESULTS_DIR" "${options[@]}" --engines $engines,marian --keep_going ;;
        profile) run "$limit" "$log" python3 benchmarks/bench_training.py --results_dir "$RESULTS_DIR" \
                     --output_name training-profile --sizes tiny,base --steps 3 --profile ;;
        attention)  # the base training step under each SDPA kernel (the last profile's largest item), then flex
            local kernel
            for kernel in efficient cudnn math; do
                run 150 "$log" python3 benchmarks/bench_training.py --results_dir "$RESULTS_DIR" \
                    --sizes base --steps 10 --sdpa_backend $kernel --output_name training-sdpa-$kernel || false
            done
            run $((limit - SECONDS + started)) "$log" python3 benchmarks/bench_training.py --results_dir "$RESULTS_DIR" \
                --sizes base --steps 10 --engines vaswani-compiled,vaswani-compiled-flex,marian \
                --output_name training-flex-{device} || false ;;
        scaling) run "$limit" "$log" python3 benchmarks/bench_scaling.py --results_dir "$RESULTS_DIR" \
                     --lengths 64,256,1024,4096 --steps 3 ;;
    esac
    local status=$?
    echo "== $stage: exit $status after $((SECONDS - started)) s (limit $limit s)" | tee -a "$log"
    publish
    return $status
}

main() {
    local status=0 name
    for name in "${stages[@]}"; do
        stage "$name" || status=1
        [ "$name" = setup ] && [ $status = 1 ] && break  # nothing runs without its packages
    done
    publish
    echo "== done at ${SECONDS} s, exit $status"
    return $status
}
# One line: bash has read the whole script before the stages start, so a file changed meanwhile (a checkout during
# a dry run) cannot change what runs.
main; exit
