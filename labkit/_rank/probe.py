"""What ``labkit.preflight`` runs on every node before a launch on several nodes: this node's
facts, and what it can reach, printed as one JSON line (lesson 09).

    python -m labkit._rank.probe --node 0 --nnodes 2 --host 127.0.0.1 --port 29500 --token T \\
        [--checkpoint-dir DIR] [--wait-s 10]

Node 0 plays the rendezvous host, as torchrun's c10d store does: it binds HOST:PORT (is the
port free, is HOST one of its addresses?) and answers every other node with the token; the
others resolve HOST and connect to it. Node 0 also writes the token into the checkpoint folder
and every node reads it back: the folder is one filesystem only if each node finds it. The
folder's name is expanded with the node's own environment ($SCRATCH, $SLURMD_NODENAME, ...),
as a batch script's shell would. Without ``--node`` the node is Slurm's ``SLURM_NODEID``.

Standard library only (with ``labkit._hardware``): it must run where torch is broken too.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import os
import re
import socket
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

#: Each probe's report is the one stdout line that starts with this.
MARK = "labkit-preflight:"
TOKEN_FILE = ".labkit-preflight-{token}"
_GREETING = "labkit-preflight"


def torch_version() -> str | None:
    """torch's version with its build suffix ("2.14.1+cu130"), read from torch/version.py so
    that nobody pays for importing torch (None: no torch here)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, "__version__", None), str):
        return str(torch.__version__)
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        if found:
            return found.group(1)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def nccl_version() -> str | None:
    """The NCCL that torch's CUDA wheels bring (the nvidia-nccl-cu* package); None without."""
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("nvidia-nccl"):
            return dist.version
    return None


def versions() -> dict:
    import labkit
    return {"python": sys.version.split()[0], "torch": torch_version(), "nccl": nccl_version(),
            "labkit": labkit.__version__}


def resolve(host: str, port: int) -> dict:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        return {"ok": False, "error": str(err)}
    return {"ok": True, "addresses": sorted({info[4][0] for info in found})}


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n") and len(data) < 256:
        chunk = conn.recv(256)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


class Host:
    """Node 0: holds HOST:PORT, greets every node that connects, counts those done."""

    def __init__(self, host: str, port: int, token: str, peers: int):
        self.token, self.peers, self.done = token, peers, set()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.server = socket.create_server((host, port), family=family, backlog=64)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._greet, args=(conn,), daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(60)
            try:
                hello = _line(conn).split()
                conn.sendall(f"{_GREETING} {self.token}\n".encode())
                if _line(conn) == "done" and hello[:2] == [_GREETING, self.token]:
                    self.done.add(hello[2])
            except (OSError, IndexError):
                pass

    def wait(self, deadline: float) -> None:
        while len(self.done) < self.peers and time.monotonic() < deadline:
            time.sleep(0.02)
        self.server.close()


def hold_port(host: str, port: int, token: str, peers: int) -> tuple[dict, Host | None]:
    try:
        return {"role": "host", "ok": True}, Host(host, port, token, peers)
    except OSError as err:
        return {"role": "host", "ok": False, "errno": errno.errorcode.get(err.errno, ""),
                "error": err.strerror or str(err)}, None


def reach_port(host: str, port: int, token: str, node: int, deadline: float):
    """Connect to node 0 (again and again until ``deadline``); (what happened, the socket)."""
    start, error = time.monotonic(), "no attempt"
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
        except OSError as err:
            error = f"{errno.errorcode.get(err.errno, type(err).__name__)}: {err.strerror or err}"
            time.sleep(0.02)
            continue
        try:
            conn.settimeout(max(0.5, min(5.0, deadline - time.monotonic())))
            conn.sendall(f"{_GREETING} {token} {node}\n".encode())
            said = _line(conn)
        except OSError as err:
            said = f"({err})"
        ms = round((time.monotonic() - start) * 1e3)
        if said == f"{_GREETING} {token}":
            return {"role": "peer", "ok": True, "ms": ms}, conn
        conn.close()
        return {"role": "peer", "ok": False, "error": "another program answers there",
                "said": said[:80]}, None
    return {"role": "peer", "ok": False, "error": error}, None


def write_token(folder: str, token: str) -> dict:
    path = Path(folder, TOKEN_FILE.format(token=token))
    try:
        path.with_suffix(".tmp").write_text(token)
        os.replace(path.with_suffix(".tmp"), path)
    except OSError as err:
        return {"dir": folder, "ok": False, "error": f"cannot write there: {err.strerror or err}"}
    return {"dir": folder, "ok": True}


def read_token(folder: str, token: str, deadline: float, wait_s: float) -> dict:
    path = Path(folder, TOKEN_FILE.format(token=token))
    if not Path(folder).is_dir():
        return {"dir": folder, "ok": False, "error": "no such folder on this node"}
    while True:  # at least once, however late
        try:
            if path.read_text() == token:
                return {"dir": folder, "ok": True}
        except OSError:
            pass
        if time.monotonic() > deadline:
            return {"dir": folder, "ok": False, "error": f"not there within {wait_s:g} s"}
        time.sleep(0.05)


def probe(node: int, nnodes: int, host: str, port: int, token: str, folder: str | None,
          wait_s: float) -> dict:
    """This node's facts and findings, as one dict (see the module's docstring)."""
    from labkit import _hardware

    deadline = time.monotonic() + wait_s
    facts = {"node": node, "host": host, "hostname": socket.gethostname(), "pid": os.getpid(),
             "versions": versions(), "gpus": _hardware.gpu_count(),
             "interfaces": sorted(name for _, name in socket.if_nameindex()),
             "ifname": {k: os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")},
             "resolve": resolve(host, port)}
    folder = os.path.expandvars(os.path.expanduser(folder)) if folder else None
    if node == 0:
        facts["checkpoint"] = write_token(folder, token) if folder else None
        facts["port"], server = hold_port(host, port, token, nnodes - 1)
        if server:
            server.wait(deadline)
        elif folder and nnodes > 1:
            time.sleep(max(0.0, deadline - time.monotonic()))  # no word from the others: let them read
        if folder:
            Path(folder, TOKEN_FILE.format(token=token)).unlink(missing_ok=True)
        return facts
    conn = None
    facts["port"] = {"role": "peer", "ok": False, "error": "the host does not resolve"}
    if facts["resolve"]["ok"]:
        facts["port"], conn = reach_port(host, port, token, node, deadline)
    facts["checkpoint"] = read_token(folder, token, deadline, wait_s) if folder else None
    if conn:
        with conn:
            conn.sendall(b"done\n")
    return facts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="labkit.preflight's probe of one node")
    parser.add_argument("--node", type=int, default=None)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--wait-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    node = args.node if args.node is not None else int(os.environ.get("SLURM_NODEID", "0"))
    facts = probe(node, args.nnodes, args.host, args.port, args.token, args.checkpoint_dir,
                  args.wait_s)
    print(MARK, json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
