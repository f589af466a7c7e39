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

    time = monotonic   # the metrics lines below are stamped on the same clock


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
    assert live._progress("ok").endswith("step 20 · loss 0.5000")   # rank 1 not there yet
    log(live.run_dir, 1, 20, 2.1, loss=0.25)
    log(live.run_dir, 1, 20, 2.2, test_acc=0.9)                           # no loss: not counted
    live._read()
    assert live._progress("ok").endswith("step 20 · loss 0.3750 (mean of 2 ranks)")
    log(live.run_dir, 0, 10, 3.0, restart=1, loss=3.0)                    # a restart resumed at 10
    live._read()
    assert live._progress("ok").endswith("step 10 · loss 3.0000")


def test_several_losses_per_rank_and_step_are_not_counted_as_ranks(view):
    """Lesson 13 logs one loss per strategy on each rank: 2 ranks, not 4."""
    live, clock, handle = view
    for rank in (0, 1):
        log(live.run_dir, rank, 5, 1.0, loss=1.0, strategy="ddp")
        log(live.run_dir, rank, 5, 1.1, loss=3.0, strategy="zero3")
    live._read()
    assert live._progress("ok").endswith("step 5 · loss 2.0000 (mean of 4 lines from 2 ranks)")


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
    [marker] = dashed(ax)
    assert marker.get_xdata()[0] == 2 and [t.get_text() for t in ax.texts] == ["restart 1"]


def dashed(ax):
    return [line for line in ax.lines if line.get_linestyle() == "--"]


def test_a_rank_that_restarted_a_moment_before_rank_0_keeps_its_first_point_after_the_restart(view):
    """A script that logs no resumed_from: after the restart, rank 1's first line can be stamped
    a moment before rank 0's, which is where the round begins."""
    live, clock, handle = view
    for step in range(1, 7):
        for rank in (0, 1):
            log(live.run_dir, rank, step, step + rank * 0.01, loss=2.0)
    log(live.run_dir, 1, 5, 20.0, restart=1, loss=1.0)
    log(live.run_dir, 0, 5, 20.01, restart=1, loss=1.0)
    for step in (6, 7):
        for rank in (0, 1):
            log(live.run_dir, rank, step, 15 + step + rank * 0.01, restart=1, loss=1.0)
    live._read()
    ax = live._figure("ddp-2").axes[0]
    for colour in ("C0", "C1"):
        lines = [line for line in ax.lines if line.get_color() == colour]
        assert [list(line.get_xdata()) for line in lines] == [[1, 2, 3, 4, 5, 6], [5, 6, 7]]
    assert [line.get_xdata()[0] for line in dashed(ax)] == [5]


