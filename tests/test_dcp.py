"""Lesson 06's sharded checkpoint: FSDP2 + torch.distributed.checkpoint on real gloo ranks.

Save on 2 ranks; load on 2 ranks (a fresh, differently initialised model), on 1 rank
(resharding), and in a plain process with no process group; every load must give back
exactly the weights that were saved. Along the way, labkit.memory counts the local
shards: on 2 ranks they add up to the whole model, byte for byte.
"""

from __future__ import annotations

import pytest
import torch

import labkit
from labkit import memory
from labkit.models import MLPStack

DIM, DEPTH = 7, 2  # 7 rows do not split evenly over 2 ranks: uneven shards are tested too

SHARDED = f"""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from labkit import memory, metrics
    from labkit.models import MLPStack
    mode, folder = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def build(seed):
        torch.manual_seed(seed)
        model = MLPStack(dim={DIM}, depth={DEPTH})
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    def load_and_compare(model):
        state = {{"model": model.state_dict()}}
        dcp.load(state, checkpoint_id=folder)
        model.load_state_dict(state["model"])
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            expected = torch.load(folder + ".full.pt", weights_only=True)
            metrics.log(1, tensors=len(expected),
                        mismatched=sum(not torch.equal(expected[k], full[k]) for k in expected))

    if mode == "save":
        model = build(0)
        metrics.log(0, param_bytes=memory.model_bytes(model).params)
        dcp.save({{"model": model.state_dict()}}, checkpoint_id=folder)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, folder + ".full.pt")
        dist.barrier()
        load_and_compare(build(1))   # other initial weights, overwritten by the load
    else:
        load_and_compare(build(2))
    dist.destroy_process_group()
"""


@pytest.mark.launch
def test_dcp_saved_on_two_ranks_loads_on_two_on_one_and_without_a_group(workdir, write_script):
    write_script("sharded.py", SHARDED)
    folder = str(workdir / "dcp")
    saved = labkit.launch("sharded.py", nproc=2, args=["save", folder], quiet=True, timeout_s=180)
    df = saved.metrics()
    shards = df.dropna(subset=["param_bytes"]).set_index("rank")["param_bytes"]
    whole = memory.model_bytes(MLPStack(dim=DIM, depth=DEPTH)).params
    assert len(shards) == 2 and shards.sum() == whole      # the shards partition the model
    assert shards.max() - shards.min() > 0                 # and they are uneven here
    on_two = df.dropna(subset=["mismatched"]).iloc[0]
    assert (on_two["tensors"], on_two["mismatched"]) == (2 + 6 * DEPTH + 4, 0)

    one = labkit.launch("sharded.py", nproc=1, args=["load", folder], quiet=True, timeout_s=180)
    on_one = one.metrics().dropna(subset=["mismatched"]).iloc[0]
    assert (on_one["tensors"], on_one["mismatched"]) == (on_two["tensors"], 0)

    # A plain process, no torchrun, no process group: DCP reads all the shards itself.
    import torch.distributed.checkpoint as dcp

    plain = MLPStack(dim=DIM, depth=DEPTH)
    state = {"model": plain.state_dict()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, checkpoint_id=folder)
    plain.load_state_dict(state["model"])
    expected = torch.load(folder + ".full.pt", weights_only=True)
    assert all(torch.equal(expected[k], v) for k, v in plain.state_dict().items())
