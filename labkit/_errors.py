"""labkit's exceptions: the tree, and what each holds (every folder raises them).

The tree::

    LabkitError                 anything labkit itself reports
    ├── LaunchError             a rank failed; .failures, root cause first
    │   └── LaunchTimeout       the run passed its timeout; .last_steps, .stacks
    ├── ScriptError             the script cannot run at all (a syntax error)
    └── NoMetricsError          a run logged no metrics, so there is nothing to chart

Bad arguments are reported with Python's own ValueError, TypeError and
FileNotFoundError, before anything is launched. An interrupted launch raises
KeyboardInterrupt, after one line that says what was stopped. What a failure most likely
means (the HINT) is worked out by ``labkit._launch.failures``.
"""

from __future__ import annotations

import re
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


class LabkitError(Exception):
    """Base class of every error that labkit raises itself.

    Attributes:
        sweep: when a run of ``labkit.sweep`` failed, the Sweep it stopped, holding the runs
            that finished before it (``err.sweep.runs``); None otherwise.

    Example::

        try:
            labkit.sweep("scripts/02_ddp.py", nproc=[1, 2])
        except labkit.LabkitError as err:
            finished = err.sweep.runs if err.sweep else []
    """

    sweep = None


class ScriptError(LabkitError):
    """The script cannot start: labkit found a syntax error before launching.

    Example::

        try:
            labkit.launch("scripts/broken.py")
        except labkit.ScriptError as err:
            print(err)                      # the file, the line and the syntax error; nothing ran
    """


class NoMetricsError(LabkitError):
    """A run has no metrics to read: the script never called ``metrics.log``.

    Example::

        try:
            run.metrics()
        except labkit.NoMetricsError:
            print("the script never called metrics.log")
    """


@dataclass(frozen=True)
class RankFailure:
    """What one rank left behind when it failed.

    Attributes:
        rank: the global rank.
        exit_code: the rank's exit code, when known.
        exc_type: the exception's class name, e.g. ``"ValueError"`` ("" if none was recorded).
        message: the exception's message.
        traceback: the traceback from the script's first frame ("" if none); for a rank a
            native crash killed, the Python stack it printed then (most recent call first).
        output_tail: the last lines the rank printed.
        time: when the failure was recorded (seconds since the epoch), or None.
        secondary: True when the rank most likely died only because a peer went away.

    Example::

        failure = err.root_cause          # err: a LaunchError
        print(failure.headline(), failure.traceback)
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


def same_error(a: RankFailure, b: RankFailure) -> bool:
    return bool(a.exc_type) and (a.exc_type, a.message) == (b.exc_type, b.message)


class LaunchError(LabkitError):
    """A rank of a launched run failed.

    Attributes:
        failures: list of RankFailure, the root cause first.
        run: the Run (its folder holds every rank's full log).
        returncode: torchrun's exit code.

    Example (lesson 00)::

        try:
            labkit.launch("scripts/00_fail.py", nproc=2)
        except labkit.LaunchError as err:
            err.root_cause.rank, err.root_cause.exc_type, err.run.output(1)
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
            if first.exc_type and first.traceback:
                parts.append(_tail(first.traceback, 12))
            else:  # no Python exception: what the rank said last, then where it was (a crash)
                if first.output_tail:
                    parts.append("  its last output:\n" + _tail(first.output_tail, 8))
                if first.traceback:
                    parts.append("  its Python stack when it died (most recent call first):\n"
                                 + _tail(first.traceback, 12))
            others = self.failures[1:]
            same = [o.rank for o in others if same_error(o, first)]
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

    Example (lesson 10)::

        try:
            labkit.launch("scripts/10_hang.py", nproc=2, hang_timeout_s=5)
        except labkit.LaunchTimeout as err:
            err.last_steps, err.stacks      # {rank: step}, {rank: "10_hang.py:31 in <module>, ..."}
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
