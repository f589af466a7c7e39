"""A saved checkpoint read back as a resume reads it: its newest file, its float tensors by path,
the paths where two differ, and keys that still carry DDP's ``module.`` prefix (exercise 05's
fault drill). Imports torch only when called."""

from __future__ import annotations


def _walk(obj, path=""):
    """(path, leaf) for every leaf of nested dicts, lists and tuples, in a fixed order."""
    if isinstance(obj, dict):
        for key in obj:
            yield from _walk(obj[key], f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _walk(item, f"{path}/{i}")
    else:
        yield path, obj


def _wrapper_keys(state) -> list[str]:
    """Keys that start with DDP's ``module.`` anywhere in a loaded checkpoint."""
    found, stack = [], [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            found += [k for k in obj if isinstance(k, str) and k.startswith("module.")]
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
    return found


def _float_tensors(state) -> dict:
    """{path: tensor} of the floating-point tensors in a loaded checkpoint: weights, optimizer state."""
    import torch

    return {path: leaf for path, leaf in _walk(state)
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}


def _differences(a: dict, b: dict, *, exact: bool) -> list[str]:
    """Paths at which two {path: tensor} dicts differ (exactly, or within a GPU's rounding)."""
    import torch

    differ = sorted(set(a) ^ set(b))
    for path in sorted(set(a) & set(b)):
        x, y = a[path], b[path]
        same = x.shape == y.shape and x.dtype == y.dtype and (
            torch.equal(x, y) if exact else torch.allclose(x, y, rtol=1e-4, atol=1e-6))
        if not same:
            differ.append(path)
    return differ


def _load_latest(folder):
    """(path, state, error) of the newest checkpoint in ``folder``, loaded as a resume loads it."""
    import warnings

    import torch

    from labkit import checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn file is skipped; the caller says what is missing
        path = checkpoint.latest(folder)
    if path is None:
        return None, None, None
    try:
        return path, torch.load(path, map_location="cpu", weights_only=True), None
    except Exception as err:  # noqa: BLE001 - whatever it is, the learner needs to hear it
        return path, None, str(err).strip().splitlines()[0][:200]