def test_an_elastic_run_s_rank_absent_from_a_round_has_a_gap_there_and_each_round_is_marked(view):
    """Lesson 10's drill: node 1 leaves after step 12 (rank 0 goes on alone from checkpoint 10,
    torchrun's restart 1), node 2 joins at step 20 as the new rank 1, its agent's restart 0."""
    live, clock, handle = view
    for step in range(1, 13):
        for rank in (0, 1):
            log(live.run_dir, rank, step, step + rank * 0.01, loss=3.0 - 0.1 * step)
    log(live.run_dir, 0, 10, 20.0, restart=1, world_size=1, resumed_from=10)
    for step in range(11, 21):
        log(live.run_dir, 0, step, 10 + step, restart=1, world_size=1, loss=3.0 - 0.1 * step)
    log(live.run_dir, 1, 20, 39.99, resumed_from=20, samples=0)  # a moment before rank 0's line
    log(live.run_dir, 0, 20, 40.0, restart=1, resumed_from=20, samples=0)
    for step in range(21, 25):
        for rank in (0, 1):
            log(live.run_dir, rank, step, 20 + step + rank * 0.01, restart=1 - rank, samples=16,
                loss=3.0 - 0.1 * step + rank * 0.1)
    live._read()
    ax = live._figure("elastic").axes[0]
    rank1 = [line for line in ax.lines if line.get_color() == "C1" and line.get_linestyle() == "-"]
    assert [list(line.get_xdata()) for line in rank1] == [list(range(1, 13)), [21, 22, 23, 24]]
    assert [line.get_xdata()[0] for line in dashed(ax)] == [10, 20]
    assert [t.get_text() for t in ax.texts] == ["restart 1, 1 rank", "2 ranks"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rank 0", "rank 1"]
    progress = live._progress("running")
    assert "step 24 · 32 samples/s" in progress and "loss 0.6500 (mean of 2 ranks)" in progress


def test_outside_a_notebook_there_is_no_live_view(tmp_path, monkeypatch):
    monkeypatch.setattr(_live, "in_notebook", lambda: False)
    live = LiveView(tmp_path, "ddp-2", 2, enabled=True)
    assert not live.enabled
    live.update()
    live.finish("ok")  # nothing to show, nothing raised


# -- progress: step of the total, samples/s, time left ------------------------------------------------
def test_the_progress_says_step_of_total_samples_per_s_and_the_time_left(view):
    live, clock, handle = view
    clock.now = 1000.0
    for rank in (0, 1):
        log(live.run_dir, rank, 0, 1000.0, total_steps=100)
    for step in (10, 20):                     # 10 steps in 5 s on each rank, 32 samples a step
        for rank in (0, 1):
            log(live.run_dir, rank, step, 1000.0 + step / 2, samples=320, loss=1.0)
    clock.now = 1012.0                        # 2 s after the last line
    live._read()
    line = live._progress("running")
    assert "step 20/100 · 128 samples/s · about 38 s left · loss" in line, line   # 80 steps at 2/s, less 2 s
    assert "left" not in live._progress("ok") and "step 20/100 · 128 samples/s on average" in live._progress("ok")
    clock.now = 1050.0                        # past the estimated end: not "about 0 s left"
    assert "almost done · loss" in live._progress("running"), live._progress("running")


def test_without_a_total_the_progress_says_there_is_no_estimate(view):
    live, clock, handle = view
    log(live.run_dir, 0, 0, 1.0)
    log(live.run_dir, 0, 10, 2.0, samples=40)
    live._read()
    assert "step 10 · 40 samples/s · no ETA (the script logs no total_steps)" in live._progress("running")


@pytest.mark.parametrize("seconds, said", [(0.4, "0 s"), (59, "59 s"), (75, "1 min 15 s"), (3725, "1 h 2 min")])
def test_durations_read_as_a_person_says_them(seconds, said):
    assert _live.duration(seconds) == said


def test_pace_follows_the_newest_restart_and_the_lowest_rank(view):
    records = [{"rank": 0, "step": 0, "time": 0.0, "total_steps": 40},
               {"rank": 0, "step": 20, "time": 10.0},
               {"rank": 0, "step": 10, "time": 20.0, "restart": 1},      # resumed from 10
               {"rank": 0, "step": 20, "time": 25.0, "restart": 1},
               {"rank": 1, "step": 22, "time": 26.0, "restart": 1}]
    assert _live.pace(records, 25.0) == {"step": 22, "total": 40, "samples_per_s": None, "eta_s": 10.0}


def test_outside_a_notebook_a_progress_line_is_printed_now_and_then(tmp_path, monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr(_live, "time", clock)
    monkeypatch.setattr(_live, "in_notebook", lambda: False)
    (tmp_path / "metrics").mkdir()
    live = LiveView(tmp_path, "ddp-2", 2, enabled=True)
    log(tmp_path, 0, 0, clock.now, total_steps=10)
    live.update()
    clock.now += 16
    log(tmp_path, 0, 5, clock.now, samples=20)
    live.update()
    live.update()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("ddp-2: running · 16 s · 2 rank(s) · step 5/10 · 1 samples/s"), out
    assert LiveView(tmp_path, "quiet", 2, enabled=False).text is False


def test_a_sweep_says_run_k_of_n_and_the_time_left_at_the_pace_so_far(monkeypatch):
    from labkit._launch import sweep as _sweep

    clock, shown = Clock(), []
    monkeypatch.setattr(_sweep, "time", clock)
    monkeypatch.setattr(_sweep, "in_notebook", lambda: True)
    import IPython.display

    class Shown:
        def update(self, bundle, raw=False):
            shown.append(bundle["text/plain"])

    monkeypatch.setattr(IPython.display, "display", lambda bundle, raw=False, display_id=False: Shown())
    progress = _sweep._Progress("ddp", 4)
    progress.show("run 1/4 (nproc=1, repeat 1)")
    clock.now += 30
    progress.done()
    progress.show("run 2/4 (nproc=2, repeat 1)")
    assert shown == ["sweep ddp: run 1/4 (nproc=1, repeat 1)",
                     "sweep ddp: run 2/4 (nproc=2, repeat 1) · about 1 min 30 s left"]
    for _ in range(3):
        progress.done()
    assert progress.left() == ""


def test_the_stop_button_sends_the_toolbars_interrupt_for_this_kernel():
    from labkit._launch.stop import kernel_id, stop_button

    assert kernel_id() is None and stop_button(None) == ""      # no kernel the server started: no button
    button = stop_button("0f6c2a44-1b7e-4c5d-9a3e-2f1d0c9b8a77")
    assert button.startswith("<button class='labkit-stop' onclick=\"") and "&#9632; Stop</button>" in button
    assert "api/kernels/0f6c2a44-1b7e-4c5d-9a3e-2f1d0c9b8a77/interrupt" in button
    assert '"' not in button.split('onclick="')[1].split('" title=')[0], "the script would end the attribute"


def test_the_live_frames_carry_the_stop_button(view, monkeypatch):
    live, clock, handle = view
    live._stop = "<button class='labkit-stop'>&#9632; Stop</button>"
    log(live.run_dir, 0, 0, clock.now, loss=1.0)
    clock.now += 3
    live.update()
    assert "<button class='labkit-stop'>" in handle.shown[-1][1]["text/html"]
    live.finish("ok")
    assert "text/html" not in handle.shown[-1][1], "the saved notebook keeps the chart, not the button"


def test_a_long_progress_line_is_a_title_of_several_lines_broken_between_its_parts():
    """A run's finished line runs to 100 characters and more: as one line, a 7-inch chart cut it
    off ("loss 2.3421 (mean of 2"). Broken between its parts, every part is whole."""
    from labkit._launch.live_chart import loss_figure, wrap_title

    line = ("reference: ok · 7 s · 2 rank(s) · step 12 · 1,349 samples/s on average · "
            "loss 2.3421 (mean of 2 ranks)")
    wrapped = wrap_title(line)
    assert wrapped.replace("\n", " · ") == line and len(wrapped.splitlines()) == 2, wrapped
    assert all(len(part) <= 72 for part in wrapped.splitlines()), wrapped
    assert wrap_title("ddp: step 3") == "ddp: step 3"
    assert wrap_title("x" * 90 + " · y") == "x" * 90 + "\ny"   # a long part keeps its own line
    records = [{"rank": 0, "step": s, "time": float(s), "loss": 2.0} for s in (1, 2)]
    fig = loss_figure(records, [0, 0], [records[0]], line)
    assert fig.axes[0].get_title() == wrapped
