"""Lesson 01: train a small ResNet on one device, and time it honestly.

Run it:  python scripts/01_single.py --synthetic --epochs 1
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from labkit import metrics
from labkit.data import get_datasets
from labkit.models import SmallResNet

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--width", type=int, default=32, help="channels of the first block")
parser.add_argument("--train-size", type=int, default=None, help="use a subset of this many images")
parser.add_argument("--test-size", type=int, default=None)
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
parser.add_argument("--log-every", type=int, default=10, help="steps between metrics lines")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--data-dir", default="data")
parser.add_argument("--synthetic", action="store_true", help="the synthetic set, no CIFAR-10")
args = parser.parse_args()

torch.manual_seed(args.seed)  # same seed, same initial weights and data order: runs compare
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
data = get_datasets(args.data_dir, synthetic=args.synthetic, train_size=args.train_size,
                    test_size=args.test_size, seed=args.seed)
print(data.description)
print(f"device: {device}, threads: {torch.get_num_threads()}")

# Pinned (page-locked) host memory lets the copy to the GPU run asynchronously;
# worker processes prepare the next batches while this one trains.
pin = device.type == "cuda"
train_loader = DataLoader(data.train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                          num_workers=args.workers, persistent_workers=args.workers > 0,
                          pin_memory=pin)
test_loader = DataLoader(data.test, batch_size=256, num_workers=args.workers, pin_memory=pin)

model = SmallResNet(width=args.width).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")


def evaluate() -> float:
    model.eval()  # BatchNorm uses its running statistics, not the batch's
    correct = total = 0
    with torch.no_grad():
        for x, y in test_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    model.train()
    return correct / total


step = 0
window_loss = torch.zeros((), device=device)  # summed on the device: no sync per step
for epoch in range(args.epochs):
    epoch_start = time.perf_counter()
    for x, y in train_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)  # frees the old gradients instead of writing zeros
        loss.backward()
        optimizer.step()
        window_loss += loss.detach()
        step += 1
        if step % args.log_every == 0:
            # .item() waits for the device to finish: a sync point, once per window,
            # so the time metrics.log stamps is when this window's work really ended.
            metrics.log(step, loss=(window_loss / args.log_every).item(),
                        samples=args.log_every * args.batch_size, epoch=epoch)
            window_loss.zero_()
    accuracy = evaluate()
    metrics.log(step, test_acc=accuracy, epoch=epoch)
    print(f"epoch {epoch}: last loss {loss.item():.3f}, test accuracy {accuracy:.1%}, "
          f"{time.perf_counter() - epoch_start:.1f} s")
