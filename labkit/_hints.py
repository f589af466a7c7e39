"""Progressive hints for the exercises: the first nudges, the last all but says it.

In an exercise notebook::

    labkit.hint("02-ddp", 1)     # then 2, then 3
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

HINTS: dict[str, list[str]] = {
    "00-hello": [
        "torchrun puts three numbers in every process's environment: RANK, LOCAL_RANK and "
        "WORLD_SIZE. os.environ gives strings, so convert them with int().",
        "dist.init_process_group(backend) connects the ranks. Then make a one-element tensor "
        "holding float(rank), on the rank's device, and pass it to dist.all_reduce.",
        "all_reduce works in place: after dist.all_reduce(value), value holds the sum on every "
        "rank. rank_sum = value.item().",
    ],
    "01-loop": [
        "Gradients add up in .grad until something clears them. Clear them once per step, "
        "before loss.backward(), with optimizer.zero_grad(set_to_none=True).",
        "BatchNorm updates its running statistics on every forward pass in training mode. "
        "Testing must not: model.eval() before the test loop, model.train() after it, and "
        "torch.no_grad() around it so that no graph is built.",
        "A window is --log-every steps: log its mean loss, (window_loss / args.log_every).item(), "
        "and its samples, args.log_every * args.batch_size. To compare the ranks: results = "
        "[None] * world_size; dist.all_gather_object(results, (accuracy, lr)); then max(results).",
    ],
    "02-ddp": [
        "Start like lesson 00: the three numbers from the environment, the device from "
        "LOCAL_RANK, then dist.init_process_group with 'nccl' on GPUs and 'gloo' on CPUs.",
        "DistributedSampler(data.train, num_replicas=world_size, rank=rank, shuffle=True, seed=0, "
        "drop_last=True) gives each rank its own share; pass it as sampler= to the DataLoader "
        "(and then no shuffle=). Call sampler.set_epoch(epoch) at the top of every epoch.",
        "Move the model to its device first, then DDP(model, device_ids=[local_rank]) on a GPU "
        "(device_ids=None on the CPU). In evaluate(), dist.all_reduce(counts) before dividing. "
        "Print only where rank == 0, and end with dist.destroy_process_group().",
    ],
    "03-syncbn": [
        "AllReduceSum.forward: total = x.clone(), then dist.all_reduce(total) (it works in place, and "
        "autograd must still see x as it was). AllReduceSum.backward does the same to grad_output: "
        "every rank's loss reads this rank's x through the shared statistics.",
        "Per channel means over dimensions 0, 2 and 3. One tensor carries everything: local = "
        "torch.cat([x.sum(dims), (x * x).sum(dims), count]), with count = torch.full((1,), "
        "x.numel() // channels, dtype=x.dtype, device=x.device) (on x's device, so that torch.cat "
        "accepts it on a GPU too). total = AllReduceSum.apply(local); n = total[-1]; mean = "
        "total[:channels] / n; var = total[channels:2 * channels] / n - mean * mean.",
        "Under torch.no_grad(): self.running_mean.lerp_(mean, self.momentum) and "
        "self.running_var.lerp_(var * n / (n - 1), self.momentum). Then, with shape = (1, channels, "
        "1, 1): (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps) * "
        "self.weight.view(shape) + self.bias.view(shape).",
    ],
    "04-accumulation": [
        ".grad adds up across backward() calls until something clears it. So: k forward and "
        "backward passes, then one optimizer.step(), then optimizer.zero_grad(set_to_none=True). "
        "Divide each micro-step's loss by k, so that the sum of the k gradients is the big batch's mean.",
        "model.no_sync() is a context manager: inside it, backward() does not all-reduce. Use it for "
        "every micro-step but the last, around forward and backward both; the last backward "
        "all-reduces the sum of all k.",
        "for i, (x, y) in enumerate(micro_batches): with nullcontext() if i == k - 1 else "
        "model.no_sync(): (F.cross_entropy(model(x), y) / k).backward(). After the loop: "
        "optimizer.step(); optimizer.zero_grad(set_to_none=True).",
    ],
    "05-resume": [
        "A checkpoint must hold everything the loop changes: the weights (of model.module, so that "
        "the names carry no 'module.' prefix), the optimizer's state (SGD's momentum), step, epoch "
        "and batch_in_epoch, and the RNG state of every rank (each rank draws its own random flips).",
        "The ranks' RNG states differ, so collect them first: rngs = [None] * world_size on rank 0 "
        "(None on the others), then dist.gather_object(checkpoint.rng_state(), rngs, dst=0). Rank 0 "
        "alone writes, with checkpoint.save_atomic(state, checkpoint.step_path(args.ckpt_dir, step)); "
        "then dist.barrier() on every rank.",
        "To resume: path = checkpoint.latest(args.ckpt_dir); if it is not None, state = torch.load(path, "
        "map_location=device, weights_only=True); model.module.load_state_dict(state['model']); "
        "optimizer.load_state_dict(state['optimizer']); checkpoint.set_rng_state(state['rng'][rank]); "
        "step, epoch, batch_in_epoch = state['step'], state['epoch'], state['batch_in_epoch'].",
    ],
    "06-fsdp": [
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
    ],
}


def _answers() -> str:
    """Where the worked answers are: in solutions/, or, in a workshop's hand-out, with the instructor."""
    from labkit import _course

    root = _course.find_root() or _course.package_root()
    if (root / "solutions").is_dir():
        return "the full answer is in solutions/, where your copy has it"
    return "this copy of the course is a workshop's hand-out, without the worked answers: ask your instructor"


