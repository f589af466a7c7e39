"""Rank output, live: every rank's log followed across restarts and nodes, printed with
``[rankN]`` (``[node1][rank2]`` with several nodes), and torchrun's own log, tidied.

Kernel side: the launcher's poll loop calls ``Streams.poll()`` several times a second.
"""

from __future__ import annotations

import os
import re
from collections import deque
from pathlib import Path

from labkit import _rundir
from labkit._diagnose import stacks
from labkit._launch.tail import LineTail

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
#: Lines of each rank's stack dump that a timeout shows in the cell; the whole dump stays in
#: the rank's log (64 ranks of ~60 lines each used to flood the notebook).
DUMP_LINES = 12
#: Lines of each rank's output kept for a failure's report: enough for what the rank said
#: before it died *and* the Python stacks a native crash prints after (``failures.split_crash``).
RECENT_LINES = 200


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
        self._torchrun = [LineTail(_rundir.agent_log(self.run_dir, k, nnodes)) for k in range(nnodes)]
        self._torchrun_quiet = [False] * nnodes
        self.node_of: dict[int, int] = {}  # rank -> node, several nodes only
        self._node_of_path: dict[str, int] = {}  # log -> its node (an elastic run's nodes restart apart)
        self._layout: dict[tuple[int, int, int], dict] = {}
        self._attempts: set[int] = {0}  # every attempt seen, torchrun's restarts
        self.recent: dict[int, deque] = {}
        self._held: dict[int, list[str]] | None = None
        self._script = ""

    def _discover(self, final: bool = False) -> None:
        if self.nnodes > 1:
            self._discover_nodes(final)
            return
        for attempt, rank, path in _rundir.rank_logs(self.run_dir):
            if str(path) not in self._tails:
                self._tails[str(path)] = (rank, attempt, LineTail(path))

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
            self._tails[path] = (rank, attempt, LineTail(path))

    @property
    def attempts(self) -> list[int]:
        """Every attempt whose output was seen so far, in order (0, then one per restart)."""
        return sorted(self._attempts)

    def follow_agent(self, node: int) -> None:
        """Also follow agent ``node``'s own log: a node that joins an elastic run later."""
        while len(self._torchrun) <= node:
            k = len(self._torchrun)
            self._torchrun.append(LineTail(_rundir.agent_log(self.run_dir, k, self.nnodes)))
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
            shown = stacks.excerpt(lines, self._script, stacks.FAULTHANDLER, DUMP_LINES)
            for line in shown:
                self.emit(f"{self.prefix(rank)} {line}")
            hidden = sum(1 for line in lines if line.strip()) - sum(1 for line in shown if line.strip())
            if hidden > 0:
                where = self.log_size(rank)
                self.emit(f"{self.prefix(rank)} … {hidden} more line(s) of its stack dump are in "
                          f"{where[0] if where else self.run_dir}")

    def _line(self, rank: int, line: str) -> None:
        self.recent.setdefault(rank, deque(maxlen=RECENT_LINES)).append(line)
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
