"""Lesson 14: a small language model whose feed-forward layers are mixtures of experts, the
experts spread over the ranks (expert parallelism); tokens go to their experts by all-to-all.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/14_ep.py
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit import comm, metrics
from labkit.data import synthetic_tokens
from labkit.models import CausalLM, FeedForward

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
parser.add_argument("--experts", type=int, default=4, help="experts in each MoE layer: the ranks split them")
parser.add_argument("--top-k", type=int, default=2, help="experts each token goes to")
parser.add_argument("--capacity-factor", type=float, default=1.25,
                    help="rows an expert takes from a group: this many times its fair share")
parser.add_argument("--aux-weight", type=float, default=0.01, help="weight of the load-balancing loss")
parser.add_argument("--groups", type=int, default=None, help="routing groups (default: one per rank)")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step: the groups split them")
parser.add_argument("--dim", type=int, default=64, help="width of the model")
parser.add_argument("--depth", type=int, default=2, help="transformer blocks")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--lr", type=float, default=0.3, help="SGD's, with momentum 0.9")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default=os.environ.get(metrics.RUN_DIR_ENV, "."),
                    help="folder for grads_rank<R>.pt and weights_rank<R>.pt (default: run folder)")
args = parser.parse_args()

# --- ranks, and which experts each one holds ------------------------------------------------
rank = int(os.environ.get("RANK", 0))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
if torch.cuda.is_available():
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")
groups = args.groups or world_size
if args.experts % world_size or groups % world_size or args.batch_size % groups:
    parser.error(f"{args.experts} experts and {groups} groups must split evenly over {world_size} ranks, and "
                 f"{args.batch_size} sequences over {groups} groups. HINT: --experts {2 * world_size}.")
if world_size > 1:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
local = args.experts // world_size  # rank r holds experts r*local to (r+1)*local - 1


# --- all-to-all, as a step autograd can go back through ---------------------------------------
class AllToAll(torch.autograd.Function):
    """Rank r sends send_sizes[d] rows to each rank d, and receives receive_sizes[s] from each s.
    Backward is the same exchange the other way: each row's gradient goes back where it came from."""

    @staticmethod
    def forward(ctx, rows, send_sizes, receive_sizes):
        ctx.sizes = send_sizes, receive_sizes
        received = rows.new_empty(sum(receive_sizes), rows.shape[1])
        dist.all_to_all_single(received, rows.contiguous(), receive_sizes, send_sizes)
        return received

    @staticmethod
    def backward(ctx, grad):
        send_sizes, receive_sizes = ctx.sizes
        back = grad.new_empty(sum(send_sizes), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), send_sizes, receive_sizes)
        return back, None, None


