"""Exercise 12-pipeline: a two-stage GPipe step written by hand with send and recv.

The skeleton builds lesson 06's ``MLPStack`` from one seed on both ranks and keeps half of it on
each (stage 0: the stem and the first blocks; stage 1: the other blocks, the head, the loss),
draws the same global batches on both, counts the sends of each step (``labkit.comm``) and the
micro-batches each stage holds at once (a forward hook), logs stage 1's loss, and saves each
stage's gradients of the first step and its weights at the end.
The check trains the whole model on the whole batch in one process, on the same batches, and
compares, as lesson 12 does: the loss at every step, then, stage by stage, every gradient of
the first step and every weight at the end. A pipeline whose sends and receives do not pair up
hangs; the launch is stopped after ``HANG_S`` seconds of silence and says where each rank waited.
"""

from __future__ import annotations

from labkit._course.checks._common import _config, _metrics, _on, _only_at, _saved
from labkit._course.attempt import launched
from labkit._course.feedback import Feedback, check

EXERCISE = "12-pipeline"

HINTS = [
    "Two loops on each stage, GPipe's way. Stage 0: for each micro-batch of x (x.chunk(m)), compute "
    "run_stage(...) and dist.send it to rank 1; then for each output, dist.recv its gradient from rank 1 and "
    "call backward with it. Stage 1: for each micro-batch, dist.recv the activations, compute the loss, keep "
    "it; then backward each loss and dist.send its input's gradient to rank 0.",
    "A dist.recv fills a tensor you made (torch.empty of the right shape). Stage 1 needs the gradient of what "
    "it received, so call h.requires_grad_() before using it. Stage 0 finishes backward with the gradient it "
    "received: out.backward(grad). Divide each micro-batch's loss by m: the mean over micro-batches is the "
    "whole batch's mean loss.",
    "Stage 0: outputs = []; for xm in x.chunk(m): out = run_stage(xm); dist.send(out.detach(), dst=1); "
    "outputs.append(out). Then for out in outputs: grad = torch.empty_like(out); dist.recv(grad, src=1); "
    "out.backward(grad). Stage 1: for ym in y.chunk(m): h = torch.empty(len(ym), args.dim); dist.recv(h, src=0); "
    "h.requires_grad_(); losses.append(F.cross_entropy(run_stage(h), ym) / m); keep h. Then for each h and loss: "
    "loss.backward(); dist.send(h.grad, dst=0).",
]

#: The settings the skeleton logs at step 0.
SETTINGS = ["dim", "depth", "batch_size", "microbatches", "steps", "lr", "seed"]
#: Seconds without a line from any rank after which the run counts as hung (a send no recv meets).
HANG_S = 10
#: Tolerances against one process (lesson 12's, on CPU): the loss, and each weight relative to its tensor.
LOSS_TOL, TENSOR_TOL = 1e-4, 1e-5


@check
def check_pipeline(target="scripts/ex12_pipeline.py", *, timeout_s: float = 180) -> Feedback:
    """Exercise 12-pipeline: each stage sends its micro-batches' tensors (activations forward,
    gradients back), and the two stages together train exactly as one process on the whole batch:
    the loss at every step within ``LOSS_TOL``, every weight at the end within ``TENSOR_TOL``.

    Launches the script on 2 CPU ranks (gloo); a hang is stopped after ``HANG_S`` seconds of
    silence and named.

    Args:
        target: the exercise's script, or a finished Run of it.
        timeout_s: seconds the launch may take.

    Returns:
        a Feedback; a mistake in the script is a finding, never an exception.

    Example (exercises/12_pipeline_parallel.ipynb)::

        labkit.check_pipeline("scripts/ex12_pipeline.py")
    """
    feedback = Feedback(EXERCISE)
    two = _only_at(feedback, 2, "the exercise's pipeline has two stages by design (lesson 12 runs one "
                                "stage per rank at any size)")
    feedback, run = launched(feedback, target, **dict(two, device="cpu"), timeout_s=timeout_s,
                             hang_timeout_s=HANG_S, name="check-12-pipeline", explain=_explain)
    df = _metrics(feedback, run, ["loss", "sends", "sent_bytes", "held", *SETTINGS])
    setting = {k: int(v) if k != "lr" else float(v) for k, v in _config(df, SETTINGS).items()}
    want_losses, want_grads, want_weights = _one_process(setting)
    _sends(feedback, df, setting)
    _gpipe_order(feedback, df, setting)
    _losses(feedback, df, want_losses, setting)
    _first_gradients(feedback, _saved(feedback, run, "grads"), want_grads)
    _weights(feedback, _saved(feedback, run, "weights"), want_weights)
    return feedback


