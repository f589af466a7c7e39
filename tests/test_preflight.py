"""labkit.preflight: before a launch on several nodes, what will break, each with its fix
(lesson 09). Every fault is injected for real on this machine's loopback "nodes" (one probe
process each, with its node's environment), and on the one-host Slurm cluster where one answers
(``make test-slurm``; skipped with the reason elsewhere)."""

from __future__ import annotations

import socket

import psutil
import pytest

import labkit
from labkit._diagnose import findings
from labkit._rank import probe


def _probes_left() -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True)
            if "labkit._rank.probe" in " ".join(p.cmdline())]


@pytest.fixture
def check(workdir):
    """preflight on 2 loopback nodes, with a short wait; asserts no probe outlives it."""
    def run(**kwargs):
        report = labkit.preflight(**{"nnodes": 2, "wait_s": 3, **kwargs})
        assert not _probes_left()
        print(report)
        return report
    return run


def _warned(report) -> dict[str, str]:
    return {c.what: f"{c.value} -> {c.advice}" for c in report.checks if c.status == "warn"}


@pytest.fixture
def taken_port():
    server = socket.create_server(("127.0.0.1", 0))  # another program's listener
    yield server.getsockname()[1]
    server.close()


# -- at the door -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    ({"nnodes": 0}, ValueError, r"nnodes must be an int >= 1, got 0. HINT"),
    ({"nproc": "2"}, ValueError, r"nproc must be an int >= 1, got '2'. HINT"),
    ({"port": 0}, ValueError, r"port must be an int >= 1, got 0. HINT"),
    ({"port": 70000}, ValueError, r"port must be at most 65535, got 70000. HINT"),
    ({"host": ""}, ValueError, r"host must be a host name or address, got ''. HINT"),
    ({"checkpoint_dir": 3}, TypeError, r"checkpoint_dir must be a folder's path, got 3. HINT"),
    ({"wait_s": 0}, ValueError, r"wait_s must be a positive number of seconds, got 0. HINT"),
    ({"node_env": {2: {}}}, ValueError, r"node_env must map nodes 0..1 to their environment.*HINT"),
    ({"node_env": {1: {}}, "slurm": True}, ValueError, r"under Slurm every node has its own.*HINT"),
    ({"env": {"X": None}}, TypeError, r"env\['X'\] must be a string, got None. HINT"),
])
def test_bad_input_is_refused_before_any_probe_starts(workdir, kwargs, error, match):
    with pytest.raises(error, match=match):
        labkit.preflight(**kwargs)
    assert not _probes_left()


# -- what the facts mean -----------------------------------------------------------------------
@pytest.mark.parametrize("value, nccl, expected", [
    ("eth", True, ["eth0", "eth1"]),            # NCCL: a prefix
    ("=eth", True, []),                         # '=': exact names only
    ("^eth,lo", True, ["ib0"]),                 # '^': every interface but these
    ("^eth,lo,ib", True, []),
    ("eth0,ib0", False, ["eth0", "ib0"]),       # gloo: exact names, each must exist
    ("eth0,eth42", False, []),
    ("eth", False, []),
])
def test_interface_names_are_read_as_nccl_and_gloo_read_them(value, nccl, expected):
    assert findings._matches(value, ["eth0", "eth1", "ib0", "lo"], nccl=nccl) == expected


def _facts(node, **changes):
    facts = {"node": node, "host": "127.0.0.1", "hostname": "n1", "pid": 10 + node, "gpus": 0,
             "versions": {"python": "3.11.7", "torch": "2.14.1", "nccl": None, "labkit": "0.1.0"},
             "interfaces": ["eth0", "lo"], "ifname": {"NCCL_SOCKET_IFNAME": None, "GLOO_SOCKET_IFNAME": None},
             "resolve": {"ok": True, "addresses": ["127.0.0.1"]},
             "port": {"role": "host", "ok": True} if node == 0 else {"role": "peer", "ok": True, "ms": 3},
             "checkpoint": None}
    facts.update(changes)
    return facts


