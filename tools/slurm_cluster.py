"""A real Slurm cluster on one machine: munged, slurmctld and two slurmd pretending to be two nodes.

``make test-slurm`` runs the Slurm tests and lesson 09 against it; anyone can do the same::

    python tools/slurm_cluster.py run -- python -m pytest tests/test_slurm.py

starts the cluster, runs the command with ``SLURM_CONF`` pointing at it, and stops every
daemon it started, by pid, whatever happens (a failure, Ctrl-C, SIGTERM). In Python::

    with OneHostCluster() as cluster:          # nodes n1 and n2, both at 127.0.0.1
        subprocess.run(["sbatch", "--wait", "job.sbatch"], env=cluster.env)

Everything lives in a temporary folder (configuration, munge key and socket, state, logs);
nothing under /etc is read or changed. The daemons run in the foreground as this process's
children and are told to die with it (Linux's parent-death signal), so even a manager killed
with SIGKILL leaves none behind. Job steps leave slurmd's process tree (slurmstepd is
re-parented to init): ``stop()`` cancels every job, then ends whatever still carries the
cluster's ``SLURM_CONF``. Slurm's daemons need root here (``SlurmUser=root``);
``missing()`` and ``install()`` say what is absent and add it with apt (Debian, Ubuntu).

Test tooling, not part of labkit: it lives beside the tests (it installs packages as root and
runs daemons, nothing a learner's package should hold). It uses labkit's process helpers
(``labkit._launch.procs``), so run it with the course's Python.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from labkit._launch import procs

#: Debian's packages: the daemons, the client commands and the authentication they share.
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
#: What a one-host cluster runs, with the package each comes from.
PROGRAMS = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
            "sbatch": "slurm-client", "srun": "slurm-client", "scontrol": "slurm-client",
            "sinfo": "slurm-client", "squeue": "slurm-client", "scancel": "slurm-client"}
NODES = ("n1", "n2")
CTLD_PORT = 17000
NODE_PORTS = (17001, 17002)
_PR_SET_PDEATHSIG = 1


def missing() -> list[str]:
    """The programs a one-host cluster needs that are not on PATH (sbin folders included)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in PROGRAMS if shutil.which(name, path=path) is None]


