"""What the probes of ``labkit.preflight`` found, said as rows with their fix (lesson 09).

Each function takes every node's facts (``labkit/_rank/probe.py`` says what a probe reports)
and returns ``Check`` rows: one "ok" row when every node is fine, else one "warn" row for each
node that is not, with the fix in its advice. Kernel side, standard library.
"""

from __future__ import annotations

from labkit._diagnose.doctor import Check

_SAME = ("every node must run the same Python, PyTorch, NCCL and labkit: install the course the "
         "same way on each (make lab, which installs through requirements.lock), or share one "
         "environment on a filesystem every node mounts")
_SHARED = ("put checkpoints on a filesystem every node mounts (your home or $SCRATCH on most "
           "clusters; /tmp and $TMPDIR are each node's own), so that what rank 0 saves every rank "
           "can load")
_NAMES = ("use a name every node resolves, or node 0's IP address (hostname -I on node 0); under "
          "Slurm, the first node's NodeAddr (scontrol show node NAME)")


def _each(rows: list[Check], ok: Check) -> list[Check]:
    """The failing rows, or the one ok row when there are none."""
    return rows or [ok]


def resolving(facts: list[dict], host: str) -> list[Check]:
    bad = [Check(f"host (node {f['node']})", f"node {f['node']} cannot resolve {host!r}: "
                                             f"{f['resolve']['error']}", "warn", _NAMES)
           for f in facts if not f["resolve"]["ok"]]
    addresses = sorted({a for f in facts for a in f["resolve"].get("addresses", [])})
    return _each(bad, Check("host", f"{host!r} resolves on every node (to {', '.join(addresses)})"))


def _host_port(f: dict, where: str) -> Check:
    said, code = f["port"], f["port"].get("errno")
    if said["ok"]:
        return Check("rendezvous port", f"{where} is free on node 0, which held it for the others")
    if not f["resolve"]["ok"]:
        return Check("rendezvous port (node 0)", "not tried: node 0 cannot resolve the host", "warn",
                     _NAMES)
    if code == "EADDRINUSE":
        return Check("rendezvous port (node 0)", f"{where} is already taken on node 0: another "
                     f"program listens there", "warn",
                     f"pick a free port (--rdzv-endpoint=HOST:PORT; on one machine labkit.launch "
                     f"picks one itself), or stop the program that holds it (ss -ltnp 'sport = "
                     f":{where.rsplit(':', 1)[1]}' names it)")
    if code == "EADDRNOTAVAIL":
        return Check("rendezvous port (node 0)", f"{where.rsplit(':', 1)[0]} is not an address of "
                     f"node 0 ({f['hostname']}), so node 0 cannot host the rendezvous", "warn",
                     "the rendezvous endpoint must name the first node (under Slurm: "
                     "scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)")
    return Check("rendezvous port (node 0)", f"node 0 cannot listen on {where}: {code} "
                 f"{said.get('error', '')}".rstrip(), "warn",
                 "ports below 1024 need root: use one above it, e.g. 29500" if code == "EACCES"
                 else "pick another port, one nothing else uses")


def port(facts: list[dict], host: str, port_number: int) -> list[Check]:
    """Node 0 holds the port; every other node reaches it there."""
    where = f"{host}:{port_number}"
    rows = [_host_port(f, where) for f in facts if f["node"] == 0]
    held = all(f["port"]["ok"] for f in facts if f["node"] == 0)
    bad = []
    for f in facts:
        said = f["port"]
        if f["node"] == 0 or said["ok"]:
            continue
        if not f["resolve"]["ok"]:
            bad.append(Check(f"reach node 0 (node {f['node']})", f"not tried: node {f['node']} "
                             f"cannot resolve the host", "warn", _NAMES))
            continue
        why = "" if held else " (node 0 could not hold the port: see above)"
        fix = ("the port is another program's on node 0: pick a free one" if "another program" in
               said.get("error", "") else
               f"is {host} node 0's address as node {f['node']} sees it, and is TCP port "
               f"{port_number} open between the nodes (a firewall)?")
        bad.append(Check(f"reach node 0 (node {f['node']})", f"node {f['node']} cannot reach "
                         f"{where}: {said.get('error', '')}{why}", "warn", fix))
    peers = [f["port"].get("ms", 0) for f in facts if f["node"] != 0]
    if peers and not bad:
        bad = [Check("reach node 0", f"every node reached node 0 at {where} (slowest: "
                                     f"{max(peers)} ms)")]
    return rows + bad


