"""The house rule, read off the imports: no stage package imports another stage package, and the
shared package imports none of them (nor the command and the demo built on top of them).

Stages meet only on topics and on the checkpoint store's format (flywheel/checkpoints/): a stage
that imported another could not be deployed, scaled or replaced alone. Every import statement of
every module is read with ``ast``, those inside functions too, so a lazy import cannot hide one.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("serving", "ingest", "reward", "trainer", "release")


def imported_packages(path: Path) -> set[str]:
    """The top-level package of every module ``path`` imports (relative imports are its own)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def modules_of(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def crossings(package: str, forbidden: set[str]) -> list[str]:
    return [f"{path.relative_to(ROOT)} imports {name}"
            for path in modules_of(package) for name in sorted(imported_packages(path) & forbidden)]


@pytest.mark.parametrize("stage", STAGES)
def test_no_stage_imports_another_stage(stage):
    assert crossings(stage, set(STAGES) - {stage}) == []


def test_the_shared_package_imports_no_stage_and_no_tool():
    # the command, the demo and the embedded broker's launcher (cli/, local/) sit on top of the
    # stages; the package every stage imports must not pull them, or a stage, in
    assert crossings("flywheel", {*STAGES, "cli", "local"}) == []


def test_the_reader_sees_imports_inside_functions_and_from_imports(tmp_path):
    # the check itself must be able to fail: a lazy import of another stage is still an import
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from trainer.loop import Trainer\n    import ingest.stage\n"
                      "from . import sibling\n")
    assert imported_packages(module) == {"os", "trainer", "ingest"}


#: Every top-level package the project ships (pyproject's packages.find).
PACKAGES = ("flywheel", "cli", "local", *STAGES)


def package_dirs(package: str) -> list[Path]:
    """The package and every folder below it that holds a module: each is a package of the wheel."""
    return sorted({path.parent for path in modules_of(package)})


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_is_a_regular_package(package):
    # a folder without __init__.py still imports, as a namespace package: one with no __file__,
    # whose parts a second folder of that name anywhere on sys.path (another project's release/,
    # a checkout beside an installed wheel) joins silently, and whose package data resolves
    # against whichever part came first
    assert [str(d.relative_to(ROOT)) for d in package_dirs(package) if not (d / "__init__.py").is_file()] == []
    module = importlib.import_module(package)
    assert module.__file__ is not None and Path(module.__file__).parent == ROOT / package
