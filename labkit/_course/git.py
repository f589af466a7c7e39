"""Git plumbing for the hand-out: read a commit's files and write a tree, without a work tree.

Standard library only. Nothing here touches the work tree, the index or the current branch:
reading goes through ``git ls-tree`` and ``git cat-file``, writing through a temporary index.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple


class File(NamedTuple):
    """One file of a commit: git's mode, the blob's id (None once the content changed), bytes."""

    mode: str
    sha: str | None
    data: bytes


def run_bytes(root: Path, *args: str, data: bytes | None = None, env: dict | None = None) -> bytes:
    """What ``git args`` prints in ``root``; a RuntimeError with git's own message if it fails."""
    try:
        return subprocess.run(["git", *args], cwd=root, input=data, capture_output=True,
                              env=env, check=True, timeout=60).stdout
    except FileNotFoundError:
        raise RuntimeError("git is not installed. HINT: install git, then try again.") from None
    except subprocess.CalledProcessError as err:
        message = err.stderr.decode(errors="replace").strip() or f"exit code {err.returncode}"
        raise RuntimeError(f"git {' '.join(args[:2])} failed: {message}") from None


def run(root: Path, *args: str, data: bytes | None = None, env: dict | None = None) -> str:
    """``run_bytes`` as text, without the final newline."""
    return run_bytes(root, *args, data=data, env=env).decode(errors="replace").strip()


def read_commit(root: Path, rev: str = "HEAD") -> dict[str, File]:
    """Every file of commit ``rev`` (path -> File), read from git, not from the work tree."""
    listing = run_bytes(root, "ls-tree", "-r", "-z", "--full-tree", rev)
    entries = []
    for item in listing.split(b"\0"):
        if item:
            meta, path = item.split(b"\t", 1)
            mode, kind, sha = meta.decode().split()
            if kind == "blob":  # a submodule ("commit") has no content here
                entries.append((path.decode(), mode, sha))
    out = run_bytes(root, "cat-file", "--batch", data="".join(f"{sha}\n" for _, _, sha in entries).encode())
    files, at = {}, 0
    for path, mode, sha in entries:
        header_end = out.index(b"\n", at)
        size = int(out[at:header_end].split()[2])
        files[path] = File(mode, sha, out[header_end + 1:header_end + 1 + size])
        at = header_end + 1 + size + 1
    return files


def write_tree(root: Path, files: dict[str, File]) -> str:
    """Write ``files`` (path -> File) as a tree object in ``root``'s repository; return its id."""
    with tempfile.TemporaryDirectory(prefix="labkit-handout-") as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))
        entries = []
        for path, file in sorted(files.items()):
            sha = file.sha or run(root, "hash-object", "-w", "--stdin", data=file.data)
            entries.append(f"{file.mode} {sha}\t{path}\0")
        run(root, "update-index", "--add", "-z", "--index-info", data="".join(entries).encode(), env=env)
        return run(root, "write-tree", env=env)


def commit_id(root: Path, name: str) -> str | None:
    """The full id of the commit ``name`` names (a branch, HEAD, an id), or None."""
    try:
        return run(root, "rev-parse", "--verify", "-q", f"{name}^{{commit}}")
    except RuntimeError:
        return None
