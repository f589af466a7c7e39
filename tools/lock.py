"""Write requirements.lock: every package the course's set-up installs, at the version installed.

``make lock`` runs it with the course's Python, after the tests passed in that ``.venv``::

    .venv/bin/python tools/lock.py requirements.lock

The list is what ``pip install -e ".[test]"`` pulls in, followed from pyproject.toml through each
installed package's own requirements (their markers evaluated here), not whatever else the
environment holds. Versions lose their local label (``2.14.1+cu130`` is written ``2.14.1``), so
that the CPU-only and the other CUDA builds of the same release satisfy the same line. labkit
itself is left out. ``make lab`` and ``make test`` install through the file (pip's ``-c``), so
every seat of a room gets the versions the course was tested with.

Standard library, plus ``packaging`` (which pip and JupyterLab bring).
"""

from __future__ import annotations

import os
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
HEADER = """\
# The versions the course was tested with, for every package its set-up installs (pip's
# constraints: make lab and make test install through this file). Regenerate with `make lock`
# after the tests pass with new versions; written by tools/lock.py from {python} on {platform}.
"""


def direct_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    """The course's own requirements: pyproject.toml's dependencies and its ``test`` extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def installed_closure(wanted: list[Requirement]) -> dict[str, str]:
    """{name: installed version} of ``wanted`` and everything they require, as installed here.

    Raises:
        RuntimeError: a requirement that applies here is not installed.
    """
    found: dict[str, str] = {}
    todo = [(req, frozenset()) for req in wanted]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        req, extras_of_parent = todo.pop()
        environment = [{"extra": extra} for extra in extras_of_parent] or [{"extra": ""}]
        if req.marker is not None and not any(req.marker.evaluate(env) for env in environment):
            continue
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise RuntimeError(f"{req} is required but not installed: run `make lab` first") from None
        found[name] = dist.version.split("+")[0]
        todo += [(Requirement(r), frozenset(req.extras)) for r in dist.requires or ()]
    return found


def lock_text() -> str:
    versions = installed_closure(direct_requirements())
    versions.pop("labkit", None)
    lines = [f"{name}=={version}" for name, version in sorted(versions.items())]
    python = f"Python {sys.version.split()[0]}"
    return HEADER.format(python=python, platform=sys.platform) + "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tools/lock.py requirements.lock", file=sys.stderr)
        return 2
    text = lock_text()
    tmp = f"{argv[0]}.tmp{os.getpid()}"
    Path(tmp).write_text(text)
    os.replace(tmp, argv[0])
    print(f"{argv[0]}: {text.count('==')} packages pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
