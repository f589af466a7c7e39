"""labkit.launch(nnodes=N): N torchrun agents on this machine as N nodes (lesson 09).

Real launches: ranks and groups land where torchrun says, a failure on either node is named,
and nothing is left running after an error, a timeout, an interrupt or a killed launcher:
neither rank nor agent.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import labkit
from conftest import python
from labkit import LaunchError, LaunchTimeout, _hardware
from labkit._launch import agents as _nodes
from labkit._launch import procs as _procs
from labkit._launch.plan import plan
from labkit._rank import proc as _proc

LAYOUT = """
    import os, torch, torch.distributed as dist
    from labkit import metrics
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    metrics.log(0, loss=1.0, group_rank=int(os.environ["GROUP_RANK"]),
                local_rank=int(os.environ["LOCAL_RANK"]), node=int(os.environ["LABKIT_NODE"]),
                local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]), pid=os.getpid())
    print(f"rank {rank} of {dist.get_world_size()}, sum {total.item():.0f}")
    dist.destroy_process_group()
"""

SLEEPER = """
    import time, torch.distributed as dist
    from labkit import metrics
    dist.init_process_group("gloo")
    metrics.log(dist.get_rank(), loss=1.0)
    print("ready", flush=True)
    time.sleep(300)
"""


def nothing_left(run_dir: Path, timeout: float = 15.0) -> bool:
    """True once every agent and every rank the run recorded has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = json.loads((run_dir / "run.json").read_text())
        ranks = [json.loads(p.read_text()) for p in (run_dir / "pids").glob("rank*.json")]
        alive = [r["pid"] for r in ranks if _proc.is_same_process(r["pid"], r["token"])]
        alive += [pid for pid in info.get("agent_pids", []) if _proc.process_token(pid) is not None]
        if not alive:
            return True
        time.sleep(0.2)
    return False


# -- at the door ---------------------------------------------------------------------------
@pytest.mark.parametrize("nnodes, error, match", [
    (0, ValueError, "nnodes must be >= 1, got 0"),
    (-1, ValueError, "nnodes must be >= 1, got -1"),
    (1.5, TypeError, "nnodes must be an int, got 1.5"),
    (True, TypeError, "nnodes must be an int, got True"),
    (None, TypeError, "nnodes must be an int, got None"),
    ("1:2", TypeError, r"nnodes must be an int, e.g. nnodes=2, got the string '1:2'. HINT: torchrun's "
                       r"elastic form"),
])
def test_bad_nnodes_is_refused_before_anything_runs(workdir, write_script, nnodes, error, match):
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(error, match=match):
        labkit.launch("ok.py", nproc=1, nnodes=nnodes)
    assert not (workdir / "runs").exists()


def test_too_many_ranks_over_all_nodes_is_refused(workdir, write_script, monkeypatch):
    write_script("ok.py", "print('hi')\n")
    monkeypatch.setattr(_hardware, "cpu_count", lambda: 2)
    with pytest.raises(ValueError, match=r"nnodes=3 × nproc=4 = 12 CPU ranks on 2 core\(s\) is too "
                                         r"many.*HINT: nnodes × nproc=2 or fewer"):
        labkit.launch("ok.py", nproc=4, nnodes=3, device="cpu")
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 4)
    with pytest.raises(ValueError, match=r"nnodes=2 × nproc=4 = 8 but only 4 GPU\(s\) are visible "
                                         r"\(every node gets GPUs of its own.*HINT: nproc=2"):
        labkit.launch("ok.py", nproc=4, nnodes=2)
    assert not (workdir / "runs").exists()


def test_the_default_nproc_is_shared_between_the_nodes(workdir, write_script, monkeypatch):
    write_script("ok.py", "print('hi')\n")
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 0)
    assert plan("ok.py", nnodes=2).nproc == 1 and plan("ok.py", nnodes=2).world_size == 2
    monkeypatch.setattr(_hardware, "gpu_count", lambda: 8)
    monkeypatch.delenv("LABKIT_SMOKE", raising=False)
    assert plan("ok.py", nnodes=2).nproc == 4


