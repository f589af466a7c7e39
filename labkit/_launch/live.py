"""The live view of a run in a notebook: one display handle, updated at most twice a second.

While the run goes, the handle shows progress text and the loss of every rank
so far. When it ends, the handle is replaced by a static PNG of the final
chart, which stays in the saved notebook. Outside a Jupyter kernel (a
terminal, a test) the same progress text is printed every 15 s, between the rank lines.

The progress text says the step, and out of how many when the script says so: it logs
``total_steps`` once, e.g. ``metrics.log(0, total_steps=epochs * len(loader))`` before its
loop. From the rate so far it then estimates the time left; without it, it says there is no
estimate. ``samples/s`` adds up what the ranks logged as ``samples`` since their first line;
once the run has ended it says "on average", since ``Run.throughput`` gives another figure: the
steady median, without the slow first windows.
"""

from __future__ import annotations

import base64
import html
import io
import time
from pathlib import Path

from labkit import _rundir
from labkit._launch.live_chart import PART_SEP, loss_figure, rounds_of
from labkit._launch.stop import kernel_id, stop_button
from labkit._launch.tail import LineTail, parse_records

_MIN_INTERVAL_S = 0.5   # at most two updates a second
_CHART_INTERVAL_S = 2.0  # re-render the chart less often: it costs CPU the ranks need
_TEXT_INTERVAL_S = 15.0  # outside a notebook: a progress line at most this often
#: What a script logs, once, to say how many steps the run will take (the ETA needs it).
TOTAL = "total_steps"


