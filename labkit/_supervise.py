"""Watching a launched run: stream rank output, stop it cleanly, explain failures."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections import deque
from pathlib import Path

from labkit import _proc, _rundir
from labkit._errors import RankFailure
from labkit._tail import LineTail as _LineTail

# torchrun's own line for a worker that died without a Python exception (a signal, say).
_TORCHRUN_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# torchrun's closing summary lists every failed worker; the line above names only the first
# it saw (rank 0 aborted by gloo can come second to rank 1 that lost it).
_TORCHRUN_SUMMARY_RE = re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)")
_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
# torchrun logs like glog: "W1122 04:01:27.719000 2582 path/api.py:753] message".
_GLOG_RE = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ \S+:\d+\] (.*)$")
_GLOG_LEVEL = {"I": "", "W": "warning: ", "E": "error: ", "F": "fatal: "}
_TORCHRUN_NOISE = ("no error file defined for parent",)
# What an agent prints when the agent that hosted the store has already exited at the end of
# a run: "[W1124 22:55:50.069 TCPStore.cpp:115] [c10d] recvVector failed on ..." (then C++
# frames), and "The node '...' has failed to shutdown the rendezvous '...' due to an error of
# type RendezvousConnectionError."
_TCPSTORE_NOISE = re.compile(r"^\[W\d{4} [\d:.]+ (?:\d+ )?(TCPStore|socket)\.cpp:\d+\]|"
                             r"has failed to shutdown the rendezvous .* RendezvousConnectionError")
_THREAD_RE = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*most recent call first")
#: Lines of each rank's stack dump that a timeout shows in the cell; the whole dump stays in
#: the rank's log (64 ranks of ~60 lines each used to flood the notebook).
DUMP_LINES = 12


class Streams:
    """Follows every rank's output (across torchrun restarts) and torchrun's own log.

    ``poll()`` hands each new complete line to ``emit`` with a ``[rankN]`` prefix.
    It runs in the caller's thread: under nbmake only output printed by the
    kernel's main thread reaches the notebook.
    """

    def __init__(self, run_dir: Path, emit, *, show_torchrun: bool = True, nnodes: int = 1):
        self.run_dir = Path(run_dir)
        self.emit = emit
        self.show_torchrun = show_torchrun
        self.nnodes = nnodes
        self._tails: dict[str, tuple[int, int, object]] = {}
        self._torchrun = [_LineTail(_rundir.agent_log(self.run_dir, k, nnodes)) for k in range(nnodes)]
        self._torchrun_quiet = [False] * nnodes
        self.node_of: dict[int, int] = {}  # rank -> node, several nodes only
        self._node_of_path: dict[str, int] = {}  # log -> its node (an elastic run's nodes restart apart)
        self._layout: dict[tuple[int, int, int], dict] = {}
        self._attempts: set[int] = {0}
        self.recent: dict[int, deque] = {}
        self._held: dict[int, list[str]] | None = None
        self._script = ""

    def _discover(self, final: bool = False) -> None:
        if self.nnodes > 1:
            self._discover_nodes(final)
            return
        for attempt, rank, path in _rundir.rank_logs(self.run_dir):
            if str(path) not in self._tails:
                self._tails[str(path)] = (rank, attempt, _LineTail(path))

    def _discover_nodes(self, final: bool) -> None:
        """Several agents: a log's folder names its node and local rank; the layout file, which
        each rank's entry point writes before the script starts, names its global rank."""
        for node, attempt, local, path in _rundir.node_rank_logs(self.run_dir):
            path = str(path)
            if path in self._tails:
                continue
            rec = self._layout.get((node, attempt, local))
            if rec is None:
                self._layout = _rundir.read_layout(self.run_dir)
                rec = self._layout.get((node, attempt, local))
            if rec is None and not final:
                continue  # its entry point has not said yet which rank it is
            rank = rec["rank"] if rec else -1 - node * 1000 - local  # unknown: never a real rank
            self.node_of[rank] = node
            self._node_of_path[path] = node
            self._tails[path] = (rank, attempt, _LineTail(path))

    def follow_agent(self, node: int) -> None:
        """Also follow agent ``node``'s own log: a node that joins an elastic run later."""
        while len(self._torchrun) <= node:
            k = len(self._torchrun)
            self._torchrun.append(_LineTail(_rundir.agent_log(self.run_dir, k, self.nnodes)))
            self._torchrun_quiet.append(False)
        self.nnodes = max(self.nnodes, node + 1)

    def layout_summary(self) -> dict:
        """{rank: {"node", "local_rank", "group_rank", "pid"}} of the latest attempt, for run.json."""
        latest: dict[int, dict] = {}
        for rec in sorted(self._layout.values(), key=lambda r: r["restart"]):
            latest[rec["rank"]] = {k: rec[k] for k in ("node", "local_rank", "group_rank", "pid")}
        return {str(rank): latest[rank] for rank in sorted(latest)}

    def poll(self, *, final: bool = False) -> None:
        """Print what is new, attempt by attempt: an older attempt is over, so it is
        drained completely (its unfinished last line too) before the next one's lines."""
        self._discover(final)
        attempts = sorted({attempt for _, attempt, _ in self._tails.values()})
        newest: dict[int, int] = {}  # node -> its latest attempt (one node: node 0)
        for path, (_, attempt, _) in self._tails.items():
            node = self._node_of_path.get(path, 0)
            newest[node] = max(newest.get(node, 0), attempt)
        for attempt in attempts:
            if attempt not in self._attempts:
                self._attempts.add(attempt)
                self.emit(f"── torchrun restarted the workers (restart {attempt}) ──")
            logs = sorted(((path, t) for path, t in self._tails.items() if t[1] == attempt),
                          key=lambda item: item[1][0])  # two nodes may share (rank, attempt)
            for path, (rank, _, tail) in logs:
                done = final or attempt < newest[self._node_of_path.get(path, 0)]
                for line in tail.new_lines():
                    self._line(rank, line)
                rest = tail.rest() if done else ""
                if rest:
                    self._line(rank, rest)
        for node, tail in enumerate(self._torchrun):
            for line in tail.new_lines():
                self._torchrun_line(line, node)

    def finish(self, *, show: bool = True) -> None:
        """Read what is left, including unfinished last lines. ``show=False`` reads it without
        printing it (an interrupted run: the rank logs keep it)."""
        if not show:
            self.emit = lambda line: None
        self.poll(final=True)
        for node, tail in enumerate(self._torchrun):
            rest = tail.rest()
            if rest:
                self._torchrun_line(rest, node)
        self._release()

    def prefix(self, rank: int) -> str:
        """``[rank3]``, or ``[node1][rank3]`` when the run has several nodes."""
        if rank < 0:  # a log whose rank never said which it was
            return f"[node{self.node_of.get(rank, '?')}][local rank {(-1 - rank) % 1000}]"
        node = self.node_of.get(rank)
        return f"[rank{rank}]" if node is None else f"[node{node}][rank{rank}]"

    def hold(self, script: str) -> None:
        """Keep rank lines back from now on (a timeout is about to ask for stack dumps).

        ``finish()`` then shows, for each rank, at most DUMP_LINES of them: the thread that
        runs ``script``, down to its outermost frame in it, and says which log holds the rest.
        """
        self._held, self._script = {}, script

    def _release(self) -> None:
        held, self._held = self._held or {}, None
        for rank, lines in sorted(held.items()):
            shown = dump_excerpt(lines, self._script)
            for line in shown:
                self.emit(f"{self.prefix(rank)} {line}")
            hidden = sum(1 for line in lines if line.strip()) - sum(1 for line in shown if line.strip())
            if hidden > 0:
                where = self.log_size(rank)
                self.emit(f"{self.prefix(rank)} … {hidden} more line(s) of its stack dump are in "
                          f"{where[0] if where else self.run_dir}")

    def _line(self, rank: int, line: str) -> None:
        self.recent.setdefault(rank, deque(maxlen=40)).append(line)
        if self._held is not None:
            self._held.setdefault(rank, []).append(line)
            return
        self.emit(f"{self.prefix(rank)} {line}")

    def _torchrun_line(self, line: str, node: int = 0) -> None:
        # torchrun ends a failed run with its own traceback and a summary box;
        # LaunchError says the same more plainly, so the rest stays in torchrun.log.
        if line.startswith("Traceback (most recent call last)"):
            self._torchrun_quiet[node] = True
        if not self.show_torchrun or self._torchrun_quiet[node] or not line.strip():
            return
        if self.nnodes > 1 and (line.startswith(("frame #", "Exception raised from ", "<omitting"))
                                or _TCPSTORE_NOISE.search(line)):
            return  # an agent's C++ warnings when a peer agent left first: its store connection
        match = _GLOG_RE.match(line)
        if match:
            line = _GLOG_LEVEL[match.group(1)] + match.group(2)
        if not any(noise in line for noise in _TORCHRUN_NOISE):
            self.emit(f"[torchrun node{node}] {line}" if self.nnodes > 1 else f"[torchrun] {line}")

    def log_size(self, rank: int) -> tuple[str, int] | None:
        """(path, size) of the rank's newest log, to read what it prints from now on."""
        newest = None
        for path, (r, attempt, _tail) in self._tails.items():
            if r == rank and (newest is None or attempt > newest[1]):
                newest = (path, attempt)
        if newest is None:
            return None
        return newest[0], os.path.getsize(newest[0])


