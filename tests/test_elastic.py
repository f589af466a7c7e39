"""Elastic launches (lesson 10): nodes killed and added while the job trains, the rounds read back.

At the door: min_nodes and the node events are checked before anything starts. Real launches:
node 1 dies, the survivor resumes alone, a new node joins and the job finishes on two; then the
same drill with node 0, the store's host, killed last, which ends the job. Nothing is left
running: no agent (the one that joined included), no rank.
"""

from __future__ import annotations

import json

import pytest

import labkit
from labkit import _rundir
from labkit._launch import elastic as _elastic
from labkit._launch.plan import plan
from test_nodes import nothing_left

# Trains until it has done argv[2] steps in a round that resumed on 2 ranks (the world grew back).
ELASTIC = """
    import os, sys, time, torch, torch.distributed as dist
    from labkit import checkpoint, metrics
    folder, last_round_steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    step, resumed = 0, False
    latest = checkpoint.latest(folder)
    if latest is not None:
        step, resumed = torch.load(latest, weights_only=True)["step"], True
        metrics.log(step, resumed_from=step)
    print(f"rank {rank} of {world} from step {step}", flush=True)
    done_here = 0
    while not (resumed and world == 2 and done_here >= last_round_steps):
        total = torch.ones(1)
        dist.all_reduce(total)
        step, done_here = step + 1, done_here + 1
        metrics.log(step, loss=1.0 / step)
        if step % 5 == 0:
            if rank == 0:
                checkpoint.save_atomic({"step": step}, checkpoint.step_path(folder, step))
                metrics.log(step, checkpoint_saved=step)
            dist.barrier()
        time.sleep(0.05)
    dist.destroy_process_group()
"""


