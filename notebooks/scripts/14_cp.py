"""Lesson 14: a small language model on sequences split over the ranks (context parallelism).
Each rank holds a slice of every sequence; attention passes keys and values around a ring.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/14_cp.py
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit import comm, memory, metrics
from labkit.data import synthetic_tokens
from labkit.models import CausalLM, causal_attention

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--seq-len", type=int, default=192, help="tokens per sequence: the ranks split it")
parser.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag", help="which tokens each rank holds")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
parser.add_argument("--dim", type=int, default=64, help="width of the model")
parser.add_argument("--depth", type=int, default=2, help="transformer blocks")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--lr", type=float, default=0.3, help="SGD's, with momentum 0.9")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--probe-lengths", type=int, nargs="*", default=[], help="lengths at which to check the ring")
parser.add_argument("--out", default=os.environ.get(metrics.RUN_DIR_ENV, "."),
                    help="folder for grads_rank<R>.pt and weights_rank<R>.pt (default: run folder)")
args = parser.parse_args()

# --- ranks, and which tokens each one holds -------------------------------------------------
rank = int(os.environ.get("RANK", 0))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
if torch.cuda.is_available():
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
for length in [args.seq_len, *args.probe_lengths]:  # every rank an equal share, or no run at all
    if length % (2 * world_size):
        parser.error(f"a sequence of {length} tokens does not split into 2 x {world_size} ranks = "
                     f"{2 * world_size} equal pieces. HINT: a length that is a multiple of {2 * world_size}.")
if world_size > 1:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def positions(owner: int, length: int, layout: str) -> torch.Tensor:
    """Where, in a sequence of `length` tokens, are the tokens rank `owner` holds? Two of its 2W
    equal pieces: contiguous, pieces 2r and 2r+1; zig-zag, piece r and piece 2W-1-r."""
    pieces = torch.arange(length, device=device).chunk(2 * world_size)
    ours = (2 * owner, 2 * owner + 1) if layout == "contiguous" else (owner, 2 * world_size - 1 - owner)
    return torch.cat([pieces[i] for i in ours])


# --- ring attention, forward: keys and values go round the ring -------------------------------
seen = {"scores": 0, "largest": 0}  # scores this rank computed, and the most it held at once


def rotate(tensor):
    """Send `tensor` to the next rank of the ring, receive the previous rank's: started, not waited for."""
    received = torch.empty_like(tensor)
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, (rank + 1) % world_size),
                                       dist.P2POp(dist.irecv, received, (rank - 1) % world_size)])
    return received, requests


def piece(tensor, i):  # each rank's tokens are two pieces of the sequence (see positions)
    return tensor.chunk(2, dim=-2)[i]


