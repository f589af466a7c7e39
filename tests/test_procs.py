"""labkit._launch.procs: the launcher's process work, and a reused pid never taken for a rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from labkit import _rundir
from labkit._launch import procs
from labkit._rank import proc

from conftest import python


def _pid_file(run_dir, rank: int, pid: int, token) -> None:
    path = _rundir.pid_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": pid, "token": token}))


def test_a_live_rank_is_found_and_a_reused_or_dead_pid_is_not(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _pid_file(tmp_path, 0, child.pid, proc.process_token(child.pid))
        _pid_file(tmp_path, 1, child.pid, "another start time")   # the pid, reused by another program
        _pid_file(tmp_path, 2, 2 ** 22 + 7, None)                  # a pid nobody has
        assert procs.live_ranks(tmp_path) == {0: child.pid}
        assert procs.running(child.pid) and child.pid in procs.children(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert procs.live_ranks(tmp_path) == {} and not procs.running(child.pid)


def test_without_an_exact_token_a_process_younger_than_its_pid_file_is_not_the_rank(tmp_path):
    """Off Linux the token only says "alive": psutil's start time tells a reused pid instead."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert procs.is_rank(child.pid, "alive", written=time.time())
        assert not procs.is_rank(child.pid, "alive", written=time.time() - 3600), (
            "a process started an hour after the rank wrote its pid file is another program")
    finally:
        child.kill()
        child.wait()


def test_kill_tree_takes_a_rank_and_its_workers_but_never_the_callers_group():
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                               "time.sleep(30)"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not (workers := procs.children(leader.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs.kill_tree(leader.pid, signal.SIGKILL)
    leader.wait(10)
    deadline = time.monotonic() + 10
    while any(procs.running(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers and not any(procs.running(w) for w in workers), "a worker outlived its rank"
    procs.kill_tree(os.getpid(), 0)  # signal 0 to this process only: it is still here


def test_leave_runs_what_python_runs_at_exit_and_keeps_the_status():
    """A rank or an agent that skips the interpreter's teardown still waits for its threads,
    runs its atexit handlers and flushes, in Python's order, and exits with its status."""
    done = python("""
        import atexit, sys, threading, time
        from labkit._rank import proc
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
        atexit.register(lambda: print("atexit ran"))
        sys.stdout.write("unflushed")
        proc.leave(proc.exit_code(3))
    """, stdout=subprocess.PIPE, text=True)
    stdout, _ = done.communicate(timeout=60)
    assert done.returncode == 3, stdout
    assert stdout == "unflushedthread done\natexit ran\n", stdout


def test_exit_code_is_the_status_python_gives_a_system_exit(capsys):
    assert [proc.exit_code(code) for code in (None, 0, 4)] == [0, 0, 4]
    assert proc.exit_code("no data") == 1
    assert capsys.readouterr().err == "no data\n"


def test_an_agent_runs_torchrun_and_exits_with_its_status():
    """``python -m labkit._rank.agent ARGS`` is ``python -m torch.distributed.run ARGS`` run in
    the same process: a flag torchrun does not know gets the same usage message and status 2."""
    agent, torchrun = (subprocess.run([sys.executable, "-m", module, "--no-such-flag", "x.py"],
                                      capture_output=True, text=True, timeout=120)
                       for module in ("labkit._rank.agent", "torch.distributed.run"))
    assert agent.returncode == torchrun.returncode == 2, (agent, torchrun)
    assert "--no-such-flag" in agent.stderr and agent.stderr == torchrun.stderr, agent.stderr