def _explain(feedback: Feedback, target) -> None:
    """What a run that did not finish most likely means here: a send or a recv the other stage never
    matched (a hang), or a gradient that was never kept (``None`` sent back)."""
    run, root = feedback.run, getattr(feedback, "failure", None)
    if run is not None and run.info.get("hung"):
        feedback.fail("the stages waited for each other for ever: every dist.recv on one stage needs a "
                      "dist.send of the same size on the other, and in the same order (stage 1 sends back one "
                      "gradient for every activation it received).", hint=1)
    elif root is not None and root.rank == 1 and "NoneType" in (root.message or ""):
        feedback.fail("stage 1 had no gradient to send back (h.grad was None): call h.requires_grad_() on "
                      "the tensor it received before computing with it, so that backward keeps its gradient.",
                      hint=2)


def _one_process(setting: dict):
    """The whole model trained on the whole batch in one process: each step's loss, the first
    step's gradients, the final weights."""
    import torch
    import torch.nn.functional as F

    from labkit.models import MLPStack

    torch.manual_seed(setting["seed"])
    model = MLPStack(dim=setting["dim"], depth=setting["depth"], in_features=setting["dim"])
    optimizer = torch.optim.SGD(model.parameters(), lr=setting["lr"], momentum=0.9)
    teacher = torch.randn(setting["dim"], 10, generator=torch.Generator().manual_seed(setting["seed"] + 1))
    losses, grads = [], {}
    for step in range(1, setting["steps"] + 1):
        generator = torch.Generator().manual_seed(1000 * setting["seed"] + step)
        x = torch.randn(setting["batch_size"], setting["dim"], generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), (x @ teacher).argmax(dim=1))
        loss.backward()
        if step == 1:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return losses, grads, {k: p.detach().clone() for k, p in model.named_parameters()}


def _sends(feedback: Feedback, df, setting: dict) -> None:
    """Each stage sent one tensor per micro-batch each step: batch × dim float32 values in all."""
    m, expected = setting["microbatches"], setting["batch_size"] * setting["dim"] * 4
    rows = df.dropna(subset=["sends"])
    rows = rows[rows["step"] > 0]
    counts = {int(r): sorted(set(part["sends"].astype(int))) for r, part in rows.groupby("rank")}
    sizes = {int(r): sorted(set(part["sent_bytes"].astype(int))) for r, part in rows.groupby("rank")}
    what = {0: "activations forward", 1: "gradients back"}
    if all(c == [m] for c in counts.values()) and all(s == [expected] for s in sizes.values()):
        feedback.ok(f"each stage sent {m} tensors a step, one per micro-batch ({what[0]}, {what[1]}), "
                    f"{expected:,} bytes in all: batch × dim float32 values")
        return
    rank = next(r for r in sorted(counts) if counts[r] != [m] or sizes[r] != [expected])
    if counts[rank] == [1]:
        feedback.fail(f"stage {rank} sent 1 tensor a step: the whole batch at once. A pipeline sends each "
                      f"micro-batch's tensor as soon as it is computed (x.chunk(m)), so that the next stage "
                      f"can start.", hint=1)
    else:
        feedback.fail(f"stage {rank} sent {' or '.join(map(str, counts[rank]))} tensor(s) a step, "
                      f"{' or '.join(f'{s:,}' for s in sizes[rank])} bytes; it should send {m}, one per "
                      f"micro-batch ({what.get(rank, 'its tensors')}), {expected:,} bytes in all.", hint=1)


def _gpipe_order(feedback: Feedback, df, setting: dict) -> None:
    """GPipe's order, which the task asks for: every forward, then every backward, so that each
    stage holds all m micro-batches at once (the skeleton's hook counts them). Another order
    (each backward right after its forward, or 1F1B) gives the same numbers and sends; only
    what a stage holds tells them apart."""
    m = setting["microbatches"]
    rows = df.dropna(subset=["held"])
    most = {int(r): int(part["held"].max()) for r, part in rows[rows["step"] > 0].groupby("rank")}
    more = {r: n for r, n in most.items() if n > m}
    fewer = {r: n for r, n in most.items() if n < m}
    if not fewer and not more:
        feedback.ok(f"each stage held all {m} micro-batches at once: every forward ran before the first "
                    f"backward, GPipe's order (and its memory cost: {m} micro-batches' activations per stage)")
        return
    if more:
        rank, n = min(more.items())
        feedback.fail(f"stage {rank} held {n} micro-batches at once, more than the {m} a step has: each "
                      f"micro-batch goes through run_stage once per step, forward, and once backward.", hint=1)
        return
    rank, n = min(fewer.items())
    feedback.fail(f"stage {rank} held at most {n} micro-batch{'es' if n != 1 else ''} at once, not {m}: it "
                  f"ran backward before every forward was done. The numbers come out the same in any order, "
                  f"but the task asks for GPipe's: every micro-batch forward (each stage sending as it goes), "
                  f"then every backward. Holding fewer at once is 1F1B's aim in lesson 12, with a warm-up "
                  f"that keeps both stages busy; here, write GPipe's two loops.", hint=1)


