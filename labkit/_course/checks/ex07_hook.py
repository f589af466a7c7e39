"""Exercise 07-hook: DDP's all-reduce written by hand, as a communication hook that sends bfloat16.

The skeleton wraps the model in DDP with small buckets, registers the learner's hook, profiles
one training step and saves each rank's trace in the run folder. It logs each step's loss and
what the hook says it sent (``hook_bytes``, ``hook_calls``), and at the end how far apart the
ranks' weights are. In the profiled step its last rank starts late. The check reads that step's
trace as lesson 07 does (``labkit.read_trace``): the bytes and type of every all-reduce, and
whether rank 0's backward pass went on while an all-reduce waited for the late rank. It trains
the same model on the same batches in float32, in one process, to follow the learner's loss.
"""

from __future__ import annotations

from labkit._course.checks._common import _config, _metrics, _ranks
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "07-hook"

HINTS = [
    "A hook gets the bucket's gradients as one flat tensor, bucket.buffer(). Do to it what PyTorch's "
    "bf16_compress_hook does: a bfloat16 copy, averaged over the ranks; an all_reduce of it that does not "
    "wait (async_op=True); and a future that, once the all-reduce is done, puts the result back into the "
    "float32 buffer.",
    "compressed = buffer.to(torch.bfloat16).div_(world_size) makes the copy and divides it first (an "
    "all_reduce adds; DDP wants the mean). dist.all_reduce(compressed, async_op=True).get_future() returns "
    "at once. What went on the wire is compressed.numel() * compressed.element_size() bytes: add that to "
    "state['bytes'], and 1 to state['calls'].",
    "The end of the hook: def decompress(done): buffer.copy_(done.value()[0]); return buffer. Then "
    "return future.then(decompress). Never call .wait() inside the hook: the backward pass would stop there "
    "until the all-reduce is done, and nothing would overlap.",
]

#: The settings the skeleton logs at step 0.
SETTINGS = ["steps", "batch_size", "width", "lr", "seed", "profile_step", "late_s", "param_bytes"]
#: How far the loss of any step may be from float32 training's (bf16 rounds to ~3 digits).
LOSS_TOL = 0.02
_TYPES = {"c10::BFloat16": "bfloat16", "c10::Half": "float16", "float": "float32", "double": "float64"}


@check
def check_hook(target="scripts/ex07_hook.py", *, timeout_s: float = 240) -> Feedback:
    """Exercise 07-hook: the learner's hook all-reduces every gradient once as bfloat16 (half the
    bytes, counted in the trace), counts what it sent, does not wait (its all-reduces overlap the
    backward pass), and averages: the ranks stay identical and the loss follows float32 training
    within ``LOSS_TOL`` at every step.

    Launches the script on 2 ranks (every GPU, if there are two or more).

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/07_profiling.ipynb)::

        labkit.check_hook("scripts/ex07_hook.py")
    """
    feedback, run = launched(EXERCISE, target, timeout_s=timeout_s, name="check-07-hook", **_ranks(2))
    df = _metrics(feedback, run, ["loss", "hook_bytes", "hook_calls", "replica_gap", *SETTINGS])
    setting = _config(df, SETTINGS)
    traces = _traces(feedback, run)
    sent = _bytes_halved(feedback, traces, int(setting["param_bytes"]))
    _counted(feedback, df, traces, int(setting["profile_step"]), sent)
    _overlap(feedback, traces, int(setting["profile_step"]), float(setting["late_s"]))
    _averaged(feedback, df, setting, run.nproc)
    return feedback


def _traces(feedback: Feedback, run) -> dict:
    """{rank: the profiled step's trace}; a rank without one ends the check."""
    from labkit._diagnose.trace import read_trace

    found = {}
    for rank in range(run.nproc):
        path = run.run_dir / f"trace_rank{rank}.json"
        if not path.is_file():
            feedback.stop(f"rank {rank} saved no trace ({path.name} in the run folder): keep the skeleton's "
                          f"profile(...) around the step and its prof.export_chrome_trace(...) line.")
        found[rank] = read_trace(path)
    return found


