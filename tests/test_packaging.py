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
    targets = re.search(r"^for target in (.+); do$", ci, re.M)  # each target runs to its end
    assert targets and targets[1].split()[:2] == ["test", "test-browser"], (
        "CI runs make test, then the browser tests right after it, as the README says")
    assert "make test-browser" in readme and 'make "$target"' in ci


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


# -- the lock: the tested set-up, pinned for a room of seats ------------------------------------
def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and " " not in line, f"requirements.lock: {line!r} is not name==version"
            pins[_name(name).replace("_", "-")] = version
    return pins


def test_the_lock_pins_the_tested_torch_and_every_direct_dependency():
    pins = _lock()
    make_pin = re.search(r"^TORCH\s*\?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    for pin in make_pin.split():
        name, version = pin.split("==")
        assert pins.get(name) == version, f"the Makefile installs {pin}, the lock says {pins.get(name)}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = {_name(r).replace("_", "-") for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    assert direct - set(pins) == set(), "a dependency of pyproject.toml is not in requirements.lock: make lock"
    assert "labkit" not in pins
    # tqdm left the dependencies (nothing of ours imports it); accelerate and lightning still
    # bring it in, so it may be pinned, but only as theirs.
    assert "tqdm" not in direct
    assert not [p for p in (ROOT / "labkit").rglob("*.py") if "tqdm" in p.read_text()]


def test_the_makefile_installs_through_the_lock_and_make_lock_writes_it():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^LOCK\s*:=\s*requirements\.lock$", makefile, re.M)
    assert "$(PY) -m pip install $(PIP_FROM) $(PIN) -e \".[test]\"" in makefile
    assert re.search(r"^lock:\n(\t.*\n)*\t\$\(PY\) tools/lock\.py \$\(LOCK\)$", makefile, re.M)


def test_the_installed_set_up_is_the_locked_one():
    """What this environment installed for the course is what the lock says (a package upgraded
    by hand, or a lock not regenerated after an upgrade, shows here): `make lock` after the
    tests pass with new versions."""
    import importlib.util
    from importlib import metadata

    spec = importlib.util.spec_from_file_location("lock", ROOT / "tools" / "lock.py")
    lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lock)
    installed = lock.installed_closure(lock.direct_requirements())
    installed.pop("labkit", None)
    pins = _lock()
    unpinned = sorted(set(installed) - set(pins))
    assert not unpinned, f"installed for the course but not in requirements.lock: {unpinned}"
    differ = {name: (version, pins[name]) for name, version in installed.items() if pins[name] != version}
    assert not differ, f"installed version != locked version: {differ}. HINT: make lock"
    assert metadata.version("torch").split("+")[0] == pins["torch"]
