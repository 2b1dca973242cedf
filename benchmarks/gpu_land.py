"""Land what a lent GPU returned: the results archive of `gpu_plan.py` unpacked into the results folder, one current
file per GPU kind and question (the older ones left to git), then the GPU rows of the results index and of the
README's headline table, and a row and the targets paragraph of `gpu-notes.md`, each from the files landed; every
target missed is said plainly (`common.GPU_TARGETS`, the one list).

    python benchmarks/gpu_land.py results.tar.gz    # beside it, compile-cache.tar.gz goes into .compile-cache/

Only files the archive holds are replaced: a question it does not answer keeps its row. The stage logs
(`gpu-<stage>.log`) are kept as `gpu-<stage>-<device>.log`, so that another GPU kind's logs stay; the quality run's
model path (`gpu-quality-selected.txt`, a path on the lent machine) is not landed.
"""

import argparse
import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from common import GPU_TARGETS, REPO_ROOT, RESULTS_DIR

# The README's and the results index's GPU rows: the question (the first cell, which starts with "GPU") → the
# result file, by its name's pattern, that answers it.
QUALITY, TRAINING, TRANSLATION = ("GPU quality: test BLEU of the base model in 300 s", "GPU training speed against Marian",
                                  "GPU translation speed against Marian")
QUESTIONS = {QUALITY: "gpu-quality-{tag}", TRAINING: "training-probe-{tag}-4000",
             TRANSLATION: "translation-trained-{tag}"}
NOT_LANDED = {"gpu-quality-selected.txt"}  # a path on the lent machine


def unpack(archive: Path, into: Path) -> None:
    with tarfile.open(archive) as packed:
        packed.extractall(into, filter="data")  # refuses absolute paths, links out and `..`


def device_tag(folder: Path) -> tuple[str, dict]:
    """The GPU's tag (`cuda-h200`) and the environment of the first report that ran on CUDA."""
    for path in sorted(folder.rglob("*.json")):
        try:
            environment = json.loads(path.read_text()).get("environment") or {}
        except (ValueError, AttributeError):
            continue
        if str(environment.get("device", "")).startswith("cuda"):
            return environment["device"], environment
    raise SystemExit("error: the archive holds no report made on a GPU (no JSON whose environment.device is cuda-…)")


def land_files(unpacked: Path, results: Path, tag: str) -> list[str]:
    """The archive's files into `results`, stage logs renamed with the device's tag; the names landed."""
    landed = []
    for path in sorted(unpacked.rglob("*")):
        if not path.is_file() or path.name in NOT_LANDED or "compile-cache" in path.relative_to(unpacked).parts:
            continue
        name = path.name
        if (stage := re.fullmatch(r"gpu-([a-z0-9-]+)\.log", name)) and tag not in name:
            name = f"gpu-{stage.group(1)}-{tag}.log"
        shutil.copyfile(path, results / name)
        landed.append(name)
    return landed


def read_report(results: Path, stem: str) -> dict | None:
    try:
        return json.loads((results / f"{stem}.json").read_text())
    except (OSError, ValueError):
        return None


def figures(results: Path, tag: str) -> dict:
    """Each target's figure (`Target.field`) from the landed reports, and each question's row cell and report."""
    found, cells, reports = {}, {}, {}
    quality = read_report(results, QUESTIONS[QUALITY].format(tag=tag))
    if quality:
        reports[QUALITY] = quality
        row = quality["results"][0]
        found.update({field: row.get(field) for field in ("test_bleu", "test_bleu_first_1000", "steady_ms_per_step")})
        first = row.get("test_bleu_first_1000")
        bleu = (f"test BLEU {row['test_bleu']:.2f} on the whole split" + (
            f", {first:.2f} on its first 1,000" if first is not None else "")
            if row.get("test_bleu") is not None else f"no test score ({row.get('test_score')})")
        steady = (f"; steady step {row['steady_ms_per_step']:.1f} ms" + (
            f", MFU {row['steady_mfu']:.1%}" if row.get("steady_mfu") is not None else "")
            if row.get("steady_ms_per_step") is not None else "")
        cells[QUALITY] = f"base, 300 s: {bleu}, {row.get('train_steps')} steps{steady}; {row.get('ended')}"
    probe = read_report(results, QUESTIONS[TRAINING].format(tag=tag))
    if probe:
        reports[TRAINING] = probe
        compiled = next((r for r in probe["results"] if r["engine"] == "vaswani-compiled"
                         and r.get("batching", "bucketed") == "bucketed"), None)
        if compiled:
            found["training_vs_marian"] = compiled.get("vs_marian")
            found.setdefault("steady_ms_per_step", 1000 / compiled["steps_per_s"])
            ratio = "–" if compiled.get("vs_marian") is None else f"{compiled['vs_marian']:.2f}"
            mfu = "" if compiled.get("mfu") is None else f", MFU {compiled['mfu']:.1%}"
            cells[TRAINING] = (f"base, compiled, 4,000-token batches: {ratio} × Marian's tokens/s{mfu}, "
                               f"{1000 / compiled['steps_per_s']:.1f} ms a step")
    translation = read_report(results, QUESTIONS[TRANSLATION].format(tag=tag))
    if translation:
        reports[TRANSLATION] = translation
        default = next((r for r in translation["results"] if r["engine"] == "vaswani" and r["beams"] == 4), None)
        if default:
            found["translation_vs_marian"] = default.get("vs_marian")
            ratio = "–" if default.get("vs_marian") is None else f"{default['vs_marian']:.2f}"
            cells[TRANSLATION] = (f"the quality run's model, beam 4, bf16, batch {default['batch_size']}: {ratio} × "
                                  "Marian's sentences/s")
    return {"found": found, "cells": cells, "reports": reports}


