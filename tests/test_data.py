"""labkit.data: the synthetic set is deterministic and learnable; CIFAR-10 falls back clearly."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import labkit
from labkit.data import SyntheticCIFAR, get_datasets


def test_synthetic_is_deterministic_and_shaped_like_cifar():
    a, b = SyntheticCIFAR(64, seed=3), SyntheticCIFAR(64, seed=3)
    image, label = a[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= label < 10
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, SyntheticCIFAR(64, seed=4).images)
    counts = torch.bincount(a.labels, minlength=10)
    assert counts.max() - counts.min() <= 1  # balanced classes


def test_train_and_test_share_patterns_but_not_images():
    train, test = SyntheticCIFAR(256, split="train"), SyntheticCIFAR(256, split="test")
    assert not torch.equal(train.images[:10], test.images[:10])


def test_synthetic_is_learnable_well_above_chance():
    """A linear model on the images beats guessing (10%) by far after a few passes."""
    torch.manual_seed(0)
    data = get_datasets(synthetic=True, train_size=2000, test_size=500)
    x = torch.stack([data.train[i][0] for i in range(len(data.train))]).flatten(1)
    y = torch.tensor([data.train[i][1] for i in range(len(data.train))])
    xt = torch.stack([data.test[i][0] for i in range(len(data.test))]).flatten(1)
    yt = torch.tensor([data.test[i][1] for i in range(len(data.test))])
    model = torch.nn.Linear(x.shape[1], 10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(60):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    accuracy = (model(xt).argmax(1) == yt).float().mean().item()
    assert accuracy > 0.3, accuracy


def test_it_always_says_which_data_and_why(tmp_path):
    smoke = get_datasets(tmp_path, synthetic=True, train_size=32, test_size=16)
    assert smoke.source == "synthetic" and "the script asked for it" in smoke.description
    offline = get_datasets(tmp_path, download=False, train_size=32, test_size=16)
    assert offline.source == "synthetic"
    assert "CIFAR-10 is not in" in offline.description and "download=False" in offline.description


def _stand_in_cifar(root) -> None:
    """CIFAR-10's files and format, four random images per batch (the real set is offline here)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (4, 3 * 32 * 32), dtype=np.uint8), "labels": [0, 1, 2, 3]}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [str(i) for i in range(10)]}))


def test_cifar_is_augmented_only_when_asked(tmp_path, monkeypatch):
    """Random crops and flips are drawn anew each time an image is read; augment=False (what the
    lessons that compare runs ask for) reads the same tensor whatever the random state."""
    import torchvision.datasets.cifar as cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda *args, **kwargs: True)  # no real md5s
    _stand_in_cifar(tmp_path)
    plain = get_datasets(tmp_path, download=False, augment=False)
    assert plain.source == "CIFAR-10" and len(plain.train) == 20 and len(plain.test) == 4
    reads = []
    for seed in range(8):
        torch.manual_seed(seed)
        reads.append(plain.train[0][0])
    assert all(torch.equal(reads[0], r) for r in reads[1:])
    augmented = get_datasets(tmp_path, download=False)
    torch.manual_seed(0)
    draws = [augmented.train[0][0] for _ in range(8)]
    assert any(not torch.equal(draws[0], d) for d in draws[1:]), "eight identical random crops"
    torch.manual_seed(1)
    first = augmented.test[0][0]
    assert all(torch.equal(first, augmented.test[0][0]) for _ in range(4)), "test images are never augmented"


def test_under_a_launch_rank_0_notes_the_data_in_the_run_folder(tmp_path, monkeypatch):
    from labkit import Run
    from labkit.metrics import RUN_DIR_ENV

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text('{"name": "r", "command": "", "nproc": 1}')
    assert Run.load(run_dir).data is None, "a run whose script never asked for data says nothing"
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
    monkeypatch.setenv("RANK", "1")
    get_datasets(tmp_path, synthetic=True, train_size=8, test_size=8)
    assert Run.load(run_dir).data is None, "only rank 0 writes the note"
    monkeypatch.setenv("RANK", "0")
    get_datasets(tmp_path, download=False, train_size=8, test_size=5)
    assert Run.load(run_dir).data == "synthetic"
    note = json.loads((run_dir / "data.json").read_text())
    assert "download=False" in note["description"] and "5 test images" in note["description"]
    assert (note["train_size"], note["test_size"]) == (8, 5), "lesson 01 reads the test-set size here"


