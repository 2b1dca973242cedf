"""Where this repository keeps its copy of the fra-eng corpus, beside the checkout: the scripts read it when neither
--corpus nor $VASWANI_FRA_ENG names a file, so that nothing is downloaded. The package knows no such place; the
scripts (and the benchmarks) pass this path in."""

import os
from pathlib import Path

# As the scripts' help names it: relative to the repository's root.
SHARED_CORPUS_RELATIVE = "../shared/data/fra-eng/fra_eng.tsv.gz"
SHARED_CORPUS = Path(os.path.normpath(Path(__file__).resolve().parents[1] / SHARED_CORPUS_RELATIVE))
