"""labkit's exceptions.

The tree::

    LabkitError                 anything labkit itself reports
    ├── LaunchError             a rank failed; .failures, root cause first
    │   └── LaunchTimeout       the run passed its timeout; .last_steps, .stacks
    ├── ScriptError             the script cannot run at all (a syntax error)
    └── NoMetricsError          a run logged no metrics, so there is nothing to chart

Bad arguments are reported with Python's own ValueError, TypeError and
FileNotFoundError, before anything is launched. An interrupted launch raises
KeyboardInterrupt, after one line that says what was stopped.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import types
from dataclasses import dataclass

__all__ = [
    "LabkitError",
    "LaunchError",
    "LaunchTimeout",
    "ScriptError",
    "NoMetricsError",
    "RankFailure",
]

# Messages of ranks that died only because a peer vanished: gloo, NCCL and the store.
_SECONDARY_PATTERNS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"remote process exited|NCCL communicator was aborted|ProcessGroupNCCL.*(abort|timeout)|"
    r"recvBytes|sendBytes|Socket Timeout|failed to recv|"
    r"DistStoreError|TCPStore|Timed out waiting",
    re.IGNORECASE,
)


# What gloo and NCCL say when the ranks' collectives do not line up.
_MISMATCH_PATTERNS = re.compile(
    r"collective mismatch|mismatch between collectives|mismatched collectives|"
    r"data size doesn't match expected size",
    re.IGNORECASE,
)

MISMATCH_ADVICE = ("every rank must call the same collectives in the same order, with tensors of "
                   "the same size: look for a collective inside `if rank == 0:` (or any branch "
                   "that only some ranks take).")


class LabkitError(Exception):
    """Base class of every error that labkit raises itself.

    Attributes:
        sweep: when a run of ``labkit.sweep`` failed, the Sweep it stopped, holding the runs
            that finished before it (``err.sweep.runs``); None otherwise.
    """

    sweep = None


class ScriptError(LabkitError):
    """The script cannot start: labkit found a syntax error before launching."""


class NoMetricsError(LabkitError):
    """A run has no metrics to read: the script never called ``metrics.log``."""


@dataclass(frozen=True)
class RankFailure:
    """What one rank left behind when it failed.

    Attributes:
        rank: the global rank.
        exit_code: the rank's exit code, when known.
        exc_type: the exception's class name, e.g. ``"ValueError"`` ("" if none was recorded).
        message: the exception's message.
        traceback: the traceback from the script's first frame ("" if none).
        output_tail: the last lines the rank printed.
        time: when the failure was recorded (seconds since the epoch), or None.
        secondary: True when the rank most likely died only because a peer went away.
    """

    rank: int
    exit_code: int | None
    exc_type: str
    message: str
    traceback: str
    output_tail: str
    time: float | None
    secondary: bool

    @staticmethod
    def looks_secondary(message: str) -> bool:
        """True if ``message`` is what a rank says when a *peer* disappeared."""
        return bool(_SECONDARY_PATTERNS.search(message))

    @property
    def says_mismatch(self) -> bool:
        """True if the rank's error or last output says the ranks' collectives did not match."""
        return bool(_MISMATCH_PATTERNS.search(
            "\n".join((self.message, self.traceback, self.output_tail))))

    def last_line(self, limit: int = 200) -> str:
        """The last line the rank printed (its end, when long), "" if none."""
        lines = [line.strip() for line in self.output_tail.splitlines() if line.strip()]
        if not lines:
            return ""
        return lines[-1] if len(lines[-1]) <= limit else "…" + lines[-1][-(limit - 1):]

    def headline(self, limit: int = 300) -> str:
        what = f"{self.exc_type}: {self.message}" if self.exc_type else self.message
        if len(what) > limit:
            what = what[: limit - 1] + "…"
        code = f" (exit code {self.exit_code})" if self.exit_code is not None else ""
        return f"rank {self.rank} failed{code}: {what}"


def _tail(text: str, lines: int) -> str:
    kept = text.rstrip("\n").splitlines()[-lines:]
    return "\n".join("    " + line for line in kept)


def _ranks(ranks: list[int]) -> str:
    """'rank 1' or 'ranks 1, 2 and 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _same_error(a: RankFailure, b: RankFailure) -> bool:
    return bool(a.exc_type) and (a.exc_type, a.message) == (b.exc_type, b.message)


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
    if first.exc_type and others and all(_same_error(first, o) for o in others):
        return (f"every rank that failed raised the same error, so its cause is in code they all run: "
                f"read rank {first.rank}'s traceback above. A rank's whole output: err.run.output(rank).")
    if first.exc_type and first.secondary:  # sorted first, so every failure is a lost peer
        return (f"rank {first.rank} lost its connection to a peer, but no rank reported an error of "
                f"its own: a peer most likely finished, or left early, while rank {first.rank} still "
                f"waited in a collective. {MISMATCH_ADVICE[0].upper()}{MISMATCH_ADVICE[1:]}")
    if first.exc_type:
        if not others:
            also = ""
        elif all(o.secondary for o in others):
            also = "; the other ranks stopped because it went away"
        else:
            also = "; other ranks failed on their own too (the 'also:' lines)"
        return (f"read rank {first.rank}'s traceback above: it is the root cause{also}. "
                f"A rank's whole output: err.run.output(rank).")
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
        return (f"rank {first.rank} was aborted (SIGABRT) by PyTorch's C++ runtime, not by a Python "
                f"exception: its last lines (above) say why.")
    if sig in (getattr(signal, "SIGSEGV", None), getattr(signal, "SIGBUS", None)):
        return (f"rank {first.rank} crashed inside native code (a C++ extension, a library): its "
                f"last lines (above) may say where; err.run.output({first.rank}) has them all.")
    if sig in (signal.SIGTERM, signal.SIGINT):
        return f"rank {first.rank} was stopped from outside (torchrun, or someone else)."
    return (f"rank {first.rank} was killed by a signal: its last lines (above) may say why; "
            f"otherwise it was stopped from outside.")