def _bytes_halved(feedback: Feedback, traces: dict, param_bytes: int) -> int | None:
    """Every rank's profiled step all-reduced every gradient once, as bfloat16: half the bytes."""
    sent = {}
    for rank, trace in traces.items():
        reduces = trace[trace["collective"] == "all_reduce"]
        types = tuple(sorted({_TYPES.get(t, t) for dtypes in reduces["dtypes"] for t in (dtypes or [])}))
        sent[rank] = (int(reduces["bytes"].sum()), types)
    found = set(sent.values())
    if len(found) > 1:
        feedback.stop("the ranks all-reduced different bytes in the profiled step: "
                      + "; ".join(f"rank {r} {b:,} bytes as {', '.join(t)}" for r, (b, t) in sent.items())
                      + ". Every rank registers the same hook, and it must send the same on each.", hint=1)
    (sent_bytes, types), = found
    if sent_bytes * 2 == param_bytes and types == ("bfloat16",):
        feedback.ok(f"your hook all-reduced {sent_bytes:,} bytes a step, as bfloat16: half of float32's "
                    f"{param_bytes:,}, every gradient once (counted in the profiler's trace)")
        return sent_bytes
    if sent_bytes == 0:
        feedback.stop("the profiled step all-reduced nothing: the hook must call dist.all_reduce on the "
                      "bucket's values, and return a future of the result.", hint=1)
    if sent_bytes == param_bytes and types == ("float32",):
        feedback.fail(f"your hook all-reduced {sent_bytes:,} bytes a step, as float32: 4 bytes a gradient "
                      f"value, uncompressed. All-reduce a bfloat16 copy of the bucket: "
                      f"buffer.to(torch.bfloat16).", hint=1)
    else:
        feedback.fail(f"your hook all-reduced {sent_bytes:,} bytes a step as {', '.join(types) or 'nothing known'}; "
                      f"the gradients are {param_bytes:,} bytes in float32, so bfloat16 sends "
                      f"{param_bytes // 2:,}, each gradient once.", hint=2)
    return None