def test_a_download_aside_is_moved_into_place_whole(tmp_path, monkeypatch):
    """A node's own download goes to a folder of its own, then into place in one rename; where
    another node's copy landed meanwhile, that copy stays and the spare one is removed."""
    import torchvision

    from labkit import data

    def fake_cifar10(root, train, download):  # what torchvision leaves: the folder, whole
        if not data.cifar10_on_disk(root):
            _stand_in_cifar(Path(root))

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", fake_cifar10)
    assert data._try_download(tmp_path / "data", aside=True) is None
    assert data.cifar10_on_disk(tmp_path / "data") and os.listdir(tmp_path / "data") == ["cifar-10-batches-py"]
    marker = tmp_path / "data" / "cifar-10-batches-py" / "batches.meta"
    before = marker.stat().st_mtime_ns
    assert data._try_download(tmp_path / "data", aside=True) is None  # another node's copy is there
    assert marker.stat().st_mtime_ns == before and os.listdir(tmp_path / "data") == ["cifar-10-batches-py"]


# Four cases, one launch: two nodes of two ranks, each node with a disk of its own ("own0", "own1")
# beside one both see ("shared"). The download is the stand-in's, and counted.
EVERY_RANK_THE_SAME_SET = """
import os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
import torch.distributed as dist
import torchvision.datasets.cifar as cifar
from labkit import data
from test_data import _stand_in_cifar

cifar.check_integrity = lambda *args, **kwargs: True  # the stand-in has no real md5s
tried = []

def download(root, works, aside=False):  # what torchvision's download leaves, without the network
    tried.append(str(root) + (" aside" if aside else ""))
    if not works:
        return "URLError: no network here"
    _stand_in_cifar(Path(root))

if torch.cuda.is_available():  # NCCL gathers on the GPU: the group's device must be right
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, node = dist.get_rank(), os.environ["GROUP_RANK"]
if rank == 0:
    _stand_in_cifar(Path("copy0"))  # node 0's disk has a copy (before get_datasets), node 1's none
for case, root, download_ok, allowed in [("shared", "shared", True, True), ("own", f"own{{node}}", True, True),
                                         ("copy", f"copy{{node}}", True, False), ("offline", f"off{{node}}", False, True)]:
    tried.clear()
    data._try_download = lambda root, aside=False, works=download_ok: download(root, works, aside)
    sets = data.get_datasets(root, download=allowed, train_size=8, test_size=4)
    print(f"{{case}}: {{sets.source}}, downloaded {{tried}}", flush=True)
    if rank == 0:
        print(f"{{case}} says {{sets.description}}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.launch
def test_every_rank_gets_the_same_set_on_nodes_with_disks_of_their_own(workdir, write_script):
    """Before, rank 0 alone downloaded and each rank then looked at its own disk: a node without
    shared storage trained on the synthetic set beside nodes on CIFAR-10, and said so nowhere
    rank 0 printed. Now rank 0 downloads first (once, for storage every node shares), a node that
    still sees nothing downloads on its local rank 0, and if any rank still lacks the files every
    rank takes the synthetic set, named by rank 0. Two nodes of two: local rank 1 must not fetch."""
    write_script("sets.py", EVERY_RANK_THE_SAME_SET.format(tests=str(Path(__file__).parent)))
    run = labkit.launch("sets.py", nproc=2, nnodes=2, device="cpu", timeout_s=180, quiet=True)
    said = {rank: run.output(rank) for rank in range(4)}
    expected = {  # case: (the set every rank takes, the folders each rank downloaded into)
        "shared": ("CIFAR-10", [["shared"], [], [], []]),
        "own": ("CIFAR-10", [["own0"], [], ["own1 aside"], []]),  # aside: moved into place whole
        "copy": ("synthetic", [[], [], [], []]),
        "offline": ("synthetic", [["off0"], [], [], []]),
    }
    for case, (source, downloads) in expected.items():
        for rank, folders in enumerate(downloads):
            assert f"{case}: {source}, downloaded {folders}" in said[rank], (case, rank, said[rank])
    assert "copy says data: synthetic" in said[0] and "on rank(s) 2, 3 (download=False)" in said[0]
    assert "offline says data: synthetic" in said[0] and "could not be downloaded (URLError: no network" in said[0]
    assert "HINT: put data_dir on storage that every node sees" in said[0]


@pytest.mark.gpu
@pytest.mark.launch
def test_the_ranks_agree_over_nccl(workdir, write_script):
    """The same cases under NCCL, whose gathers need tensors on each rank's own GPU: two ranks
    where two GPUs are visible, else one. On one node every rank sees node 0's folders, so rank 0
    alone downloads and the copy on node 0 is every rank's."""
    from labkit import _hardware

    ranks = min(2, _hardware.gpu_count())
    write_script("sets.py", EVERY_RANK_THE_SAME_SET.format(tests=str(Path(__file__).parent)))
    run = labkit.launch("sets.py", nproc=ranks, timeout_s=180, quiet=True)
    expected = {"shared": ("CIFAR-10", ["shared"]), "own": ("CIFAR-10", ["own0"]),
                "copy": ("CIFAR-10", []), "offline": ("synthetic", ["off0"])}
    for rank in range(ranks):
        for case, (source, folders) in expected.items():
            line = f"{case}: {source}, downloaded {folders if rank == 0 else []}"
            assert line in run.output(rank), (rank, run.output(rank))


