"""labkit.elastic_resumes: each restart of an elastic run set against the round before (lesson 10).

Run folders written by hand show each way a restart can go wrong, and the check naming it; an
empty comparison (no step done twice, or their lines lost with a killed node) fails instead of
passing. A real drill of lesson 10's script, in a copy that forgets to load the model's weights
when it resumes, is caught by its losses; the script as the lesson writes it passes.
"""

from __future__ import annotations

import json
import shutil

import pytest

import labkit
from labkit import _rundir
from conftest import ROOT


def _run(tmp_path, lines: dict, name="el"):
    """A run folder with the given metrics lines ({rank: [record, ...]})."""
    run_dir = _rundir.create(tmp_path, name)
    for rank, records in lines.items():
        with open(_rundir.metrics_file(run_dir, rank), "a") as f:
            for record in records:
                f.write(json.dumps({"rank": rank, **record}) + "\n")
    return labkit.Run(run_dir, {"name": name, "nproc": 1, "start_time": 1000.0})


def _drill(tmp_path, *, redo_loss=None, resumed_from=5, lose_rank1_after=7, reached=7, name="el"):
    """Two ranks to step ``reached`` (7; checkpoint at 5), then one rank resumed from
    ``resumed_from`` to 12. ``redo_loss``: the loss the second round logs for the steps it does
    again (default: the same as the first time); rank 1's lines after ``lose_rank1_after`` are
    lost with its node."""
    t = 1000.0
    first = [dict(step=s, world_size=2, restart=0, time=t + s, loss=1.0 / s) for s in range(1, reached + 1)]
    saved = [dict(step=5, world_size=2, restart=0, time=t + 5.1, checkpoint_saved=5)]
    second = [dict(step=resumed_from, world_size=1, restart=1, time=t + 20, resumed_from=resumed_from)]
    second += [dict(step=s, world_size=1, restart=1, time=t + 20 + s,
                    loss=(redo_loss if redo_loss is not None and s <= reached else 1.0 / s))
               for s in range(resumed_from + 1, 13)]
    rank1 = [dict(r, time=r["time"] + 0.01) for r in first if r["step"] <= lose_rank1_after]
    return _run(tmp_path, {0: first + saved + second, 1: rank1}, name)


def test_a_restart_that_redid_its_steps_alike_passes(tmp_path):
    resumes = labkit.elastic_resumes(_drill(tmp_path), tol=1e-6).check(ckpt_every=5)
    row = resumes.table.iloc[1]
    assert (row["resumed_from"], row["saved_before"], row["redone"], row["compared"]) == (5, 5, [6, 7], 2)
    assert list(resumes.table["restart"]) == [0, 1]
    assert "redone" in repr(resumes) and "<table" in resumes._repr_html_()


def test_other_losses_on_the_redone_steps_fail(tmp_path):
    """A resume that did not load the weights trains the same steps from elsewhere."""
    with pytest.raises(AssertionError, match=r"round 1 .* redid steps \[6, 7\] with losses up to .*"
                                             r"were the model.s weights loaded"):
        labkit.elastic_resumes(_drill(tmp_path, redo_loss=2.3), tol=1e-4).check(ckpt_every=5)


def test_nothing_compared_fails_instead_of_passing(tmp_path):
    """Rank 1's lines for steps 6 and 7 were lost with its node: no step done twice is whole."""
    resumes = labkit.elastic_resumes(_drill(tmp_path, lose_rank1_after=5), tol=1e-4)
    assert resumes.table["compared"].sum() == 0
    with pytest.raises(AssertionError, match="no step done twice could be compared"):
        resumes.check(ckpt_every=5)


def test_a_round_stopped_between_logging_a_checkpoint_step_and_saving_it_redoes_that_many(tmp_path):
    """The script logs step 10's loss, then saves step 10's checkpoint: a node that leaves
    between the two leaves step 5's as the last, and the next round redoes 6 to 10, all
    ``ckpt_every`` of them (lesson 10 saw it). That is no missed checkpoint; one step more is."""
    resumes = labkit.elastic_resumes(_drill(tmp_path, reached=10, lose_rank1_after=10), tol=1e-6)
    assert resumes.check(ckpt_every=5).table.iloc[1]["redone"] == [6, 7, 8, 9, 10]
    late = labkit.elastic_resumes(_drill(tmp_path, reached=11, lose_rank1_after=11, name="late"), tol=1e-6)
    with pytest.raises(AssertionError, match=r"round 1 .* redid steps \[6, 7, 8, 9, 10, 11\]: more than 5, "
                                             r"so a checkpoint was missed"):
        late.check(ckpt_every=5)


def test_a_checkpoint_written_but_not_yet_logged_when_the_round_was_stopped_is_resumed_from(tmp_path):
    """Stopped between writing step 10's checkpoint and logging it, the round's lines say 5, the
    disk holds 10, and the next round rightly goes on from 10 (the course's tests saw it under
    load). It redid nothing, so the whole-run comparison is what fails here, not the resume.
    A checkpoint at a step the round never reached is another matter."""
    written = labkit.elastic_resumes(_drill(tmp_path, reached=10, lose_rank1_after=10, resumed_from=10), tol=1e-6)
    assert written.table.iloc[1][["saved_before", "reached_before"]].tolist() == [5, 10]
    with pytest.raises(AssertionError, match="no step done twice could be compared"):
        written.check(ckpt_every=5)
    assert written.check_resume_points(ckpt_every=5) is written  # where it went on from is right
    beyond = labkit.elastic_resumes(_drill(tmp_path, reached=9, lose_rank1_after=9, resumed_from=10, name="beyond"),
                                    tol=1e-6)
    with pytest.raises(AssertionError, match=r"resumed from step 10, but the last checkpoint saved before it was step 5 "
                                             r"\(and the round before reached step 9\): it read the wrong checkpoint"):
        beyond.check(ckpt_every=5)


