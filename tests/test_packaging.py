"""Versions are decided in pyproject.toml alone: the install scripts take what a user's `pip install` resolves, and
the oldest supported set that CI tests is exactly the lower bounds pyproject.toml declares (and datasets' helpers at
the versions pip resolves for its lower bound, which a lent GPU carries)."""

import ast
import importlib.metadata
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
# The scripts through which the README's commands and CI install the package.
INSTALL_SCRIPTS = ("scripts/setup.sh", "scripts/run_tests.sh", "scripts/main_job.sh", ".ci/run")


def dependencies() -> list[Requirement]:
    """The package's own dependencies (no extras), as installed from pyproject.toml."""
    requirements = [Requirement(text) for text in importlib.metadata.requires("vaswani") or []]
    return [requirement for requirement in requirements if requirement.marker is None]


def pins(path: Path) -> dict[str, Version]:
    """name → version of each `name==version` line of a pip constraints file."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(Requirement(line).name): Version(line.split("==")[1]) for line in lines if line}


def test_the_oldest_supported_set_is_every_lower_bound_of_pyproject():
    declared = {}
    for requirement in dependencies():
        lower = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        assert lower, f"{requirement} declares no lower bound, so no oldest version is tested"
        declared[canonicalize_name(requirement.name)] = Version(lower[0])
    pinned = pins(ROOT / ".ci" / "oldest.txt")
    assert {name: version for name, version in pinned.items() if name in declared} == declared
    # Beside them, only datasets' own dependencies, pinned at what pip resolves (the wheels a lent GPU carries).
    helpers = {canonicalize_name(requirement.name) for requirement in map(Requirement, importlib.metadata.requires(
        "datasets")) if "extra" not in str(requirement.marker)}
    assert pinned.keys() - declared.keys() <= helpers, "a pin that is neither a lower bound nor datasets' dependency"


def test_no_install_script_pins_a_version_of_its_own():
    names = "|".join(re.escape(requirement.name) for requirement in dependencies())
    pinned = re.compile(rf"\b({names})\s*(==|>=|<=|~=|!=|<|>)", re.IGNORECASE)
    for script in INSTALL_SCRIPTS:
        for number, line in enumerate((ROOT / script).read_text().splitlines(), 1):
            assert not pinned.search(line), f"{script}:{number} decides a version outside pyproject.toml: {line}"


def package_imports() -> dict[str, set[str]]:
    """module → the package's modules it imports, at its top or inside a function (`from .x import y`, `from . import
    x`)."""
    package = ROOT / "src" / "vaswani"
    modules = {path.stem for path in package.glob("*.py")}
    graph = {}
    for path in package.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                imported |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        graph[path.stem] = imported & modules - {path.stem}
    return graph


def test_the_package_imports_downward_with_no_cycle_even_inside_functions():
    graph = package_imports()
    finished, path = set(), []

    def visit(module):
        if module in path:
            cycle = path[path.index(module):] + [module]
            raise AssertionError("import cycle: " + " → ".join(cycle))
        if module in finished:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path.pop()
        finished.add(module)

    for module in sorted(graph):
        visit(module)
