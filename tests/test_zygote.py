"""labkit._rank.zygote: ranks forked warm from a copy of their agent, that are the ranks a new
process would be (folder, environment, argv, output, threads, random seeds, exit status), and
that end with their agent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

import labkit
from conftest import entry_processes
from labkit._launch import procs
from labkit._rank import forkserver, zygote

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote forks on Linux only")

SHOW = """
    import json, os, sys
    import numpy, torch
    parent = open(f"/proc/{os.getppid()}/comm").read().strip()
    print(json.dumps({"rank": int(os.environ["RANK"]), "cwd": os.getcwd(), "argv": sys.argv,
                      "path0": sys.path[0],
                      "threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
                      "unbuffered": sys.stdout.write_through, "numpy": numpy.random.rand(),
                      "torch": torch.rand(1).item(), "parent": parent}))
"""


def _shown(capsys) -> list[dict]:
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()
             if line.startswith("[rank") and '"rank"' in line]
    return sorted((json.loads(line) for line in lines), key=lambda row: row["rank"])


@pytest.mark.launch
def test_a_forked_rank_is_the_rank_a_new_process_would_be(workdir, write_script, capsys):
    """Side by side with plain torchrun in a terminal (new processes): the same folder, argv,
    sys.path[0], unbuffered output and thread counts; and torch's and numpy's generators seeded
    afresh in each rank, so that the ranks draw different numbers before any manual_seed."""
    os.mkdir(workdir / "scripts")
    write_script("scripts/show.py", SHOW)
    labkit.launch("scripts/show.py", nproc=2)
    forked = _shown(capsys)
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node=2", "scripts/show.py"], capture_output=True, text=True,
                           timeout=120)
    fresh = sorted((json.loads(line) for line in plain.stdout.splitlines() if line.startswith("{")),
                   key=lambda row: row["rank"])
    assert [row["parent"] for row in forked] == [zygote.NAME] * 2, forked
    assert [row["parent"] for row in fresh] != [zygote.NAME] * 2, fresh
    for mine, theirs in zip(forked, fresh):
        for key in ("cwd", "argv", "path0", "threads", "interop", "unbuffered"):
            assert mine[key] == theirs[key], (key, mine, theirs)
    for ranks in (fresh, forked):
        assert ranks[0]["torch"] != ranks[1]["torch"] and ranks[0]["numpy"] != ranks[1]["numpy"], ranks


def test_only_the_same_rank_is_forked(monkeypatch):
    """Another command, or another value of what Python and torch read as they load: torchrun
    starts a new process (the zygote says None). OMP_NUM_THREADS is applied in the fork."""
    class Zygote(zygote._Zygote):
        def __init__(self):
            self.loaded_with, self.threads = forkserver.read_at_load(os.environ), os.environ.get("OMP_NUM_THREADS")

        def alive(self):
            return True

        def start(self, request):
            return request

    z, env = Zygote(), dict(os.environ)
    rank = [sys.executable, "-u", "-m", "labkit._rank.entry", "train.py"]
    assert z.rank(rank, dict(env, OMP_NUM_THREADS="1"), None, None)["threads"] == 1
    assert z.rank(rank, dict(env, RANK="3", TORCHELASTIC_RUN_ID="x"), None, None)["args"] == ["train.py"]
    assert z.rank(["numactl", "-N", "0", *rank], env, None, None) is None
    assert z.rank(["/other/python", *rank[1:]], env, None, None) is None
    assert z.rank(rank, dict(env, PYTHONPATH="/elsewhere"), None, None) is None
    assert z.rank(rank, dict(env, TORCH_CPP_LOG_LEVEL="INFO"), None, None) is None
    assert z.rank(rank, dict(env, OMP_NUM_THREADS="four"), None, None) is None
    assert z.rank(rank, dict(env, OMP_NUM_THREADS="0"), None, None) is None
    assert z.rank(rank, dict(env, TORCH_DISTRIBUTED_DEBUG="DETAIL"), None, None) is None


@pytest.mark.launch
def test_a_variable_torch_distributed_reads_as_it_loads_gets_new_ranks(workdir, write_script, capsys):
    """The agent server loaded torch without TORCH_DISTRIBUTED_DEBUG; a launch that sets it
    (lesson 10's DETAIL run) is forked warm as far as its agent, whose ranks are then new
    processes that load torch with it."""
    write_script("debug.py", """
        import os
        import torch.distributed as dist
        parent = open(f"/proc/{os.getppid()}/comm").read().strip()
        print("level", dist.get_debug_level(), "parent", parent)
    """)
    labkit.launch("debug.py", nproc=2)
    assert capsys.readouterr().out.count(f"level DebugLevel.OFF parent {zygote.NAME}") == 2
    labkit.launch("debug.py", nproc=2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    out = capsys.readouterr().out
    assert out.count("level DebugLevel.DETAIL parent pt_elastic") == 2, out


@pytest.mark.launch
def test_a_failing_forked_rank_fails_the_launch_as_a_new_one_would(workdir, write_script):
    write_script("fail.py", "import sys\nprint('about to fail', flush=True)\nsys.exit(3)\n")
    with pytest.raises(labkit.LaunchError) as caught:
        labkit.launch("fail.py", nproc=2)
    assert "exit code 3" in str(caught.value) or "exitcode: 3" in str(caught.value), caught.value


@pytest.mark.launch
def test_ranks_end_with_their_agent(workdir, write_script):
    """SIGKILL the agent: its zygote dies with it (the parent-death signal), and each rank's
    watcher ends the rank when its parent is gone. procs.children looks through the zygote."""
    write_script("sleep.py", "import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    from labkit._launch import forked
    from labkit._rank import agent

    argv = agent.command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", "-m", "labkit._rank.entry", "sleep.py"])
    started = forked.start(argv, None, workdir / "agent.log") or subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(procs.children(started.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = [psutil.Process(pid) for pid in procs.children(started.pid)]
    assert len(ranks) == 2 and {r.name() for r in ranks} == {zygote.RANK_NAME}, ranks
    zygotes = [c for c in psutil.Process(started.pid).children() if c.name() == zygote.NAME]
    assert len(zygotes) == 1 and entry_processes(workdir)
    os.kill(started.pid, signal.SIGKILL)
    started.wait(10)
    gone, alive = psutil.wait_procs([*ranks, *zygotes], timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


@pytest.mark.launch
def test_each_launch_gets_its_own_thread_count_from_the_same_servers(workdir, write_script, capsys):
    """labkit sets OMP_NUM_THREADS for every launch; OpenMP read the server's value as torch
    loaded, so the zygote gives each forked rank the launch's count."""
    write_script("threads.py", """
        import os, torch
        parent = open(f"/proc/{os.getppid()}/comm").read().strip()
        print("threads", torch.get_num_threads(), os.environ["OMP_NUM_THREADS"], parent)
    """)
    for count in (2, 1, 2):
        labkit.launch("threads.py", nproc=1, threads_per_rank=count)
        out = capsys.readouterr().out
        assert f"threads {count} {count} {zygote.NAME}" in out, out