def blocks(q, keys, q_pos, k_pos):
    """The scores of each piece of queries with each piece of keys, except where every key comes
    after every query (the causal mask would hide the whole block): (i, j, scores) for each."""
    for i, (qi, qp) in enumerate(zip(q.chunk(2, dim=2), q_pos.chunk(2))):
        for j, (kj, kp) in enumerate(zip(keys.chunk(2, dim=2), k_pos.chunk(2))):
            if kp[0] <= qp[-1]:
                scores = (qi @ kj.transpose(-2, -1)) * qi.shape[-1] ** -0.5
                seen["scores"] += scores.numel()
                seen["largest"] = max(seen["largest"], scores.numel())
                yield i, j, scores.masked_fill(qp[:, None] < kp[None, :], float("-inf"))


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries to every rank's keys and values, which travel round
    the ring; `layout` says which tokens each rank holds."""

    @staticmethod
    def forward(ctx, q, k, v, layout):
        length = q.shape[2] * world_size
        q_pos, kv = positions(rank, length, layout), torch.stack([k, v])
        out = torch.zeros_like(q)  # per query: the output so far, and the log-sum-exp of its scores
        lse = torch.full_like(q[..., :1], float("-inf"))
        for step in range(world_size):
            owner = (rank - step) % world_size  # whose keys and values this rank holds now
            if step + 1 < world_size:  # the next block travels while this one is computed
                incoming, requests = rotate(kv)
            for i, j, scores in blocks(q, kv[0], q_pos, positions(owner, length, layout)):
                # two softmaxes over different keys, merged as above: o' = e^(l - l') o + e^(S - l') V
                total = torch.logaddexp(piece(lse, i), scores.logsumexp(dim=-1, keepdim=True))
                piece(out, i).mul_((piece(lse, i) - total).exp()).add_((scores - total).exp() @ piece(kv[1], j))
                piece(lse, i).copy_(total)
            if step + 1 < world_size:
                for request in requests:
                    request.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)  # no scores: backward computes them again
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        length, scale = q.shape[2] * world_size, q.shape[-1] ** -0.5
        q_pos = positions(rank, length, ctx.layout)
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # one number per query
        grad_q = torch.zeros_like(q)
        # keys, values and their gradients so far travel together; each rank adds its part
        moving = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
        for step in range(world_size):
            owner = (rank - step) % world_size
            for i, j, scores in blocks(q, moving[0], q_pos, positions(owner, length, ctx.layout)):
                p = (scores - piece(lse, i)).exp()  # forward's probabilities, computed again
                piece(moving[3], j).add_(p.transpose(-2, -1) @ piece(grad_out, i))  # of v
                d_scores = p * (piece(grad_out, i) @ piece(moving[1], j).transpose(-2, -1) - piece(delta, i)) * scale
                piece(grad_q, i).add_(d_scores @ piece(moving[0], j))
                piece(moving[2], j).add_(d_scores.transpose(-2, -1) @ piece(q, i))  # of k
            if world_size > 1:  # pass them on; after the last step only the gradients go: home
                moving, requests = rotate(moving if step + 1 < world_size else moving[2:])
                for request in requests:
                    request.wait()
        return grad_q, moving[-2], moving[-1], None


# --- ring attention against full attention, at several lengths and both layouts -------------
for length in args.probe_lengths if world_size > 1 else []:
    generator = torch.Generator().manual_seed(args.seed + length)  # the same numbers on every rank
    q, k, v, grad_out = (torch.randn(2, 4, length, 16, generator=generator).to(device) for _ in range(4))
    full, everywhere = [t.clone().requires_grad_() for t in (q, k, v)], torch.arange(length, device=device)
    with memory.SavedTensorMeter() as one_process:  # what one process keeps for backward
        expected = causal_attention(*full, everywhere, everywhere)
    expected.backward(grad_out)
    for layout in ("contiguous", "zigzag"):
        mine = positions(rank, length, layout)
        local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        seen.update(scores=0, largest=0)
        with memory.SavedTensorMeter() as ring:
            out = RingAttention.apply(*local, layout)
            out.backward(grad_out[:, :, mine])
        pairs = [(out.detach(), expected[:, :, mine].detach()),  # detached: plain numbers, no autograd
                 *((m.grad, f.grad[:, :, mine]) for m, f in zip(local, full))]
        error = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)  # relative to the largest
        metrics.log(0, probe_length=length, layout=layout, max_error=error, scores=seen["scores"],
                    largest_scores=seen["largest"], saved_bytes=ring.bytes, one_process_saved_bytes=one_process.bytes)


# --- the model: ring attention in every block --------------------------------------------------
torch.manual_seed(args.seed)  # the same initial weights on every rank, and in one process
model = CausalLM(dim=args.dim, depth=args.depth, max_len=args.seq_len).to(device)  # vocabulary 64
for block in model.blocks if world_size > 1 else []:  # the ring works out every rank's positions itself
    block.attn.attend = lambda q, k, v, q_positions, k_positions: RingAttention.apply(q, k, v, args.layout)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

# --- training: the same sequences as one process, each rank its own tokens of every one ------
mine = positions(rank, args.seq_len, args.layout)
for step in range(1, args.steps + 1):
    tokens = synthetic_tokens(args.batch_size, args.seq_len + 1, seed=1000 * args.seed + step).to(device)
    x, y = tokens[:, :-1][:, mine], tokens[:, 1:][:, mine]  # inputs, and the next token of each
    with comm.count_collectives() as sent:
        loss = F.cross_entropy(model(x, mine).flatten(0, 1), y.flatten())
        loss.backward()
        for p in model.parameters() if world_size > 1 else []:  # each rank's part of the gradient:
            dist.all_reduce(p.grad)  # added up, then averaged, as DDP does
            p.grad /= world_size
    if step == 1 and rank == 0:  # the first gradients, to compare with one process
        torch.save({n: p.grad.cpu() for n, p in model.named_parameters()}, f"{args.out}/grads_rank0.pt")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics.log(step, loss=loss.item(), samples=args.batch_size, sent_bytes=sent.sent_bytes,
                **{f"calls_{kind}": n for kind, n in sent.calls.items()},
                **{f"bytes_{kind}": n for kind, n in sent.bytes.items()})
    if rank == 0 and step in (1, args.steps):
        print(f"step {step}: loss {loss.item():.4f} (rank 0's tokens); sent {sent.calls}")
if rank == 0:
    torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, f"{args.out}/weights_rank0.pt")
if world_size > 1:
    dist.destroy_process_group()
