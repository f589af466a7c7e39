"""Charts: curves averaged over ranks, restarts marked, clear errors."""

from __future__ import annotations

import matplotlib
import pytest

import labkit
from labkit import NoMetricsError
from labkit._results.plots import metric_curve
from test_run import make_run, rec

matplotlib.use("Agg")


def test_curve_is_the_mean_over_ranks_at_each_step(tmp_path):
    run = make_run(tmp_path, {0: [rec(0, 1, 1.0, loss=2.0, samples=4)],
                              1: [rec(1, 1, 1.1, loss=4.0, samples=4)]})
    curve = metric_curve(run.metrics(), x="step", y="loss")
    assert curve["y"].tolist() == [3.0] and curve["x"].tolist() == [1]
    by_samples = metric_curve(run.metrics(), x="samples", y="loss")
    assert by_samples["x"].tolist() == [8]


def test_plot_loss_over_time_counts_seconds_from_the_launch(tmp_path):
    run = make_run(tmp_path, {0: [rec(0, 1, 1003.0, loss=2.0), rec(0, 2, 1005.0, loss=1.0)],
                              1: [rec(1, 1, 1003.5, loss=4.0), rec(1, 2, 1004.5, loss=2.0)]},
                   start_time=1000.0)
    ax = labkit.plot_loss(run, x="time")
    curve = ax.lines[0]
    assert curve.get_xdata().tolist() == [3.5, 5.0]  # the later rank ends each step
    assert curve.get_ydata().tolist() == [3.0, 1.5]
    assert ax.get_xlabel() == "seconds since launch"


def test_plot_loss_marks_restarts(tmp_path):
    lines = [rec(0, 1, 1.0, loss=2.0), rec(0, 2, 2.0, loss=1.5),
             {**rec(0, 2, 5.0, loss=1.5), "restart": 1}, {**rec(0, 3, 6.0, loss=1.2), "restart": 1}]
    run = make_run(tmp_path, {0: lines})
    ax = labkit.plot_loss(run)
    assert [t.get_text() for t in ax.texts] == ["restart 1"]
    assert len(ax.lines) == 2  # the curve and the restart marker


def test_restart_marker_sits_where_the_attempt_resumed_not_at_its_first_loss(tmp_path):
    """A restarted script that logs where it resumed (step 2) before its next loss (step 4)."""
    lines = [rec(0, 2, 1.0, loss=2.0), rec(0, 4, 2.0, loss=1.5),
             {**rec(0, 2, 5.0, resumed_from=2), "restart": 1},
             {**rec(0, 4, 6.0, loss=1.5), "restart": 1}]
    run = make_run(tmp_path, {0: lines})
    ax = labkit.plot_loss(run)
    marker = ax.lines[1]
    assert marker.get_xdata()[0] == 2 and ax.texts[0].get_text() == "restart 1"


def test_an_elastic_run_is_one_curve_round_by_round_each_round_marked(tmp_path):
    """Lesson 10's shape: 2 ranks, a node leaves (1 rank resumes from step 2), a node joins
    (2 ranks resume from step 4). The joining node's rank counts its restarts from 0 again: the
    curve still averages it with rank 0 of its own round, not with the first round."""
    def line(rank, step, time, loss, restart, world, **extra):
        return {**rec(rank, step, time, loss=loss, **extra), "restart": restart, "world_size": world}
    rank0 = [line(0, 1, 1.0, 4.0, 0, 2), line(0, 2, 2.0, 3.0, 0, 2), line(0, 3, 3.0, 2.6, 0, 2),
             line(0, 3, 5.0, 2.8, 1, 1, resumed_from=2), line(0, 4, 6.0, 2.4, 1, 1),
             line(0, 5, 8.0, 2.0, 2, 2, resumed_from=4), line(0, 6, 9.0, 1.6, 2, 2)]
    rank1 = [line(1, 1, 1.1, 6.0, 0, 2), line(1, 2, 2.1, 5.0, 0, 2), line(1, 3, 3.1, 4.6, 0, 2),
             line(1, 5, 8.1, 3.0, 0, 2), line(1, 6, 9.1, 2.6, 0, 2)]  # the new node's rank 1
    run = make_run(tmp_path, {0: rank0, 1: rank1})
    curve = metric_curve(run.metrics(), x="step", y="loss")
    assert curve["round"].tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert curve["x"].tolist() == [1, 2, 3, 3, 4, 5, 6]
    assert curve["y"].tolist() == pytest.approx([5.0, 4.0, 3.6, 2.8, 2.4, 2.5, 2.1])  # 2: both ranks
    ax = labkit.plot_loss(run)
    assert [t.get_text() for t in ax.texts] == ["restart 1, 1 rank", "restart 2, 2 ranks"]
    assert [m.get_xdata()[0] for m in ax.lines[1:]] == [3, 5]  # where each round logged first