@pytest.mark.parametrize("node, nproc, visible, expected", [
    (0, 2, None, "0,1"), (1, 2, None, "2,3"), (1, 1, "5,7", "7"), (1, 2, "4,5,6,7", "6,7")])
def test_each_node_gets_gpus_of_its_own(node, nproc, visible, expected):
    assert _nodes.gpu_slice(node, nproc, visible) == expected


@pytest.mark.parametrize("survivor, waited", [
    (["sh", "-c", "sleep 300 & wait"], (0.4, 10)),   # its ranks run still: the grace
    (["sleep", "300"], (0, 0.4)),                    # no rank left (torchrun's exit barrier): none
], ids=["with-ranks", "rankless"])
def test_an_agent_that_failed_ends_the_wait_for_the_others(tmp_path, monkeypatch, survivor, waited):
    """torchrun's exit barrier would keep a healthy agent 300 s after its peer failed."""
    monkeypatch.setattr(_nodes, "FAILURE_GRACE_S", 0.5)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    agents = _nodes.Agents([["sh", "-c", "exit 3"], survivor], [None, None], logs)
    agents.start()
    try:
        time.sleep(0.2)  # both started; the survivor's child too
        start = time.monotonic()
        while agents.running():
            time.sleep(0.05)
        assert waited[0] <= time.monotonic() - start < waited[1]
        assert agents.returncode == 3  # the failure, not the survivor's "still running"
    finally:
        for child in _procs.children(agents.procs[1].pid):  # the stand-in rank, which no torchrun ends
            _procs.kill_tree(child)
        agents.stop(grace_s=1)
    assert agents.procs[1].returncode is not None


def test_a_taken_port_is_recognised_in_the_store_hosts_log(tmp_path):
    logs = [tmp_path / "a.log"]
    logs[0].write_text("torch.distributed.DistNetworkError: ... code: -98, name: EADDRINUSE, "
                       "message: address already in use\n")
    agents = _nodes.Agents([["sh", "-c", "exit 1"]], [None], logs)
    agents.procs = [subprocess.Popen(["sh", "-c", "exit 1"])]
    agents.procs[0].wait()
    assert agents.addr_in_use()


def test_an_agents_end_of_run_noise_stays_out_of_the_cell(tmp_path):
    """The agent that did not host the store says, at a normal end, that the store went away."""
    from labkit._launch.streams import Streams

    (tmp_path / "torchrun-node1.log").write_text(
        "[W1124 22:55:50.069039490 TCPStore.cpp:115] [c10d] recvVector failed on SocketImpl(fd=3): "
        "Failed to recv, got 0 bytes.\n"
        "Exception raised from recvBytes at /__w/pytorch/torch/csrc/distributed/c10d/Utils.hpp:790\n"
        "frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d\n"
        "<omitting python frames>\n"
        "W1124 22:55:50.144000 12877 torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1298] "
        "The node '127.0.0.1_12877_0' has failed to shutdown the rendezvous 'x' due to an error of "
        "type RendezvousConnectionError.\n"
        "W1124 22:55:51.000000 12877 torch/distributed/run.py:1] a warning worth reading\n")
    lines = []
    Streams(tmp_path, lines.append, nnodes=2).finish()
    assert lines == ["[torchrun node1] warning: a warning worth reading"]


