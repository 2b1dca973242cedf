"""corpus.py: finding the corpus (a path, the environment, the caller's copy, a checked download) and reading
it robustly, every skipped line counted."""

import hashlib
import http.server
import io
import json
import os
import random
import threading
import zipfile
from pathlib import Path

import pytest

from vaswani import corpus as vcorpus
from vaswani import data
from vaswani.corpus import ReadSummary, download_corpus, read_parallel_tsv, resolve_corpus_path
from conftest import SHARED_CORPUS, script_module
from data_helpers import ANIMALS, isolated_caches, write_tsv  # noqa: F401 (an autouse fixture)


# --------------------------------------------------------------------------------------------------
# Reading


def test_reader_skips_and_counts_every_kind_of_bad_line(tmp_path):
    path = tmp_path / "messy.tsv"
    path.write_bytes(
        b"\xef\xbb\xbfHello.\tBonjour.\r\n"  # byte-order mark and Windows line end: kept
        b"no tab on this line\n"
        b"\n"
        b"Go.\tVa !\tCC-BY 2.0 (France) Attribution: tatoeba.org #2877272 (CM)\n"  # 3rd column: kept
        b"Empty target.\t  \n"
        b"\tEmpty source.\n"
        b"Bad \xff\xfe bytes.\tOctets invalides.\n"
        b"Last.\tDernier.\n"
    )
    pairs, summary = read_parallel_tsv(path)
    assert pairs == [("Hello.", "Bonjour."), ("Go.", "Va !"), ("Last.", "Dernier.")]
    assert summary == ReadSummary(path=str(path), lines=8, pairs=3, blank=1, no_tab=1, empty_side=2,
                                  invalid_utf8=1, extra_columns=1, truncated=False)
    assert summary.skipped == 5


def test_reader_detects_gzip_by_content_not_name(tmp_path):
    pairs = [("One.", "Un."), ("Two.", "Deux.")]
    assert read_parallel_tsv(write_tsv(tmp_path / "plain.tsv.gz", pairs))[0] == pairs
    assert read_parallel_tsv(write_tsv(tmp_path / "packed.tsv", pairs, compress=True))[0] == pairs


