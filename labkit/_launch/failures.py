"""What failed in a launch, root cause first, and what it most likely means (the HINT).

``collect_failures`` reads what the last attempt left: the error files the ranks' entry points wrote
(``errors/``), and torchrun's own lines for a rank that died without a Python exception (a
signal). ``failure_hint`` and ``timeout_hint`` turn them into the HINT of a ``LaunchError`` or
``LaunchTimeout``. Kernel side, standard library.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from labkit import _rundir
from labkit._diagnose.stacks import FAULTHANDLER, excerpt, waiting_place, where
from labkit._errors import RankFailure, same_error

# torchrun's own line for a worker that died without a Python exception (a signal, say).
_TORCHRUN_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# torchrun's closing summary lists every failed worker; the line above names only the first
# it saw (rank 0 aborted by gloo can come second to rank 1 that lost it).
_TORCHRUN_SUMMARY_RE = re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)")

# What a rank's entry point (faulthandler) prints on a fatal signal, before its Python stacks.
_CRASH_RE = re.compile(r"^Fatal Python error: ")
# faulthandler's last line after the stacks: every extension module loaded (one long line).
_EXTENSIONS_RE = re.compile(r"^Extension modules: ")
# What else a dump holds besides threads' headers and frames (``FAULTHANDLER``'s patterns): a
# thread without Python frames, a stack cut short, the blank line between two threads.
_DUMP_OTHER_RE = re.compile(r"^\s+<no Python frame>$|^\s+\.\.\.$|^\s*$")

# A lost peer's message that says the rank gave up waiting, rather than that the peer left.
_TIMED_OUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)

# glibc's own words when it finds a process's heap corrupted, just before it aborts it (SIGABRT).
_HEAP_CORRUPTION_RE = re.compile(
    r"(?m)^(?:\[rank\d+\] )?((?:malloc|free|realloc|malloc_consolidate|munmap_chunk|_int_\w+)\(\): [^\n]*"
    r"|double free or corruption[^\n]*|corrupted (?:size vs\. prev_size|double-linked list)[^\n]*)")
# The HINT's words for it, which a test harness may look for (tests/conftest.py does).
HEAP_CORRUPTED = "found its heap memory corrupted"

MISMATCH_ADVICE = ("every rank must call the same collectives in the same order, with tensors of "
                   "the same size: look for a collective inside `if rank == 0:` (or any branch "
                   "that only some ranks take).")


def _error_records(run_dir: Path) -> list[dict]:
    records = []
    for path in _rundir.error_files(run_dir):
        try:
            records.append(json.loads(path.read_text()))
        except (ValueError, OSError):
            continue
    return records


def _signalled(run_dir: Path, nnodes: int) -> dict[int, int]:
    """{rank: exit code} of the workers torchrun's own log says failed (signals included)."""
    found = {}
    for node in range(nnodes):
        log = _rundir.agent_log(run_dir, node, nnodes)
        text = log.read_text(errors="replace") if log.exists() else ""
        if nnodes == 1:  # with several agents, this line's local rank is not the rank
            found.update({int(rank): int(code) for code, rank in _TORCHRUN_FAILED_RE.findall(text)})
        found.update({int(rank): int(code) for rank, code in _TORCHRUN_SUMMARY_RE.findall(text)})
    return found


def split_crash(tail: str) -> tuple[str, list[str]]:
    """A rank's last lines cut where a native crash began: what it printed before (glibc's or
    gloo's last words among them) and the Python stacks faulthandler printed then (the rank's
    entry point asks for them), without faulthandler's list of extension modules. No crash at
    the end of ``tail`` (none, or one of an earlier attempt, before the rank started again):
    ``(tail, [])``.

    Example::

        before, dump = split_crash("step 3\\nFatal Python error: Aborted\\n\\nCurrent thread ...")
    """
    lines = tail.splitlines()
    begins = [i for i, line in enumerate(lines) if _CRASH_RE.match(line)]
    if not begins:
        return tail, []
    dump = [line for line in lines[begins[-1] + 1:] if not _EXTENSIONS_RE.match(line)]
    if not all(FAULTHANDLER.thread.match(line) or FAULTHANDLER.frame.match(line)
               or _DUMP_OTHER_RE.match(line) for line in dump):
        return tail, []  # the rank printed on after it: a crash of an attempt before the last
    while dump and not dump[-1].strip():
        dump.pop()
    return "\n".join(lines[:begins[-1]]), dump


