"""Where is a rank? Every stack format labkit reads, parsed once, said in one form.

Three formats name the line a rank is at:

- **faulthandler** dumps, which a rank writes when a timeout asks (SIGUSR1, ``labkit._rank.entry``):
  ``Current thread 0x... (most recent call first):`` then ``File "x.py", line 12 in f``;
- **py-spy** dumps, read from outside (lesson 10, ``labkit._diagnose.hang``):
  ``Thread 4242 (idle): "MainThread"`` then ``    f (x.py:12)``;
- **tracebacks** a rank recorded when it failed: ``File "x.py", line 12, in f``, outermost first.

Each becomes threads of frames, innermost first, and every answer has one form::

    where(dump, "scripts/10_hang.py", FAULTHANDLER)
    # 'scripts/10_hang.py:31 in <module>, inside all_reduce (distributed_c10d.py)'

so that a timeout's stacks, py-spy's and a failure's traceback can be compared.
``excerpt`` cuts a dump to the lines worth showing in a cell. Kernel side, standard library:
the launcher (timeouts), ``hang`` (py-spy), ``failures`` and the exercises' checks (tracebacks).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Format:
    """How one kind of dump writes a thread and a frame."""

    name: str
    thread: re.Pattern          # a line that starts a thread's block
    frame: re.Pattern           # a frame line, with the groups file, line and func
    by_basename: bool           # py-spy shortens paths: a script's frame is known by its name


FAULTHANDLER = Format(
    "faulthandler", re.compile(r"^\s*(Current thread|Thread) 0x[0-9a-f]+ .*most recent call first"),
    re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$'), False)
PY_SPY = Format(
    "py-spy", re.compile(r"^Thread "),
    re.compile(r"^\s+(?P<func>.+?) \((?P<file>[^()]+?):(?P<line>\d+)\)\s*$"), True)
_TRACEBACK_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$',
                              re.MULTILINE)


@dataclass
class Thread:
    """One thread of a dump: its lines (the header first) and its frames, innermost first.
    Each frame is a dict with ``file``, ``line``, ``func`` and ``at`` (its index in ``lines``)."""

    lines: list[str]
    frames: list[dict] = field(default_factory=list)

    @property
    def current(self) -> bool:
        """The thread that was running (faulthandler says which; py-spy does not)."""
        return self.lines[0].strip().startswith("Current thread")


def threads(lines: list[str], fmt: Format) -> tuple[list[str], list[Thread]]:
    """(the lines before the first thread, the threads) of a dump in format ``fmt``."""
    starts = [i for i, line in enumerate(lines) if fmt.thread.match(line)]
    found = []
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        thread = Thread(lines[a:b])
        for i, line in enumerate(thread.lines[1:], 1):
            match = fmt.frame.match(line)
            if match:
                thread.frames.append(dict(match.groupdict(), at=i))
        found.append(thread)
    return lines[:starts[0]] if starts else lines, found


def _is_script(file: str, script: str, fmt: Format) -> bool:
    if fmt.by_basename:
        return os.path.basename(file) == os.path.basename(script)
    return os.path.abspath(file) == os.path.abspath(script)


def _script_frames(thread: Thread, script: str, fmt: Format) -> list[dict]:
    return [f for f in thread.frames if _is_script(f["file"], script, fmt)]


def _scripts_thread(found: list[Thread], script: str, fmt: Format) -> Thread | None:
    """The thread that runs ``script`` (the current one first); None if no thread does."""
    mine = [t for t in found if _script_frames(t, script, fmt)]
    return min(mine, key=lambda t: not t.current) if mine else None


def place(script: str, frames: list[dict], frame: dict, *, library_file: bool = True) -> str:
    """'scripts/x.py:12 in <module>, inside all_reduce (distributed_c10d.py)': where a thread of
    the script is. ``frames``: the thread's frames, innermost first; ``frame``: the script's
    innermost one among them; ``library_file``: name the innermost call's file too.

    Example::

        place("x.py", frames, frames[2])   # 'x.py:6 in step, inside all_reduce (distributed_c10d.py)'
    """
    where = f"{script}:{frame['line']} in {frame['func'].strip()}"
    if frames[0] is not frame:
        where += f", inside {frames[0]['func'].strip()}"
        if library_file:
            where += f" ({os.path.basename(frames[0]['file'])})"
    return where


def where(dump: str, script: str, fmt: Format) -> str | None:
    """Where the thread that runs ``script`` is, from a dump in format ``fmt``; None if no
    frame is the script's.

    Example (a timeout's faulthandler dump; a py-spy dump with ``PY_SPY``)::

        where(text, "scripts/10_hang.py", FAULTHANDLER)
    """
    _, found = threads(dump.splitlines(), fmt)
    thread = _scripts_thread(found, script, fmt)
    if thread is None:
        return None
    return place(script, thread.frames, _script_frames(thread, script, fmt)[0])


def traceback_frames(traceback: str) -> list[dict]:
    """The frames of a Python traceback (dicts with file, line and func), innermost first.

    Example::

        traceback_frames(failure.traceback)[0]["func"]     # where it raised
    """
    return [m.groupdict() for m in _TRACEBACK_FRAME.finditer(traceback or "")][::-1]


def waiting_place(traceback: str) -> str:
    """'scripts/x.py:29 in train_step, inside all_reduce' from a traceback: the innermost frame
    outside the installed packages and the library call it was in ("" if the traceback has no
    such frames, or ends in the script's own code).

    Example::

        waiting_place(failure.traceback)
    """
    frames = traceback_frames(traceback)
    mine = [f for f in frames if "site-packages" not in f["file"] and not f["file"].startswith("<")]
    if not mine or frames[0] is mine[0]:
        return ""
    return place(mine[0]["file"], frames, mine[0], library_file=False)


def excerpt(lines: list[str], script: str, fmt: Format, limit: int | None = None) -> list[str]:
    """The lines of a dump worth showing in a cell: what came before the threads, then the
    thread that runs ``script`` (the current thread, or the first, if none does) down to its
    outermost frame in ``script``: runpy's and labkit's frames below it say nothing. At most
    ``limit`` lines (the thread's first); the whole dump stays in the rank's log.

    Example::

        excerpt(dump.splitlines(), "scripts/10_hang.py", PY_SPY)
    """
    before, found = threads(lines, fmt)
    before = [line for line in before if line.strip()]
    if not found:
        return before[:limit]
    thread = _scripts_thread(found, script, fmt) or min(found, key=lambda t: not t.current)
    mine = _script_frames(thread, script, fmt)
    end = mine[-1]["at"] + 1 if mine else len(thread.lines)
    chosen = [line for line in thread.lines[:end] if line.strip()][:limit]
    if limit is None:
        return before + chosen
    room = limit - len(chosen)
    return (before[-room:] if room else []) + chosen
