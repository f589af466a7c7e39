"""One rank of metrics_cost.py: times lesson 02's training step and metrics.log, side by side.

Started by labkit.launch (so metrics.log writes to a real run folder, as in the
lessons). The step is the body of the training loop of notebooks/scripts/02_ddp.py
(SmallResNet with GroupNorm, wrapped in DDP, gradients all-reduced over gloo, SGD
with momentum and weight decay, the lr scheduler, the loss window), on a fixed
random batch: data loading is left out, which makes the step shorter and the
share of metrics.log larger than in the lesson.

metrics.log is timed two ways: one call right after each training step, with the
fields lesson 02 logs (what it costs in the loop, caches cooled by the step), and
a tight loop of calls after training (what it costs at best). Writes
``bench-rank<R>.json`` in the run folder.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import metrics
from labkit.models import SmallResNet

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, required=True)
parser.add_argument("--batch-size", type=int, required=True, help="per rank")
parser.add_argument("--norm", default="group")
parser.add_argument("--steps", type=int, default=20, help="timed steps, after 3 unmeasured ones")
parser.add_argument("--calls", type=int, default=50_000, help="metrics.log calls in the tight loop")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(SmallResNet(width=args.width, norm=args.norm))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
torch.manual_seed(1 + rank)
x, y = torch.randn(args.batch_size, 3, 32, 32), torch.randint(0, 10, (args.batch_size,))
window_loss = torch.zeros(())

step_ms, call_us = [], []
for step in range(1, args.steps + 4):
    start = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # DDP all-reduces the gradients with the other rank here
    optimizer.step()
    scheduler.step()
    window_loss += loss.detach()
    value = window_loss.item()
    middle = time.perf_counter()
    metrics.log(step, loss=value, samples=args.batch_size, epoch=0, lr=scheduler.get_last_lr()[0])
    end = time.perf_counter()
    window_loss.zero_()
    if step > 3:  # warm-up steps left out
        step_ms.append((middle - start) * 1e3)
        call_us.append((end - middle) * 1e6)

dist.barrier()
tight_us = []
for _ in range(5):
    start = time.perf_counter()
    for step in range(args.calls // 5):
        metrics.log(step, loss=2.3025850929940455, samples=args.batch_size, epoch=0, lr=0.05)
    tight_us.append((time.perf_counter() - start) / (args.calls // 5) * 1e6)
metrics.flush()

result = {"rank": rank, "threads": torch.get_num_threads(),
          "step_ms": statistics.median(step_ms),
          "call_in_loop_us": statistics.median(call_us),
          "call_tight_us": statistics.median(tight_us)}
with open(os.path.join(os.environ[metrics.RUN_DIR_ENV], f"bench-rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