# -- pids, stopping ----------------------------------------------------------------------
def recorded_ranks(run_dir: Path) -> dict[int, tuple[int, str | None]]:
    """{rank: (pid, token)} as each rank's entry point recorded it (latest attempt)."""
    found = {}
    for rank, path in _rundir.pid_files(run_dir).items():
        try:
            data = json.loads(path.read_text())
            found[rank] = (int(data["pid"]), data.get("token"))
        except (ValueError, KeyError, OSError):
            continue
    return found


def live_ranks(run_dir: Path) -> dict[int, int]:
    """{rank: pid} of recorded ranks that still run."""
    return {rank: pid for rank, (pid, token) in recorded_ranks(run_dir).items()
            if _proc.is_same_process(pid, token)}


def stop(agents, run_dir: Path, *, grace_s: float = 3.0) -> None:
    """End every torchrun agent and every rank: SIGTERM, a grace period, then SIGKILL by
    recorded pid (``agents``: a ``_nodes.Agents``)."""
    agents.stop(grace_s)
    deadline = time.monotonic() + 5.0
    while True:
        alive = live_ranks(run_dir)
        if not alive:
            return
        for pid in alive.values():
            _proc.kill_tree(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            print(f"labkit: could not stop pids {sorted(alive.values())}", file=sys.stderr)
            return
        time.sleep(0.05)


# -- where a hung rank is ------------------------------------------------------------------
def request_stacks(run_dir: Path, streams: Streams) -> dict[int, tuple[str, int]]:
    """Ask every live rank to print its Python stacks (SIGUSR1 → faulthandler).

    Returns {rank: (log path, offset)}: the dump is what the log holds after offset.
    """
    marks = {}
    if not hasattr(signal, "SIGUSR1"):
        return marks
    for rank, pid in live_ranks(run_dir).items():
        mark = streams.log_size(rank)
        if mark is None:
            continue
        try:
            os.kill(pid, signal.SIGUSR1)
            marks[rank] = mark
        except ProcessLookupError:
            pass
    return marks


def place(script: str, frames: list[dict], frame: dict) -> str:
    """'scripts/x.py:12 in <module>, inside all_reduce (distributed_c10d.py)': where a thread of
    the script is. ``frames``: the thread's frames, innermost first (dicts with file, line and
    func); ``frame``: the script's innermost one among them. Timeouts (faulthandler's dumps) and
    lesson 10's py-spy dumps say it in this one form, so the two can be compared."""
    where = f"{script}:{frame['line']} in {frame['func'].strip()}"
    if frames[0] is not frame:
        where += f", inside {frames[0]['func'].strip()} ({os.path.basename(frames[0]['file'])})"
    return where


def parse_stack(text: str, script: str) -> str | None:
    """'scripts/x.py:12 in <module>, inside all_reduce' from a faulthandler dump."""
    script_abs = os.path.abspath(script)
    best = None
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text):
        lines = block.strip().splitlines()
        if not lines or not _THREAD_RE.match(lines[0].strip()):
            continue
        frames = [m.groupdict() for m in map(_FRAME_RE.match, lines[1:]) if m]
        mine = [f for f in frames if os.path.abspath(f["file"]) == script_abs]
        if not mine:
            continue
        best = place(script, frames, mine[0])
        if lines[0].startswith("Current thread"):
            break
    return best