# -- real launches ---------------------------------------------------------------------------
@pytest.mark.launch
def test_two_nodes_of_several_ranks_each(workdir, write_script, capsys, monkeypatch, ranks):
    """The layout torchrun gives, rank by rank, on two nodes of ``ranks`` ranks each (2 x 2; 2 x 3
    at --ranks 3, where a LOCAL_RANK / RANK mix-up cannot hide); the first port chosen was taken
    (another program got it first), so the launch starts again on a new one."""
    write_script("layout.py", LAYOUT)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = _nodes.free_port
    monkeypatch.setattr(_nodes, "free_port", lambda: next(ports, None) or real())
    try:
        run = labkit.launch("layout.py", nproc=ranks, nnodes=2, device="cpu", timeout_s=180)
    finally:
        taken.close()
    out = capsys.readouterr().out
    world = 2 * ranks
    assert run.status == "ok" and run.world_size == world and run.nnodes == 2
    assert "note: the rendezvous port was taken meanwhile" in out
    df = run.metrics().set_index("rank")
    assert list(df.index) == list(range(world))
    assert (df["world_size"] == world).all() and (df["local_world_size"] == ranks).all()
    # Ranks are numbered node by node: GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK.
    assert (df.index == df["group_rank"] * ranks + df["local_rank"]).all()
    assert sorted(df.groupby("node")["group_rank"].nunique()) == [1, 1]  # one group rank per node
    assert sorted(df.groupby("node").size()) == [ranks, ranks]
    assert df["pid"].nunique() == world
    for rank, node in df["node"].items():
        assert f"[node{node}][rank{rank}] rank {rank} of {world}, sum {sum(range(world))}" in out
        assert run.info["layout"][str(rank)]["node"] == node
        assert run.output(rank).strip() == f"rank {rank} of {world}, sum {sum(range(world))}"
    # Node 0 hosts the store; both agents are echoed, and none of their noise is printed.
    commands = run.info["commands"]
    assert "--rdzv-conf=is_host=1" in commands[0] and "--rdzv-conf=is_host=0" in commands[1]
    assert commands[0].replace("is_host=1", "is_host=0").replace("node0", "node1") == commands[1]
    assert "recvVector failed" not in out and "frame #" not in out
    assert nothing_left(run.run_dir, timeout=5)


@pytest.mark.launch
def test_a_rank_that_raises_on_the_second_node_is_named_and_nothing_waits_for_it(
        workdir, write_script, monkeypatch):
    """Rank 0 finishes and its agent enters torchrun's exit barrier; rank 1, on the other node,
    raises. torchrun alone would keep agent 0 waiting 300 s; the launch ends in seconds. Agent 0
    has no rank left, so it is not even given the grace an agent with ranks still running gets:
    with that grace set to 120 s, the launch still ends well before it."""
    monkeypatch.setattr(_nodes, "FAILURE_GRACE_S", 120.0)
    write_script("fail.py", """
        import time, torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        if dist.get_rank() == 1:
            time.sleep(2)
            raise ValueError("rank 1 is unhappy")
    """)
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 failed \(exit code 1\): ValueError: rank 1 is unhappy") as info:
        labkit.launch("fail.py", nproc=1, nnodes=2, device="cpu", timeout_s=240)
    assert time.monotonic() - start < 90
    err = info.value
    assert err.failures[0].rank == 1 and 'File "fail.py", line 6' in err.failures[0].traceback
    assert err.run.info["returncodes"][1] == 1
    assert nothing_left(err.run.run_dir, timeout=5)


@pytest.mark.launch
def test_a_hang_across_nodes_becomes_a_timeout(workdir, write_script):
    write_script("sleeper.py", SLEEPER)
    with pytest.raises(LaunchTimeout) as info:  # 20 s: time for both nodes' ranks to start when busy
        labkit.launch("sleeper.py", nproc=1, nnodes=2, device="cpu", timeout_s=20)
    err = info.value
    assert err.last_steps == {0: 0, 1: 1}
    assert err.stacks[0].startswith("sleeper.py:6 in <module>")
    assert nothing_left(err.run.run_dir, timeout=10)


@pytest.mark.launch
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_no_rank_and_no_agent_outlives_the_launcher(workdir, write_script, sig):
    write_script("sleeper.py", SLEEPER)
    launcher = python("""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import labkit
        labkit.launch("sleeper.py", nproc=1, nnodes=2, device="cpu", timeout_s=300)
    """, cwd=workdir)
    try:
        deadline = time.monotonic() + 120
        run_dir = None
        while time.monotonic() < deadline and run_dir is None:
            for found in (workdir / "runs").glob("*/pids/rank1.json"):
                if (found.parent / "rank0.json").exists():
                    run_dir = found.parent.parent
            time.sleep(0.2)
        assert run_dir is not None, "the ranks never started"
        agents = json.loads((run_dir / "run.json").read_text())["agent_pids"]
        assert len(agents) == 2
        launcher.send_signal(sig)
        assert nothing_left(run_dir, timeout=20), f"processes of {run_dir} outlived a {sig.name}"
    finally:
        launcher.kill()
        launcher.wait()


