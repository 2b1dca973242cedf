"""transformers' own common model tests, taken from the source distribution of the installed release on PyPI.

Every model inside transformers is held to `ModelTesterMixin` (tests/test_modeling_common.py) and `ConfigTester`
(tests/test_configuration_common.py). Those files are not in the wheel, and we do not copy them into this repository:
`load()` downloads the sdist of exactly the installed version once, extracts the test files into the git-ignored
`.cache/transformers-tests/<version>/`, and imports them from there as the package `transformers_tests`.

The sdist ships only the top-level `tests/test_*.py` files (setuptools' default), not the subpackages that
`test_modeling_common.py` and `test_configuration_common.py` import at module level. Those get a stand-in
(docs/upstream-suite.md lists what each leaves out):

* `generation/test_utils.py` (`GenerationTesterMixin`): an empty mixin, so the generate() tests do not run here
  (tests/test_generation_mixin.py runs those that apply, in their image);
* `exporters/test_export.py` (`ExportTesterMixin`, a base of `ModelTesterMixin`): an empty mixin, no export tests;
* `utils/test_configuration_utils.py` (`config_common_kwargs`, the data of `ConfigTester.check_config_arguments_init`):
  None, and tests/test_upstream_suite.py skips that one check, saying why.

Where the sdist does ship one of them (a later release may), the shipped file is used and the stand-in is not written.
"""

import io
import json
import os
import shutil
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

import transformers

VERSION = transformers.__version__
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "transformers-tests" / VERSION
PACKAGE = "transformers_tests"  # not `tests`: that name is ours

# The shipped files the suites need, relative to the sdist's tests/.
SHIPPED = ("test_modeling_common.py", "test_configuration_common.py")
STAND_INS = {
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    "utils/test_configuration_utils.py": "config_common_kwargs = None\n",
}
NOT_SHIPPED = "transformers {version}'s sdist does not ship tests/{path}"


def _sdist_url(version: str) -> str:
    """The sdist's address from the package index's JSON listing (PEP 691), the index pip itself would ask."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(f"{index}/transformers/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        files = json.load(response)["files"]
    for file in files:
        if file["filename"] == f"transformers-{version}.tar.gz":
            return urllib.parse.urljoin(f"{index}/transformers/", file["url"])
    raise RuntimeError(f"{index} lists no source distribution for transformers {version}")


def _extract(version: str, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)  # what an interrupted run left
    with urllib.request.urlopen(_sdist_url(version), timeout=120) as response:
        archive = tarfile.open(fileobj=io.BytesIO(response.read()), mode="r:gz")
    prefix = f"transformers-{version}/tests/"
    wanted = {prefix + name for name in SHIPPED} | {prefix + path for path in STAND_INS}
    members = [member for member in archive.getmembers() if member.name in wanted]
    missing = {prefix + name for name in SHIPPED} - {member.name for member in members}
    if missing:
        raise RuntimeError(f"transformers {version}'s sdist lacks {sorted(missing)}")
    package = target / PACKAGE
    for member in members:
        destination = package / member.name[len(prefix) :]
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(archive.extractfile(member).read())
    stood_in = []
    for path, source in STAND_INS.items():
        destination = package / path
        if not destination.exists():
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_text(source)
            stood_in.append(path)
    for directory in {package, *((package / path).parent for path in STAND_INS)}:
        (directory / "__init__.py").touch()
    (target / "stand_ins.json").write_text(json.dumps(stood_in))


def load() -> dict[str, str]:
    """Makes `transformers_tests` importable; returns {path: reason} for each stand-in used.

    Raises OSError (urllib's URLError included) when the index cannot be reached; the caller turns that into a skip."""
    if not (CACHE / "stand_ins.json").exists():
        # Each process extracts into a folder of its own (pytest-xdist's workers may all start here at once) and
        # renames it into place: a download cut off half-way is not mistaken for a complete cache next time, and the
        # first complete one wins.
        staging = CACHE.with_name(f"{VERSION}.partial-{os.getpid()}")
        _extract(VERSION, staging)
        try:
            staging.rename(CACHE)
        except OSError:
            if not (CACHE / "stand_ins.json").exists():  # not another process's complete copy in place
                raise
            shutil.rmtree(staging)
    if str(CACHE) not in sys.path:
        sys.path.insert(0, str(CACHE))
    stood_in = json.loads((CACHE / "stand_ins.json").read_text())
    return {path: NOT_SHIPPED.format(version=VERSION, path=path) for path in stood_in}
