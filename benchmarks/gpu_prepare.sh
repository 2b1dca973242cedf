#!/usr/bin/env bash
# Run here, before the first call on a lent GPU machine: it gathers what that machine lacks into folders that git
# ignores, to be carried there with the working tree: .whl/ (wheels for Python 3.12 of CI's oldest set, the pairing
# with the image's torch 2.11 that CI tests; gpu_plan.py installs them), .corpus/ (the corpus: ../shared does not travel),
# benchmarks/.cache/data/ (the corpus' splits, the benchmarks' tokenizer and the quality run's tokenized splits, which
# the call only loads). Prints the device call to make and the carried size (benchmarks/README.md, "A lent GPU").
# Needs a package registry (pip download) and the corpus ($VASWANI_FRA_ENG, else the scripts' default).
set -euo pipefail
cd "$(dirname "$0")/.."

corpus=${VASWANI_FRA_ENG:-$(cd scripts && python3 -c "from shared_corpus import SHARED_CORPUS; print(SHARED_CORPUS)")}
[ -f "$corpus" ] || { echo "no corpus at $corpus: set VASWANI_FRA_ENG" >&2; exit 2; }
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" .whl .corpus
for folder in /.whl/ /.corpus/; do
    grep -qxF "$folder" "$exclude" 2>/dev/null || echo "$folder" >> "$exclude"
done

install -m 0644 "$corpus" .corpus/fra_eng.tsv.gz
about=$(dirname "$corpus")/ABOUT.txt
[ -f "$about" ] && install -m 0644 "$about" .corpus/ABOUT.txt  # the corpus' attribution travels with it
rm -rf .whl/*.whl .whl/datasets4  # datasets4/: what an earlier version downloaded, which nothing installs
# The lent GPU runs the image's torch 2.11: the wheels carried are CI's oldest set (.ci/oldest.txt), the pairing with
# torch 2.11 that CI tests, datasets' helpers included; all of it but torch (the image's) and tensorboard and
# matplotlib (which no stage imports). Wheels for the machine's Python 3.12, without their dependencies.
pins=$(grep -E '^[A-Za-z0-9_.-]+==' .ci/oldest.txt | grep -vE '^(torch|tensorboard|matplotlib)==' | tr '\n' ' ')
# shellcheck disable=SC2086  # one pin a word
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --dest .whl $pins
# The corpus' splits and the tokenizer, which the benchmarks otherwise make on first use.
PYTHONPATH=benchmarks:${PYTHONPATH:-} python3 -c 'import common; common.corpus_and_tokenizer(".corpus/fra_eng.tsv.gz")'
VASWANI_FRA_ENG=.corpus/fra_eng.tsv.gz PYTHONPATH=$PWD/src:$PWD/benchmarks:${PYTHONPATH:-} \
    python3 benchmarks/gpu_quality.py --prepare_only --data_cache_dir benchmarks/.cache/data

mkdir -p .compile-cache  # torch.compile's caches that an earlier GPU of the same kind returned (results' compile-cache/)
echo "carry: .whl .corpus benchmarks/.cache/data .compile-cache ($(du -shc .whl .corpus benchmarks/.cache/data .compile-cache | tail -1 | cut -f1))"
echo "command: ARCHIVE=\$OUT/results.tar.gz RESULTS_DIR=/tmp/results VASWANI_FRA_ENG=.corpus/fra_eng.tsv.gz python3 benchmarks/gpu_plan.py [second] 2>&1 | tee \$OUT/session.log"
