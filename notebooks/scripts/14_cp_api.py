"""Lesson 14: PyTorch's own context parallel, on GPUs. Inside `context_parallel` every rank keeps
a zig-zag share of q, k and v, and scaled_dot_product_attention runs as ring attention (keys and
values by all-gather, the default): in fp32, then in bf16 with the flash-attention kernel.

Run it:  torchrun --standalone --nproc-per-node=2 scripts/14_cp_api.py
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import context_parallel_unshard
from torch.nn.attention import SDPBackend, sdpa_kernel

from labkit import metrics

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--seq-len", type=int, default=8192, help="a multiple of 2 x the ranks")
parser.add_argument("--heads", type=int, default=8)
args = parser.parse_args()
pieces = 2 * int(os.environ["WORLD_SIZE"])  # zig-zag: two pieces of the sequence on each rank
if args.seq_len % pieces:  # unequal pieces: no zig-zag, and the shares differ from rank to rank
    parser.error(f"{args.seq_len} tokens do not split into {pieces} equal pieces. HINT: a multiple of {pieces}.")

device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # GPUs only: on CPU it stops (see the lesson)
torch.cuda.set_device(device)
dist.init_process_group("nccl")
mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("cp",))


def ring_against_full(q, k, v) -> tuple[int, float]:
    """Tokens this rank held, and the largest gap to full attention relative to its largest value."""
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the whole sequence, one GPU
    shards = [t.clone() for t in (q, k, v)]
    with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2, 2, 2]):  # sharded in place...
        held = shards[0].shape[2]  # ...so each rank holds seq_len / ranks tokens of each
        out = F.scaled_dot_product_attention(*shards, is_causal=True)  # ring attention
    (out,) = context_parallel_unshard(mesh, [out], [2])  # every rank's share, in the sequence's order
    return held, float((out - expected).abs().max() / expected.abs().max())


torch.manual_seed(0)  # the same q, k and v on every rank
q, k, v = (torch.randn(2, args.heads, args.seq_len, 64, device=device) for _ in range(3))
held, error = ring_against_full(q, k, v)
# Flash attention takes bf16 (or fp16) on Ampere or newer; sdpa_kernel makes SDPA use it or fail.
flash = torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability() >= (8, 0)
if flash:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        _, flash_error = ring_against_full(*(t.bfloat16() for t in (q, k, v)))
else:
    flash_error = float("nan")
metrics.log(0, max_error=error, flash_error=flash_error, tokens_held=held)
print(f"rank {dist.get_rank()}: held {held} of {args.seq_len} tokens; within {error:.1e} of full attention"
      + (f"; in bf16 with flash attention within {flash_error:.1e}" if flash else
         "; no flash attention on this GPU (it needs compute capability 8.0 or newer)"))
dist.destroy_process_group()
