"""The live view of a run: throttled updates of one display handle, a static chart at the end."""

from __future__ import annotations

import base64
import json

import pytest

from labkit._launch import live as _live
from labkit._launch.live import LiveView


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class Handle:
    """Stands in for IPython's DisplayHandle: remembers every bundle shown, and when."""

    def __init__(self, clock):
        self.clock, self.shown = clock, []

    def update(self, bundle, raw=False):
        assert raw
        self.shown.append((self.clock.now, bundle))


@pytest.fixture
def view(tmp_path, monkeypatch):
    """A LiveView as in a notebook, on a fake clock and a fake display handle."""
    import IPython.display

    clock = Clock()
    handle = Handle(clock)
    monkeypatch.setattr(_live, "time", clock)
    monkeypatch.setattr(_live, "in_notebook", lambda: True)

    def display(bundle, raw=False, display_id=False):
        handle.shown.append((clock.now, bundle))
        return handle

    monkeypatch.setattr(IPython.display, "display", display)
    (tmp_path / "metrics").mkdir()
    live = LiveView(tmp_path, "ddp-2", 2, enabled=True)
    return live, clock, handle


def log(run_dir, rank, step, t, restart=0, **values):
    with open(run_dir / "metrics" / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"rank": rank, "step": step, "time": t, "restart": restart,
                            "world_size": 2, **values}) + "\n")


def test_updates_come_at_most_twice_a_second(view):
    live, clock, handle = view
    for i in range(80):  # the launcher polls every 50 ms for 4 s
        if i % 10 == 0:
            log(live.run_dir, i % 2, i, clock.now, loss=1.0 / (i + 1))
        live.update()
        clock.now += 0.05
    times = [t for t, _ in handle.shown[1:]]  # the first is the "starting…" display
    assert 6 <= len(times) <= 9
    assert all(b - a >= _live._MIN_INTERVAL_S for a, b in zip(times, times[1:]))
    assert any("image/png;base64" in bundle.get("text/html", "") for _, bundle in handle.shown)


def test_finishing_leaves_a_static_png_in_the_cell(view):
    live, clock, handle = view
    for step in range(3):
        log(live.run_dir, 0, step, clock.now, loss=1.0 / (step + 1))
        log(live.run_dir, 1, step, clock.now, loss=1.5 / (step + 1))
        clock.now += 1.0
    live.update()
    live.finish("ok")
    last = handle.shown[-1][1]
    assert set(last) == {"text/plain", "image/png"}, "no HTML with live content: a plain image stays"
    assert base64.b64decode(last["image/png"]).startswith(b"\x89PNG")
    assert last["text/plain"].startswith("ddp-2: ok") and "step 2" in last["text/plain"]


def test_the_progress_line_shows_the_latest_step_s_loss_averaged_over_ranks(view):
    """Not whichever rank's line came last: two identical runs must print the same figure."""
    live, clock, handle = view
    log(live.run_dir, 0, 10, 1.0, loss=2.0)
    log(live.run_dir, 1, 10, 1.1, loss=1.0)
    log(live.run_dir, 0, 20, 2.0, loss=0.5)
    live._read()
    assert live._progress("running").endswith("step 20 · loss 0.5000")   # rank 1 not there yet
    log(live.run_dir, 1, 20, 2.1, loss=0.25)
    log(live.run_dir, 1, 20, 2.2, test_acc=0.9)                           # no loss: not counted
    live._read()
    assert live._progress("ok").endswith("step 20 · loss 0.3750 (mean of 2 ranks)")
    log(live.run_dir, 0, 10, 3.0, restart=1, loss=3.0)                    # a restart resumed at 10
    live._read()
    assert live._progress("running").endswith("step 10 · loss 3.0000")


def test_finishing_without_a_loss_leaves_the_progress_line(view):
    live, clock, handle = view
    log(live.run_dir, 0, 0, clock.now, samples=4)
    live.finish("failed")
    assert handle.shown[-1][1] == {"text/plain": handle.shown[-1][1]["text/plain"]}
    assert handle.shown[-1][1]["text/plain"].startswith("ddp-2: failed")


def test_the_restart_marker_sits_where_the_attempt_resumed(view):
    """As in plot_loss: the crash came after step 4, the restart resumed from step 2."""
    live, clock, handle = view
    log(live.run_dir, 0, 2, 1.0, loss=2.0)
    log(live.run_dir, 0, 4, 2.0, loss=1.5)
    log(live.run_dir, 0, 2, 5.0, restart=1, resumed_from=2)
    log(live.run_dir, 0, 4, 6.0, restart=1, loss=1.5)
    live._read()
    ax = live._figure("ddp-2").axes[0]
    marker = ax.lines[1]
    assert marker.get_xdata()[0] == 2 and ax.texts[0].get_text() == "restart 1"


def test_outside_a_notebook_there_is_no_live_view(tmp_path, monkeypatch):
    monkeypatch.setattr(_live, "in_notebook", lambda: False)
    live = LiveView(tmp_path, "ddp-2", 2, enabled=True)
    assert not live.enabled
    live.update()
    live.finish("ok")  # nothing to show, nothing raised