def judged(found: dict) -> tuple[list[str], list[str]]:
    """The targets met and the targets missed (with the figure, or "no figure"), in words."""
    met, missed = [], []
    for target in GPU_TARGETS:
        value = found.get(target.field)
        verdict = target.met(value)
        shown = "no figure" if value is None else f"{value:.2f}"
        (met if verdict else missed).append(f"{target.text} (got {shown})")
    return met, missed


def machine_cell(report: dict, order: str = "machine") -> str:
    """The row's last cell: "GPU, date, commit" (`gpu-notes.md`), "GPU, commit, date" (the README's "machine, commit,
    date") or "commit, GPU, date" (the results index's "commit, machine, date")."""
    environment = report["environment"]
    gpu = re.sub(r"^NVIDIA ", "", environment.get("device_name") or environment["device"])
    date, commit = report["timestamp"][:10], environment.get("git_commit") or "commit unknown"
    return {"notes": f"{gpu}, {date}, {commit}", "machine": f"{gpu}, {commit}, {date}",
            "commit": f"{commit}, {gpu}, {date}"}[order]


def replace_rows(text: str, cells: dict[str, list[str]]) -> tuple[str, list[str]]:
    """`text` with each table row whose first cell is a question of `cells` given those cells after the first;
    returns the text and the questions found."""
    found, lines = [], text.split("\n")
    for i, line in enumerate(lines):
        first = line.split("|")[1].strip() if line.startswith("|") and line.count("|") > 2 else None
        if first in cells:
            lines[i] = "| " + " | ".join([first, *cells[first]]) + " |"
            found.append(first)
    return "\n".join(lines), found


def update_rows(path: Path, landed: dict, tag: str, results_from: str, order: str) -> list[str]:
    """The GPU question rows (question | answer | file | machine) of the README's headline table or of the results
    index: their answer, file and machine cells, from the files landed."""
    cells = {question: [cell, f"[{QUESTIONS[question].format(tag=tag)}]({results_from}"
                                f"{QUESTIONS[question].format(tag=tag)}.md)", machine_cell(landed["reports"][question], order)]
             for question, cell in landed["cells"].items()}
    text, found = replace_rows(path.read_text(), cells)
    path.write_text(text)
    return found


def update_notes(notes: Path, landed: dict, tag: str, names: list[str], met: list[str], missed: list[str]) -> None:
    """`gpu-notes.md`: a row for this session at the head of its table, and its targets paragraph (the one that
    starts "Targets on an H100 or H200") rewritten from this session's figures."""
    text, report = notes.read_text(), next(iter(landed["reports"].values()), None)
    if report is None:
        return
    gpu, date, commit = machine_cell(report, "notes").split(", ")
    measured = "; ".join(landed["cells"].values()) or "no figure for a GPU question"
    files = ", ".join(f"`{name}`" for name in names if name.endswith((".md", ".log")))
    row = f"| {date} | {gpu} | {commit} | {measured} | {files} |"
    lines = text.split("\n")
    header = next(i for i, line in enumerate(lines) if line.startswith("|---"))
    lines.insert(header + 1, row)
    text = "\n".join(lines)
    paragraph = (f"Targets on an H100 or H200: {'; '.join(target.text for target in GPU_TARGETS)}. "
                 f"On the {gpu} of {date} ({commit}): "
                 + (f"missed: {'; '.join(missed)}." if missed else "every target met.")
                 + (f" Met: {'; '.join(met)}." if met else ""))
    text = re.sub(r"Targets on an H100 or H200:.*?(?=\n\n)", lambda _: paragraph, text, count=1, flags=re.S)
    notes.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archive", type=Path, help="the results.tar.gz a device call returned")
    parser.add_argument("--results_dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md")
    parser.add_argument("--compile_cache", type=Path, default=REPO_ROOT / ".compile-cache",
                        help="where the compile-cache.tar.gz beside the archive is unpacked, for the next GPU")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        unpack(args.archive, Path(scratch))
        tag, _ = device_tag(Path(scratch))
        names = land_files(Path(scratch), args.results_dir, tag)
    caches = args.archive.with_name("compile-cache.tar.gz")
    if caches.is_file():
        args.compile_cache.mkdir(parents=True, exist_ok=True)
        unpack(caches, args.compile_cache)
        print(f"compile caches into {args.compile_cache}")
    landed = figures(args.results_dir, tag)
    met, missed = judged(landed["found"])
    rows = update_rows(args.readme, landed, tag, "benchmarks/results/", "machine")
    indexed = update_rows(args.results_dir / "README.md", landed, tag, "", "commit")
    update_notes(args.results_dir / "gpu-notes.md", landed, tag, names, met, missed)
    print(f"landed {len(names)} files for {tag} in {args.results_dir}; README rows: {', '.join(rows) or 'none'}; "
          f"results index rows: {', '.join(indexed) or 'none'}; gpu-notes.md: a row and the targets")
    for line in missed:
        print(f"MISSED: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
