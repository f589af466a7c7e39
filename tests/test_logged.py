"""labkit.logged and the per-rank, per-step series lessons 02 to 06 read from a run."""

from __future__ import annotations

import pytest

import labkit
from labkit import NoMetricsError
from test_run import make_run, rec


def test_logged_indexes_by_rank_and_step_and_keeps_the_later_of_a_redone_step(tmp_path):
    first = [rec(0, 4, 1.0, loss=2.0), rec(0, 8, 2.0, loss=1.5)]
    redone = [dict(rec(0, 8, 3.0, loss=1.4), restart=1), dict(rec(0, 12, 4.0, loss=1.0), restart=1)]
    run = make_run(tmp_path, {0: first + redone, 1: [rec(1, 4, 1.0, loss=2.2), rec(1, 4, 1.1, test_acc=0.3)]})
    loss = labkit.logged(run, "loss")
    assert loss.index.names == ["rank", "step"]
    assert loss.to_dict() == {(0, 4): 2.0, (0, 8): 1.4, (0, 12): 1.0, (1, 4): 2.2}   # the restart's 8 wins
    per_rank = loss.unstack("rank")
    assert list(per_rank.columns) == [0, 1] and per_rank.loc[4].tolist() == [2.0, 2.2]
    assert labkit.logged(run.metrics(), "test_acc").to_dict() == {(1, 4): 0.3}   # a DataFrame works too


def test_logged_takes_several_columns_and_an_epoch_index(tmp_path):
    lines = {r: [rec(r, 0, 1.0, epoch=0, shard_rows=2 + r, full_rows=5), rec(r, 4, 2.0, epoch=1, fp=7 * r)]
             for r in (0, 1)}
    run = make_run(tmp_path, lines)
    shards = labkit.logged(run, ["shard_rows", "full_rows"])
    assert list(shards.columns) == ["shard_rows", "full_rows"] and shards["shard_rows"].tolist() == [2, 3]
    assert labkit.logged(run, "fp", by="epoch").to_dict() == {(0, 1): 0, (1, 1): 7}


def test_logged_names_what_the_run_did_not_log(tmp_path):
    run = make_run(tmp_path, {0: [rec(0, 1, 1.0, loss=2.0)]})
    with pytest.raises(NoMetricsError, match=r"run 'r' logged no 'batch_fp'.*HINT"):
        labkit.logged(run, "batch_fp")
    with pytest.raises(NoMetricsError, match=r"logged no 'epoch'"):
        labkit.logged(run, "loss", by="epoch")


def test_steps_per_epoch_is_where_the_first_test_came(tmp_path):
    lines = [rec(0, 4, 1.0, loss=2.0), rec(0, 8, 2.0, test_acc=0.2), rec(0, 16, 3.0, test_acc=0.3)]
    assert labkit.steps_per_epoch(make_run(tmp_path, {0: lines})) == 8


def test_late_loss_is_the_mean_over_the_last_share_of_the_samples(tmp_path):
    # two ranks, 4 windows of 10 samples each per rank: the last quarter of 80 samples is window 4
    lines = {r: [rec(r, 2 * i, float(i), loss=loss + r, samples=10) for i, loss in enumerate([4, 3, 2, 1], 1)]
             for r in (0, 1)}
    run = make_run(tmp_path, lines)
    assert labkit.late_loss(run) == pytest.approx(1.5)
    assert labkit.late_loss(run, share=0.5) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="share must be in"):
        labkit.late_loss(run, share=0)


def test_bn_allreduces_per_step_reads_rank_0s_running_total(tmp_path):
    lines = {0: [rec(0, 4, 1.0, bn_allreduces=40), rec(0, 8, 2.0, bn_allreduces=80), rec(0, 12, 3.0, bn_allreduces=120)],
             1: [rec(1, 4, 1.0, bn_allreduces=999)]}
    assert labkit.bn_allreduces_per_step(make_run(tmp_path, lines)).tolist() == [10.0, 10.0]


def test_ddp_allreduces_per_step_leaves_out_each_ranks_first_window(tmp_path):
    # counts per window (reset after each line), 2 optimizer steps a window; the first window
    # made fewer all-reduces (DDP's buckets are rebuilt after the first step)
    lines = {r: [rec(r, 2, 1.0, allreduces=3), rec(r, 4, 2.0, allreduces=4), rec(r, 6, 3.0, allreduces=4)]
             for r in (0, 1)}
    assert labkit.ddp_allreduces_per_step(make_run(tmp_path, lines)) == [2.0]
    uneven = {0: [rec(0, 2, 1.0, allreduces=2), rec(0, 4, 2.0, allreduces=2), rec(0, 6, 3.0, allreduces=6)]}
    assert labkit.ddp_allreduces_per_step(make_run(tmp_path / "u", uneven)) == [1.0, 3.0]


def test_step_s_divides_each_steady_window_by_its_steps(tmp_path):
    lines = [rec(0, 4 * i, t, loss=1.0, samples=8) for i, t in enumerate([1.0, 2.0, 2.4, 3.2], 1)]
    assert labkit.step_s(make_run(tmp_path, {0: lines})).tolist() == pytest.approx([0.1, 0.2])