def test_a_round_that_only_resumed_is_marked_resumed():
    from labkit._results.rounds import what_changed
    assert what_changed({"restart": 0, "world_size": 2}, {"restart": 0, "world_size": 2,
                                                           "resumed_from": 4}) == "resumed"
    assert what_changed({"restart": 1.0, "world_size": 4.0},
                        {"restart": 2.0, "world_size": 1.0}) == "restart 2, 1 rank"


def test_plot_errors_are_clear(tmp_path):
    run = make_run(tmp_path, {0: [rec(0, 1, 1.0, loss=2.0)]})
    with pytest.raises(NoMetricsError, match=r"logged no 'test_acc' \(it logged: step, restart, loss\)"):
        labkit.plot_metric(run, "test_acc")
    with pytest.raises(ValueError, match="x must be one of"):
        labkit.plot_loss(run, x="epoch")
    with pytest.raises(ValueError, match="at least one run"):
        labkit.plot_loss([])


def test_plot_throughput_marks_warmup_and_draws_the_reported_median(tmp_path):
    lines = [rec(0, i, float(t), samples=10) for i, t in enumerate([0, 5, 6, 7, 8])]
    run = make_run(tmp_path, {0: lines})
    ax = labkit.plot_throughput(run)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[1] == "warm-up windows (left out)"
    assert labels[2] == f"median: {run.throughput():,.0f} samples/s per rank"
    assert ax.get_lines()[1].get_ydata().tolist() == [2.0]  # the slow first window, marked


def test_plot_loss_takes_legend_labels_one_per_run(tmp_path):
    a = make_run(tmp_path / "a", {0: [rec(0, 1, 1.0, loss=2.0), rec(0, 2, 2.0, loss=1.0)]})
    b = make_run(tmp_path / "b", {0: [rec(0, 1, 1.0, loss=2.5), rec(0, 2, 2.0, loss=1.5)]})
    ax = labkit.plot_loss([a, b], labels=["1 rank", "2 ranks"])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["1 rank", "2 ranks"]
    with pytest.raises(ValueError, match="labels has 1 entries for 2 run"):
        labkit.plot_loss([a, b], labels=["only one"])


def test_runs_on_different_data_say_which_in_the_legend(tmp_path):
    a = make_run(tmp_path / "a", {0: [rec(0, 1, 1.0, loss=2.0), rec(0, 2, 2.0, loss=1.0)]})
    b = make_run(tmp_path / "b", {0: [rec(0, 1, 1.0, loss=2.5), rec(0, 2, 2.0, loss=1.5)]})
    (a.run_dir / "data.json").write_text('{"source": "CIFAR-10"}')
    (b.run_dir / "data.json").write_text('{"source": "synthetic"}')
    ax = labkit.plot_loss([a, b], labels=["8 GPUs (reference)", "mine"])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "8 GPUs (reference) (CIFAR-10)", "mine (synthetic)"]
    (b.run_dir / "data.json").write_text('{"source": "CIFAR-10"}')
    ax = labkit.plot_loss([a, b], labels=["8 GPUs (reference)", "mine"])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["8 GPUs (reference)", "mine"]
