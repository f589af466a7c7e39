"""Pipeline schedules (labkit._results.pipeline): the orders, the in-flight count, the replay, a run read back."""

from __future__ import annotations

import pandas as pd
import pytest

import labkit


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (2, 8), (3, 5), (4, 8), (4, 32)])
def test_every_stage_runs_each_microbatch_once_each_way(stages, microbatches):
    for schedule in ("GPipe", "1F1B"):
        for stage in range(stages):
            order = labkit.schedule_order(schedule, stage, stages=stages, microbatches=microbatches)
            assert sorted(order) == sorted([("F", i) for i in range(microbatches)]
                                           + [("B", i) for i in range(microbatches)])
            # each phase in micro-batch order, each backward after its own forward
            assert [i for p, i in order if p == "F"] == list(range(microbatches))
            assert [i for p, i in order if p == "B"] == list(range(microbatches))
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(microbatches))


def test_gpipe_is_all_forwards_then_all_backwards():
    assert labkit.schedule_order("gpipe", 1, stages=2, microbatches=3) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_1f1b_warms_up_with_p_minus_s_forwards_then_alternates():
    assert labkit.schedule_order("1f1b", 0, stages=2, microbatches=4) == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert labkit.schedule_order("1f1b", 1, stages=2, microbatches=4) == [
        ("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    # fewer micro-batches than the warm-up: every forward first
    assert labkit.schedule_order("1f1b", 0, stages=4, microbatches=2)[:2] == [("F", 0), ("F", 1)]


@pytest.mark.parametrize("stages, microbatches", [(2, 8), (4, 8), (4, 32)])
def test_in_flight_is_m_for_gpipe_and_p_minus_s_for_1f1b(stages, microbatches):
    for stage in range(stages):
        gpipe = labkit.schedule_order("gpipe", stage, stages=stages, microbatches=microbatches)
        one = labkit.schedule_order("1f1b", stage, stages=stages, microbatches=microbatches)
        assert labkit.most_in_flight(gpipe) == microbatches
        assert labkit.most_in_flight(one) == min(microbatches, stages - stage)
    assert labkit.most_in_flight([]) == 0


@pytest.mark.parametrize("stages, microbatches", [(1, 4), (2, 8), (3, 5), (4, 8), (4, 32)])
def test_the_replayed_bubble_is_the_formula_for_both_schedules(stages, microbatches):
    """Forward 1, backward 2, free messages: the step lasts 3(m + p - 1), each stage works 3m."""
    for schedule in ("gpipe", "1f1b"):
        orders = [labkit.schedule_order(schedule, s, stages=stages, microbatches=microbatches)
                  for s in range(stages)]
        length = labkit.replay_schedule(orders)
        assert length == 3 * (microbatches + stages - 1)
        assert abs((1 - 3 * microbatches / length) - (stages - 1) / (microbatches + stages - 1)) < 1e-12


def test_replay_uses_the_durations_given():
    orders = [labkit.schedule_order("gpipe", s, stages=2, microbatches=1) for s in range(2)]
    assert labkit.replay_schedule(orders, forward=1.0, backward=1.0) == 4.0   # F F B B, one after another


def test_an_order_that_deadlocks_is_a_clear_error():
    # stage 0 wants micro-batch 1's backward before it has sent micro-batch 0 forward
    orders = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    with pytest.raises(ValueError, match=r"wait on each other for ever.*HINT"):
        labkit.replay_schedule(orders)


@pytest.mark.parametrize("call, match", [
    (lambda: labkit.schedule_order("zigzag", 0, stages=2, microbatches=4), r"unknown schedule 'zigzag'"),
    (lambda: labkit.schedule_order("gpipe", 2, stages=2, microbatches=4), r"stage must be 0 to 1"),
    (lambda: labkit.schedule_order("gpipe", 0, stages=0, microbatches=4), r"stages must be a whole number >= 1"),
    (lambda: labkit.schedule_order("gpipe", 0, stages=2, microbatches=0), r"microbatches must be"),
    (lambda: labkit.most_in_flight([("X", 0)]), r"a phase is 'F'"),
    (lambda: labkit.replay_schedule([[("X", 0)]]), r"a phase is 'F'"),
])
def test_bad_input_is_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _logged(stages: int, microbatches: int, schedule: str, *, late: bool = False) -> pd.DataFrame:
    """A run's metrics as the lesson's script logs them: the replayed times, in seconds, at step 3
    (and a step 2 before it, which must be ignored). ``late``: one forward starts too early."""
    orders = [labkit.schedule_order(schedule, s, stages=stages, microbatches=microbatches)
              for s in range(stages)]
    rows, end, clock = [], {}, [0.0] * stages
    todo = [list(o) for o in orders]
    while any(todo):
        for s, work in enumerate(todo):
            while work:
                phase, i = work[0]
                after = (s - 1, "F", i) if phase == "F" else (s + 1, "B", i)
                if 0 <= after[0] < stages and after not in end:
                    break
                start = max(clock[s], end.get(after, 0.0))
                clock[s] = end[(s, phase, i)] = start + (1.0 if phase == "F" else 2.0)
                rows.append({"rank": s, "step": 3, "phase": phase, "microbatch": float(i),
                             "start": 100 + start / 1000, "end": 100 + clock[s] / 1000})
                work.pop(0)
    if late:
        row = next(r for r in rows if r["rank"] == 1 and r["phase"] == "F")
        row["start"] -= 0.0005
    rows.append({"rank": 0, "step": 2, "phase": "F", "microbatch": 0.0, "start": 1.0, "end": 2.0})
    rows.append({"rank": 0, "step": 3, "loss": 2.3})   # a line without pipeline work
    return pd.DataFrame(rows)


def test_a_run_is_read_back_stage_by_stage():
    events = labkit.schedule_events(_logged(2, 4, "1f1b"))
    assert list(events.columns) == ["rank", "phase", "microbatch", "start", "end"]
    assert events["start"].min() == 0 and len(events) == 2 * 2 * 4
    assert labkit.stage_orders(events) == [labkit.schedule_order("1f1b", s, stages=2, microbatches=4)
                                           for s in range(2)]
    assert labkit.early_starts(events) == []
    ideal = (2 - 1) / (4 + 2 - 1)
    assert abs(labkit.measured_bubble(events) - ideal) < 1e-9   # replayed times: no waits


def test_what_a_stage_held_is_read_back_where_it_was_logged():
    logged = _logged(2, 4, "gpipe")
    logged["held"] = [float(i) for i in range(len(logged))]
    events = labkit.schedule_events(logged)
    assert list(events.columns) == ["rank", "phase", "microbatch", "start", "end", "held"]
    assert events["held"].dtype.kind == "i" and len(events) == 2 * 2 * 4


def test_work_that_starts_before_its_input_is_named():
    [found] = labkit.early_starts(labkit.schedule_events(_logged(2, 4, "gpipe", late=True)))
    assert found.startswith("stage 1 started F of micro-batch 0 at") and "before stage 0 finished F" in found


def test_a_run_without_pipeline_work_is_a_clear_error():
    with pytest.raises(ValueError, match=r"logged no pipeline work.*HINT"):
        labkit.schedule_events(pd.DataFrame({"rank": [0], "step": [1], "loss": [2.0]}))
    with pytest.raises(ValueError, match=r"no pipeline work logged at step 9; steps logged: \[2, 3\]"):
        labkit.schedule_events(_logged(2, 4, "gpipe"), step=9)


def test_plot_schedule_draws_a_bar_per_piece_of_work():
    import matplotlib
    matplotlib.use("Agg")
    events = labkit.schedule_events(_logged(2, 4, "gpipe"))
    ax = labkit.plot_schedule(events, title="GPipe")
    assert len(ax.collections) == len(events) and ax.get_title() == "GPipe"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1"]
    assert ax.get_xlabel() == "ms since the step began (wall clock, all ranks)"
    with pytest.raises(ValueError, match="no events"):
        labkit.plot_schedule(events.iloc[:0])