def _counted(feedback: Feedback, df, traces: dict, step: int, sent: int | None) -> None:
    """The hook's own count of the profiled step equals what the trace saw: the bytes on the wire."""
    trace = traces[0]
    reduces = trace[trace["collective"] == "all_reduce"]
    on_wire, calls = int(reduces["bytes"].sum()), len(reduces)
    row = df[(df["step"] == step) & (df["rank"] == 0)].dropna(subset=["hook_bytes"])
    if row.empty:
        feedback.fail(f"the skeleton logs hook_bytes at every step; nothing at step {step}: keep its "
                      f"metrics.log(...) lines as they are.")
        return
    counted, counted_calls = int(row["hook_bytes"].iloc[0]), int(row["hook_calls"].iloc[0])
    numel = sum(int(b // 2) for b in reduces["bytes"]) if sent else None
    if counted == on_wire and counted_calls == calls:
        feedback.ok(f"your hook counted what it sent: {counted:,} bytes in {counted_calls} all-reduce(s) at "
                    f"step {step}, as the trace says")
    elif counted_calls != calls:
        feedback.fail(f"your hook counted {counted_calls} call(s) at step {step}, and the trace holds {calls} "
                      f"all-reduce(s), one per bucket: add 1 to state['calls'] each time the hook runs.", hint=2)
    elif numel is not None and counted == numel:
        feedback.fail(f"your hook counted {counted:,} at step {step}: the number of values sent, not the "
                      f"bytes ({on_wire:,}). Multiply by compressed.element_size() (2 for bfloat16).", hint=2)
    elif counted == 2 * on_wire:
        feedback.fail(f"your hook counted {counted:,} bytes at step {step}: the float32 bucket's size. What went "
                      f"on the wire is the bfloat16 copy, {on_wire:,} bytes: count the tensor you all-reduce.",
                      hint=2)
    else:
        feedback.fail(f"your hook counted {counted:,} bytes at step {step}, and the trace saw {on_wire:,} "
                      f"all-reduced: add compressed.numel() * compressed.element_size() to state['bytes'] for "
                      f"each bucket.", hint=2)


def _overlap(feedback: Feedback, traces: dict, step: int, late_s: float) -> None:
    """The hook returned at once: rank 0's backward pass went on while its all-reduce waited.

    The skeleton starts the last rank ``late_s`` late in the profiled step, so rank 0's first
    all-reduce lasts at least that long. It starts inside the gradient computation whose hook
    sent it. A hook that waits holds that computation open until the all-reduce is done (nearly
    all of the all-reduce's time passes inside it); one that returns a future lets it end at once
    (almost none does). Judged on that long all-reduce alone: the short ones may finish before
    any hook returns, and would look the same either way on a busy machine."""
    trace = traces[0]  # the profiled step alone: the skeleton profiles one step, without a schedule
    compute = trace[trace["name"].str.startswith("autograd::engine::evaluate_function")]
    comm = trace[trace["collective"] == "all_reduce"]
    if comm.empty or compute.empty or (trace["device"] == "gpu").any():
        return  # GPUs: NCCL's kernels run on their own stream whether or not the hook waits
    longest = comm.loc[comm["dur_ms"].idxmax()]
    if longest["dur_ms"] < 500 * late_s:
        feedback.stop(f"rank 0's longest all-reduce in step {step} took {longest['dur_ms']:.1f} ms, and the "
                      f"last rank starts that step {1000 * late_s:.0f} ms late: keep the skeleton's "
                      f"time.sleep(args.late_s) inside the profiled step, so that the check can see "
                      f"whether your hook waits.")
    sender = compute[(compute["start_ms"] <= longest["start_ms"]) & (compute["end_ms"] > longest["start_ms"])]
    held = (min(float(sender["end_ms"].max()), float(longest["end_ms"])) - float(longest["start_ms"])
            if len(sender) else 0.0)
    share = held / float(longest["dur_ms"])
    feedback.expect(share < 0.5,
                    f"your hook returned without waiting: rank 0's backward pass went on while its first "
                    f"all-reduce waited {longest['dur_ms']:.0f} ms for the late rank (step {step}: "
                    f"{share:.0%} of that time inside the computation that sent it)",
                    f"the hook waited for each all-reduce before the backward pass went on: rank 0's "
                    f"all-reduce waited {longest['dur_ms']:.0f} ms for the late rank, and {share:.0%} of that "
                    f"time passed inside the gradient computation that sent it (step {step}). Return the "
                    f"future without calling .wait(), and all-reduce with async_op=True.", hint=3)


def _float32_losses(seed: int, world: int, batch_size: int, width: int, lr: float, steps: int) -> list:
    """The mean over ranks of each step's loss, in float32 on one process: one batch of every
    rank's data (seed + 1 + rank), DDP's maths without compression."""
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
        loss = F.cross_entropy(model(x), y)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
    return losses


def _averaged(feedback: Feedback, df, setting: dict, world: int) -> None:
    """The ranks stay identical, and the loss follows float32 training: the hook averaged."""
    from labkit._results.losses import loss_by_step

    gaps = df.dropna(subset=["replica_gap"]).groupby("rank")["replica_gap"].last()
    feedback.expect(len(gaps) == world and (gaps == 0).all(),
                    "every rank ended with the very same weights (each received the same all-reduced bucket)",
                    f"the ranks ended with different weights (up to {gaps.max():.2e} apart): the future must "
                    f"return the all-reduced values, on every rank.", hint=3)
    steps = int(setting["steps"])
    got = loss_by_step(df)
    if list(got.index) != list(range(1, steps + 1)):
        feedback.fail(f"the skeleton logs the loss of each of the {steps} steps; it logged steps "
                      f"{list(got.index)}: keep its loop and its metrics.log(...) as they are.")
        return
    args = (int(setting["seed"]), world, int(setting["batch_size"]), int(setting["width"]))
    want = _float32_losses(*args, float(setting["lr"]), steps)
    gaps = [abs(g - w) for g, w in zip(got, want)]
    worst = max(range(steps), key=gaps.__getitem__)
    if gaps[worst] <= LOSS_TOL:
        feedback.ok(f"the loss follows float32 training on the same batches: within {gaps[worst]:.1e} at every "
                    f"step (tolerance {LOSS_TOL:g}; {got.iloc[0]:.3f} → {got.iloc[-1]:.3f})")
        return
    summed = _float32_losses(*args, world * float(setting["lr"]), steps)   # W times the gradient
    if max(abs(g - s) for g, s in zip(got, summed)) <= LOSS_TOL:
        feedback.fail(f"the loss follows float32 training with {world} times the learning rate, not the one "
                      f"asked for: your hook returned the sum of the ranks' gradients. Divide by the world "
                      f"size, as DDP does (before the all-reduce, or after it).", hint=2)
    else:
        feedback.fail(f"at step {worst + 1} the loss is {got.iloc[worst]:.3f}, where float32 training on the "
                      f"same batches reaches {want[worst]:.3f} (tolerance {LOSS_TOL:g}): the hook must return "
                      f"the ranks' mean gradient, every value of the bucket.", hint=3)
