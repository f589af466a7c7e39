"""pyproject.toml and environment.yml install the same packages; the public surface is whole."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

import labkit

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower()


def test_pyproject_and_environment_list_the_same_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    conda, pip = set(), set()
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip |= {_name(r) for r in dep["pip"] if not r.startswith("-e")}
            assert "-e ." in dep["pip"]
        else:
            conda.add(_name(dep))
    assert {"torch", "torchvision"} <= pip, "torch comes from pip inside the conda environment"
    assert (conda | pip) - {"python", "pip"} == wanted


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make lab" in readme
    assert re.search(r"^make test$", ci, re.M)
    assert "make test-browser" in readme and re.search(r"^make test\nmake test-browser$", ci, re.M), (
        "CI runs the browser tests right after make test, as the README says")


def test_every_public_name_resolves():
    for name in labkit.__all__:
        assert getattr(labkit, name) is not None, name


def test_make_and_conda_pin_the_same_torch():
    """Both set-up paths install the PyTorch the course is tested with."""
    make_pin = re.search(r"^TORCH\s*\?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert make_pin, "the Makefile names the tested torch in TORCH ?= ..."
    pins = set(make_pin.group(1).split())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(dep["pip"] for dep in env["dependencies"] if isinstance(dep, dict))
    conda_pins = {r.split("#")[0].strip() for r in pip if r.startswith("torch")}
    assert pins == conda_pins, (pins, conda_pins)
    assert {p.split("==")[0] for p in pins} == {"torch", "torchvision"}