def test_gpus_fewer_than_nproc_on_one_node_is_named():
    rows = findings.gpus([_facts(0, gpus=4), _facts(1, gpus=2)], nproc=4)
    assert [(r.what, r.status) for r in rows] == [("GPUs (node 1)", "warn")]
    assert "node 1 has 2 GPU(s) for nproc=4 ranks" in rows[0].value and "nproc=2" in rows[0].advice
    assert findings.gpus([_facts(0), _facts(1)], nproc=2)[0].status == "info"


def test_a_report_renders_as_text_html_and_a_table():
    report = labkit.Preflight(nodes=[], host="h", port=1)
    report.checks += [findings.Check("PyTorch", "differs: node 0 2.14.1, node 1 2.9.0", "warn", "same <everywhere>")]
    assert not report.ok and "! PyTorch" in str(report) and "→ same <everywhere>" in str(report)
    assert "&lt;everywhere&gt;" in report._repr_html_()
    assert report.table().to_dict("records") == [{"status": "warn", "check": "PyTorch", "found":
                                                  "differs: node 0 2.14.1, node 1 2.9.0", "fix": "same <everywhere>"}]


# -- on the loopback nodes, each fault injected ------------------------------------------------
@pytest.mark.launch
def test_healthy_nodes_pass_every_check(check, workdir):
    (workdir / "ckpt").mkdir()
    report = check(checkpoint_dir="ckpt", port=_free_port())
    assert report.ok, report
    found = {c.what: c.value for c in report.checks}
    assert "resolves on every node" in found["host"] and "every node reached node 0" in found["reach node 0"]
    assert "one filesystem" in found["checkpoint folder"] and "on every node" in found["PyTorch"]
    assert [n["node"] for n in report.nodes] == [0, 1] and not list((workdir / "ckpt").iterdir())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.launch
def test_a_taken_port(check, taken_port):
    warned = _warned(check(port=taken_port))
    assert f"127.0.0.1:{taken_port} is already taken on node 0" in warned["rendezvous port (node 0)"]
    assert "pick a free port" in warned["rendezvous port (node 0)"]
    assert "another program answers there" in warned["reach node 0 (node 1)"]


@pytest.mark.launch
def test_an_interface_that_does_not_exist(check):
    warned = _warned(check(node_env={1: {"GLOO_SOCKET_IFNAME": "eth42", "NCCL_SOCKET_IFNAME": "=ib9"}}))
    assert set(warned) == {"GLOO_SOCKET_IFNAME (node 1)", "NCCL_SOCKET_IFNAME (node 1)"}
    assert "GLOO_SOCKET_IFNAME='eth42' names no interface of node 1 (it has " in warned["GLOO_SOCKET_IFNAME (node 1)"]
    assert "ip -br addr" in warned["GLOO_SOCKET_IFNAME (node 1)"]


@pytest.mark.launch
def test_a_host_that_does_not_resolve(check):
    warned = _warned(check(host="no-such-host.invalid"))
    assert "node 1 cannot resolve 'no-such-host.invalid'" in warned["host (node 1)"]
    assert "node 0's IP address" in warned["host (node 0)"]
    assert warned["reach node 0 (node 1)"].startswith("not tried: node 1 cannot resolve the host")


@pytest.mark.launch
def test_a_host_that_is_not_node_0(check):
    warned = _warned(check(host="192.0.2.1", wait_s=1))  # TEST-NET-1: nobody's address
    assert "192.0.2.1 is not an address of node 0" in warned["rendezvous port (node 0)"]
    assert "node 1 cannot reach 192.0.2.1:29500" in warned["reach node 0 (node 1)"]


@pytest.mark.launch
def test_a_node_with_another_torch(check, workdir):
    fake = workdir / "other-env" / "torch"  # a node whose environment finds another torch first
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "version.py").write_text("__version__ = '2.9.0+cpu'\n")
    warned = _warned(check(node_env={1: {"PYTHONPATH": str(fake.parent)}}))
    assert list(warned) == ["PyTorch"]
    assert warned["PyTorch"].startswith(f"differs: node 0 {probe.torch_version()}, node 1 2.9.0+cpu")
    assert "install the course the same way on each" in warned["PyTorch"]