def test_a_round_too_short_to_save_a_checkpoint_leaves_the_one_before_to_resume_from(tmp_path):
    """Node 2 joins before the survivor's round reaches its first checkpoint (a fast join, as
    lesson 10's at 4 ranks saw): the round after goes on from round 0's checkpoint, the last one
    on disk, and that is right. Going on from an older one is still named."""
    t = 1000.0
    first = [dict(step=s, world_size=2, restart=0, time=t + s, loss=1.0 / s) for s in range(1, 8)]
    first += [dict(step=5, world_size=2, restart=0, time=t + 5.1, checkpoint_saved=5)]
    alone = [dict(step=5, world_size=1, restart=1, time=t + 20, resumed_from=5)]
    alone += [dict(step=s, world_size=1, restart=1, time=t + 20 + s, loss=1.0 / s) for s in range(6, 9)]
    again = [dict(step=5, world_size=2, restart=1, time=t + 40, resumed_from=5)]
    again += [dict(step=s, world_size=2, restart=1, time=t + 40 + s, loss=1.0 / s) for s in range(6, 13)]
    rank1 = [dict(r, time=r["time"] + 0.01) for r in first + again if "loss" in r]
    run = _run(tmp_path, {0: first + alone + again, 1: rank1})
    resumes = labkit.elastic_resumes(run, tol=1e-6).check(ckpt_every=5)
    assert resumes.table["saved_before"].tolist()[1:] == [5, 5]
    assert resumes.table.iloc[2]["redone"] == [6, 7, 8]
    older = [dict(r, resumed_from=3) if "resumed_from" in r else r for r in again]
    run = _run(tmp_path, {0: first + alone + older, 1: rank1}, name="older")
    with pytest.raises(AssertionError, match=r"round 2 .* resumed from step 3, but the last checkpoint saved "
                                             r"before it was step 5"):
        labkit.elastic_resumes(run, tol=1e-6).check_resume_points(ckpt_every=5)


def test_an_older_checkpoint_is_named(tmp_path):
    with pytest.raises(AssertionError, match=r"resumed from step 3, but the last checkpoint saved before it was step 5"):
        labkit.elastic_resumes(_drill(tmp_path, resumed_from=3), tol=1e-4).check(ckpt_every=5)


@pytest.fixture
def elastic_script(workdir):
    shutil.copy(ROOT / "notebooks" / "scripts" / "10_elastic.py", workdir / "elastic.py")
    labkit.write_variant(workdir / "elastic.py", workdir / "forgetful.py", {
        '    raw_model.load_state_dict(state["model"])\n': ""})
    return workdir


ARGS = ["--synthetic", "--workers", "0", "--train-size", "512", "--test-size", "32", "--width", "8",
        "--global-batch", "32", "--epochs", "100", "--log-every", "1", "--norm", "group",
        "--ckpt-every", "5", "--step-pause", "0.05", "--timeout", "30"]


def _drill_of(script: str, folder: str):
    """Node 1 dies after step 12, between checkpoints; then node 0, the store's host."""
    try:
        return labkit.launch(script, nproc=1, nnodes=2, min_nodes=1, max_restarts=3, device="cpu",
                             quiet=True, timeout_s=300, args=ARGS + ["--ckpt-dir", folder],
                             events=[labkit.kill_node(1, at_step=12), labkit.kill_node(0, world_size=1)])
    except labkit.LaunchError as err:  # every node killed: labkit may call that a failure
        return err.run


@pytest.mark.launch
def test_a_real_resume_that_forgets_the_weights_is_caught(elastic_script):
    good = labkit.elastic_resumes(_drill_of("elastic.py", "ckpt-good"), tol=1e-4).check(ckpt_every=5)
    assert good.table["compared"].sum() >= 1  # step 11 at least: every rank flushed it before 12
    forgetful = labkit.elastic_resumes(_drill_of("forgetful.py", "ckpt-bad"), tol=1e-4)
    with pytest.raises(AssertionError, match="were the model's weights loaded"):
        forgetful.check(ckpt_every=5)


def test_the_resume_points_alone_pass_other_losses_and_fail_a_wrong_checkpoint(tmp_path):
    """``check_resume_points`` is the first half of ``check``: where each round went on from,
    for runs whose losses differ by design (the course's launch tests log a made-up loss)."""
    other = labkit.elastic_resumes(_drill(tmp_path, redo_loss=2.3), tol=1e-4)
    assert other.check_resume_points(ckpt_every=5) is other
    older = labkit.elastic_resumes(_drill(tmp_path, resumed_from=3, name="older"), tol=1e-4)
    with pytest.raises(AssertionError, match=r"resumed from step 3, but the last checkpoint saved before it was step 5"):
        older.check_resume_points(ckpt_every=5)
    first = [dict(step=s, world_size=2, restart=0, time=1000.0 + s, loss=1.0) for s in range(1, 7)]
    skipped = _run(tmp_path, {0: first + [dict(step=5, world_size=2, restart=0, time=1005.1, checkpoint_saved=5),
                                          dict(step=5, world_size=1, restart=1, time=1020.0, resumed_from=5),
                                          dict(step=8, world_size=1, restart=1, time=1028.0, loss=1.0)]},
                   name="skipped")
    with pytest.raises(AssertionError, match=r"resumed from step 5 but trained first step 8: steps were skipped"):
        labkit.elastic_resumes(skipped, tol=1e-4).check_resume_points(ckpt_every=5)