def dump_excerpt(lines: list[str], script: str, limit: int = DUMP_LINES) -> list[str]:
    """The lines of a faulthandler dump worth showing: what came before it, then the thread
    that runs ``script`` (the current thread if none does) down to its outermost frame in
    ``script`` (runpy's and labkit's frames below it say nothing); at most ``limit`` lines."""
    starts = [i for i, line in enumerate(lines) if _THREAD_RE.match(line.strip())]
    if not starts:
        return [line for line in lines if line.strip()][:limit]
    before = [line for line in lines[:starts[0]] if line.strip()]
    blocks = [lines[a:b] for a, b in zip(starts, starts[1:] + [len(lines)])]
    script_abs = os.path.abspath(script)

    def in_script(line: str) -> bool:
        match = _FRAME_RE.match(line)
        return bool(match) and os.path.abspath(match["file"]) == script_abs

    def rank(block: list[str]) -> tuple[bool, bool]:  # False sorts first
        return (not any(in_script(line) for line in block),
                not block[0].strip().startswith("Current thread"))

    block = min(blocks, key=rank)
    last = max((i for i, line in enumerate(block) if in_script(line)), default=len(block) - 1)
    chosen = [line for line in block[:last + 1] if line.strip()][:limit]
    room = limit - len(chosen)
    return (before[-room:] if room else []) + chosen