# -- token sequences for lesson 14's language model ---------------------------------------------
def test_tokens_are_deterministic_in_range_and_shaped():
    from labkit.data import synthetic_tokens

    a = synthetic_tokens(4, 33, vocab=16, seed=5)
    assert a.shape == (4, 33) and a.dtype == torch.int64
    assert 0 <= int(a.min()) and int(a.max()) < 16
    assert torch.equal(a, synthetic_tokens(4, 33, vocab=16, seed=5))
    assert not torch.equal(a, synthetic_tokens(4, 33, vocab=16, seed=6))


def test_tokens_follow_the_grammar_and_the_second_half_repeats_the_first():
    from labkit.data import SUCCESSOR_PROBABILITIES, synthetic_tokens

    def successors(*batches):
        """{token: the tokens seen right after it} in the first halves (the walks) of ``batches``."""
        found = {}
        for tokens in batches:
            for first, second in zip(tokens[:, :50].flatten().tolist(), tokens[:, 1:51].flatten().tolist()):
                found.setdefault(first, set()).add(second)
        return found

    tokens = synthetic_tokens(64, 101, vocab=32, seed=0)
    assert torch.equal(tokens[:, 51:], tokens[:, :50])   # 101 tokens: a walk of 51, then 50 again
    most = len(SUCCESSOR_PROBABILITIES)
    same = successors(tokens, synthetic_tokens(64, 101, vocab=32, seed=1))
    assert max(len(s) for s in same.values()) <= most        # every seed walks one grammar
    other = successors(tokens, synthetic_tokens(64, 101, vocab=32, seed=1, grammar_seed=1))
    assert max(len(s) for s in other.values()) > most        # another grammar: other successors


def test_a_small_language_model_learns_the_tokens():
    """CausalLM's loss falls from ln(vocab), guessing, to below half of it in 60 steps."""
    import math

    from labkit.data import synthetic_tokens
    from labkit.models import CausalLM

    torch.manual_seed(0)
    model = CausalLM(vocab=64, dim=32, depth=1, heads=2, max_len=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(60):
        tokens = synthetic_tokens(8, 49, vocab=64, seed=step)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * math.log(64), loss.item()


def test_bad_token_sizes_are_a_clear_error():
    import pytest

    from labkit.data import synthetic_tokens

    with pytest.raises(ValueError, match=r"length >= 1.*got batch_size=2, length=0.*HINT"):
        synthetic_tokens(2, 0)