def _losses(feedback: Feedback, df, want: list, setting: dict) -> None:
    """Stage 1's loss at every step is one process's, on the whole batch."""
    got = df[(df["rank"] == 1) & (df["step"] > 0)].dropna(subset=["sends"]).set_index("step")["loss"]
    if list(got.index) != list(range(1, len(want) + 1)):
        feedback.fail(f"stage 1 logs the loss of each of the {len(want)} steps; it logged steps {list(got.index)}: "
                      f"keep the skeleton's metrics.log(...) lines, and append each micro-batch's loss to losses.")
        return
    gaps = [abs(g - w) if g == g else float("inf") for g, w in zip(got, want)]   # NaN: as far as it gets
    m = setting["microbatches"]
    if gaps[0] > LOSS_TOL and abs(got.iloc[0] - m * want[0]) <= LOSS_TOL * m:
        feedback.fail(f"the loss at step 1 is {got.iloc[0]:.4f}, {m} times one process's {want[0]:.4f}: the "
                      f"micro-batches' losses were added up, not averaged. Divide each by m, so that the "
                      f"gradients are the whole batch's mean.", hint=2)
        return
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    feedback.expect(gaps[worst] <= LOSS_TOL,
                    f"the loss at every step is one process's on the whole batch: within {gaps[worst]:.1e} "
                    f"(tolerance {LOSS_TOL:g}; {got.iloc[0]:.4f} → {got.iloc[-1]:.4f})",
                    f"at step {worst + 1} the loss is {got.iloc[worst]:.4f}, where one process on the whole batch "
                    f"has {want[worst]:.4f} (tolerance {LOSS_TOL:g}).", hint=2)


def _gaps(saved: dict, want: dict, what: str, feedback: Feedback) -> dict:
    """{stage: (its worst tensor, its gap)} for the stages whose tensors are off (NaN counts as off)."""
    off = {}
    for rank, tensors in saved.items():
        unknown = [k for k in tensors if k not in want]
        if unknown or not tensors:
            feedback.stop(f"stage {rank} saved {what} the model does not have ({unknown[:3]}): keep the "
                          f"skeleton's save(...) lines as they are.")
        gaps = {k: float((v - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12))
                for k, v in tensors.items()}
        worst = max(gaps, key=lambda k: gaps[k] if gaps[k] == gaps[k] else float("inf"))
        if not gaps[worst] <= TENSOR_TOL:
            off[rank] = (worst, gaps[worst])
    return off


def _first_gradients(feedback: Feedback, saved: dict, want: dict) -> None:
    """Every gradient of the first step, stage by stage, is one process's: the backward pass is right."""
    mine = set().union(*(t.keys() for t in saved.values()))
    missing = sorted(k for k in want if k not in mine)
    if missing:
        feedback.fail(f"after the first backward, {missing[0]} has no gradient (and {len(missing) - 1} more): "
                      f"each stage must run backward over every micro-batch.", hint=2)
        return
    off = _gaps(saved, want, "gradients", feedback)
    if not off:
        feedback.ok(f"every gradient of the first step, on both stages, is within {TENSOR_TOL:g} of one "
                    f"process's (relative): the backward pass crossed the stages right")
    elif list(off) == [0]:
        name, gap = off[0]
        feedback.fail(f"stage 0's first gradients are not one process's ({name} is {gap:.1e} off, relative), "
                      f"though stage 1's are: stage 0's backward must carry the gradient stage 1 sent back, "
                      f"out.backward(grad), for the output that gradient belongs to.", hint=2)
    else:
        name, gap = off[min(off)]
        feedback.fail(f"the first gradients of {_on(sorted(off), 2).replace('rank', 'stage')} are not one "
                      f"process's ({name} is {gap:.1e} off, relative): each stage must run the forward and "
                      f"the backward of every micro-batch once, with the loss divided by m.", hint=2)


def _weights(feedback: Feedback, saved: dict, want: dict) -> None:
    """Every weight of each stage, at the end, is one process's."""
    off = _gaps(saved, want, "weights", feedback)
    if not off:
        feedback.ok(f"every weight of both stages ends within {TENSOR_TOL:g} of one process's (relative): the "
                    f"pipeline trained the whole model as one process does")
        return
    name, gap = off[min(off)]
    feedback.fail(f"at the end, the weights of {_on(sorted(off), 2).replace('rank', 'stage')} are not one "
                  f"process's ({name} is {gap:.1e} off, relative).", hint=2)