def read_stacks(marks: dict[int, tuple[str, int]], script: str) -> dict[int, str]:
    stacks = {}
    for rank, (path, offset) in marks.items():
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            continue
        where = parse_stack(text, script)
        if where:
            stacks[rank] = where
    return stacks


# -- what failed -----------------------------------------------------------------------
def _newest_pids(run_dir: Path) -> set[int]:
    """The pid of each rank's newest process, from the layout file (empty for one node)."""
    newest: dict[int, int] = {}
    try:
        lines = _rundir.layout_file(run_dir).read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        try:
            rec = json.loads(line)
            newest[int(rec["rank"])] = int(rec["pid"])
        except (ValueError, KeyError, TypeError):
            continue
    return set(newest.values())


def collect_failures(run_dir: Path, streams: Streams) -> tuple[list[RankFailure], int]:
    """The failures of the last attempt, root cause first, and how many restarts happened."""
    records = []
    for path in _rundir.error_files(run_dir):
        try:
            records.append(json.loads(path.read_text()))
        except (ValueError, OSError):
            continue
    signalled = {}
    for node in range(streams.nnodes):
        torchrun_log = _rundir.agent_log(run_dir, node, streams.nnodes)
        text = torchrun_log.read_text(errors="replace") if torchrun_log.exists() else ""
        if streams.nnodes == 1:  # with several agents, this line's local rank is not the rank
            signalled.update({int(rank): int(code) for code, rank in _TORCHRUN_FAILED_RE.findall(text)})
        signalled.update({int(rank): int(code) for rank, code in _TORCHRUN_SUMMARY_RE.findall(text)})
    last_restart = max([r["restart"] for r in records] + [max(streams._attempts)])
    # Several nodes: each rank's newest process, from the layout file. An elastic run's nodes
    # count their restarts apart (a node that joined late is at restart 0), so the restart
    # number alone cannot say which records are the last round's.
    newest = _newest_pids(run_dir)
    failures = []
    for rec in records:
        if (rec.get("pid") not in newest) if newest else rec["restart"] != last_restart:
            continue
        rank = rec["rank"]
        failures.append(RankFailure(
            rank=rank, exit_code=rec.get("exit_code"), exc_type=rec["type"],
            message=rec["message"], traceback=rec["traceback"],
            output_tail="\n".join(streams.recent.get(rank, ())), time=rec["time"],
            secondary=RankFailure.looks_secondary(rec["message"] + rec["traceback"]),
        ))
    recorded = {f.rank for f in failures}
    for rank, code in signalled.items():
        if rank in recorded:
            continue
        if code < 0:
            try:
                what = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                what = f"killed by signal {-code}"
            secondary = -code in (signal.SIGTERM, signal.SIGINT)
        else:
            what, secondary = f"exited with code {code} without a Python exception", False
        failures.append(RankFailure(
            rank=rank, exit_code=code, exc_type="", message=what, traceback="",
            output_tail="\n".join(streams.recent.get(rank, ())), time=None,
            secondary=secondary,
        ))
    failures.sort(key=lambda f: (f.secondary, f.exc_type == "", f.time or float("inf"), f.rank))
    return failures, last_restart
