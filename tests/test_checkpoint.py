"""labkit.checkpoint: atomic saves, the latest complete checkpoint, RNG states, and a real resume."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import labkit
from labkit import checkpoint


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 64), value)}, "step": int(value)}


# -- names and bad input --------------------------------------------------------------------
def test_step_path_is_zero_padded_and_sorts(tmp_path):
    assert checkpoint.step_path(tmp_path, 40).name == "step_00000040.pt"
    names = [checkpoint.step_path(tmp_path, s).name for s in (9, 10, 100)]
    assert names == sorted(names)


@pytest.mark.parametrize("step", [-1, 1.5, "3", True])
def test_step_path_rejects_bad_steps(tmp_path, step):
    with pytest.raises(ValueError, match=r"step must be an int >= 0.*HINT"):
        checkpoint.step_path(tmp_path, step)


def test_bad_folders(tmp_path):
    with pytest.raises(TypeError, match=r"folder must be a path.*HINT"):
        checkpoint.latest(42)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(NotADirectoryError, match=r"is a file.*HINT"):
        checkpoint.latest(tmp_path / "a_file")
    with pytest.raises(IsADirectoryError, match=r"is a folder.*HINT"):
        checkpoint.save_atomic({}, tmp_path)
    with pytest.raises(ValueError, match=r"keep must be an int >= 1.*HINT"):
        checkpoint.prune(tmp_path, keep=0)


# -- atomic save -----------------------------------------------------------------------------
def test_save_atomic_round_trip_loads_with_weights_only(tmp_path):
    path = checkpoint.save_atomic(_state(3.0), checkpoint.step_path(tmp_path / "new", 3))
    assert path.is_file() and path.parent.name == "new"      # the folder was created
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], torch.full((64, 64), 3.0))


def test_files_written_lists_the_files_this_process_put_in_place(tmp_path, monkeypatch):
    before = len(checkpoint.files_written())
    first = checkpoint.save_atomic(_state(1.0), checkpoint.step_path(tmp_path, 1))
    second = checkpoint.save_atomic(_state(2.0), checkpoint.step_path(tmp_path, 2))
    assert checkpoint.files_written()[before:] == [first, second]
    checkpoint.files_written().clear()  # a copy: the record cannot be changed from outside
    assert checkpoint.files_written()[before:] == [first, second]
    monkeypatch.setattr(checkpoint.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        checkpoint.save_atomic(_state(3.0), checkpoint.step_path(tmp_path, 3))
    assert checkpoint.files_written()[before:] == [first, second]  # a failed save wrote nothing

def test_crash_between_write_and_rename_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    old = checkpoint.save_atomic(_state(1.0), checkpoint.step_path(tmp_path, 1))
    target = checkpoint.step_path(tmp_path, 2)

    def crash(src, dst):
        assert os.path.getsize(src) > 0  # the bytes were written; only the rename is missing
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_atomic(_state(2.0), target)
    monkeypatch.undo()
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]  # temp file cleaned up
    assert checkpoint.latest(tmp_path) == old


def test_a_writer_killed_mid_write_never_becomes_the_latest(tmp_path):
    """A real process, SIGKILLed after writing its bytes and before the rename."""
    old = checkpoint.save_atomic(_state(1.0), checkpoint.step_path(tmp_path, 1))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time, torch
        from labkit import checkpoint
        real_fsync = os.fsync
        def fsync_then_hang(fd):           # the data is in the temporary file: stop here
            real_fsync(fd)
            print("written", flush=True)
            time.sleep(60)
        os.fsync = fsync_then_hang
        checkpoint.save_atomic({{"model": {{"w": torch.ones(256, 256)}}, "step": 2}},
                               checkpoint.step_path({str(tmp_path)!r}, 2))
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "written"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        child.kill()
        child.stdout.close()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".step_00000002.pt.tmp-")]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 256 * 256 * 4  # killed mid-way
    assert checkpoint.latest(tmp_path) == old
    assert torch.load(checkpoint.latest(tmp_path), weights_only=True)["step"] == 1


def test_latest_picks_the_highest_complete_step(tmp_path):
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path) is None
    for step in (5, 20, 10):
        checkpoint.save_atomic(_state(float(step)), checkpoint.step_path(tmp_path, step))
    (tmp_path / ".step_00000030.pt.tmp-123").write_bytes(b"half a checkpoint")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert checkpoint.latest(tmp_path).name == "step_00000020.pt"


def test_latest_skips_a_torn_file_with_a_warning(tmp_path):
    good = checkpoint.save_atomic(_state(1.0), checkpoint.step_path(tmp_path, 1))
    whole = checkpoint.save_atomic(_state(2.0), checkpoint.step_path(tmp_path, 2)).read_bytes()
    torn = checkpoint.step_path(tmp_path, 2)
    torn.write_bytes(whole[: len(whole) // 2])  # what a plain torch.save killed mid-way leaves
    with pytest.raises((OSError, RuntimeError), match="Invalid argument|zip archive|central directory"):
        torch.load(torn, weights_only=True)
    with pytest.warns(UserWarning, match="not a complete torch.save archive"):
        assert checkpoint.latest(tmp_path) == good


def test_prune_keeps_the_newest(tmp_path):
    for step in range(1, 6):
        checkpoint.save_atomic(_state(float(step)), checkpoint.step_path(tmp_path, step))
    deleted = checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in deleted] == [f"step_0000000{s}.pt" for s in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004.pt", "step_00000005.pt"]


# -- random number generators -----------------------------------------------------------------
def _draw() -> tuple:
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


def test_rng_round_trip_through_a_weights_only_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draw()
    np.random.randn()  # leaves a cached Gaussian in NumPy's state: it must come back too
    path = checkpoint.save_atomic({"rng": checkpoint.rng_state()}, tmp_path / "rng.pt")
    expected = (*_draw(), np.random.randn())
    _draw(), np.random.randn()
    checkpoint.set_rng_state(torch.load(path, weights_only=True)["rng"])
    assert (*_draw(), np.random.randn()) == expected


def test_set_rng_state_rejects_other_objects():
    with pytest.raises(TypeError, match=r"checkpoint.rng_state\(\).*HINT"):
        checkpoint.set_rng_state({"seed": 0})
    with pytest.raises(TypeError, match="HINT"):
        checkpoint.set_rng_state(torch.get_rng_state())


def test_cuda_state_needs_cuda(monkeypatch):
    state = checkpoint.rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available here.*HINT"):
        checkpoint.set_rng_state(state)


@pytest.mark.gpu
def test_cuda_rng_round_trip():
    torch.cuda.init()
    torch.cuda.manual_seed_all(7)
    state = checkpoint.rng_state()
    assert "cuda" in state and len(state["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(4, device="cuda").tolist()
    checkpoint.set_rng_state(state)
    assert torch.rand(4, device="cuda").tolist() == expected


def test_is_a_public_submodule():
    assert labkit.checkpoint is checkpoint and "checkpoint" in labkit.__all__


# -- a real resume: 2 gloo ranks, one crashes, torchrun restarts, the run resumes ---------------
RESUMABLE = """
    import os, sys, torch, torch.distributed as dist
    from labkit import checkpoint, metrics
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    folder, crash_at = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(100 + rank)            # per-rank streams: the data below is random
    step, path = 0, checkpoint.latest(folder)
    if path is not None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
        checkpoint.set_rng_state(state["rng"][rank]); step = state["step"]
    while step < 12:
        x = torch.randn(4, 8)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad(); loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad); p.grad /= world
        opt.step(); step += 1
        metrics.log(step, loss=loss.item())
        if step == crash_at and rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            raise RuntimeError("crash")
        if step % 3 == 0:
            rngs = [None] * world
            dist.gather_object(checkpoint.rng_state(), rngs if rank == 0 else None, dst=0)
            if rank == 0:
                checkpoint.save_atomic({"model": model.state_dict(), "opt": opt.state_dict(),
                                        "rng": rngs, "step": step}, checkpoint.step_path(folder, step))
            dist.barrier()
    if rank == 0:
        checkpoint.save_atomic(model.state_dict(), os.path.join(folder, "final.pt"))
    dist.destroy_process_group()
"""


@pytest.mark.launch
def test_crashed_and_resumed_run_equals_the_uninterrupted_one(workdir, write_script):
    write_script("resumable.py", RESUMABLE)
    whole = labkit.launch("resumable.py", nproc=2, args=["whole", "0"], quiet=True, timeout_s=120)
    drill = labkit.launch("resumable.py", nproc=2, args=["drill", "7"], max_restarts=1,
                          quiet=True, timeout_s=120)
    assert whole.status == drill.status == "ok"
    df = drill.metrics()
    assert sorted(df["restart"].unique()) == [0, 1]
    assert df[df["restart"] == 1]["step"].min() == 7  # resumed after the step-6 checkpoint
    a = torch.load(workdir / "whole" / "final.pt", weights_only=True)
    b = torch.load(workdir / "drill" / "final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit for bit, on CPU
    losses = lambda run: run.metrics().groupby(["rank", "step"])["loss"].last()
    assert losses(whole).equals(losses(drill))