# -- sweep -------------------------------------------------------------------------------------
@pytest.mark.parametrize("nnodes, error", [(0, ValueError), ("2", TypeError), (2.0, TypeError)])
def test_a_sweep_refuses_bad_nnodes_before_any_run(workdir, write_script, nnodes, error):
    write_script("ok.py", "print('hi')\n")
    with pytest.raises(error, match="nnodes must be"):
        labkit.sweep("ok.py", nproc=[1, 2], nnodes=nnodes, repeats=1)
    assert not (workdir / "runs").exists()


@pytest.mark.launch
def test_a_sweep_on_two_nodes(workdir, write_script):
    """sweep's nproc are ranks per node; every run of the sweep has the same two nodes."""
    write_script("steps.py", """
        import time, torch.distributed as dist
        from labkit import metrics
        dist.init_process_group("gloo")
        for step in range(4):
            time.sleep(0.05)
            metrics.log(step, loss=1.0, samples=8)
        dist.destroy_process_group()
    """)
    result = labkit.sweep("steps.py", nproc=[1], nnodes=2, repeats=1, device="cpu", timeout_s=180)
    [run] = result.runs
    assert run.nnodes == 2 and run.world_size == 2 and run.name.endswith("-2nodes")
    table = result.table()
    assert list(table["world_size"]) == [2] and list(table["nproc"]) == [1]
    assert "2 nodes (torchrun agents) on one machine" in result.caption
    assert nothing_left(run.run_dir, timeout=5)


@pytest.mark.launch
def test_a_launcher_killed_before_any_rank_started_leaves_no_agent(workdir, write_script):
    """Killed while the agents still meet: the ranks they then start see their launcher gone
    and end at once, and so do the agents (torchrun ends when its workers fail)."""
    write_script("sleeper.py", SLEEPER)
    launcher = python("""
        import labkit
        labkit.launch("sleeper.py", nproc=1, nnodes=2, device="cpu", timeout_s=300)
    """, cwd=workdir)
    try:
        deadline = time.monotonic() + 120
        run_dir = None
        while time.monotonic() < deadline and run_dir is None:
            for info in (workdir / "runs").glob("*/run.json"):
                if "agent_pids" in json.loads(info.read_text()):
                    run_dir = info.parent
            time.sleep(0.05)
        assert run_dir is not None, "the agents never started"
        assert not list((run_dir / "pids").glob("rank*.json")), "too late: a rank had started"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert nothing_left(run_dir, timeout=60), f"an agent or a rank of {run_dir} outlived its launcher"
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.launch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_an_agent_waiting_for_a_peer_that_never_comes_dies_with_its_launcher(workdir, write_script):
    """No rank of its own yet, so no rank's watchdog to end it: torchrun would wait 600 s in the
    rendezvous. labkit._rank.agent asks Linux to kill it with its launcher."""
    write_script("ok.py", "print('hi')\n")
    launcher = python("""
        import os, sys, time
        from pathlib import Path
        from labkit._launch import agents as _nodes
        from labkit._rank import proc as _proc
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_nodes.free_port()}",
                "--rdzv-id=alone", "ok.py"]
        env = dict(os.environ, LABKIT_LAUNCHER_PID=str(os.getpid()),
                   LABKIT_LAUNCHER_TOKEN=_proc.process_token(os.getpid()))
        agents = _nodes.Agents([argv], [env], [Path("agent.log")])
        agents.start()
        print(agents.pids[0], flush=True)
        time.sleep(300)
    """, cwd=workdir, stdout=subprocess.PIPE, text=True)
    try:
        agent = int(launcher.stdout.readline())
        token = _proc.process_token(agent)
        time.sleep(3)  # torchrun runs in it, and waits for a second agent
        assert _proc.is_same_process(agent, token), "the agent did not start"
        # labkit's agent, not bare torchrun: forked warm from the launcher's server, or started cold
        assert psutil.Process(agent).cmdline()[1:3] in (["-m", "labkit._rank.agent_server"],
                                                        ["-m", "labkit._rank.agent"])
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while _proc.is_same_process(agent, token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _proc.is_same_process(agent, token), "the agent outlived its launcher"
