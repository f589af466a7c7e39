"""Exercise 06-fsdp: FSDP2 units, and each rank's bytes, predicted and measured."""

from __future__ import annotations

from dataclasses import dataclass

from labkit._course.checks._common import _metrics, _on, _ranks
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "06-fsdp"

HINTS = [
    "fully_shard(module) makes a module one FSDP unit, whose weights are gathered together. Call "
    "it on each block in model.blocks, then on model itself: the root comes last and takes what "
    "no block took (the stem and the head).",
    "FSDP cuts every parameter along dim 0 as torch.chunk(p, world_size) would: ceil(rows / "
    "world_size) rows to a rank, and fewer (or none) to the last ranks when the rows do not "
    "divide. A shard's bytes: its rows × (p.numel() // p.shape[0]) × p.element_size(). Each rank "
    "keeps the gradient of its own shard only: the same bytes again.",
    "AdamW keeps exp_avg and exp_avg_sq, each shaped like the shard, plus a 4-byte step counter "
    "for each parameter tensor: optimizer = 2 × params + 4 × len(list(plain.parameters())). To "
    "measure: memory.model_bytes(model, optimizer) counts each DTensor's local shard; call it "
    "where the TODO is, after optimizer.step().",
]

_BYTES = ("params", "grads", "optim")  # what the script predicts and measures, in this order
#: What the skeleton logs: its settings, the units it made, and the bytes.
COLUMNS = ["dim", "depth", "block_units", "root_unit", "gathered_bytes",
           *(f"predicted_{n}" for n in _BYTES), *(f"measured_{n}" for n in _BYTES)]