def duration(seconds: float) -> str:
    """``75`` -> ``"1 min 15 s"``: a time left as a person reads it."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    return f"{minutes // 60} h {minutes % 60} min"


def pace(records: list[dict], now: float, rounds: list[int] | None = None) -> dict:
    """How far a run has got and how fast, from its metrics lines (the newest round's: since the
    last restart, or the last time an elastic run's ranks changed).

    Returns:
        ``step`` (the highest logged), ``total`` (``total_steps`` as logged, or None),
        ``samples_per_s`` (all ranks, since each one's first line; None before two lines with
        ``samples``) and ``eta_s`` (seconds left at the rate so far, from ``now``, an epoch
        time; None without a total or a rate yet). ``rounds``: each line's round, if known
        (``rounds_of``).
    """
    rounds = rounds_of(records) if rounds is None else rounds
    recent = [r for r, number in zip(records, rounds) if number == max(rounds)]
    totals = [r[TOTAL] for r in records if isinstance(r.get(TOTAL), (int, float))]
    step = max(r["step"] for r in recent)
    by_rank: dict = {}
    for r in recent:
        by_rank.setdefault(r["rank"], []).append(r)
    rates, eta = [], None
    for lines in by_rank.values():
        lines.sort(key=lambda r: r["time"])
        done = sum(r["samples"] for r in lines[1:] if isinstance(r.get("samples"), (int, float)))
        if done and lines[-1]["time"] > lines[0]["time"]:
            rates.append(done / (lines[-1]["time"] - lines[0]["time"]))
    total = max(totals) if totals else None
    first = min(by_rank)                       # the lowest rank present: its steps set the pace
    lines = by_rank[first]
    steps, span = lines[-1]["step"] - lines[0]["step"], lines[-1]["time"] - lines[0]["time"]
    if total is not None and steps > 0 and span > 0:
        eta = max(0.0, (total - lines[-1]["step"]) * span / steps - (now - lines[-1]["time"]))
    return {"step": step, "total": total, "samples_per_s": sum(rates) if rates else None, "eta_s": eta}


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, nbmake, nbclient)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class LiveView:
    def __init__(self, run_dir: Path, name: str, nproc: int, *, enabled: bool):
        self.run_dir = Path(run_dir)
        self.name = name
        self.nproc = nproc
        interactive = in_notebook()
        self.enabled = enabled and interactive
        self.text = enabled and not interactive   # a terminal: progress lines now and then
        self._last_text = time.monotonic()
        self._records: list[dict] = []
        self._starts: list[dict] = []   # each round's first line (round_starts), and
        self._round_of: list[int] = []  # each line's round: updated as lines arrive
        self._tails: dict[str, LineTail] = {}
        self._handle = None
        self._start = time.monotonic()
        self._last_update = 0.0
        self._last_chart = 0.0
        self._png: bytes | None = None
        self._dirty = False
        self._stop = stop_button(kernel_id()) if self.enabled else ""
        if self.enabled:
            from IPython.display import display
            self._handle = display({"text/plain": f"{name}: starting…"}, raw=True,
                                   display_id=True)

    # -- data -------------------------------------------------------------------
    def _read(self) -> None:
        before = len(self._records)
        for path in _rundir.metrics_files(self.run_dir):
            tail = self._tails.setdefault(str(path), LineTail(path))
            found, _ = parse_records(tail.new_lines())
            if found:
                self._records += found
                self._dirty = True
        if len(self._records) > before:  # the rounds, once per batch of new lines
            from labkit._results.rounds import round_starts

            self._starts = round_starts(self._records, step_back=False)
            self._round_of = rounds_of(self._records, self._starts)

    def _progress(self, status: str) -> str:
        elapsed = time.monotonic() - self._start
        parts = [f"{self.name}: {status}", f"{elapsed:.0f} s", f"{self.nproc} rank(s)"]
        if self._records:
            parts += self._pace(status == "running")
            loss = self._latest_loss()
            if loss:
                parts.append(loss)
        return PART_SEP.join(parts)

    def _pace(self, running: bool) -> list[str]:
        """Step (of the total), samples/s and, while running, the time left or why none."""
        now = pace(self._records, time.time(), self._round_of)
        parts = [f"step {now['step']}" + (f"/{now['total']:.0f}" if now["total"] is not None else "")]
        if now["samples_per_s"] is not None:  # once ended, the whole run's: not Run.throughput's steady median
            parts.append(f"{now['samples_per_s']:,.0f} samples/s" + ("" if running else " on average"))
        if running and now["eta_s"] is not None:
            parts.append(f"about {duration(now['eta_s'])} left" if now["eta_s"] >= 0.5 else "almost done")
        elif running and now["total"] is None:
            parts.append("no ETA (the script logs no total_steps)")
        return parts

    def _latest_loss(self) -> str:
        """The loss at the latest step any rank logged one, averaged over the ranks that did:
        each rank's loss is its own batch's, so the last line to arrive (rank 0's or rank 1's,
        by chance) would make two identical runs print different figures."""
        keyed = [((number, r["step"]), r) for r, number in zip(self._records, self._round_of)
                 if isinstance(r.get("loss"), (int, float))]
        if not keyed:
            return ""
        latest = max(key for key, _ in keyed)
        at = [r["loss"] for key, r in keyed if key == latest]
        mean = sum(at) / len(at)
        ranks = len({r.get("rank") for key, r in keyed if key == latest})
        if len(at) == 1:
            return f"loss {mean:.4f}"
        # A script may log several losses per rank and step (lesson 13 trains six strategies).
        lines = "" if len(at) == ranks else f"{len(at)} lines from "
        return f"loss {mean:.4f} (mean of {lines}{ranks} rank{'s' * (ranks > 1)})"

    def _figure(self, title: str):
        """The chart so far (``loss_figure``), or None before any loss."""
        return loss_figure(self._records, self._round_of, self._starts, title)

    def _render(self, title: str) -> bytes | None:
        fig = self._figure(title)
        if fig is None:
            return None
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    # -- updates ----------------------------------------------------------------
    def update(self) -> None:
        if self.text:
            self._print_progress()
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_update < _MIN_INTERVAL_S:
            return
        self._last_update = now
        self._read()
        text = self._progress("running")
        if self._dirty and now - self._last_chart >= _CHART_INTERVAL_S:
            self._png = self._render(text)
            self._last_chart, self._dirty = now, False
        bundle = {"text/plain": text}
        if self._png is not None or self._stop:
            img = "" if self._png is None else (
                f"<img src='data:image/png;base64,{base64.b64encode(self._png).decode()}'/>")
            bundle["text/html"] = f"<pre>{html.escape(text)}</pre>{self._stop}{img}"
        self._handle.update(bundle, raw=True)

    def _print_progress(self) -> None:
        """Outside a notebook: the progress line, every ``_TEXT_INTERVAL_S``, once there is one."""
        now = time.monotonic()
        if now - self._last_text < _TEXT_INTERVAL_S:
            return
        self._last_text = now
        self._read()
        if self._records:
            print(self._progress("running"))

    def finish(self, status: str) -> None:
        """Leave a static chart (PNG) in the cell, or the final progress line."""
        if not self.enabled:
            return
        self._read()
        text = self._progress(status)
        png = self._render(text)
        bundle = {"text/plain": text}
        if png is not None:
            bundle["image/png"] = base64.b64encode(png).decode()
        self._handle.update(bundle, raw=True)