def test_gzip_cut_short_keeps_what_was_read(tmp_path):
    rng = random.Random(0)  # random words compress badly, so half the file holds many whole lines
    pairs = [(" ".join(rng.choice(ANIMALS) for _ in range(8)) + f" {i}.", f"Phrase {i}.") for i in range(5000)]
    whole = write_tsv(tmp_path / "whole.tsv.gz", pairs, compress=True).read_bytes()
    cut = tmp_path / "cut.tsv.gz"
    cut.write_bytes(whole[: len(whole) // 2])

    read, summary = read_parallel_tsv(cut)
    assert summary.truncated
    assert 100 < len(read) < len(pairs)
    assert read == pairs[: len(read)]


def test_missing_and_unreadable_files_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_parallel_tsv(tmp_path / "absent.tsv")
    with pytest.raises(IsADirectoryError, match="not a file"):
        read_parallel_tsv(tmp_path)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can read files without permission")
def test_file_without_read_permission_raises(tmp_path):
    path = write_tsv(tmp_path / "locked.tsv", [("a", "b")])
    path.chmod(0)
    with pytest.raises(OSError, match="Cannot read corpus file"):
        read_parallel_tsv(path)


# --------------------------------------------------------------------------------------------------
# Finding and downloading the corpus


def test_resolution_order_path_then_env_then_shared_then_download(tmp_path, monkeypatch):
    explicit = write_tsv(tmp_path / "explicit.tsv", [("a", "b")])
    from_env = write_tsv(tmp_path / "env.tsv", [("a", "b")])
    shared = write_tsv(tmp_path / "shared.tsv.gz", [("a", "b")], compress=True)
    downloaded = tmp_path / "downloaded.txt"
    monkeypatch.setattr(vcorpus, "download_corpus", lambda: downloaded)

    assert resolve_corpus_path() == downloaded
    assert resolve_corpus_path(default_corpus=tmp_path / "not-there.tsv.gz") == downloaded
    assert resolve_corpus_path(default_corpus=shared) == shared
    monkeypatch.setenv(vcorpus.CORPUS_ENV_VAR, str(from_env))
    assert resolve_corpus_path(default_corpus=shared) == from_env
    assert resolve_corpus_path(explicit, default_corpus=shared) == explicit


class Called(Exception):
    pass


def test_the_scripts_pass_the_repository_copy_that_the_package_does_not_know(monkeypatch, tmp_path):
    """The copy beside a checkout is the scripts' default; the installed package names no such place."""
    assert not hasattr(data, "SHARED_CORPUS") and not hasattr(vcorpus, "SHARED_CORPUS")
    seen = {}

    def capture(**found):
        seen.update(found)
        raise Called

    tokenizer_script = script_module("train_tokenizer")
    monkeypatch.setattr(tokenizer_script, "train_corpus_tokenizer", lambda *args, **kwargs: capture(**kwargs))
    with pytest.raises(Called):
        tokenizer_script.main(["--output_dir", str(tmp_path / "tokenizer")])
    assert seen["default_corpus"] == SHARED_CORPUS

    training_script = script_module("train_translation")
    monkeypatch.setattr(training_script, "keep_freed_cpu_memory", lambda **kwargs: None)  # process-wide otherwise
    monkeypatch.setattr(training_script, "run_training", lambda model_args, data_args, args, command: capture(
        default_corpus=Path(data_args.default_corpus), corpus=data_args.corpus))
    with pytest.raises(Called):
        training_script.main(["--output_dir", str(tmp_path / "model"), "--use_cpu", "true"])
    assert seen == {"default_corpus": SHARED_CORPUS, "corpus": None}

    bleu_script = script_module("evaluate_bleu")
    assert bleu_script.SHARED_CORPUS == SHARED_CORPUS


def test_a_wrong_explicit_path_or_env_var_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="given path"):
        resolve_corpus_path(tmp_path / "typo.tsv")
    monkeypatch.setenv(vcorpus.CORPUS_ENV_VAR, str(tmp_path / "typo.tsv"))
    with pytest.raises(FileNotFoundError, match=vcorpus.CORPUS_ENV_VAR):
        resolve_corpus_path()


class CountingHandler(http.server.SimpleHTTPRequestHandler):
    requests = 0

    def do_GET(self):
        type(self).requests += 1
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def web_root(tmp_path):
    """A local HTTP server standing in for manythings.org; yields (folder it serves, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    CountingHandler.requests = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: CountingHandler(*a, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def make_zip(members: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        for name, text in members.items():
            bundle.writestr(name, text)
    return buffer.getvalue()


def test_download_extracts_verifies_records_and_reuses_the_cache(web_root, tmp_path):
    root, base = web_root
    lines = "Go.\tVa !\tCC-BY 2.0 (France) Attribution: tatoeba.org\nHi.\tSalut !\tCC-BY 2.0\n"
    archive = make_zip({"fra.txt": lines, "_about.txt": "About."})
    (root / "fra-eng.zip").write_bytes(archive)
    cache = tmp_path / "cache"

    corpus = download_corpus(cache, url=f"{base}/fra-eng.zip")
    assert corpus == cache / "fra.txt" and corpus.read_text() == lines
    record = json.loads((cache / "download.json").read_text())
    assert record["sha256"]["zip"] == hashlib.sha256(archive).hexdigest()
    assert not list(cache.glob("*.part"))
    pairs, summary = read_parallel_tsv(corpus)
    assert pairs == [("Go.", "Va !"), ("Hi.", "Salut !")] and summary.extra_columns == 2

    # Pinned to the recorded checksum, the cached copy is used without another request.
    assert download_corpus(cache, url=f"{base}/fra-eng.zip", expected_sha256=record["sha256"]["zip"]) == corpus
    assert CountingHandler.requests == 1
    with pytest.raises(ValueError, match="not the expected"):
        download_corpus(cache, url=f"{base}/fra-eng.zip", expected_sha256="0" * 64)

    corpus.write_text(lines + "Tampered.\tTrafiqué.\n")
    with pytest.raises(ValueError, match="no longer matches"):
        download_corpus(cache, url=f"{base}/fra-eng.zip")


@pytest.mark.parametrize(
    "served, message",
    [
        (make_zip({"deu.txt": "Go.\tGeh.\n"}), "has no fra.txt"),
        (make_zip({"fra.txt": "<html>Not found</html>\n"}), "does not start with"),
        (b"<html>Forbidden</html>", "did not return a zip"),
    ],
    ids=["other-language", "not-sentence-pairs", "not-a-zip"],
)
def test_download_rejects_what_is_not_the_corpus(web_root, tmp_path, served, message):
    root, base = web_root
    (root / "fra-eng.zip").write_bytes(served)
    with pytest.raises(ValueError, match=message):
        download_corpus(tmp_path / "cache", url=f"{base}/fra-eng.zip")
    assert not (tmp_path / "cache" / "fra.txt").exists() and not list((tmp_path / "cache").iterdir())


def test_download_with_a_wrong_pinned_checksum_caches_nothing(web_root, tmp_path):
    root, base = web_root
    (root / "fra-eng.zip").write_bytes(make_zip({"fra.txt": "Go.\tVa !\n"}))
    with pytest.raises(ValueError, match="not the expected"):
        download_corpus(tmp_path / "cache", url=f"{base}/fra-eng.zip", expected_sha256="0" * 64)
    assert not list((tmp_path / "cache").iterdir())