def _shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of a ``rows``-row tensor that FSDP2 gives ``rank``: torch.chunk's split of dim 0."""
    per_rank = -(-rows // world_size)
    return max(0, min(per_rank, rows - rank * per_rank))


def _fsdp_bytes(dim: int, depth: int, world_size: int, rank: int, *, units: str | None = None,
                root: bool = True) -> dict:
    """What ``rank`` holds of exercise 06's MLPStack after one AdamW step, exactly.

    A parameter is sharded when an FSDP unit holds it: the root (``root``), or its block
    (``units[i] == "1"``); otherwise the rank holds it whole. AdamW keeps two moments shaped
    like the parameter and a 4-byte float32 step counter per parameter tensor.
    """
    import torch

    from labkit.models import MLPStack

    units = "1" * depth if units is None else units
    with torch.device("meta"):
        plain = MLPStack(dim=dim, depth=depth, in_features=dim)
    params = tensors = 0
    for name, p in plain.named_parameters():
        parts = name.split(".")
        sharded = root or (parts[0] == "blocks" and units[int(parts[1])] == "1")
        rows = p.shape[0]
        mine = _shard_rows(rows, world_size, rank) if sharded else rows
        params += mine * (p.numel() // rows) * p.element_size()
        tensors += 1
    return {"params": params, "grads": params, "optimizer": 2 * params + 4 * tensors, "tensors": tensors}


def _mlp_weights(dim: int, depth: int) -> tuple[int, int, int]:
    """Bytes of exercise 06's whole MLPStack, of its root's own weights (stem, head), of one block."""
    import torch

    from labkit.memory import tensor_bytes
    from labkit.models import MLPStack

    with torch.device("meta"):
        plain = MLPStack(dim=dim, depth=depth, in_features=dim)
    whole = tensor_bytes(plain.parameters())
    block = max(tensor_bytes(b.parameters()) for b in plain.blocks)
    return whole, whole - sum(tensor_bytes(b.parameters()) for b in plain.blocks), block


def _name_the_order(feedback: Feedback, script) -> None:
    """The launch failed: if a rank failed inside fully_shard, say that the order matters (the root comes last)."""
    import os
    import re

    failure = feedback.failure
    if failure is None or failure.exc_type in ("", "NotImplementedError"):
        return
    frame = r'File "(?P<file>[^"]+)", line (?P<line>\d+)[^\n]*\n[ \t]*(?P<code>[^\n]*)'
    frames = [m for m in re.finditer(frame, failure.traceback or "")
              if os.path.abspath(m["file"]) == os.path.abspath(os.fspath(script))]
    if frames and "fully_shard" in frames[-1]["code"]:
        feedback.fail(f"fully_shard failed on line {frames[-1]['line']}. The order matters: fully_shard "
                      f"each block first, then the model. Once the root has taken every parameter, a "
                      f"block can no longer become a unit of its own.", hint=1)


@dataclass
class _Logged:
    """What the ranks logged: the model's sizes and units (rank 0's), and each rank's numbers."""

    firsts: dict  # {column: {rank: the first value it logged}}
    world: int
    dim: int
    depth: int
    units: str  # "1" for each block that is an FSDP unit, else "0"
    root: bool  # the model itself is an FSDP unit

    def bytes(self, kind: str) -> dict:
        """{rank: (params, grads, optimizer)} that each rank logged as ``kind``: predicted or measured."""
        return {r: tuple(int(self.firsts[f"{kind}_{n}"][r]) for n in _BYTES) for r in range(self.world)}


@check
def check_fsdp(target="scripts/ex06_fsdp.py", *, timeout_s: float = 300) -> Feedback:
    """Exercise 06-fsdp: every block and the root are FSDP units, at most the root and one block
    are whole at once, and each rank's bytes after the first step are predicted exactly and
    measured exactly (2 ranks, or ``LABKIT_RANKS``; every GPU, if there are two or more).

    The truth it compares with is worked out here from the model's shapes, the world size and
    the units the script logged (FSDP2 splits dim 0 as torch.chunk does; AdamW adds two moments
    and a 4-byte step counter per tensor), and is tested against what FSDP really holds.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/06_fsdp.ipynb)::

        labkit.check_fsdp("scripts/ex06_fsdp.py")
    """
    feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-06-fsdp", explain=_name_the_order,
                             **_ranks(2))
    logged = _read(feedback, run)
    whole, root_bytes, block_bytes = _mlp_weights(logged.dim, logged.depth)
    _units(feedback, logged, whole, root_bytes + block_bytes)
    _prediction(feedback, logged, whole)
    _measurement(feedback, logged, whole)
    return feedback


def _read(feedback: Feedback, run) -> _Logged:
    """Every column the check reads, from every rank; stops naming the ranks that left one out."""
    df = _metrics(feedback, run, COLUMNS)
    firsts = {c: df.dropna(subset=[c]).groupby("rank")[c].first().to_dict() for c in COLUMNS}
    silent = sorted({r for c in COLUMNS for r in range(run.nproc) if r not in firsts[c]})
    if silent:
        feedback.stop(f"{_on(silent, run.nproc)} did not log all the check reads (did the run stop early?): "
                      f"keep the skeleton's metrics.log(...) lines.")
    return _Logged(firsts, run.nproc, dim=int(firsts["dim"][0]), depth=int(firsts["depth"][0]),
                   units=str(firsts["block_units"][0]), root=bool(firsts["root_unit"][0]))


def _units(feedback: Feedback, logged: _Logged, whole: int, limit: int) -> None:
    """Each block and the root are FSDP units, and at most the root and one block are whole at once."""
    depth, units, root = logged.depth, logged.units, logged.root
    missing = [i for i, u in enumerate(units) if u != "1"]
    feedback.expect(not missing, f"each of the {depth} blocks is an FSDP unit of its own",
                    "no block is an FSDP unit of its own: call fully_shard(block) for each block in "
                    "model.blocks, before the root." if len(missing) == depth else
                    f"block(s) {', '.join(map(str, missing))} are not FSDP units of their own: call fully_shard(block) for each "
                    f"block in model.blocks, before the root.", hint=1)
    feedback.expect(root, "the model itself is an FSDP unit too: the root, which shards the stem and the head",
                    "the model itself is not an FSDP unit, so the stem and the head stay whole on every rank "
                    "and nothing averages their gradients: call fully_shard(model) after the blocks.", hint=1)
    gathered = int(max(logged.firsts["gathered_bytes"].values()))
    if gathered <= limit:
        feedback.ok(f"at most the root and one block were whole at once: {gathered:,} of the model's "
                    f"{whole:,} bytes of weights")
    elif len(missing) == depth and not root:
        feedback.fail(f"nothing is sharded: every rank holds all {gathered:,} bytes of weights, all the time.", hint=1)
    elif len(missing) == depth:
        feedback.fail(f"the whole model ({gathered:,} bytes of weights) was whole at once: with only the root "
                      f"wrapped, FSDP gathers every weight when the forward pass starts. With each block a "
                      f"unit of its own, only the root and one block ({limit:,} bytes) are whole at a time.", hint=1)
    elif not root:
        feedback.fail(f"{gathered:,} bytes of weights were whole at once, more than the root and one block "
                      f"({limit:,}): without fully_shard(model), each block is an FSDP root of its own, and "
                      f"a root keeps its weights gathered after its forward. Shard the root last.", hint=1)
    else:
        feedback.fail(f"{gathered:,} bytes of weights were whole at once, more than the root and one block "
                      f"({limit:,}): shard every block, and leave reshard_after_forward at its default "
                      f"(True), so that each block frees its gathered weights after its forward.", hint=1)


def _prediction(feedback: Feedback, logged: _Logged, whole: int) -> None:
    """Each rank's prediction, against what FSDP done right holds."""
    world = logged.world
    predicted = logged.bytes("predicted")
    truth = {r: _fsdp_bytes(logged.dim, logged.depth, world, r) for r in range(world)}
    wrong = [r for r in range(world)
             if predicted[r] != (truth[r]["params"], truth[r]["grads"], truth[r]["optimizer"])]
    if wrong:
        r = wrong[0]
        sharding = predicted[r][:2] != (truth[r]["params"], truth[r]["grads"])   # hint 2; AdamW's state: hint 3
        feedback.fail(_misprediction(r, predicted[r], truth[r], whole, world, truth[0]["tensors"]),
                      hint=2 if sharding else 3)
        return
    t = truth[0]
    share = (f"exactly 1/{world}" if t["params"] * world == whole
             else f"about 1/{world} (some tensors' rows do not divide by {world})")
    feedback.ok(f"your prediction is exact on every rank: rank 0 holds {t['params']:,} bytes of parameters "
                f"({share} of the model's {whole:,}), {t['grads']:,} of gradients and {t['optimizer']:,} "
                f"of AdamW state")


def _measurement(feedback: Feedback, logged: _Logged, whole: int) -> None:
    """Each rank's measurement, against what it really holds with the units it has."""
    world = logged.world
    measured = logged.bytes("measured")
    held = {r: _fsdp_bytes(logged.dim, logged.depth, world, r, units=logged.units, root=logged.root)
            for r in range(world)}
    wrong = [r for r in range(world)
             if measured[r] != (held[r]["params"], held[r]["grads"], held[r]["optimizer"])]
    if not wrong:
        h = held[0]
        feedback.ok(f"your measurement is exact: rank 0 holds {h['params']:,} bytes of parameters, "
                    f"{h['grads']:,} of gradients and {h['optimizer']:,} of AdamW state")
        return
    r = wrong[0]
    (params, grads, optim), h = measured[r], held[r]
    if params == whole and h["params"] != whole:
        feedback.fail(f"you measured {params:,} bytes of parameters on rank {r}, the whole model's: count "
                      f"each DTensor's local shard (p.to_local()), as memory.model_bytes(model, optimizer) "
                      f"does. Rank {r} holds {h['params']:,}.", hint=3)
    elif optim == 0:
        feedback.fail("you measured no optimizer state: pass the optimizer too, "
                      "memory.model_bytes(model, optimizer).", hint=3)
    elif grads == 0:
        feedback.fail("you measured no gradients: measure where the TODO is, after optimizer.step() and "
                      "before the next zero_grad(set_to_none=True) frees them.", hint=3)
    else:
        feedback.fail(f"rank {r} holds {h['params']:,} / {h['grads']:,} / {h['optimizer']:,} bytes of "
                      f"parameters / gradients / optimizer state, but you measured {params:,} / "
                      f"{grads:,} / {optim:,}: count the local shards, memory.model_bytes(model, optimizer).", hint=3)


def _misprediction(rank: int, predicted: tuple, truth: dict, whole: int, world: int, tensors: int) -> str:
    """What is wrong with the first wrong number of one rank's prediction, and why."""
    params, grads, optim = predicted
    if params != truth["params"]:
        if params == whole:
            return (f"you predicted the whole model's {whole:,} bytes of parameters on rank {rank}: under FSDP "
                    f"each rank holds only its shard, about 1/{world} of every tensor's rows.")
        if params * world == whole:
            return (f"rank {rank} holds {truth['params']:,} bytes of parameters, not 1/{world} of the model "
                    f"({params:,}): FSDP cuts each tensor's rows like torch.chunk, ceil(rows / {world}) to a "
                    f"rank, so the last rank(s) get fewer, or none.")
        return (f"you predicted {params:,} bytes of parameters on rank {rank}; it holds {truth['params']:,}: "
                f"its dim-0 shard of every parameter, ceil(rows / {world}) rows of each (fewer on the last "
                f"ranks), at 4 bytes a float32.")
    if grads != truth["grads"]:
        return (f"you predicted {grads:,} bytes of gradients on rank {rank}; it holds {truth['grads']:,}: after "
                f"the reduce-scatter each rank keeps only its own shard's gradient, as many bytes as its "
                f"parameters.")
    if optim == 2 * truth["params"]:
        return (f"your AdamW prediction is {4 * tensors} bytes short: besides its two moments, AdamW keeps a "
                f"4-byte step counter for each of the {tensors} parameter tensors, on every rank.")
    if optim in (truth["params"], truth["params"] + 4 * tensors):
        return (f"AdamW keeps two moments per weight (exp_avg and exp_avg_sq), each the size of the shard: "
                f"rank {rank} holds {truth['optimizer']:,} bytes of optimizer state, not {optim:,}.")
    return (f"you predicted {optim:,} bytes of optimizer state on rank {rank}; it holds {truth['optimizer']:,}: "
            f"two moments the size of its shard, and a 4-byte step counter per parameter tensor.")
