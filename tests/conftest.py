"""Shared fixtures for the model tests: tiny configs and padded batches, and the scripts' `main` functions.

Token ids follow `VaswaniConfig`'s special-token layout (pad 0, eos 1, bos/decoder start 3); ordinary tokens are
drawn from [4, vocab_size) so that no test input accidentally contains a special token.
"""

import functools
import getpass
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Inductor compiles its CPU kernels for the vector ISA that ATEN_CPU_CAPABILITY names, but its on-disk cache (torch
# 2.13) does not key compiled graphs by it: a graph compiled with the default capability and loaded under avx2 gave
# wrong outputs, and the reverse crashed the process. A run under a forced capability (as .ci/run's AVX2 suite)
# therefore keeps a cache of its own, inherited by the scripts the tests start. Set before torch and vaswani are
# imported: importing them fixes the cache directory in the environment.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_aten_{os.environ['ATEN_CPU_CAPABILITY']}")

# What the tools keep per machine (`vaswani.machine.cache_dir`: CTranslate2 exports, the bf16 answer) goes to a
# directory of this run, inherited by the scripts the tests start, never to the user's cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="vaswani-test-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

from vaswani import VaswaniConfig, VaswaniForConditionalGeneration  # noqa: E402

FIRST_ORDINARY_ID = 4
# The start of a script for a fresh process in which `import vaswani` fails, as for a Hub user without the package:
# it drops every path entry that holds the package (the editable install adds src/ through a .pth file).
WITHOUT_THE_PACKAGE = """
import os, sys
sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "vaswani"))]
try:
    import vaswani
except ImportError:
    pass
else:
    raise SystemExit("vaswani is importable in the fresh process: the test would prove nothing")
"""
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# Scripts loaded in this process import their neighbours (as `python scripts/x.py` lets them).
sys.path.append(str(SCRIPTS))
# This repository's copy of the fra-eng corpus, beside the checkout (tests that need it skip where it is absent).
SHARED_CORPUS = SCRIPTS.parents[1] / "shared" / "data" / "fra-eng" / "fra_eng.tsv.gz"


def run_without_the_package(script: str, *args: str, work: Path, home: Path):
    """Run `script` (which starts with WITHOUT_THE_PACKAGE) in a fresh, isolated Python (-I: no user site-packages,
    no PYTHON* variables, no cwd on sys.path) in `work`, offline, with its own HF_HOME; it must succeed."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-I", "-c", script, *args], cwd=work, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


class Forked:
    """`target()` in a child process forked from this one, with a Popen's poll, wait, send_signal and communicate:
    a real process (its own pid, signals, locks and SIGKILL), without the seconds a fresh Python spends importing
    torch and transformers. For what a test does to a process of our code (kill it mid-write, signal it); a test of
    how a script starts, or of a launcher, runs the script itself. The child's stdout and stderr go to files of its
    own; it ends as an interpreter does: status 0, a SystemExit's code, SIGINT after an uncaught KeyboardInterrupt's
    traceback, or 1 after any other's; and it runs none of this process' exit handlers."""

    def __init__(self, target):
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.returncode = None
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid:
            return
        status = 1
        try:
            os.dup2(self._out.fileno(), 1)
            os.dup2(self._err.fileno(), 2)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's handlers
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                target()
                status = 0
            except SystemExit as exit:  # as the interpreter ends on one
                if exit.code is None or isinstance(exit.code, int):
                    status = exit.code or 0
                else:
                    print(exit.code, file=sys.stderr)
            except KeyboardInterrupt:  # the interpreter prints it, then ends by SIGINT
                traceback.print_exc()
                sys.stderr.flush()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum):
        if self.returncode is None:
            os.kill(self.pid, signum)

    def communicate(self, timeout=None):
        self.wait(timeout)
        return tuple(self._read(f) for f in (self._out, self._err))

    @staticmethod
    def _read(f) -> str:
        f.seek(0)
        return f.read().decode(errors="replace")


def forked_script(name: str, argv: list[str], prepare=None) -> Forked:
    """scripts/<name>.py on `argv` as a process of its own, forked from this one (`Forked`), with the sys.argv that
    `python scripts/<name>.py ARGV` gives; `prepare()` runs first, in that process (to slow or break what it calls)."""

    def run():
        sys.argv = [str(SCRIPTS / f"{name}.py"), *argv]
        if prepare is not None:
            prepare()
        script_main(name)(argv)

    return Forked(run)


def free_port() -> int:
    """A TCP port that is free now, for a launcher's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_module(name: str):
    """scripts/<name>.py as a module of this process."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_main(name: str):
    """The `main` of scripts/<name>.py, called in this process (a user error is a SystemExit with status 2)."""
    return script_module(name).main


def fails_with_one_line(main, argv, capsys, match: str) -> str:
    """Run a script's main; it must exit with status 2 and end stderr with one `error: ...` line matching `match`."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and match in last, last
    return last


def interrupted_after(chunks: int, monkeypatch):
    """Make translate_chunk fail after `chunks` chunks, as a kill would stop the run (the resume state kept)."""
    from vaswani import file_translation

    calls, real = [], file_translation.translate_chunk

    def stop(*args, **kwargs):
        calls.append(1)
        if len(calls) > chunks:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(file_translation, "translate_chunk", stop)


def slowed_chunks(seconds: float):
    """Make translate_chunk take `seconds` longer, so that a signal, a kill or a second run lands mid-file: a
    `forked_script` preparation (it patches the process it runs in)."""
    from vaswani import file_translation

    def prepare():
        chunk = file_translation.translate_chunk
        file_translation.translate_chunk = lambda *args, **kwargs: (time.sleep(seconds), chunk(*args, **kwargs))[1]

    return prepare


def snapshot(directory: Path) -> dict:
    """Every entry under `directory` and its bytes: what a refused command must leave as it found it."""
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None for p in directory.rglob("*")}