@dataclass(frozen=True)
class Hint:
    """One hint: shows as a short note in Jupyter, as text elsewhere."""

    exercise: str
    number: int
    total: int
    text: str

    def __str__(self) -> str:
        more = (f" (labkit.hint({self.exercise!r}, {self.number + 1}) for the next)"
                if self.number < self.total else f" (the last one; {_answers()})")
        return f"Hint {self.number} of {self.total} for {self.exercise}{more}:\n{self.text}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head, body = str(self).split("\n", 1)
        return (f"<div style='border-left:3px solid #9a6700;padding-left:8px'>"
                f"<b>{html.escape(head)}</b><br>{html.escape(body)}</div>")


def _exercise_id(name) -> str:
    """'02-ddp' from '02-ddp', '02', 2, '02_ddp' or '02_ddp.ipynb' (as ``make restore`` takes them)."""
    key = str(name).strip().removesuffix(".ipynb")
    if key in HINTS:
        return key
    number = re.match(r"\d+", key)
    ids = [i for i in HINTS if number and i[:2] == number[0].zfill(2)]
    if len(ids) == 1 and (key == number[0] or key.replace("_", "-") == ids[0]
                          or key.split("_", 1)[0] == number[0]):
        return ids[0]
    raise ValueError(f"no exercise {name!r}; the exercises are: {', '.join(sorted(HINTS))}. "
                     f"HINT: the id is in the exercise notebook's title, e.g. '02-ddp' (or just '02').")


def hint(exercise: str, number: int = 1) -> Hint:
    """Hint ``number`` (1, 2, ...) for ``exercise``, e.g. ``labkit.hint("02-ddp", 1)``.

    ``exercise`` is the exercise's id ('02-ddp'), its number ('02') or its notebook's name
    ('02_ddp').

    Raises:
        ValueError: an unknown exercise (the message lists them), or a number out of range.
    """
    exercise = _exercise_id(exercise)
    texts = HINTS[exercise]
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= len(texts):
        raise ValueError(f"{exercise} has hints 1 to {len(texts)}, not {number!r}. "
                         f"HINT: after the last hint, {_answers()}.")
    return Hint(exercise, number, len(texts), texts[number - 1])

