"""Exercise 08-bf16: bf16 autocast and bf16 gradient compression under DDP, against float32.

The skeleton profiles one training step and saves each rank's trace in the run folder; it logs
each step's loss, the type of the first convolution's output, and the calls to
``optimizer.step()``; at the end, the type of the weights and how far apart the ranks' weights
are. The check counts the bytes of the profiled step's all-reduces from the trace
(``labkit.read_trace``, as lesson 07 does) and trains the same model on the same batches in
float32, in one process, to follow the learner's loss.
"""

from __future__ import annotations

from labkit._course.checks._common import _config, _metrics, _ranks
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "08-bf16"

HINTS = [
    "Two small places. DDP takes a communication hook with model.register_comm_hook(state, hook), "
    "before the first backward pass; PyTorch's own hooks are in default_hooks (imported at the top). "
    "Autocast is a context manager: with torch.autocast(device_type, dtype=...):, around the forward pass.",
    "model.register_comm_hook(None, default_hooks.bf16_compress_hook): None is the hook's state (the default "
    "process group). In the step: with torch.autocast(device.type, dtype=torch.bfloat16): loss = "
    "F.cross_entropy(model(x), y). bfloat16, not float16: bf16 keeps float32's range and needs no scaler.",
    "Leave the weights float32 (no model.to(torch.bfloat16)): autocast computes in bf16 from float32 weights. The "
    "step, in full: with torch.autocast(device.type, dtype=torch.bfloat16): loss = F.cross_entropy(model(x), y); "
    "then, outside the with-block, loss.backward(); optimizer.step() (once).",
]

#: The settings the skeleton logs at step 0.
SETTINGS = ["steps", "batch_size", "width", "lr", "seed", "profile_step", "param_bytes"]
#: How far the loss of any step may be from float32 training's (bf16 rounds to ~3 digits).
LOSS_TOL = 0.02
_TYPES = {"c10::BFloat16": "bfloat16", "c10::Half": "float16", "float": "float32", "double": "float64"}


@check
def check_bf16(target="scripts/ex08_bf16.py", *, timeout_s: float = 240) -> Feedback:
    """Exercise 08-bf16: DDP all-reduces the gradients as bfloat16 (half the bytes), the forward
    pass runs under bf16 autocast from float32 weights, the ranks stay identical, and the loss
    follows float32 training within ``LOSS_TOL`` at every step.

    Launches the script on 2 ranks (every GPU, if there are two or more).

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/08_speed.ipynb)::

        labkit.check_bf16("scripts/ex08_bf16.py")
    """
    feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-08-bf16", **_ranks(2))
    df = _metrics(feedback, run, ["loss", "conv_dtype", "step_calls", "replica_gap", "param_dtype", *SETTINGS])
    setting = _config(df, SETTINGS)
    _bytes_halved(feedback, run, int(setting["param_bytes"]))
    _autocast(feedback, df)
    _weights(feedback, df, run.nproc)
    _loss_follows_float32(feedback, df, setting, run.nproc)
    return feedback


def _bytes_halved(feedback: Feedback, run, param_bytes: int) -> None:
    """Every rank's profiled step all-reduced the gradients once, as bfloat16: half the bytes."""
    from labkit._diagnose.trace import read_trace

    sent = {}
    for rank in range(run.nproc):
        path = run.run_dir / f"trace_rank{rank}.json"
        if not path.is_file():
            feedback.stop(f"rank {rank} saved no trace ({path.name} in the run folder): keep the skeleton's "
                          f"profile(...) around the step and its prof.export_chrome_trace(...) line.")
        trace = read_trace(path)
        reduces = trace[trace["collective"] == "all_reduce"]
        types = tuple(sorted({_TYPES.get(t, t) for dtypes in reduces["dtypes"] for t in (dtypes or [])}))
        sent[rank] = (int(reduces["bytes"].sum()), types)
    found = set(sent.values())
    if len(found) > 1:
        feedback.fail("the ranks all-reduced different bytes in the profiled step: "
                      + "; ".join(f"rank {r} {b:,} bytes as {', '.join(t)}" for r, (b, t) in sent.items())
                      + ". Every rank must register the same hook.", hint=2)
        return
    (sent_bytes, types), = found
    if sent_bytes == 0:
        feedback.fail("the profiled step all-reduced nothing: DDP all-reduces in loss.backward(), through hooks it "
                      "put on the model's parameters when it wrapped them. Call loss.backward() in every step, and "
                      "do not convert the model after wrapping it (model.to(...) gives it new parameter tensors, "
                      "which DDP's hooks do not see).", hint=3)
    elif sent_bytes * 2 == param_bytes and types == ("bfloat16",):
        feedback.ok(f"DDP all-reduced {sent_bytes:,} bytes a step, as bfloat16: half of float32's {param_bytes:,} "
                    f"(counted in the profiler's trace)")
    elif sent_bytes * 2 == param_bytes and types == ("float16",):
        feedback.fail(f"DDP all-reduced half the bytes ({sent_bytes:,}), but as float16 (fp16_compress_hook): this "
                      f"exercise asks for bf16_compress_hook. float16's largest number is 65504 and its smallest "
                      f"about 6e-8, where bfloat16 keeps float32's range.", hint=2)
    elif sent_bytes == param_bytes and types == ("float32",):
        feedback.fail(f"DDP all-reduced {sent_bytes:,} bytes a step, as float32: 4 bytes for each gradient value, "
                      f"uncompressed. Register default_hooks.bf16_compress_hook on the DDP model with "
                      f"model.register_comm_hook(None, ...), before the first backward pass.", hint=1)
    else:
        feedback.fail(f"DDP all-reduced {sent_bytes:,} bytes a step as {', '.join(types) or 'nothing known'}; the "
                      f"gradients are {param_bytes:,} bytes in float32, so bf16 compression sends "
                      f"{param_bytes // 2:,}, each gradient once.", hint=2)


