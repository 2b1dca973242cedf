#!/usr/bin/env bash
# Run here, before the first call on a lent GPU machine: it gathers what that machine lacks into folders that git
# ignores (named in .git/info/exclude), to be carried there with the working tree.
#
#   .whl/     transformers at this checkout's version, as a wheel (the machine's image has an older one;
#             gpu_session.sh installs .whl/*.whl first)
#   .corpus/  the fra-eng corpus, which is not in the repository (../shared does not travel)
#   benchmarks/.cache/ (already ignored) the benchmarks' joint BPE tokenizer, trained here on first use
#
# It prints the call to make: RESULTS_DIR=$OUT VASWANI_FRA_ENG=.corpus/fra_eng.tsv.gz bash benchmarks/gpu_session.sh
# STAGE…, carrying .whl, .corpus and benchmarks/.cache. Needs a package registry (pip download) and the corpus
# ($VASWANI_FRA_ENG or ../shared/data/fra-eng/fra_eng.tsv.gz).
set -euo pipefail
cd "$(dirname "$0")/.."

corpus=${VASWANI_FRA_ENG:-../shared/data/fra-eng/fra_eng.tsv.gz}
[ -f "$corpus" ] || { echo "no corpus at $corpus: set VASWANI_FRA_ENG" >&2; exit 2; }
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" .whl .corpus
for folder in /.whl/ /.corpus/; do
    grep -qxF "$folder" "$exclude" 2>/dev/null || echo "$folder" >> "$exclude"
done

install -m 0644 "$corpus" .corpus/fra_eng.tsv.gz
about=$(dirname "$corpus")/ABOUT.txt
[ -f "$about" ] && install -m 0644 "$about" .corpus/ABOUT.txt  # the corpus' attribution travels with it
version=$(python3 -c "import transformers; print(transformers.__version__)")
rm -f .whl/transformers-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --dest .whl "transformers==$version"
# The tokenizer the benchmarks train on first use (a minute here, and the same on the GPU machine otherwise).
python3 - <<'EOF'
import argparse
import sys

sys.path.insert(0, "benchmarks")
from common import add_common_arguments, corpus_and_tokenizer

parser = argparse.ArgumentParser()
add_common_arguments(parser)
corpus_and_tokenizer(parser.parse_args(["--corpus", ".corpus/fra_eng.tsv.gz"]))
EOF

echo "carry: .whl .corpus benchmarks/.cache ($(du -shc .whl .corpus benchmarks/.cache | tail -1 | cut -f1))"
echo "command: RESULTS_DIR=\$OUT VASWANI_FRA_ENG=.corpus/fra_eng.tsv.gz bash benchmarks/gpu_session.sh STAGE…"
