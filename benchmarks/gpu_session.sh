#!/usr/bin/env bash
# The GPU measurements of benchmarks/README.md, in stages that each fit a 10-minute slot on a lent GPU machine:
#
#   bash benchmarks/gpu_session.sh tests        # the CUDA tests (tests marked gpu), a few minutes (compilation)
#   bash benchmarks/gpu_session.sh training     # bench_training.py: tiny, base, big; Vaswani eager and compiled, Marian
#   bash benchmarks/gpu_session.sh translation  # bench_translation.py: base; batch 256 and 32 over all 3,000 sentences,
#                                               #   greedy and beam 4: Vaswani (lean loop), transformers' loop, CUDA graphs; Marian
#   bash benchmarks/gpu_session.sh translation-compiled  # the same for compile_for_generation, alone and under graphs
#   bash benchmarks/gpu_session.sh translation-batch1    # as `translation`, at batch 1 over the first 100 draws
#   bash benchmarks/gpu_session.sh scaling      # bench_scaling.py: modern decoder, 64 … 4096 tokens
#   bash benchmarks/gpu_session.sh profile      # where a training step's GPU time goes (tiny, base; every engine)
#   bash benchmarks/gpu_session.sh attention    # base training under each SDPA kernel: efficient, cudnn, math; and flex
#
# Several stages can be named in one call. Results go to benchmarks/results/ (or $RESULTS_DIR), logs next to them.
# On a machine whose Python lacks some of this project's packages (or has older ones), put their wheels in .whl/:
# they are installed into a scratch directory first. The corpus path comes from $VASWANI_FRA_ENG as usual.
# benchmarks/gpu_prepare.sh, run beforehand where a package registry is reachable, gathers both (and the benchmarks'
# tokenizer) into ignored folders to carry, and prints the command.
set -uo pipefail
cd "$(dirname "$0")/.."

RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
mkdir -p "$RESULTS_DIR"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"

run() {  # run a command, logging its output; return its own exit status
    "$@" 2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
}

status=0
for stage in "$@"; do
    log="$RESULTS_DIR/gpu-$stage.log"
    echo "== $stage" | tee "$log"
    case $stage in
        tests) run timeout 360 python3 -m pytest -q -m gpu tests/test_fast_paths.py tests/test_modeling.py \
                   tests/test_decoding.py -p no:cacheprovider ;;
        profile) run python3 benchmarks/bench_training.py --results_dir "$RESULTS_DIR" --output_name training-profile \
                     --sizes tiny,base --steps 3 --profile ;;
        training) run python3 benchmarks/bench_training.py --results_dir "$RESULTS_DIR" ;;
        translation|translation-compiled|translation-batch1)
            # vaswani-graphs[-compiled] only once their own CUDA test has passed here (it checks their outputs too);
            # --keep_going drops an engine that fails anyway (a crash included) and names it in the report.
            engines=vaswani,vaswani-hfloop graphs=vaswani-graphs test=eager
            [ "$stage" = translation-compiled ] && engines=vaswani-compiled graphs=vaswani-graphs-compiled test=compiled
            if run timeout 150 python3 -m pytest -q -m gpu tests/test_decoding.py -k "cuda_graphs and $test" \
                   -p no:cacheprovider; then
                engines=$engines,$graphs
            fi
            options=(--batch_sizes 256,32 --output_name "$stage-{device}")
            [ "$stage" = translation-batch1 ] && options=(--batch_sizes 1 --batch1_sentences 100 --output_name "$stage-{device}")
            run timeout 420 python3 benchmarks/bench_translation.py --results_dir "$RESULTS_DIR" "${options[@]}" \
                --engines $engines,marian --keep_going ;;
        attention)  # the same base training step under each SDPA kernel (the profile's largest item), then FlexAttention
            for kernel in efficient cudnn math; do
                run timeout 150 python3 benchmarks/bench_training.py --results_dir "$RESULTS_DIR" --sizes base --steps 10 \
                    --sdpa_backend $kernel --output_name training-sdpa-$kernel || false
            done
            run timeout 150 python3 benchmarks/bench_training.py --results_dir "$RESULTS_DIR" --sizes base --steps 10 \
                --engines vaswani-compiled,vaswani-compiled-flex,marian --output_name training-flex-{device} || false ;;
        scaling) run timeout 150 python3 benchmarks/bench_scaling.py --results_dir "$RESULTS_DIR" \
                     --lengths 64,256,1024,4096 --steps 3 ;;
        *) echo "unknown stage $stage" | tee -a "$log"; false ;;
    esac || status=1
done
exit $status