def other_names(path: Path, directory: Path) -> dict[str, Path]:
    """`path` under the names a shell user may give it: itself, a symbolic link and, for a file, a hard link (both
    made in `directory`)."""
    names = {"same path": path}
    names["symlink"] = directory / f"link-to-{path.name}"
    names["symlink"].symlink_to(path.resolve())
    if path.is_file():
        names["hard link"] = directory / f"hard-link-to-{path.name}"
        os.link(path, names["hard link"])
    return names


def tiny_config(**overrides) -> VaswaniConfig:
    """`VaswaniConfig.tiny` without dropout: most tests compare two forward passes for (near) equality."""
    return VaswaniConfig.tiny(**{"dropout": 0.0, **overrides})


def random_ids(config: VaswaniConfig, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ORDINARY_ID, config.vocab_size, (batch, length), generator=generator)


def padded_batch(config: VaswaniConfig, lengths: list[int], seed: int = 0, side: str = "right"):
    """(input_ids, attention_mask) for sequences of the given lengths, padded to the longest with pad_token_id."""
    longest = max(lengths)
    input_ids = random_ids(config, len(lengths), longest, seed)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        if side == "right":
            attention_mask[row, :length] = 1
        else:
            attention_mask[row, longest - length :] = 1
    return input_ids.masked_fill(attention_mask == 0, config.pad_token_id), attention_mask


# Marks of transformers' own test files, which tests/test_upstream_suite.py runs (transformers registers them in its
# pyproject.toml; registered here, pytest does not warn about them).
UPSTREAM_MARKS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test")


def pytest_configure(config):
    for mark in UPSTREAM_MARKS:
        config.addinivalue_line("markers", f"{mark}: a mark of transformers' own tests")


# The test files that take longest, longest first: their seconds in the suite on the Zen 4 EPYC with a cold inductor
# cache, as CI runs it (docs/benchmarks.md). scripts/run_tests.sh hands whole files to its test processes in
# collection order (--dist loadfile --no-loadscope-reorder; xdist's own order is by test count, which put the long
# files of few tests last), so the files that start last are short ones and no process idles at the end while
# another runs a long file. The files not named follow in their usual order. A rough order is enough.
LONGEST_FIRST = ("test_benchmarks", "test_gpu_session", "test_fast_paths", "test_training_interruptions",
                 "test_decoding", "test_toy_task", "test_interruptions", "test_modeling", "test_decoding_static",
                 "test_compile_cache", "test_file_translation", "test_training", "test_trainer", "test_data",
                 "test_convert", "test_decoding_contract", "test_loading", "test_cpu_packing")


