"""The live view of a run in a notebook: one display handle, updated at most twice a second.

While the run goes, the handle shows progress text and the loss of every rank
so far. When it ends, the handle is replaced by a static PNG of the final
chart, which stays in the saved notebook. Outside a Jupyter kernel (a
terminal, a test) there is no live view: the rank lines are the progress.
"""

from __future__ import annotations

import base64
import html
import io
import time
from pathlib import Path

from labkit import _rundir
from labkit._launch.tail import LineTail, parse_records

_MIN_INTERVAL_S = 0.5   # at most two updates a second
_CHART_INTERVAL_S = 2.0  # re-render the chart less often: it costs CPU the ranks need


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
        self.enabled = enabled and in_notebook()
        self._records: list[dict] = []
        self._tails: dict[str, LineTail] = {}
        self._handle = None
        self._start = time.monotonic()
        self._last_update = 0.0
        self._last_chart = 0.0
        self._png: bytes | None = None
        self._dirty = False
        if self.enabled:
            from IPython.display import display
            self._handle = display({"text/plain": f"{name}: starting…"}, raw=True,
                                   display_id=True)

    # -- data -------------------------------------------------------------------
    def _read(self) -> None:
        for path in _rundir.metrics_files(self.run_dir):
            tail = self._tails.setdefault(str(path), LineTail(path))
            found, _ = parse_records(tail.new_lines())
            if found:
                self._records += found
                self._dirty = True

    def _progress(self, status: str) -> str:
        elapsed = time.monotonic() - self._start
        parts = [f"{self.name}: {status}", f"{elapsed:.0f} s", f"{self.nproc} rank(s)"]
        if self._records:
            last = max(self._records, key=lambda r: r["time"])
            parts.append(f"step {last['step']}")
            loss = self._latest_loss()
            if loss:
                parts.append(loss)
        return " · ".join(parts)

    def _latest_loss(self) -> str:
        """The loss at the latest step any rank logged one, averaged over the ranks that did:
        each rank's loss is its own batch's, so the last line to arrive (rank 0's or rank 1's,
        by chance) would make two identical runs print different figures."""
        losses = [r for r in self._records if isinstance(r.get("loss"), (int, float))]
        if not losses:
            return ""
        latest = max((r.get("restart", 0), r["step"]) for r in losses)
        at = [r["loss"] for r in losses if (r.get("restart", 0), r["step"]) == latest]
        mean = sum(at) / len(at)
        return f"loss {mean:.4f}" + (f" (mean of {len(at)} ranks)" if len(at) > 1 else "")

    def _figure(self, title: str):
        """The loss of every rank so far, restarts marked where each attempt resumed; None
        before any loss. Every record goes to ``metric_curve``, not only those with a loss:
        a line such as ``resumed_from`` is what places a restart's marker (as in plot_loss)."""
        if not any(isinstance(r.get("loss"), (int, float)) for r in self._records):
            return None
        import pandas as pd
        from matplotlib.figure import Figure

        from labkit._results.plots import draw_curve, metric_curve

        df = pd.DataFrame.from_records(self._records)
        df["loss"] = pd.to_numeric(df["loss"], errors="coerce")
        ranks = sorted(df.loc[df["loss"].notna(), "rank"].unique())
        fig = Figure(figsize=(7, 3.4), dpi=90)
        ax = fig.subplots()
        for rank in ranks:
            curve = metric_curve(df[df["rank"] == rank], x="step", y="loss")
            draw_curve(ax, curve, label=f"rank {rank}", mark_restarts=rank == ranks[0])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (each rank's own batches)" if len(ranks) > 1 else "loss")
        ax.grid(alpha=0.3)
        if len(ranks) > 1:
            ax.legend(fontsize=8, ncol=min(4, len(ranks)))
        ax.set_title(title, fontsize=10)
        fig.tight_layout()
        return fig

    def _render(self, title: str) -> bytes | None:
        fig = self._figure(title)
        if fig is None:
            return None
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    # -- updates ----------------------------------------------------------------
    def update(self) -> None:
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
        if self._png is not None:
            img = base64.b64encode(self._png).decode()
            bundle["text/html"] = (f"<pre>{html.escape(text)}</pre>"
                                   f"<img src='data:image/png;base64,{img}'/>")
        self._handle.update(bundle, raw=True)

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