def _from_signal(rank: int, code: int, tail: str, script: str | None = None) -> RankFailure:
    """A rank that ended without a Python exception: killed by a signal, or an exit code. A
    native crash's Python stacks (``split_crash``) become its traceback, cut to the thread
    that runs ``script``, and say in its message which of the script's lines it was on."""
    if code < 0:
        try:
            what = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            what = f"killed by signal {-code}"
        secondary = -code in (signal.SIGTERM, signal.SIGINT)
    else:
        what, secondary = f"exited with code {code} without a Python exception", False
    tail, dump = split_crash(tail)
    place = where("\n".join(dump), script, FAULTHANDLER) if dump and script else None
    if place:
        what += f" at {place}"
    stack = "\n".join(excerpt(dump, script or "", FAULTHANDLER))
    return RankFailure(rank=rank, exit_code=code, exc_type="", message=what, traceback=stack,
                       output_tail=tail, time=None, secondary=secondary)


def collect_failures(run_dir: Path, streams, script: str | None = None,
                     ) -> tuple[list[RankFailure], int]:
    """The failures of the last attempt, root cause first, and how many restarts happened.

    ``streams``: the launch's ``Streams`` (its ``attempts``, ``nnodes`` and each rank's last
    lines). ``script``: the launched script, where a native crash's stack is placed.

    Example (the launcher, once the run has ended)::

        found, restarts = collect_failures(run.run_dir, streams, run.info["script"])
    """
    records = _error_records(run_dir)
    last_restart = max([r["restart"] for r in records] + streams.attempts)
    # Several nodes: each rank's newest process, from the layout file. An elastic run's nodes
    # count their restarts apart (a node that joined late is at restart 0), so the restart
    # number alone cannot say which records are the last round's.
    newest = set({rec["rank"]: rec["pid"] for rec in _rundir.layout_records(run_dir)}.values())
    tail = lambda rank: "\n".join(streams.recent.get(rank, ()))  # noqa: E731
    found = []
    for rec in records:
        if (rec.get("pid") not in newest) if newest else rec["restart"] != last_restart:
            continue
        found.append(RankFailure(
            rank=rec["rank"], exit_code=rec.get("exit_code"), exc_type=rec["type"],
            message=rec["message"], traceback=rec["traceback"], output_tail=tail(rec["rank"]),
            time=rec["time"], secondary=RankFailure.looks_secondary(rec["message"] + rec["traceback"]),
        ))
    recorded = {f.rank for f in found}
    found += [_from_signal(rank, code, tail(rank), script)
              for rank, code in _signalled(run_dir, streams.nnodes).items() if rank not in recorded]
    found.sort(key=lambda f: (f.secondary, f.exc_type == "", f.time or float("inf"), f.rank))
    return found, last_restart


