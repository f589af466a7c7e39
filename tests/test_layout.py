"""The package's shape: folders by role, what each may import, sizes, and an example for every
public name (CONTRIBUTING.md: labkit)."""

from __future__ import annotations

import ast
import inspect
import sys
import types
from pathlib import Path

import pytest

import labkit
from conftest import ROOT
from test_rundir import HEAVY, imported_by

PACKAGE = ROOT / "labkit"
FOLDERS = ("_rank", "_launch", "_diagnose", "_results", "_course", "_interact")
#: Scripts launched on the ranks (the doctor's, labkit.bandwidth's), not modules anyone imports:
#: they load torch.
SCRIPTS = {"labkit._rank.selftest", "labkit._rank.collectives"}

# "Readable in one sitting": about 300 lines a module, about 60 code lines a function (its
# docstring not counted). "About": a few lines over is noise, not a second topic.
MODULE_LINES, FUNCTION_LINES, ABOUT = 300, 60, 10
# Longer on purpose, each with why (say it in the module too).
LONG_MODULES = {
    # One exercise, one module (labkit/_course/checks finds them by file name): a check whose
    # phases are many stays whole rather than split into files nobody would look for.
    "labkit/data.py": "lesson scripts import both data sets from one public module, and CIFAR-10's "
                      "download under a process group (every rank's collectives in step) reads "
                      "best beside its one caller",
}
LONG_FUNCTIONS: dict[str, str] = {}


def _modules(folder: Path):
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def test_every_folder_says_what_it_owns_and_who_imports_it():
    for folder in FOLDERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
        assert "Owns" in doc and "Imported by" in doc, f"labkit/{folder}/__init__.py says neither"
        for path in (PACKAGE / folder).glob("*.py"):
            if path.stem != "__init__":
                assert path.stem in doc, f"labkit/{folder}/__init__.py does not name {path.name}"
        for sub in (PACKAGE / folder).iterdir():
            if sub.is_dir() and (sub / "__init__.py").exists():
                assert sub.name in doc, f"labkit/{folder}/__init__.py does not name {sub.name}/"


def test_no_flat_module_is_left_but_the_public_ones_and_the_shared_three():
    """The top level holds the public rank-side modules, the command-line entry points, and the
    three every folder shares; anything else belongs in a folder by its role."""
    top = {p.stem for p in PACKAGE.glob("*.py")}
    public = {"metrics", "data", "models", "syncbn", "comm", "checkpoint", "memory", "exercises", "handout"}
    assert top - public == {"__init__", "_rundir", "_errors", "_hardware"}, sorted(top - public)


@pytest.mark.parametrize("module", [m for m, _ in _modules(PACKAGE / "_rank") if m not in SCRIPTS])
def test_the_rank_side_is_standard_library_only(module):
    """A rank imports labkit/_rank/ before its script (and torch) loads: python -m labkit._rank.entry."""
    new = imported_by(f"import {module}")
    outside = [m for m in new if m not in sys.stdlib_module_names and m != "labkit"]
    assert not outside and not [m for m in HEAVY if m in new], f"{module} imports {outside}"


def _code_lines(node) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_modules_and_functions_read_in_one_sitting():
    too_long = []
    for _, path in _modules(PACKAGE):
        name = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MODULE_LINES + ABOUT and name not in LONG_MODULES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                code = _code_lines(node)
                if code > FUNCTION_LINES + ABOUT // 2 and f"{name}:{node.name}" not in LONG_FUNCTIONS:
                    too_long.append(f"{name}:{node.name}: {code} code lines")
    assert not too_long, ("split these into named steps, or say why in LONG_MODULES / "
                          "LONG_FUNCTIONS: " + "; ".join(too_long))
    for name in LONG_MODULES:
        assert len((ROOT / name).read_text().splitlines()) > MODULE_LINES + ABOUT, (
            f"{name} is short again: take it off LONG_MODULES")


def test_every_public_name_has_an_example():
    missing = []
    for name in labkit.__all__:
        value = getattr(labkit, name)
        doc = inspect.getdoc(value) or ""
        if "Example" not in doc and not (isinstance(value, types.ModuleType) and "::" in doc):
            missing.append(name)
    assert not missing, f"no example in the docstring of labkit.{', labkit.'.join(missing)}"
