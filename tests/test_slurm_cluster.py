"""The one-host Slurm cluster behind make test-slurm, and what a notebook sees without Slurm."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import psutil

from conftest import ROOT
from labkit._launch import procs
from labkit._launch import sbatch as _slurm

sys.path.insert(0, str(ROOT / "tools"))  # test tooling, beside the tests: tools/slurm_cluster.py
import slurm_cluster as _slurm_cluster  # noqa: E402
from slurm_cluster import OneHostCluster, config_text  # noqa: E402

#: Ports apart from make test-slurm's own cluster (17000-17002), which may be running.
PORTS = dict(ctld_port=17010, node_ports=(17011, 17012))


def test_config_puts_every_node_on_this_machine(tmp_path):
    text = config_text(tmp_path, nodes=("a", "b"), node_ports=(1, 2), ctld_port=3, cpus=2)
    assert "NodeName=a NodeHostname=localhost NodeAddr=127.0.0.1 Port=1 CPUs=2" in text
    assert "NodeName=b NodeHostname=localhost NodeAddr=127.0.0.1 Port=2 CPUs=2" in text
    assert "SlurmctldPort=3" in text and "PartitionName=debug Nodes=a,b Default=YES" in text
    for line in ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SlurmUser=root",
                 f"AuthInfo=socket={tmp_path / 'munge.socket'}", f"StateSaveLocation={tmp_path / 'state'}"):
        assert line in text.splitlines()
    with pytest.raises(ValueError, match="one port per node"):
        config_text(tmp_path, nodes=("a", "b"), node_ports=(1,))


def test_without_slurm_the_notebook_is_told_why(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    status = _slurm.slurm_status()
    assert not status and "Slurm is not installed here (no sbatch on PATH)" in status.reason
    assert "make test-slurm" in status.reason


def test_without_slurm_sbatch_refuses_to_submit(monkeypatch, workdir):
    (workdir / "job.sbatch").write_text("#!/bin/bash\necho hi\n")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="cannot submit job.sbatch: Slurm is not installed here"):
        _slurm.sbatch("job.sbatch")
    assert not (workdir / "runs").exists()


def test_sbatch_refuses_bad_input_before_asking_slurm(workdir):
    with pytest.raises(FileNotFoundError, match="batch script 'nope.sbatch' does not exist"):
        _slurm.sbatch("nope.sbatch")
    (workdir / "job.sbatch").write_text("#!/bin/bash\necho hi\n")
    with pytest.raises(ValueError, match="nodes must be >= 1, got 0"):
        _slurm.sbatch("job.sbatch", nodes=0)
    with pytest.raises(TypeError, match="args must be a list of strings"):
        _slurm.sbatch("job.sbatch", args="--epochs 1")
    assert not (workdir / "runs").exists()


def test_installed_but_no_controller(monkeypatch, tmp_path):
    """sbatch on PATH, nobody answering: the reason says so (sinfo's own words)."""
    for name in ("sbatch", "sinfo"):
        tool = tmp_path / name
        tool.write_text("#!/bin/sh\necho 'slurm_load_partitions: Unable to contact slurm controller' >&2\nexit 1\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    status = _slurm.slurm_status()
    assert not status and "no Slurm controller answers (slurm_load_partitions: Unable" in status.reason


def test_make_test_slurm_skips_with_its_reason_where_it_cannot_install(monkeypatch, capsys):
    monkeypatch.setattr(_slurm_cluster, "missing", lambda: ["slurmctld", "munged"])
    monkeypatch.setattr(_slurm_cluster, "cannot_install", lambda: "installing needs root")
    assert _slurm_cluster.main(["run", "--install", "--", "false"]) == 0
    assert capsys.readouterr().out.startswith(
        "skipped: the Slurm tests need slurmctld, munged, which are not installed, and installing needs root")
    assert _slurm_cluster.main(["run"]) == 2


def test_make_test_slurm_skips_with_apts_words_when_the_install_fails(monkeypatch, capsys):
    monkeypatch.setattr(_slurm_cluster, "missing", lambda: ["slurmd"])
    monkeypatch.setattr(_slurm_cluster, "cannot_install", lambda: None)

    def offline(**kwargs):
        raise RuntimeError("apt-get update -qq failed with code 100:\nTemporary failure resolving")
    monkeypatch.setattr(_slurm_cluster, "install", offline)
    assert _slurm_cluster.main(["run", "--install", "--", "false"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("skipped: the Slurm tests need slurmd, and apt-get update -qq failed with code 100")


def test_installing_needs_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in _slurm_cluster.cannot_install()
    with pytest.raises(RuntimeError, match="cannot install slurmctld, slurmd, slurm-client, munge: "):
        _slurm_cluster.install()


@pytest.mark.skipif(bool(_slurm_cluster.missing()) or os.geteuid() != 0,
                    reason="needs Slurm and munge installed and root (make test-slurm installs them)")
def test_the_cluster_starts_runs_a_two_node_step_and_leaves_nothing():
    cluster = OneHostCluster(**PORTS)
    try:
        started = time.monotonic()
        cluster.start()
        up_s = time.monotonic() - started
        assert cluster.node_states() == {"n1": "idle", "n2": "idle"}
        out = subprocess.run(["srun", "-N2", "bash", "-c", "echo $SLURM_PROCID $SLURMD_NODENAME"],
                             env=cluster.env, capture_output=True, text=True, timeout=120)
        assert sorted(out.stdout.split("\n")[:2]) == ["0 n1", "1 n2"], out
        # A job still running when the cluster stops is cancelled, and its processes go too.
        sleeper = subprocess.Popen(["srun", "-N2", "sleep", "300"], env=cluster.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _step(cluster.job_processes()) != (2, 2):
            time.sleep(0.2)
        below = cluster.job_processes()  # srun, two slurmstepd, two sleep
        assert _step(below) == (2, 2), "the job step never started on both nodes"
        daemons = list(cluster.pids.values())
    finally:
        cluster.stop()
    sleeper.wait(30)
    assert not [pid for pid in daemons + below if _alive(pid)], "a daemon or a job outlived stop()"
    assert not cluster.folder.exists()
    print(f"one-host cluster up in {up_s:.1f} s")


def test_the_manager_killed_outright_takes_its_daemons_along(tmp_path):
    """The daemons get SIGKILL when the process that started them dies (parent-death signal)."""
    if _slurm_cluster.missing() or os.geteuid() != 0:
        pytest.skip("needs Slurm and munge installed and root (make test-slurm installs them)")
    manager = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; sys.path.insert(0, {str(ROOT / 'tools')!r}); "
         "from slurm_cluster import OneHostCluster; "
         f"c = OneHostCluster(ctld_port=17020, node_ports=(17021, 17022), folder={str(tmp_path)!r}); "
         "c.start(); print(*c.pids.values(), flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in manager.stdout.readline().split()]
        assert len(pids) == 4 and all(_alive(p) for p in pids)
    finally:
        manager.kill()
        manager.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]


def _step(pids) -> tuple[int, int]:
    """(slurmstepd processes, sleep tasks) among ``pids``."""
    commands = [_cmdline(pid).split()[:1] for pid in pids]
    return (sum(c[:1] and c[0].startswith("slurmstepd") for c in commands),
            sum(c in (["sleep"], ["/usr/bin/sleep"]) for c in commands))


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


_alive = procs.running


def test_a_jobs_processes_are_found_by_the_variable_they_carry(monkeypatch):
    """slurmstepd leaves slurmd's process tree: the cluster finds its processes by SLURM_CONF."""
    from labkit._launch.procs import processes_with_env

    conf = f"/tmp/labkit-test-{os.getpid()}/slurm.conf"
    monkeypatch.setenv("SLURM_CONF", conf)  # this process carries it too
    child = subprocess.Popen(["sleep", "30"], env={"SLURM_CONF": conf})
    try:
        found = processes_with_env("SLURM_CONF", conf)
        assert child.pid in found and os.getpid() not in found  # never the caller, nor its parents
        assert os.getppid() not in found
    finally:
        child.kill()
        child.wait()
    assert child.pid not in processes_with_env("SLURM_CONF", conf)


def _fake_slurm(folder, *, scontrol: str) -> None:
    """sinfo, sbatch and scontrol stand-ins: one idle node; sbatch writes the job's output file
    and says job 42; scontrol prints ``scontrol``."""
    tools = {
        "sinfo": 'echo "n1 idle"',
        "sbatch": 'for a in "$@"; do case $a in --output=*) out=${a#--output=};; esac; done\n'
                  'printf "hello from the job\\n%s\\n" "$LABKIT_RUN_DIR" > "$out"\necho 42',
        "scontrol": scontrol,
        "scancel": "exit 0",
    }
    for name, body in tools.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)


def test_sbatch_streams_the_jobs_output_and_reads_its_end(monkeypatch, workdir, tmp_path, capsys):
    _fake_slurm(tmp_path, scontrol='echo "JobId=42 JobState=COMPLETED Reason=None ExitCode=0:0"')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    (workdir / "job.sbatch").write_text("#!/bin/bash\necho hi\n")
    run = _slurm.sbatch("job.sbatch", nodes=2, timeout_s=30)
    out = capsys.readouterr().out
    assert "$ sbatch --parsable --nodes=2 --job-name=job --output=" in out
    assert "[job 42] hello from the job" in out and "✓ job 42: COMPLETED on 2 node(s)" in out
    assert run.status == "ok" and run.returncode == 0 and run.info["slurm"]["job_id"] == "42"
    assert run.output().splitlines() == ["hello from the job", str(run.run_dir.resolve())]


def test_a_job_slurm_no_longer_knows_is_reported_not_waited_for(monkeypatch, workdir, tmp_path):
    """scontrol forgets a job some minutes after its end (MinJobAge): the wait must end."""
    _fake_slurm(tmp_path, scontrol="exit 1")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(_slurm, "_FORGOTTEN_S", 0.5)
    (workdir / "job.sbatch").write_text("#!/bin/bash\necho hi\n")
    from labkit import LaunchError

    with pytest.raises(LaunchError, match=r"Slurm job 42 ended UNKNOWN"):
        _slurm.sbatch("job.sbatch", nodes=1, timeout_s=30, quiet=True)