def failure_hint(failures) -> str:
    """The HINT of a LaunchError: what the root cause's kind of failure usually means.

    A collective mismatch that a rank's output names comes first, whichever rank said it;
    then a Python exception (its traceback), then a signal (which one says most) or an
    exit code without an exception.
    """
    failures = list(failures)
    if not failures:
        return ""
    first, others = failures[0], failures[1:]
    mismatch = next((f for f in failures if f.says_mismatch), None)
    if mismatch is not None:
        return f"rank {mismatch.rank}'s output says the ranks' collectives did not match: {MISMATCH_ADVICE}"
    if first.exc_type == "SystemExit":
        return "the script exited on purpose; its last output (above) says why."
    if first.exc_type and others and all(f.secondary for f in failures):
        # Every rank gave up waiting (a collective's timeout): where each waited says more than
        # the message they share.
        places = {f.rank: waiting_place(f.traceback) for f in failures}
        places = {rank: where for rank, where in places.items() if where}
        if len(set(places.values())) > 1:
            return timeout_hint(places, verb="waited")
    if first.exc_type and others and all(same_error(first, o) for o in others):
        return (f"every rank that failed raised the same error, so its cause is in code they all run: "
                f"read rank {first.rank}'s traceback above. A rank's whole output: err.run.output(rank).")
    if first.exc_type and first.secondary:  # sorted first, so every failure is a lost peer
        if _TIMED_OUT_RE.search(first.message):
            what, peer = "gave up waiting for a peer (its collective timed out)", "waited elsewhere"
        else:
            what, peer = "lost its connection to a peer", "finished, or left early"
        return (f"rank {first.rank} {what}, but no rank reported an error of its own: a peer most "
                f"likely {peer} while rank {first.rank} still waited in a collective. "
                f"{MISMATCH_ADVICE[0].upper()}{MISMATCH_ADVICE[1:]}")
    if first.exc_type:
        if not others:
            also = ""
        elif all(o.secondary for o in others):
            also = "; the other ranks stopped because it went away"
        else:
            also = "; other ranks failed on their own too (the 'also:' lines)"
        return (f"read rank {first.rank}'s traceback above: it is the root cause{also}. "
                f"A rank's whole output: err.run.output(rank).")
    return _exit_hint(first)


def timeout_hint(stacks: dict, *, verb: str = "wait") -> str:
    """The HINT of a LaunchTimeout, from where each rank was (``{rank: "x.py:7 in f, inside
    all_reduce (...)"}``): ranks waiting in different collectives get the mismatch advice."""
    waiting = {rank: where for rank, where in stacks.items() if ", inside " in where}
    if len(set(waiting.values())) > 1:
        places = "; ".join(f"rank {rank} at {where.split(' (')[0]}"
                           for rank, where in sorted(waiting.items()))
        return f"the ranks {verb} in different places ({places}): {MISMATCH_ADVICE}"
    return ("a rank that logged fewer steps than the others, or waits in a collective the "
            "others never reach, is the one to read first.")


def _stack_says(failure: RankFailure) -> str:
    """The HINT's words for a native crash's Python stack, when the rank printed one."""
    return ", and its Python stack which of your lines called into it" if failure.traceback else ""


def _exit_hint(first: RankFailure) -> str:
    """What a rank that failed without a Python exception most likely met: its exit code, or
    the signal that killed it (which one says most)."""
    code = first.exit_code
    if code is None or code >= 0:
        return (f"rank {first.rank} exited with code {code} without a Python exception: its last "
                f"lines (above) say why.")
    sig = -code
    if sig == getattr(signal, "SIGKILL", None):
        return (f"rank {first.rank} was killed by SIGKILL, most often by the out-of-memory killer: "
                f"too many ranks, or too large a batch or model, for this machine's memory "
                f"(`dmesg` says), unless someone stopped it.")
    if sig == getattr(signal, "SIGABRT", None):
        heap = _HEAP_CORRUPTION_RE.search(first.output_tail or "")
        if heap:
            return (f"glibc {HEAP_CORRUPTED} and aborted rank {first.rank} (\"{heap.group(1).strip()}\"): "
                    f"a memory bug in native code (PyTorch, gloo, a C++ extension), not in your "
                    f"Python. It strikes rarely and at random: run the cell again. If it comes back, "
                    f"report it with these lines and labkit.doctor()'s output.")
        return (f"rank {first.rank} was aborted (SIGABRT) by PyTorch's C++ runtime, not by a Python "
                f"exception: its last lines (above) say why{_stack_says(first)}.")
    if sig in (getattr(signal, "SIGSEGV", None), getattr(signal, "SIGBUS", None)):
        return (f"rank {first.rank} crashed inside native code (a C++ extension, a library): its "
                f"last lines (above) may say where{_stack_says(first)}; "
                f"err.run.output({first.rank}) has them all.")
    if sig in (signal.SIGTERM, signal.SIGINT):
        return f"rank {first.rank} was stopped from outside (torchrun, or someone else)."
    return (f"rank {first.rank} was killed by a signal: its last lines (above) may say why; "
            f"otherwise it was stopped from outside.")