# --- the mixture of experts: route, dispatch, compute, combine --------------------------------
class MoE(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.router = nn.Linear(dim, args.experts, bias=False)
        every = [FeedForward(dim) for _ in range(args.experts)]  # made alike everywhere (same seed)...
        self.experts = nn.ModuleDict({str(e): every[e] for e in range(rank * local, (rank + 1) * local)})

    def forward(self, h):  # h: this rank's sequences, (sequences, length, dim)
        tokens = h.reshape(groups // world_size, -1, h.shape[-1])  # (groups, tokens per group, dim)
        size = tokens.shape[1]  # tokens per group
        probs = self.router(tokens).softmax(dim=-1)
        weight, expert = probs.topk(args.top_k, dim=-1)  # each token's k experts, and their weights
        weight = weight / weight.sum(dim=-1, keepdim=True)
        # A row: one token for one of its experts, numbered in each group first choices first.
        # Capacity: an expert keeps at most `capacity` rows from each group, in that order.
        capacity = math.ceil(args.capacity_factor * size * args.top_k / args.experts)
        choice = F.one_hot(expert.transpose(1, 2).flatten(1), args.experts)  # (groups, k*size, E)
        place = (choice.cumsum(dim=1) * choice).sum(dim=-1) - 1  # rows before it, at its expert
        kept = (place < capacity).flatten().nonzero().squeeze(1)
        self.aux = args.experts * (choice.float().mean(1) * probs.mean(1)).sum(-1).mean()  # balance
        self.routed, self.kept = choice.sum((0, 1)), choice.flatten(0, 1)[kept].sum(0)  # rows per expert
        # Dispatch: the kept rows, sorted by expert, so by the rank that holds it; the counts first
        order = kept[expert.transpose(1, 2).flatten()[kept].argsort(stable=True)]
        token = order // (args.top_k * size) * size + order % size  # which of this rank's tokens
        counts = self.kept.clone()  # becomes: from each rank, its rows for each of my experts
        if world_size > 1:
            dist.all_to_all_single(counts, self.kept)
        self.send = self.kept.view(world_size, local).sum(1)  # rows to each rank
        self.receive = counts.view(world_size, local).sum(1)  # rows from each rank
        rows = tokens.flatten(0, 1)[token]
        received = AllToAll.apply(rows, self.send.tolist(), self.receive.tolist()) if world_size > 1 else rows
        # Compute: each of my experts on its rows, whichever rank they came from
        which = torch.arange(local, device=h.device).repeat(world_size).repeat_interleave(counts)
        by_expert = which.argsort(stable=True)
        sizes = counts.view(world_size, local).sum(0).tolist()  # rows for each of my experts
        done = torch.cat([self.experts[str(rank * local + e)](x)
                          for e, x in enumerate(received[by_expert].split(sizes))])[by_expert.argsort()]
        # Combine: back to the rank each row came from, weighted by the router, added to its token
        back = AllToAll.apply(done, self.receive.tolist(), self.send.tolist()) if world_size > 1 else done
        row_weight = weight.transpose(1, 2).flatten()[order]
        out = torch.zeros_like(tokens.flatten(0, 1)).index_add(0, token, back * row_weight[:, None])
        return out.view_as(h)

# --- the model: a mixture of experts in every block -------------------------------------------
torch.manual_seed(args.seed)  # the same initial weights on every rank, and in one process
model = CausalLM(dim=args.dim, depth=args.depth, max_len=args.seq_len).to(device)  # vocabulary 64
for block in model.blocks:
    block.mlp = MoE(args.dim).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

# --- training: each rank its own sequences, and its own experts ------------------------------
mine = slice(rank * args.batch_size // world_size, (rank + 1) * args.batch_size // world_size)
for step in range(1, args.steps + 1):
    tokens = synthetic_tokens(args.batch_size, args.seq_len + 1, seed=1000 * args.seed + step).to(device)
    x, y = tokens[mine, :-1], tokens[mine, 1:]  # this rank's sequences, and the next token of each
    with comm.count_collectives() as sent:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        aux = sum(block.mlp.aux for block in model.blocks)
        ((loss + args.aux_weight * aux) / world_size).backward()  # the mean over ranks, summed below
        for name, p in model.named_parameters():
            if world_size > 1 and ".experts." not in name:  # replicated: add up every rank's part;
                dist.all_reduce(p.grad)  # an expert's gradient came home with the all-to-all
    if step == 1:  # the first gradients, to compare with one process
        torch.save({n: p.grad.cpu() for n, p in model.named_parameters()}, f"{args.out}/grads_rank{rank}.pt")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    moe = [block.mlp for block in model.blocks]
    metrics.log(step, loss=loss.item(), aux_loss=aux.item(), samples=x.shape[0], sent_bytes=sent.sent_bytes,
                **{f"calls_{kind}": n for kind, n in sent.calls.items()},
                **{f"bytes_{kind}": n for kind, n in sent.bytes.items()},
                rows_out=sum(int(m.send.sum() - m.send[rank]) for m in moe),  # to other ranks
                rows_in=sum(int(m.receive.sum() - m.receive[rank]) for m in moe),
                **{f"routed_{b}_{e}": int(m.routed[e]) for b, m in enumerate(moe) for e in range(args.experts)},
                **{f"kept_{b}_{e}": int(m.kept[e]) for b, m in enumerate(moe) for e in range(args.experts)})
    if rank == 0 and step in (1, args.steps):
        dropped = sum(int((m.routed - m.kept).sum()) for m in moe)
        print(f"step {step}: loss {loss.item():.4f} (rank 0's sequences); {dropped} of rank 0's "
              f"{sum(int(m.routed.sum()) for m in moe)} rows dropped; sent {sent.calls}")
torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, f"{args.out}/weights_rank{rank}.pt")
if world_size > 1:
    dist.destroy_process_group()