_TB_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$', re.MULTILINE)


def waiting_place(traceback: str) -> str:
    """'scripts/x.py:29 in train_step, inside all_reduce' from a traceback: the script's
    innermost frame and the library call it was in ("" if the traceback has no such frames)."""
    frames = [m.groupdict() for m in _TB_FRAME.finditer(traceback or "")]
    mine = [f for f in frames if "site-packages" not in f["file"] and not f["file"].startswith("<")]
    if not frames or not mine or frames[-1] is mine[-1]:
        return ""
    return f"{mine[-1]['file']}:{mine[-1]['line']} in {mine[-1]['func'].strip()}, inside {frames[-1]['func'].strip()}"


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


class LaunchError(LabkitError):
    """A rank of a launched run failed.

    Attributes:
        failures: list of RankFailure, the root cause first.
        run: the Run (its folder holds every rank's full log).
        returncode: torchrun's exit code.
    """

    def __init__(self, summary: str, *, failures=(), run=None, returncode=None, hint=""):
        self.failures = list(failures)
        self.run = run
        self.returncode = returncode
        self.summary = summary
        self.hint = hint
        super().__init__(self._compose())

    @property
    def root_cause(self) -> RankFailure | None:
        """The failure to read first (None when no rank recorded one)."""
        return self.failures[0] if self.failures else None

    def _compose(self) -> str:
        parts = [self.summary]
        if self.failures:
            first = self.failures[0]
            parts.append(first.headline())
            if first.traceback:
                parts.append(_tail(first.traceback, 12))
            elif first.output_tail:
                parts.append("  its last output:\n" + _tail(first.output_tail, 8))
            others = self.failures[1:]
            same = [o.rank for o in others if _same_error(o, first)]
            if same:
                parts.append(f"also: {_ranks(sorted(same))} failed with the same error")
            for other in others:
                if other.rank in same:
                    continue
                why = " (most likely because a peer went away)" if other.secondary else ""
                parts.append(f"also: {other.headline()}{why}")
        if self.run is not None:
            parts.append(f"full logs: {self.run.run_dir}")
        if self.hint:
            parts.append(f"HINT: {self.hint}")
        return "\n".join(parts)


class LaunchTimeout(LaunchError):
    """A launched run passed its ``timeout`` and was stopped.

    Attributes:
        last_steps: {rank: last step it logged, or None}.
        stacks: {rank: where its main thread was when stopped, e.g. ``"scripts/x.py:12 in <module>"``}.
    """

    def __init__(self, summary: str, *, last_steps=None, stacks=None, run=None, hint=""):
        self.last_steps = dict(last_steps or {})
        self.stacks = dict(stacks or {})
        super().__init__(summary, run=run, hint=hint)

    def _compose(self) -> str:
        parts = [self.summary]
        ranks = sorted(set(self.last_steps) | set(self.stacks))
        for rank in ranks:
            step = self.last_steps.get(rank)
            step_text = f"last logged step {step}" if step is not None else "logged no step"
            where = self.stacks.get(rank)
            parts.append(f"  rank {rank}: {step_text}" + (f"; was at {where}" if where else ""))
        if self.run is not None:
            parts.append(f"full logs: {self.run.run_dir}")
        if self.hint:
            parts.append(f"HINT: {self.hint}")
        return "\n".join(parts)


# -- tracebacks ------------------------------------------------------------------------------
_PACKAGE_DIR = os.path.dirname(os.path.realpath(__file__))


def _labkit_frame(frame: types.FrameType) -> bool:
    return os.path.realpath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


def without_labkit_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback ``tb`` with every frame of labkit's own files left out."""
    kept = []
    while tb is not None:
        if not _labkit_frame(tb.tb_frame):
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for entry in reversed(kept):
        out = types.TracebackType(out, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return out


def _render_without_labkit(err: BaseException) -> list[str]:
    from IPython import get_ipython

    formatter = get_ipython().InteractiveTB
    tb = err.__traceback__
    if getattr(formatter, "skip_hidden", True):  # a user who asked for every frame gets them
        tb = without_labkit_frames(tb)
    return formatter.structured_traceback(type(err), err, tb)


def hide_labkit_frames(err: BaseException) -> BaseException:
    """Let IPython (Jupyter) show ``err`` without labkit's frames; returns ``err``.

    IPython leaves out a frame whose locals set ``__tracebackhide__``, but never the innermost
    one, and for an interrupted launch that is labkit's poll loop: plumbing, in the learner's
    way. Before it formats an exception, IPython asks it for ``_render_traceback_()`` (its hook
    for exceptions that format themselves), so ``err`` gets one that formats its traceback
    without any frame from labkit's files: the learner's cell is the last frame shown. Plain
    Python does not know the hook and prints every frame, as always.
    """
    err._render_traceback_ = functools.partial(_render_without_labkit, err)
    return err