@pytest.mark.launch
def test_a_checkpoint_folder_that_is_each_nodes_own(check, workdir):
    for node in (0, 1):
        (workdir / f"local{node}" / "ckpt").mkdir(parents=True)
    warned = _warned(check(checkpoint_dir="$NODE_LOCAL/ckpt",
                           node_env={n: {"NODE_LOCAL": str(workdir / f"local{n}")} for n in (0, 1)}))
    said = warned["checkpoint folder (node 1)"]
    assert f"node 1 does not find the token node 0 wrote in {workdir}/local0/ckpt" in said
    assert f"looked in its {workdir}/local1/ckpt" in said and "$SCRATCH" in said
    assert not list((workdir / "local0" / "ckpt").iterdir())  # the token is cleaned up


@pytest.mark.launch
def test_probes_that_outlast_the_timeout_are_stopped_and_named(check, taken_port):
    """Node 1 waits 30 s for a node 0 that never answers; the check stops it after 5 s. (Node 0
    must report its part before then: with 1 s, a probe that started slowly on a loaded machine
    was stopped too, and CI saw it.)"""
    report = check(port=taken_port, wait_s=30, timeout_s=5)
    warned = _warned(report)
    assert warned["probe (node 1)"] == ("reported nothing: no report within 5 s -> run python -m "
                                        "labkit._rank.probe --help on node 1 to see why")
    assert "already taken" in warned["rendezvous port (node 0)"]  # node 0 had said its part
    assert report["PyTorch"].value.endswith("on every node (node 1 did not report)")


# -- on the one-host Slurm cluster (make test-slurm) -------------------------------------------
@pytest.mark.slurm
def test_under_slurm_every_node_of_the_job_is_probed(slurm_cluster, workdir):
    report = labkit.preflight(nnodes=2, slurm=True, port=_free_port(), checkpoint_dir=str(workdir),
                              wait_s=10, timeout_s=120)
    print(report)
    assert report.ok, report
    assert [n["node"] for n in report.nodes] == [0, 1]
    assert report.host == "127.0.0.1"  # the first node's NodeAddr, found by the batch script


@pytest.mark.slurm
def test_under_slurm_a_node_local_folder_and_a_taken_port(slurm_cluster, workdir, taken_port):
    for node in ("n1", "n2"):  # the one-host cluster's nodes: each "node" gets its own folder
        (workdir / node).mkdir()
    report = labkit.preflight(nnodes=2, slurm=True, port=taken_port, wait_s=5, timeout_s=120,
                              checkpoint_dir=str(workdir / "$SLURMD_NODENAME"))
    print(report)
    warned = _warned(report)
    assert "is already taken on node 0" in warned["rendezvous port (node 0)"]
    assert "node 1 does not find the token node 0 wrote" in warned.get("checkpoint folder (node 1)", "")


# -- make doctor NODES=2 -----------------------------------------------------------------------
@pytest.mark.launch
def test_make_doctor_nodes_runs_the_preflight_and_fails_on_a_warning(workdir, taken_port):
    import shutil
    import subprocess
    import sys

    from conftest import ROOT
    if shutil.which("make"):
        said = subprocess.run(["make", "-n", "-C", str(ROOT), "doctor", "NODES=2", "PORT=29600"],
                              capture_output=True, text=True).stdout
        assert "-m labkit._diagnose.preflight --nnodes \"2\"" in said and "--port \"29600\"" in said
    command = [sys.executable, "-m", "labkit._diagnose.preflight", "--nnodes", "2"]
    ok = subprocess.run(command + ["--port", str(_free_port())], capture_output=True, text=True)
    assert ok.returncode == 0 and "✓ reach node 0" in ok.stdout, ok.stdout + ok.stderr
    taken = subprocess.run(command + ["--port", str(taken_port)], capture_output=True, text=True)
    assert taken.returncode == 1 and "! rendezvous port (node 0)" in taken.stdout
    bad = subprocess.run(command[:-1] + ["two"], capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid int value: 'two'" in bad.stderr
