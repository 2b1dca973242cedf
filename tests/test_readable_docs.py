"""The README and the results index stay readable, and the results stay a small part of the repository.

A reader gets one screen of headline figures (at most 8 rows), table cells of at most 200 characters and paragraphs
of at most 600 (README.md); every result file is reachable from `benchmarks/results/README.md`, whose links all
resolve; and `benchmarks/results/` holds under a quarter of the tracked lines (as `git ls-files | xargs wc -l`
counts them). Paths are taken from this file, so the checks read the checkout they belong to, CI's fresh clone too.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RESULTS = REPO / "benchmarks" / "results"
INDEX = RESULTS / "README.md"

MAX_HEADLINE_ROWS = 8
MAX_CELL_CHARS = 200
MAX_PARAGRAPH_CHARS = 600
MAX_RESULTS_SHARE = 0.25
LINK_TARGET = re.compile(r"\]\(([^)\s]+)\)")


def tracked_files() -> list[Path]:
    """The files git tracks in this checkout; the test is skipped outside a git checkout (an unpacked sdist)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    return [REPO / name for name in listed.decode().split("\0") if name and (REPO / name).is_file()]


def blocks(text: str) -> tuple[list[list[str]], list[str]]:
    """The Markdown tables (each a list of its rows' lines, the header and separator included) and the paragraphs
    (list items each on its own) of `text`, outside code fences; headings are neither."""
    tables, paragraphs, table, paragraph, fenced = [], [], [], [], False

    def close():
        if table:
            tables.append(table.copy())
        if paragraph:
            paragraphs.append(" ".join(paragraph))
        table.clear()
        paragraph.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            close()
            fenced = not fenced
        elif fenced:
            continue
        elif not stripped or stripped.startswith("#"):
            close()
        elif stripped.startswith("|"):
            if paragraph:
                close()
            table.append(stripped)
        else:
            if table or re.match(r"([-*]|\d+\.) ", stripped):
                close()
            paragraph.append(stripped)
    close()
    return tables, paragraphs


def cells(row: str) -> list[str]:
    """A table row's cells, the `|` inside code spans left alone."""
    parts, cell, code = [], "", False
    for char in row.strip().strip("|"):
        if char == "`":
            code = not code
        if char == "|" and not code:
            parts.append(cell.strip())
            cell = ""
        else:
            cell += char
    return parts + [cell.strip()]


def headline_table(text: str) -> list[str]:
    """The data rows of the first table under the README's "Headline" heading."""
    section = re.search(r"^## Headline[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README.md has no '## Headline …' section"
    tables, _ = blocks(section.group(1))
    assert tables, "README.md's headline section has no table"
    return tables[0][2:]


@pytest.mark.parametrize("path", [README, INDEX], ids=["README", "results-index"])
def test_cells_and_paragraphs_are_short(path):
    tables, paragraphs = blocks(path.read_text(encoding="utf-8"))
    long_cells = [cell[:80] + "…" for table in tables for row in table for cell in cells(row)
                  if len(cell) > MAX_CELL_CHARS]
    assert not long_cells, f"{path.name}: table cells over {MAX_CELL_CHARS} characters: {long_cells}"
    long_paragraphs = [p[:80] + "…" for p in paragraphs if len(p) > MAX_PARAGRAPH_CHARS]
    assert not long_paragraphs, f"{path.name}: paragraphs over {MAX_PARAGRAPH_CHARS} characters: {long_paragraphs}"


def test_readme_headline_table_fits_a_screen():
    rows = headline_table(README.read_text(encoding="utf-8"))
    assert 0 < len(rows) <= MAX_HEADLINE_ROWS, f"README.md's headline table has {len(rows)} rows"


def test_every_result_file_is_indexed_and_every_index_link_resolves():
    results = sorted(p.name for p in tracked_files() if p.parent == RESULTS and p != INDEX)
    targets = set(LINK_TARGET.findall(INDEX.read_text(encoding="utf-8")))
    unindexed = [name for name in results if name not in targets]
    assert not unindexed, f"result files not linked from benchmarks/results/README.md: {unindexed}"
    local = [t for t in targets if "://" not in t and not t.startswith("#")]
    dangling = sorted(t for t in local if not (RESULTS / t.split("#")[0]).exists())
    assert not dangling, f"benchmarks/results/README.md links to missing files: {dangling}"


def test_results_hold_under_a_quarter_of_the_tracked_lines():
    lines = {path: path.read_bytes().count(b"\n") for path in tracked_files()}
    in_results = sum(n for path, n in lines.items() if RESULTS in path.parents)
    share = in_results / sum(lines.values())
    assert share < MAX_RESULTS_SHARE, (f"benchmarks/results/ holds {share:.1%} of the tracked lines "
                                       f"({in_results:,} of {sum(lines.values()):,}): move superseded runs to git")
