"""The lessons' data: CIFAR-10 when it is on disk or can be downloaded, else a synthetic stand-in.

The synthetic set is made from a seed, so every rank builds the same one
without a download: ten classes of 32×32 RGB images, each class a smooth
colour pattern, seen through random shifts, flips, contrast, colour casts, a
faint pattern of another class and pixel noise. A CNN learns it (loss falls,
accuracy climbs far above the 10% of guessing) but not in one step. Smoke
runs and offline machines use it; the returned ``DataSets`` always says which
set you got, and why.

Example (a lesson script)::

    from labkit.data import get_datasets
    data = get_datasets("data", synthetic=args.smoke)
    print(data.description)

Lesson 14's language model reads token sequences instead: ``synthetic_tokens`` draws them from
a seed, as many and as long as asked, with structure at every distance a model can learn::

    from labkit.data import synthetic_tokens
    tokens = synthetic_tokens(8, 129, vocab=64, seed=step)   # inputs tokens[:, :-1], targets tokens[:, 1:]

Longer than the usual module on purpose: lesson scripts import both data sets from this one public
module, and CIFAR-10's download under a process group (every rank's collectives in step) reads
best whole, beside the function that calls it.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import Dataset, Subset

from labkit import _rundir

__all__ = ["DataSets", "SyntheticCIFAR", "get_datasets", "synthetic_tokens", "CIFAR_MEAN", "CIFAR_STD"]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
           "dog", "frog", "horse", "ship", "truck")


@dataclass
class DataSets:
    """The train and test sets, and which data they hold.

    Attributes:
        train, test: map-style datasets of (image tensor 3×32×32, label).
        source: "CIFAR-10" or "synthetic".
        description: one line for the log: what was used, how much, and why.
    """

    train: Dataset
    test: Dataset
    source: str
    description: str


class SyntheticCIFAR(Dataset):
    """A learnable, CIFAR-shaped data set generated from a seed (see the module docstring).

    Args:
        size: number of images.
        seed: the class patterns come from ``seed``; ``split`` picks the images,
            so train and test share patterns but not images.
        split: "train" or "test".
    """

    def __init__(self, size: int, *, seed: int = 0, split: str = "train"):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        patterns = _class_patterns(seed)
        gen = torch.Generator().manual_seed(seed * 1000 + (1 if split == "train" else 2))
        labels = torch.arange(size) % 10
        labels = labels[torch.randperm(size, generator=gen)]
        images = torch.empty(size, 3, 32, 32, dtype=torch.uint8)
        for start in range(0, size, 2048):  # in chunks: little memory at any size
            y = labels[start:start + 2048]
            images[start:start + len(y)] = _render(patterns, y, gen)
        self.images, self.labels = images, labels
        mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        std = torch.tensor(CIFAR_STD).view(3, 1, 1)
        self._scale, self._shift = 1 / (255 * std), mean / std

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = self.images[index].float() * self._scale - self._shift
        return image, int(self.labels[index])


def _class_patterns(seed: int) -> torch.Tensor:
    """Ten smooth colour patterns, 3×32×32 each, roughly in [-1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(10, 3, 4, 4, generator=gen)
    patterns = F.interpolate(coarse, size=(32, 32), mode="bicubic", align_corners=False)
    return patterns / patterns.abs().amax(dim=(1, 2, 3), keepdim=True)


def _render(patterns: torch.Tensor, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    n = len(labels)
    x = patterns[labels].clone()
    other = patterns[(labels + torch.randint(1, 10, (n,), generator=gen)) % 10]
    x = x + 0.35 * other                                      # a faint pattern of another class
    x = x * (0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=gen))  # contrast
    x = x + 0.2 * torch.randn(n, 3, 1, 1, generator=gen)         # colour cast
    shifts = torch.randint(-2, 3, (n, 2), generator=gen)
    flips = torch.rand(n, generator=gen) < 0.5
    for i in range(n):                                        # shift and flip, image by image
        x[i] = torch.roll(x[i], shifts=(int(shifts[i, 0]), int(shifts[i, 1])), dims=(1, 2))
        if flips[i]:
            x[i] = x[i].flip(-1)
    x = x + 0.5 * torch.randn(x.shape, generator=gen)            # pixel noise
    return ((x * 0.22 + 0.48).clamp(0, 1) * 255).round().to(torch.uint8)


CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")


def cifar10_on_disk(data_dir: str | os.PathLike = "data") -> bool:
    """True when all of torchvision's CIFAR-10 files are in ``data_dir`` (``labkit.doctor`` asks too)."""
    return all((Path(data_dir) / CIFAR_FOLDER / name).is_file() for name in CIFAR_FILES)


def _try_download(root: Path, *, aside: bool = False) -> str | None:
    """Download CIFAR-10 into ``root``; None on success, else why it failed. ``aside``: into a
    folder of this process's own first, then moved into place whole, so that nodes which share
    ``root`` but did not yet see each other's files never write the same ones."""
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(20)
    target = root / f".download-{socket.gethostname()}-{os.getpid()}" if aside else root
    try:
        import torchvision

        torchvision.datasets.CIFAR10(str(target), train=True, download=True)
        torchvision.datasets.CIFAR10(str(target), train=False, download=True)
        if aside and not cifar10_on_disk(root):  # another node's copy may have landed meanwhile
            os.replace(target / CIFAR_FOLDER, root / CIFAR_FOLDER)
        return None
    except Exception as err:  # noqa: BLE001 - any failure means: use the synthetic set
        return f"{type(err).__name__}: {err}"
    finally:
        socket.setdefaulttimeout(previous)
        if aside:
            shutil.rmtree(target, ignore_errors=True)


def _first(dataset: Dataset, size: int | None, seed: int) -> Dataset:
    if size is None or size >= len(dataset):
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    return Subset(dataset, order[:size].tolist())


def get_datasets(data_dir: str | os.PathLike = "data", *, synthetic: bool = False,
                 download: bool = True, train_size: int | None = None,
                 test_size: int | None = None, seed: int = 0,
                 augment: bool = True) -> DataSets:
    """CIFAR-10 if on disk (or downloadable), else the synthetic set; always says which.

    Under ``torchrun``, call it after ``init_process_group``: every rank gets the same
    set. Rank 0 downloads while the others wait; a node that still sees no files (no
    shared storage) downloads on its local rank 0. If a rank still lacks CIFAR-10,
    all take the synthetic set, and the description names the ranks without it.

    Args:
        data_dir: where CIFAR-10 is, or goes.
        synthetic: use the synthetic set without looking for CIFAR-10 (smoke runs).
        download: try to download CIFAR-10 when it is not on disk.
        train_size, test_size: use this many images (a fixed random subset; the
            synthetic set's defaults are 10 000 and 2 000).
        seed: the synthetic set's seed, and the subset's.
        augment: random crops and flips for CIFAR-10's training images.

    Returns:
        DataSets(train, test, source, description).
    """
    root = Path(data_dir)
    if synthetic:
        reason = "the script asked for it (synthetic=True, e.g. --synthetic)"
    elif dist.is_available() and dist.is_initialized():
        reason = _everyone_has_cifar10(root, download)
    elif cifar10_on_disk(root):
        reason = None
    elif not download:
        reason = f"CIFAR-10 is not in {root} and download=False"
    else:
        failure = _try_download(root)
        reason = f"CIFAR-10 could not be downloaded ({failure})" if failure else None
    if reason is None:
        import torchvision.transforms as T

        normalize = [T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)]
        train_tf = T.Compose(([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
                              if augment else []) + normalize)
        from torchvision.datasets import CIFAR10

        train = _first(CIFAR10(str(root), train=True, transform=train_tf), train_size, seed)
        test = _first(CIFAR10(str(root), train=False, transform=T.Compose(normalize)),
                      test_size, seed)
        return _noted(DataSets(train, test, "CIFAR-10",
                               f"data: CIFAR-10 from {root} ({_sizes(train, test)})"))
    train = SyntheticCIFAR(train_size or 10_000, seed=seed, split="train")
    test = SyntheticCIFAR(test_size or 2_000, seed=seed, split="test")
    return _noted(DataSets(train, test, "synthetic",
                           f"data: synthetic CIFAR-like set, seed {seed} ({_sizes(train, test)}), "
                           f"because {reason}"))


def _everyone_has_cifar10(root: Path, download: bool) -> str | None:
    """Under a process group: None when every rank sees CIFAR-10 in ``root``, downloading it where
    missing (rank 0 first, then each node's local rank 0), else why not. Each step is decided from
    gathered answers, so every rank makes the same collective calls and takes the same set."""
    first = dist.get_rank() == 0 and download and not cifar10_on_disk(root)
    failure = _try_download(root) if first else None
    have = _everyone(lambda: cifar10_on_disk(root))
    if download and have[0] and not all(have):  # a node without shared storage: it fetches its own
        if os.environ.get("LOCAL_RANK", "0") == "0" and not cifar10_on_disk(root):
            failure = _try_download(root, aside=True)
            if failure:  # only rank 0 prints the data line: say it here, on the rank it happened
                print(f"rank {dist.get_rank()}: CIFAR-10 could not be downloaded ({failure})", flush=True)
        have = _everyone(lambda: cifar10_on_disk(root))
    if all(have):
        return None
    if not any(have):
        return (f"CIFAR-10 could not be downloaded ({failure or 'see rank 0'})" if download else
                f"CIFAR-10 is not in {root} and download=False")
    missing = ", ".join(str(rank) for rank, has in enumerate(have) if not has)
    why = f"the download failed: {failure}" if failure else "the download there failed" if download else "download=False"
    return (f"CIFAR-10 is not in {root} on rank(s) {missing} ({why}), and every rank must train on "
            f"the same set. HINT: put data_dir on storage that every node sees")


def _everyone(check) -> list[bool]:
    """Every rank's answer to ``check()``, in rank order, on the group's device."""
    device = "cpu" if "gloo" in str(dist.get_backend()) else torch.device("cuda", torch.cuda.current_device())

    def gather(value: int) -> list[bool]:
        mine = torch.tensor([value], device=device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return [bool(answer.item()) for answer in every]

    gather(0)  # a barrier first: the check waits for a download that another rank began
    return gather(int(check()))


def _sizes(train, test) -> str:
    return f"{len(train)} train / {len(test)} test image{'' if len(test) == 1 else 's'}"


def _noted(sets: DataSets) -> DataSets:
    """Under labkit.launch, rank 0 writes which data set it got into the run folder, so that a
    run (a reference run shipped to a workshop too) always says what it trained on."""
    run_dir = _rundir.from_env()
    if run_dir and os.environ.get("RANK", "0") == "0":
        try:
            _rundir.write_json(Path(run_dir, _rundir.DATA_FILE),
                               {"source": sets.source, "description": sets.description,
                                "train_size": len(sets.train), "test_size": len(sets.test)})
        except OSError:  # the run folder is the launcher's; never fail training over a note
            pass
    return sets


#: How likely each of a token's successors is in ``synthetic_tokens``' grammar.
SUCCESSOR_PROBABILITIES = (0.55, 0.25, 0.15, 0.05)


def synthetic_tokens(batch_size: int, length: int, *, vocab: int = 64, seed: int = 0,
                     grammar_seed: int = 0) -> torch.Tensor:
    """Token sequences a small language model can learn, drawn from a seed (lesson 14).

    Each sequence starts as a walk through a fixed random grammar: every token has four
    possible successors, with probabilities ``SUCCESSOR_PROBABILITIES``, so the next token is
    partly predictable from the last one. Its second half then repeats its first half, token
    for token, so a model that looks back half a sequence can predict that half exactly: the
    loss falls fast at first (the grammar), and further with attention over long distances.
    The same ``seed`` gives the same tokens on every rank and in every run; ``grammar_seed``
    fixes the grammar, the same for every seed by default.

    Args:
        batch_size: sequences.
        length: tokens per sequence (a language model's inputs are ``tokens[:, :-1]`` and its
            targets ``tokens[:, 1:]``, so draw one more than the model reads).
        vocab: tokens are 0 to ``vocab`` − 1.
        seed: which sequences.
        grammar_seed: which grammar.

    Returns:
        an int64 tensor (batch_size, length).

    Raises:
        ValueError: ``batch_size`` or ``length`` below 1, or ``vocab`` below 4.

    Example (lesson 14)::

        tokens = synthetic_tokens(8, 193, vocab=64, seed=1000 * args.seed + step)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
    """
    if batch_size < 1 or length < 1 or vocab < len(SUCCESSOR_PROBABILITIES):
        raise ValueError(f"synthetic_tokens needs batch_size >= 1, length >= 1 and vocab >= "
                         f"{len(SUCCESSOR_PROBABILITIES)}, got batch_size={batch_size}, length={length}, "
                         f"vocab={vocab}. HINT: synthetic_tokens(8, 129, vocab=64, seed=0).")
    successors = torch.randint(vocab, (vocab, len(SUCCESSOR_PROBABILITIES)),
                               generator=torch.Generator().manual_seed(grammar_seed))
    gen = torch.Generator().manual_seed(seed)
    half = (length + 1) // 2
    choices = torch.multinomial(torch.tensor(SUCCESSOR_PROBABILITIES), batch_size * half,
                                replacement=True, generator=gen).view(batch_size, half)
    tokens = torch.empty(batch_size, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(vocab, (batch_size,), generator=gen)
    for i in range(1, half):  # the walk: each token one of the last one's successors
        tokens[:, i] = successors[tokens[:, i - 1], choices[:, i]]
    tokens[:, half:] = tokens[:, :length - half]  # the second half repeats the first
    return tokens
