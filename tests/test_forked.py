"""labkit._launch.forked and labkit._rank.agent_server: torchrun agents forked warm, with torch
already loaded, that behave as the plain ones did (folder, environment, exit status, signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from labkit._launch import forked
from labkit._rank import agent, proc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the server forks on Linux only")


def _torchrun(script: str) -> list[str]:
    return agent.command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=1", script])


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_NOT_PASSED"}
    return dict(env, **extra)


@pytest.mark.launch
def test_a_warm_agent_runs_in_its_folder_with_exactly_its_environment(workdir, write_script, monkeypatch):
    """The server was started from elsewhere, with other variables: the agent (and so its
    ranks) sees the folder and environment of its own request, and nothing of the server's."""
    write_script("show.py", """
        import os
        print("cwd", os.getcwd())
        print("given", os.environ.get("LABKIT_GIVEN"), "not passed", os.environ.get("LABKIT_NOT_PASSED"))
    """)
    monkeypatch.setenv("LABKIT_NOT_PASSED", "the kernel's")
    started = forked.start(_torchrun("show.py"), _env(LABKIT_GIVEN="yes"), workdir / "agent.log")
    assert isinstance(started, forked.ForkedAgent)
    server = forked._servers[forked._key()]
    assert psutil.Process(started.pid).ppid() == server.proc.pid
    assert started.wait(120) == 0
    log = (workdir / "agent.log").read_text()
    assert f"cwd {workdir}" in log and "given yes not passed None" in log, log


@pytest.mark.launch
def test_a_started_agent_already_leads_its_session(workdir, write_script):
    """As Popen(start_new_session=True) returns only after the child's setsid: a killpg(pid)
    at once (torchrun's way to stop a rank) finds the group."""
    write_script("ok.py", "print('ok')\n")
    started = forked.start(_torchrun("ok.py"), _env(), workdir / "agent.log")
    assert os.getpgid(started.pid) == started.pid and os.getsid(started.pid) == started.pid
    assert started.wait(120) == 0


