"""Run a function on W real gloo ranks (spawned processes) and collect what each returns.

Not a test module: test_syncbn.py and test_comm.py use it. Each rank joins a
gloo group through a FileStore in a fresh temporary folder (no ports, no
collisions), runs ``target(rank, world_size, *args)``, saves the result with
``torch.save`` and leaves with ``os._exit`` after ``destroy_process_group``:
gloo's worker threads can abort a process during the interpreter's teardown
("terminate called without an active exception"), see labkit._rank.entry._exit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from pathlib import Path


def run_ranks(world_size: int, target, *args, backend: str = "gloo", timeout_s: float = 90) -> list:
    """``[target(0, W, *args), ..., target(W-1, W, *args)]``, each computed on its own rank.

    ``target`` must be a module-level function (spawned processes import it).
    With ``backend="nccl"`` rank r uses GPU r. A rank that raises fails the
    call with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(target, rank, world_size, tmp, args, backend))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        errors = sorted(Path(tmp).glob("rank*.err"))
        if errors:
            raise AssertionError("\n".join(e.read_text() for e in errors))
        if alive:
            raise AssertionError(f"{len(alive)} rank(s) still running after {timeout_s} s: a hang")
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world_size, f"exit codes {codes}"
        import torch
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _rank_main(target, rank: int, world_size: int, tmp: str, args: tuple, backend: str) -> None:
    code = 0
    try:
        import torch
        import torch.distributed as dist

        from labkit import _hardware

        torch.set_num_threads(1)  # W ranks share this machine's cores
        loopback = _hardware.loopback_interface()
        if loopback:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world_size)
        try:
            torch.save(target(rank, world_size, *args), Path(tmp) / f"rank{rank}.pt")
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        Path(tmp, f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        code = 1
    os._exit(code)