def pytest_collection_modifyitems(config, items):
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each file keeps its own order


# `scripts/run_tests.sh --quick` sets this: the edit loop's tier, every test that starts no process.
QUICK_TIER = os.environ.get("VASWANI_QUICK_TESTS") == "1"


@pytest.fixture(autouse=True, scope="session")
def _quick_tier_starts_no_process():
    """In the quick tier, a test (or a fixture it uses) that starts a process is skipped at that moment: whatever
    starts one (subprocess, a launcher, multiprocessing, a compiler that inductor calls) goes through these calls,
    so the tier needs no list of such tests that could fall behind them. The full suite runs everything. Session-
    scoped so that it applies before any module fixture, and a fixture, so that it never runs in xdist's controller,
    which starts the workers."""
    if not QUICK_TIER:
        yield
        return
    import multiprocessing.util
    import subprocess

    def starts_a_process(*args, **kwargs):
        pytest.skip("starts a process: the full suite runs it (the quick tier runs none)")

    patcher = pytest.MonkeyPatch()
    patcher.setattr(subprocess.Popen, "__init__", starts_a_process)
    patcher.setattr(multiprocessing.util, "spawnv_passfds", starts_a_process)  # the spawn and forkserver methods
    for name in ("fork", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            patcher.setattr(os, name, starts_a_process)
    yield
    patcher.undo()


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state, so weight initialisation is reproducible test by test."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def session_directory(tmp_path_factory) -> Path:
    """A directory of this test session that all its xdist workers share (each worker's own base directory is a
    child of it), for what is built once per session."""
    base = tmp_path_factory.getbasetemp()
    directory = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    directory.mkdir(exist_ok=True)
    return directory


@pytest.fixture(scope="session")
def tiny_models(session_directory):
    """`tiny_models(**config_overrides)`: the tiny model of tiny_translation_model.py and its tokenizer, trained
    once per test session for each configuration and loaded fresh on each call."""
    from tiny_translation_model import shared_model_and_tokenizer

    return functools.partial(shared_model_and_tokenizer, session_directory)


@pytest.fixture(scope="module")
def trained(tiny_models):
    """The tiny model of tiny_translation_model.py with its tokenizer, a fresh copy per test module that asks for it
    (a module may define its own `trained`)."""
    return tiny_models()


@pytest.fixture(scope="module")
def checkpoint(trained, tmp_path_factory):
    """`trained` saved as a checkpoint directory."""
    model, tokenizer = trained
    path = tmp_path_factory.mktemp("checkpoint") / "tiny"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def greedy_checkpoint(checkpoint, path, **generation):
    """A copy of `checkpoint` whose generation config decodes greedily (or as `generation` says)."""
    shutil.copytree(checkpoint, path)
    model = VaswaniForConditionalGeneration.from_pretrained(path)
    model.generation_config.num_beams, model.generation_config.length_penalty = 1, None
    for name, value in generation.items():
        setattr(model.generation_config, name, value)
    model.generation_config.save_pretrained(path)
    return path


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread. For these tiny models, thread synchronisation costs more than it saves, and
    on a shared (oversubscribed) CI machine two spinning threads made a training step 30x slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def good_checkpoint(tiny_models, tmp_path_factory):
    """The tiny model of tiny_translation_model.py saved as a complete checkpoint of this module: the failure-mode
    tests copy and damage it (unlike `checkpoint`, whatever `trained` a module has)."""
    model, tokenizer = tiny_models()
    path = tmp_path_factory.mktemp("checkpoint") / "good"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def subprocess_env():
    # One intra-op thread: on a shared machine, spinning threads make a tiny model's step many times slower.
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