# -- at the door ------------------------------------------------------------------------------
def test_the_elastic_command(workdir, write_script):
    write_script("ok.py", "print('hi')\n")
    p = plan("ok.py", nproc=1, nnodes=2, min_nodes=1)
    assert _elastic.nnodes_spec(p) == "1:2" and _elastic.is_elastic(p)
    assert _elastic.rdzv_conf(p, 0) == ("is_host=1,last_call_timeout=2,keep_alive_interval=1,"
                                        "keep_alive_max_attempt=3")
    assert _elastic.rdzv_conf(p, 1).startswith("is_host=0,")
    fixed = plan("ok.py", nproc=1, nnodes=2)
    assert _elastic.nnodes_spec(fixed) == "2" and _elastic.rdzv_conf(fixed, 1) == "is_host=0"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"min_nodes": 3}, ValueError, r"min_nodes=3 with nnodes=2: torchrun's --nnodes=MIN:MAX needs "
                                   r"1 <= MIN <= MAX"),
    ({"min_nodes": 0}, ValueError, "min_nodes=0 with nnodes=2"),
    ({"min_nodes": "1"}, TypeError, "min_nodes must be an int or None"),
    ({"events": [labkit.kill_node(2, at_step=3)]}, ValueError,
     r"kill_node\(2\) but the launch has nodes 0 to 1"),
    ({"min_nodes": 1, "events": [labkit.add_node(at_step=3)]}, ValueError,
     "add_node comes before any node has left.*HINT: list labkit.kill_node"),
    ({"events": [labkit.kill_node(1, at_step=3), labkit.add_node(at_step=5)]}, ValueError,
     "add_node needs an elastic launch.*HINT: launch\\(..., nnodes=2, min_nodes=1"),
])
def test_bad_elastic_arguments_are_refused_before_anything_runs(workdir, write_script, kwargs, error, match):
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(error, match=match):
        labkit.launch("ok.py", nproc=1, nnodes=2, **kwargs)
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize("make, match", [
    (lambda: labkit.kill_node(1), "say when: at_step=N"),
    (lambda: labkit.add_node(at_step=-1), "at_step must be an int >= 0"),
    (lambda: labkit.add_node(world_size=0), "world_size must be an int >= 1"),
    (lambda: labkit.kill_node(-1, at_step=1), "node must be an int >= 0"),
])
def test_an_event_must_say_when(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


class _Progress:
    def __init__(self, step, world_size, world_steps):
        self.step, self.world_size, self.world_steps = step, world_size, world_steps


def test_when_an_event_is_due():
    at = labkit.kill_node(1, at_step=12)
    assert not at.due(_Progress(None, None, 0)) and not at.due(_Progress(11, 2, 11))
    assert at.due(_Progress(12, 2, 12))
    settled = labkit.add_node(world_size=1)  # once the survivor has trained alone a while
    assert not settled.due(_Progress(30, 2, 30)) and not settled.due(_Progress(30, 1, 4))
    assert settled.due(_Progress(30, 1, _elastic.STEADY_STEPS))
    both = labkit.kill_node(0, at_step=40, world_size=2)
    assert not both.due(_Progress(39, 2, 9)) and not both.due(_Progress(41, 1, 9))
    assert both.due(_Progress(41, 2, 9))


def _metrics(run_dir, rank, lines):
    with open(_rundir.metrics_file(run_dir, rank), "a") as f:
        for line in lines:
            f.write(json.dumps({"rank": rank, "restart": 0, **line}) + "\n")


def test_rounds_and_losses_of_an_elastic_run(tmp_path):
    """Two ranks to step 6 (rank 1 killed before it logged step 6), one rank from the checkpoint
    of step 5 to 9, then two ranks again from step 9."""
    run_dir = _rundir.create(tmp_path, "el")
    t = 1000.0
    _metrics(run_dir, 0, [dict(step=s, world_size=2, time=t + s, loss=1.0 / s) for s in range(1, 7)]
             + [dict(step=5, world_size=2, time=t + 5.1, checkpoint_saved=5)]
             + [dict(step=5, world_size=1, time=t + 20, resumed_from=5)]
             + [dict(step=s, world_size=1, time=t + 20 + s, loss=1.0 / s) for s in range(6, 10)]
             + [dict(step=9, world_size=2, time=t + 40, resumed_from=9)]
             + [dict(step=s, world_size=2, time=t + 40 + s, loss=1.0 / s) for s in range(10, 12)])
    _metrics(run_dir, 1, [dict(step=s, world_size=2, time=t + s + 0.01, loss=1.0 / s) for s in range(1, 6)]
             + [dict(step=9, world_size=2, time=t + 40, resumed_from=9)]
             + [dict(step=s, world_size=2, time=t + 40 + s, loss=1.0 / s) for s in range(10, 12)])
    run = labkit.Run(run_dir, {"name": "el", "nproc": 1, "start_time": t})
    losses = labkit.elastic_losses(run)
    assert list(losses[losses["round"] == 0]["step"]) == [1, 2, 3, 4, 5]  # step 6: rank 1's line was lost
    rounds = labkit.elastic_rounds(run)
    assert list(rounds["world_size"]) == [2, 1, 2]
    assert rounds["resumed_from"].isna().tolist() == [True, False, False]
    assert list(rounds["resumed_from"][1:]) == [5, 9]
    assert list(rounds["first_step"]) == [1, 6, 10] and list(rounds["last_step"]) == [5, 9, 11]
    assert rounds.loc[0, "last_checkpoint"] == 5 and rounds.loc[0, "start_s"] == pytest.approx(1)


# -- real launches ----------------------------------------------------------------------------
def _rounds_resume_where_they_should(run):
    rounds = labkit.elastic_rounds(run)
    assert list(rounds["world_size"])[:3] == [2, 1, 2], rounds
    # From the last checkpoint logged, or the next one, written by a round stopped before it
    # logged it (seen under load); the script checkpoints every 5 steps ("ckpt" 5 below 10).
    labkit.elastic_resumes(run, tol=0).check_resume_points(ckpt_every=5)
    return rounds


@pytest.mark.launch
def test_a_node_dies_the_job_goes_on_a_node_joins_and_it_finishes(workdir, write_script):
    write_script("elastic.py", ELASTIC)
    run = labkit.launch("elastic.py", nproc=1, nnodes=2, min_nodes=1, max_restarts=3, device="cpu",
                        args=["ckpt", "10"], timeout_s=400,
                        events=[labkit.kill_node(1, at_step=7), labkit.add_node(world_size=1)])
    assert run.status == "ok" and run.info["returncodes"][0] == 0 and run.info["returncodes"][2] == 0
    assert run.info["returncodes"][1] == -9  # killed on purpose: not a failure
    assert [e["event"] for e in run.info["events"]] == ["KillNode", "AddNode"]
    assert len(run.info["agent_pids"]) == 3 and len(run.info["commands"]) == 3
    assert run.info["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "--nnodes=1:2" in run.info["commands"][2] and "is_host=0" in run.info["commands"][2]
    _rounds_resume_where_they_should(run)
    layout = [json.loads(line) for line in _rundir.layout_file(run.run_dir).read_text().splitlines()]
    assert {rec["node"] for rec in layout} == {0, 1, 2}
    assert "from step" in run.output(1)  # node 2's rank 1, read through the layout
    assert nothing_left(run.run_dir)


@pytest.mark.launch
def test_killing_the_store_host_ends_the_job_however_many_nodes_survive(workdir, write_script):
    write_script("elastic.py", ELASTIC)
    with pytest.raises(labkit.LaunchError) as caught:
        labkit.launch("elastic.py", nproc=1, nnodes=2, min_nodes=1, max_restarts=3, device="cpu",
                      args=["ckpt", "100000"], timeout_s=400,  # the last round never ends by itself
                      events=[labkit.kill_node(1, at_step=7), labkit.add_node(world_size=1),
                              labkit.kill_node(0, world_size=2)])
    run = caught.value.run
    codes = run.info["returncodes"]
    assert codes[:2] == [-9, -9] and codes[2] not in (0, None), codes
    assert "RendezvousConnectionError" in _rundir.agent_log(run.run_dir, 2, 2).read_text()
    _rounds_resume_where_they_should(run)
    assert nothing_left(run.run_dir)


def test_a_log_written_again_from_the_start_is_read_again(tmp_path):
    """When a node joins, torchrun restarts the workers with the same restart count, so the
    new worker writes the same attempt's stdout.log afresh: its lines must not be lost."""
    from labkit._launch.tail import LineTail
    log = tmp_path / "stdout.log"
    log.write_text("old line one\nold line two, which is longer\n")
    tail = LineTail(log)
    assert tail.new_lines() == ["old line one", "old line two, which is longer"]
    log.write_text("resumed\n")  # truncated and written again
    assert tail.new_lines() == ["resumed"]