def _matches(value: str, interfaces: list[str], *, nccl: bool) -> list[str]:
    """The interfaces NCCL (prefixes; '^' excludes, '=' exact) or gloo (exact names) would take."""
    exclude = nccl and value.startswith("^")
    value = value.lstrip("^")
    exact = not nccl or value.startswith("=")
    names = [n.strip() for n in value.lstrip("=").split(",") if n.strip()]
    hit = [i for i in interfaces if any(i == n if exact else i.startswith(n) for n in names)]
    if not nccl:  # gloo uses every name it is given: each must exist
        return hit if len(hit) == len(names) else []
    return [i for i in interfaces if i not in hit] if exclude else hit


def interfaces(facts: list[dict]) -> list[Check]:
    rows = []
    for f in facts:
        for var, value in f["ifname"].items():
            if value is None:
                continue
            if not _matches(value, f["interfaces"], nccl=var.startswith("NCCL")):
                rows.append(Check(f"{var} (node {f['node']})", f"{var}={value!r} names no interface "
                                  f"of node {f['node']} (it has {', '.join(f['interfaces'])})", "warn",
                                  f"set it to the interface of the network the nodes share "
                                  f"(ip -br addr shows them), or unset it and let "
                                  f"{var.split('_')[0].lower()} choose"))
    set_somewhere = sorted({v for f in facts for v, value in f["ifname"].items() if value})
    said = (f"{' and '.join(set_somewhere)} name interfaces every node has" if set_somewhere else
            "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are unset: each library picks an interface")
    return _each(rows, Check("network interface", said, "ok" if set_somewhere else "info"))


def versions(facts: list[dict]) -> list[Check]:
    rows = []
    for key, label in (("python", "Python"), ("torch", "PyTorch"), ("nccl", "NCCL"), ("labkit", "labkit")):
        seen = {f["node"]: f["versions"].get(key) or "none" for f in facts}
        if len(set(seen.values())) == 1:
            rows.append(Check(label, f"{next(iter(seen.values()))} on every node"))
        else:
            rows.append(Check(label, "differs: " + ", ".join(f"node {n} {v}" for n, v in seen.items()),
                              "warn", _SAME))
    return rows


def checkpoint(facts: list[dict]) -> list[Check]:
    said = {f["node"]: f.get("checkpoint") for f in facts}
    if said.get(0) is None:
        return []
    if not said[0]["ok"]:
        return [Check("checkpoint folder", f"node 0 cannot use {said[0]['dir']}: {said[0]['error']}",
                      "warn", "make the folder (mkdir -p) on a filesystem every node mounts")]
    bad = [Check(f"checkpoint folder (node {n})", f"node {n} does not find the token node 0 wrote "
                 f"in {said[0]['dir']}: {s['error']}"
                 + (f" (node {n} looked in its {s['dir']})" if s["dir"] != said[0]["dir"] else ""),
                 "warn", _SHARED) for n, s in said.items() if n and s and not s["ok"]]
    return _each(bad, Check("checkpoint folder", f"{said[0]['dir']} is one filesystem: every node "
                                                 f"read the token node 0 wrote"))


def gpus(facts: list[dict], nproc: int) -> list[Check]:
    counts = {f["node"]: f["gpus"] for f in facts}
    if not any(counts.values()):
        return [Check("GPUs", f"none on any node: {nproc} CPU rank(s) per node with gloo", "info")]
    bad = [Check(f"GPUs (node {n})", f"node {n} has {c} GPU(s) for nproc={nproc} ranks", "warn",
                 f"nproc must not exceed the GPUs of the smallest node: nproc={min(counts.values()) or 1}"
                 + ("" if c else ", or device='cpu' on every node"))
           for n, c in counts.items() if c < nproc]
    return _each(bad, Check("GPUs", ", ".join(f"node {n}: {c}" for n, c in counts.items())
                            + f" (nproc={nproc})"))