def _autocast(feedback: Feedback, df) -> None:
    """The first convolution computed in bfloat16 at every step, on every rank."""
    seen = sorted(set(df.dropna(subset=["loss"])["conv_dtype"]))
    if seen == ["torch.bfloat16"]:
        feedback.ok("the forward pass ran under bf16 autocast (the first convolution's output was bfloat16)")
    elif seen == ["torch.float32"]:
        feedback.fail("the forward pass ran in float32: put the forward pass and the loss inside "
                      "with torch.autocast(device.type, dtype=torch.bfloat16):", hint=1)
    elif seen == ["torch.float16"]:
        feedback.fail("the forward pass ran in float16: ask autocast for dtype=torch.bfloat16. float16 needs a "
                      "GradScaler, or small gradients round to zero; bfloat16 does not.", hint=2)
    elif seen == ["none"]:
        feedback.fail("the model never ran a forward pass in the training steps: call model(x) in each step.",
                      hint=3)
    else:
        feedback.fail(f"the first convolution's output was {', '.join(s.replace('torch.', '') for s in seen)} in "
                      f"different steps: run every step's forward pass under the same bf16 autocast.", hint=2)


def _weights(feedback: Feedback, df, world: int) -> None:
    """One optimizer step per training step; weights float32 and equal on every rank."""
    calls = sorted(set(df.dropna(subset=["step_calls"])["step_calls"].astype(int)))
    feedback.expect(calls == [1], "optimizer.step() ran once in every step",
                    f"optimizer.step() ran {' or '.join(map(str, calls))} time(s) in a step: once, after "
                    f"loss.backward(), is right.", hint=3)
    dtypes = sorted(set(df.dropna(subset=["param_dtype"])["param_dtype"]))
    feedback.expect(dtypes == ["torch.float32"], "the weights stayed float32 (autocast computes in bf16 from them)",
                    f"the weights are {', '.join(d.replace('torch.', '') for d in dtypes)}: autocast needs no "
                    f"conversion of the model, and the optimizer must add its small updates to float32 weights "
                    f"(in bf16, with 8 significant bits, most of them would round away). Remove the model's "
                    f"conversion.", hint=3)
    gaps = df.dropna(subset=["replica_gap"]).groupby("rank")["replica_gap"].last()
    feedback.expect(len(gaps) == world and (gaps == 0).all(),
                    f"every rank ended with the very same weights (compression happens before the all-reduce, "
                    f"so all ranks apply the same update)",
                    f"the ranks ended with different weights (up to {gaps.max():.2e} apart): every rank must "
                    f"train the same DDP model with the same hook.", hint=2)


def _float32_losses(seed: int, world: int, batch_size: int, width: int, lr: float, steps: int) -> list:
    """The mean over ranks of each step's loss, in float32 on one process: what the skeleton's
    data gives every rank (seed + 1 + rank), one batch of all of it, plain DDP's maths."""
    import torch
    import torch.nn.functional as F

    from labkit.models import SmallResNet

    torch.manual_seed(seed)
    model = SmallResNet(width=width, norm="group")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    batches = []
    for rank in range(world):
        data = torch.Generator().manual_seed(seed + 1 + rank)
        batches.append((torch.randn(batch_size, 3, 32, 32, generator=data),
                        torch.randint(0, 10, (batch_size,), generator=data)))
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits, y)  # the mean over equal shares = the mean of the ranks' losses
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
    return losses


def _loss_follows_float32(feedback: Feedback, df, setting: dict, world: int) -> None:
    from labkit._results.losses import loss_by_step

    steps = int(setting["steps"])
    got = loss_by_step(df)
    if list(got.index) != list(range(1, steps + 1)):
        feedback.fail(f"the skeleton logs the loss of each of the {steps} steps; it logged steps "
                      f"{list(got.index)}: keep its loop and its metrics.log(...) as they are.")
        return
    want = _float32_losses(int(setting["seed"]), world, int(setting["batch_size"]), int(setting["width"]),
                           float(setting["lr"]), steps)
    gaps = [abs(g - w) for g, w in zip(got, want)]
    worst = max(range(steps), key=gaps.__getitem__)
    feedback.expect(gaps[worst] <= LOSS_TOL,
                    f"the loss follows float32 training on the same batches: within {gaps[worst]:.1e} at every "
                    f"step (tolerance {LOSS_TOL:g}; {got.iloc[0]:.3f} → {got.iloc[-1]:.3f})",
                    f"at step {worst + 1} the loss is {got.iloc[worst]:.3f}, where float32 training on the same "
                    f"batches reaches {want[worst]:.3f} (tolerance {LOSS_TOL:g}): bf16 should round the maths, not "
                    f"change the training.", hint=3)