def cannot_install() -> str | None:
    """Why ``install()`` cannot add the packages here (None: it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "installing Slurm and munge needs root (apt-get), and this is not root"
    if shutil.which("apt-get") is None:
        return "no apt-get here (Slurm's packages are installed with apt on Debian and Ubuntu)"
    return None


def install(*, quiet: bool = False) -> None:
    """``apt-get install`` Slurm and munge, without starting any service.

    Raises:
        RuntimeError: not root, no apt-get, or apt failed (with its last lines).
    """
    reason = cannot_install()
    if reason:
        raise RuntimeError(f"cannot install {', '.join(PACKAGES)}: {reason}.")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-qq"],
                 ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        if not quiet:
            print("$", " ".join(argv), flush=True)
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:])
            raise RuntimeError(f"{' '.join(argv)} failed with code {done.returncode}:\n{tail}")


def config_text(folder: Path, *, nodes=NODES, node_ports=NODE_PORTS, ctld_port=CTLD_PORT,
                cpus: int | None = None) -> str:
    """slurm.conf of a cluster whose nodes all live on this machine at 127.0.0.1."""
    if len(nodes) != len(node_ports):
        raise ValueError(f"one port per node: nodes {list(nodes)}, ports {list(node_ports)}")
    cpus = cpus or max(1, os.cpu_count() or 1)
    lines = [
        "ClusterName=labkit",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={folder / 'munge.socket'}",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}/%n",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd'}-%n.pid",
        f"SlurmctldLogFile={folder / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'log'}/slurmd-%n.log",
        # One machine: track a job's processes by parent pid; no cgroups, no CPU binding.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        # Both slurmd see the same cores: trust the node lines below, not the hardware.
        "SlurmdParameters=config_overrides",
        "KillWait=5",
        "MinJobAge=600",
    ]
    for name, port in zip(nodes, node_ports):
        lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                     f"CPUs={cpus} State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the manager dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


class ClusterError(RuntimeError):
    """The one-host cluster could not start (its daemons' last log lines say why)."""


class OneHostCluster:
    """munged, slurmctld and one slurmd per node, all on this machine, in a temporary folder.

    Attributes:
        folder: the cluster's folder (slurm.conf, munge key and socket, state, spool, log/).
        conf: path of slurm.conf.
        env: this process's environment with ``SLURM_CONF`` set: pass it to sbatch and friends.
        pids: {daemon name: pid} of every daemon started (the manager stops exactly these).
    """

    def __init__(self, *, nodes=NODES, node_ports=NODE_PORTS, ctld_port=CTLD_PORT,
                 folder: str | os.PathLike | None = None):
        self.nodes, self.node_ports, self.ctld_port = tuple(nodes), tuple(node_ports), ctld_port
        self._own_folder = folder is None
        self.folder = Path(folder or tempfile.mkdtemp(prefix="labkit-slurm-")).resolve()
        self.conf = self.folder / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._procs: dict[str, subprocess.Popen] = {}

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    def __enter__(self) -> "OneHostCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- start ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> "OneHostCluster":
        """Write the configuration, start the daemons, wait until every node is idle.

        Raises:
            ClusterError: a program is missing, a daemon exited, or the nodes were not idle
                within ``timeout_s`` seconds (every daemon started is stopped first).
        """
        absent = missing()
        if absent:
            raise ClusterError(f"not installed: {', '.join(absent)}. HINT: make test-slurm installs "
                               f"them (as root, with apt): {' '.join(PACKAGES)}.")
        os.chmod(self.folder, 0o700)  # munged refuses a key that others could read
        for sub in ("state", "spool", "log"):
            (self.folder / sub).mkdir(exist_ok=True)
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf.write_text(config_text(self.folder, nodes=self.nodes,
                                         node_ports=self.node_ports, ctld_port=self.ctld_port))
        try:
            socket_path = self.folder / "munge.socket"
            self._spawn("munged", ["munged", "-F", "--force", f"--socket={socket_path}",
                                   f"--key-file={key}", f"--pid-file={self.folder / 'munged.pid'}",
                                   f"--log-file={self.folder / 'log' / 'munged.log'}",
                                   f"--seed-file={self.folder / 'munged.seed'}"])
            self._wait(lambda: socket_path.exists(), 10, "munged did not open its socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            self._wait(self._all_idle, timeout_s, f"the nodes were not idle within {timeout_s:g} s")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        exe = shutil.which(argv[0], path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"]))
        log = open(self.folder / "log" / f"{name}.out", "wb")
        try:
            self._procs[name] = subprocess.Popen(
                [exe or argv[0], *argv[1:]], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        finally:
            log.close()

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = {name: p.returncode for name, p in self._procs.items() if p.poll() is not None}
            if dead:
                raise ClusterError(f"{', '.join(dead)} exited (code {list(dead.values())}) while "
                                   f"the cluster started.\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{what}.\n{self.log_tail()}")
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        """{node: state} as ``sinfo`` reports it ({} when slurmctld does not answer)."""
        try:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env,
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        pairs = (line.split() for line in out.stdout.splitlines() if line.strip())
        return {p[0]: p[1] for p in pairs if len(p) == 2} if out.returncode == 0 else {}

    def _all_idle(self) -> bool:
        states = self.node_states()
        return sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values())

    def log_tail(self, lines: int = 6) -> str:
        """The last lines of every daemon's log, to say why something failed."""
        parts = []
        for path in sorted((self.folder / "log").glob("*")):
            try:
                text = path.read_text(errors="replace").strip().splitlines()[-lines:]
            except OSError:
                continue
            if text:
                parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # -- stop ----------------------------------------------------------------------------
    def stop(self, grace_s: float = 5.0) -> None:
        """Cancel every job, then stop each daemon by its pid (SIGTERM, then SIGKILL), and
        every process still running below them (job steps, tasks). Safe to call twice."""
        if not self._procs:
            return
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            self._cancel_jobs(grace_s)
        for name in reversed(list(self._procs)):  # slurmd first, munged last
            proc = self._procs[name]
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self._procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        deadline = time.monotonic() + grace_s
        while (left := self.job_processes()) and time.monotonic() < deadline:
            for pid in left:  # job steps and their tasks, should scancel have missed any
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self._procs.clear()
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def job_processes(self) -> list[int]:
        """Pids of every process of this cluster other than its daemons: job steps (slurmstepd),
        their tasks, and clients such as srun, all found by the ``SLURM_CONF`` they carry."""
        daemons = set(self.pids.values())
        return [pid for pid in procs.processes_with_env("SLURM_CONF", str(self.conf))
                if pid not in daemons and procs.running(pid)]

    def _cancel_jobs(self, grace_s: float) -> None:
        run = lambda argv: subprocess.run(argv, env=self.env, capture_output=True, text=True,  # noqa: E731
                                          timeout=10)
        try:
            run(["scancel", "--partition=debug"])
            deadline = time.monotonic() + grace_s + 5
            while time.monotonic() < deadline:
                out = run(["squeue", "-h", "-o", "%i"])
                if out.returncode != 0 or not out.stdout.strip():
                    return
                time.sleep(0.2)
        except (OSError, subprocess.TimeoutExpired):
            pass


# -- make test-slurm -------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """``python tools/slurm_cluster.py run [--install] -- COMMAND...``: the command's exit code;
    0 with a ``skipped:`` line when Slurm is absent and cannot be installed here."""
    if len(argv) < 3 or argv[0] != "run" or "--" not in argv:
        print("usage: python tools/slurm_cluster.py run [--install] -- COMMAND [ARGS...]",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[1:split], argv[split + 1:]
    if missing():
        reason = cannot_install()
        if "--install" not in options or reason:
            why = reason or "pass --install to add them"
            print(f"skipped: the Slurm tests need {', '.join(missing())}, which are not installed, "
                  f"and {why}.", flush=True)
            return 0
        try:
            install()
        except RuntimeError as err:  # apt could not fetch them (offline, a mirror down, a lock)
            print(f"skipped: the Slurm tests need {', '.join(missing())}, and {err}", flush=True)
            return 0
    # SIGTERM (CI, a closed terminal) ends the command and the cluster as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    child = None
    cluster = OneHostCluster()
    started_pids: list[int] = []
    try:
        started = time.monotonic()
        cluster.start()
        print(f"one-host Slurm cluster up in {time.monotonic() - started:.1f} s: nodes "
              f"{', '.join(cluster.nodes)}; SLURM_CONF={cluster.conf}; daemons {cluster.pids}",
              flush=True)
        started_pids = list(cluster.pids.values())
        child = subprocess.Popen(command, env=cluster.env)
        return child.wait()
    except KeyboardInterrupt:
        print("interrupted: stopping the command and the cluster", file=sys.stderr, flush=True)
        return 130
    finally:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        cluster.stop()
        left = [pid for pid in started_pids if procs.running(pid)]
        print(f"one-host Slurm cluster stopped{'' if not left else f'; still running: {left}'}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