@pytest.mark.launch
def test_its_exit_status_is_the_plain_agents(workdir, write_script):
    """A failing rank: torchrun's status (1, ChildFailedError's traceback in the log), as the
    agent started cold gives it."""
    write_script("fail.py", "raise SystemExit(3)\n")
    warm = forked.start(_torchrun("fail.py"), _env(), workdir / "warm.log")
    with open(workdir / "cold.log", "ab") as log:
        cold = subprocess.Popen(_torchrun("fail.py"), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    assert warm.wait(120) == cold.wait(120) == 1
    assert "ChildFailedError" in (workdir / "warm.log").read_text()
    assert warm.poll() == 1 and warm.returncode == 1   # asked again: the same answer


@pytest.mark.launch
def test_terminate_stops_the_agent_and_its_rank(workdir, write_script):
    write_script("sleep.py", "import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    started = forked.start(_torchrun("sleep.py"), _env(), workdir / "agent.log")
    deadline = time.monotonic() + 60
    log = workdir / "agent.log"   # the agent creates it once forked
    while not (log.exists() and "up" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = psutil.Process(started.pid).children()
    assert ranks, "the rank did not start"
    with pytest.raises(subprocess.TimeoutExpired):
        started.wait(0.1)
    started.terminate()
    assert started.wait(30) != 0
    psutil.wait_procs(ranks, timeout=10)
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)
    started.terminate()   # ended already: nothing is signalled, nothing raised


@pytest.mark.launch
def test_a_dead_server_is_replaced_and_each_thread_has_its_own(workdir, write_script):
    write_script("ok.py", "print('ok')\n")
    first = forked.start(_torchrun("ok.py"), _env(), workdir / "a.log")
    assert first.wait(120) == 0
    server = forked._servers[forked._key()]
    server.proc.kill()
    server.proc.wait()
    again = forked.start(_torchrun("ok.py"), _env(), workdir / "b.log")
    assert again.wait(120) == 0 and again.server is not server

    other = {}
    thread = threading.Thread(target=lambda: other.update(
        agent=forked.start(_torchrun("ok.py"), _env(), workdir / "c.log")))
    thread.start()
    thread.join()
    assert other["agent"].server is not again.server
    assert other["agent"].wait(60) == -signal.SIGKILL or other["agent"].returncode == 0
    # its thread ended, and Linux killed its server (the parent-death signal follows the
    # thread); the agent went with it, or had finished first
    deadline = time.monotonic() + 10
    while other["agent"].server.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not other["agent"].server.alive()


@pytest.mark.launch
def test_what_torch_reads_as_it_loads_gets_a_server_loaded_with_it(workdir, write_script):
    """torchrun's agent sets its loggers' level from LOGLEVEL as its modules load: a launch
    asking for LOGLEVEL=INFO gets a server of its own, and the agent's INFO lines from a module
    the first server had loaded at WARNING (torchrun's own __main__ reads it afresh anyway)."""
    write_script("ok.py", "print('ok')\n")
    quiet = forked.start(_torchrun("ok.py"), _env(LOGLEVEL="WARNING"), workdir / "quiet.log")
    assert quiet.wait(120) == 0
    loud = forked.start(_torchrun("ok.py"), _env(LOGLEVEL="INFO"), workdir / "loud.log")
    assert loud.wait(120) == 0 and loud.server is not quiet.server
    assert not quiet.server.alive()   # it was idle: replaced, not kept beside the new one
    assert "elastic/agent/server/api.py" not in (workdir / "quiet.log").read_text()
    assert "elastic/agent/server/api.py" in (workdir / "loud.log").read_text()
    again = forked.start(_torchrun("ok.py"), _env(LOGLEVEL="INFO", TORCH_FR_DUMP_TEMP_FILE="x"),
                         workdir / "again.log")
    assert again.wait(120) == 0 and again.server is loud.server   # read later: same server
    threads = forked.start(_torchrun("ok.py"), _env(LOGLEVEL="INFO", OMP_NUM_THREADS="3"),
                           workdir / "threads.log")
    assert threads.wait(120) == 0 and threads.server is loud.server   # each rank gets it


def test_no_server_where_it_cannot_fork_warm(monkeypatch):
    """Elsewhere than Linux, or a command that is not labkit's agent: None, and the caller
    starts a plain process."""
    assert forked.start(["sh", "-c", "true"], {}, os.devnull) is None
    monkeypatch.setattr(sys, "platform", "darwin")
    assert forked.start([sys.executable, "-m", "labkit._rank.agent", "x.py"], {}, os.devnull) is None


def test_an_agent_that_died_with_its_server_reads_as_killed():
    """No exit status can come from a server that is gone: a pid that no longer runs is taken
    as killed by the parent-death signal."""
    class Gone:
        exits: dict = {}
        running: set = set()
        def read(self): pass
        def alive(self): return False
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    started = forked.ForkedAgent(Gone(), child.pid)
    assert started.poll() == -signal.SIGKILL
    assert not proc.is_same_process(child.pid, started.token)


def test_an_interrupt_while_waiting_for_the_server_takes_the_server_down(workdir, monkeypatch):
    """Ctrl-C before the server said which agent it started: the server dies, so that no agent
    it forks later runs unwatched."""
    server = forked._Server(sys.executable, dict(os.environ))

    def interrupted(timeout_s=0.0):
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.start({"argv": ["--standalone", "--nproc-per-node=1", "x.py"], "env": dict(os.environ),
                      "cwd": str(workdir), "stdout": str(workdir / "a.log"), "stderr": str(workdir / "a.log")})
    assert not server.alive()


def test_a_forked_process_does_not_use_its_parents_server(monkeypatch):
    """Its replies would go to the parent's reader: the key holds the pid."""
    key = forked._key()
    monkeypatch.setattr(os, "getpid", lambda: -1)
    assert forked._key() != key and forked._key()[1] == key[1]
