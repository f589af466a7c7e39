"""labkit.plan_table and labkit.planner: the course's memory calculator, and its one arithmetic
(labkit/_results/shapes.py, costs.py), shared with lessons 06, 11, 12 and 13 (unit tests here;
tests/test_plan_measured.py proves the figures against real launches of the lessons' scripts)."""

from __future__ import annotations

import pytest
import torch

import labkit
from labkit._interact import plan as _plan
from labkit._results import costs
from labkit._results.shapes import Shapes
from labkit.models import MLPStack
from test_predict import in_kernel  # noqa: F401  (a fixture: as in a Jupyter kernel)
from test_rundir import imported_by


# -- the shapes, from a module or worked out without torch ------------------------------------
@pytest.mark.parametrize("kwargs", [dict(dim=8, depth=4, in_features=8), dict(dim=256, depth=4),
                                    dict(dim=64, depth=2, in_features=64, num_classes=3)])
def test_mlp_stack_without_torch_is_what_the_module_says(kwargs):
    model = MLPStack(**kwargs)
    assert Shapes.mlp_stack(**kwargs) == Shapes.of(model, label=f"MLPStack(dim={kwargs['dim']}, depth={kwargs['depth']})")
    shapes = Shapes.of(model)
    assert shapes.numel() == sum(p.numel() for p in model.parameters())
    assert shapes.units() == [sum(p.numel() for p in m.parameters()) for m in (model.stem, *model.blocks, model.head)]
    assert set(shapes.root()) == {k for k, _ in model.named_parameters() if not k.startswith("blocks.")}
    assert shapes.depth == kwargs["depth"] and shapes.width == kwargs["dim"]


def test_a_bare_count_has_no_width_and_no_cuts():
    shapes = Shapes.count(10, blocks=3)
    assert shapes.units() == [4, 3, 3] and shapes.numel() == 10 and shapes.width is None and not shapes.tp_cuts
    with pytest.raises(ValueError, match=r"parameters must be an int >= blocks \(3\), got 2\. HINT"):
        Shapes.count(2, blocks=3)
    with pytest.raises(ValueError, match=r"dim must be an int >= 1, got 0\. HINT"):
        Shapes.mlp_stack(dim=0, depth=2)
    with pytest.raises(ValueError, match=r"mix element sizes \[2, 4\] bytes\. HINT"):
        Shapes.of(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).bfloat16()))


# -- one arithmetic: the lessons' functions and the planner agree -----------------------------------
MODEL = MLPStack(dim=8, depth=4, in_features=8)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zeros_table_is_the_planners(world_size, stage):
    units = [MODEL.stem, *MODEL.blocks, MODEL.head]
    row = labkit.plan_table(MODEL, world_size=world_size, strategy=["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"][stage],
                            per_rank=True).iloc[0]
    want = labkit.zero_bytes(units, world_size, stage)
    assert (row["params"], row["grads"], row["optimizer"]) == (want.params, want.grads, want.optimizer)
    assert row["sent"] == labkit.zero_table(units, world_size).iloc[stage]["sent"]


@pytest.mark.parametrize("strategy, world_size", [("one process", 1), ("DDP", 2), ("FSDP", 3), ("TP", 4),
                                                  ("PP", 2), ("FSDP x TP", 4)])
def test_the_strategy_maps_table_is_the_planners_with_sgd(strategy, world_size):
    want = labkit.expected_cost(strategy, MODEL, ranks=world_size, batch_size=16)
    got = labkit.plan_table(MODEL, world_size=world_size, strategy=strategy, optimizer="SGD momentum",
                            batch_size=16, per_rank=True).loc[strategy]
    assert list(got["params"]) == list(want["param_bytes"]) and list(got["total"]) == list(want["state_bytes"])
    assert list(got["sent"]) == list(want["sent_bytes"]) and (got["steps"] == 0).all()


def test_adamw_keeps_two_moments_and_a_step_per_tensor_it_updates():
    tensors = len(list(MODEL.parameters()))
    ddp = labkit.plan_table(MODEL, world_size=2, strategy="DDP").loc["DDP"]
    P = sum(p.numel() * 4 for p in MODEL.parameters())
    assert (ddp["optimizer"], ddp["steps"], ddp["total"]) == (2 * P, 4 * tensors, 4 * P + 4 * tensors)
    zero = labkit.plan_table(MODEL, world_size=2, strategy="ZeRO-1").loc["ZeRO-1"]
    assert zero["steps"] == 4 * len(Shapes.of(MODEL).units())   # AdamW on one flat slice per unit


def test_comm_weighs_a_collective_as_the_planner_does():
    for kind in costs.SENT_PER_BYTE:
        assert labkit.comm.Collective(kind, 1000, 4).sent_bytes == costs.sent_bytes(kind, 1000, 4)


# -- plan_table ---------------------------------------------------------------------------------
def test_every_strategy_has_a_row_and_one_that_cannot_run_says_why():
    table = labkit.plan_table(MODEL, world_size=3)
    assert list(table.index) == list(costs.STRATEGIES)
    assert table.loc["TP", "note"] == "TP over 3 ranks cuts 4*dim = 32, which must divide by 3"
    assert table.loc["PP", "note"].startswith("PP cuts 4 blocks into 3 equal stages")
    assert table.loc["FSDP", "note"] == "" and table.loc["FSDP", "total"] > 0
    assert table.loc["one process", "total"] == labkit.plan_table(MODEL, world_size=1).loc["DDP", "total"]
    assert table.attrs["model"] == "MLPStack" and table.attrs["world_size"] == 3


def test_the_table_shows_each_strategys_largest_rank():
    """The head's 10 rows over 4 ranks: 3, 3, 3, 1 (torch.chunk), so rank 0 holds the most."""
    per_rank = labkit.plan_table(MODEL, world_size=4, strategy="FSDP", per_rank=True).loc["FSDP"]
    assert per_rank.loc[3, "params"] < per_rank.loc[0, "params"]
    assert labkit.plan_table(MODEL, world_size=4).loc["FSDP", "total"] == per_rank["total"].max()
    assert per_rank["params"].sum() == Shapes.of(MODEL).bytes()


def test_bf16_halves_every_figure_but_the_step_counters():
    fp32 = labkit.plan_table(MODEL, world_size=2, precision="fp32")
    bf16 = labkit.plan_table(MODEL, world_size=2, precision="bf16")
    for column in ("params", "grads", "optimizer", "sent"):
        assert (bf16[column] * 2 == fp32[column]).all(), column
    assert (bf16["steps"] == fp32["steps"]).all()


def test_a_parameter_count_plans_data_parallel_and_says_what_it_cannot():
    table = labkit.plan_table(7_000_000_000, world_size=8)
    assert table.loc["ZeRO-3", "params"] == 7_000_000_000 * 4 // 8
    assert "says nothing of which layers tensor parallelism cuts" in table.loc["TP", "note"]
    assert "needs the model's width" in table.loc["PP", "note"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(model="big", world_size=2), r"model must be a module \(an MLPStack\), a parameter count or a Shapes, got str\. HINT"),
    (dict(model=MODEL, world_size=2, strategy="ZeRO"), r"unknown strategy \['ZeRO'\].*HINT: strategy=None"),
    (dict(model=MODEL, world_size=2, precision="fp8"), r"unknown precision 'fp8': one of fp32, bf16"),
    (dict(model=MODEL, world_size=2, optimizer="Adam"), r"unknown optimizer 'Adam': one of SGD momentum, AdamW"),
    (dict(model=MODEL, world_size=0), r"world_size must be a whole number >= 1, got 0\. HINT"),
    (dict(model=MODEL, world_size=2, batch_size=0.5), r"batch_size must be a whole number >= 1, got 0\.5"),
    (dict(model=MODEL, world_size=3, strategy="TP"), r"TP over 3 ranks cuts 4\*dim = 32, which must divide by 3"),
    (dict(model=10**9, world_size=2, strategy="PP"), r"PP sends activations.*HINT: plan an MLPStack"),
])
def test_plan_table_refuses_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        labkit.plan_table(**kwargs)


def test_plan_table_loads_neither_torch_nor_widgets():
    new = imported_by("import labkit\nfrom labkit._results.shapes import Shapes\n"
                      "labkit.plan_table(Shapes.mlp_stack(dim=64, depth=2), world_size=2)\n"
                      "labkit.planner(world_size=2)")
    assert not {"torch", "ipywidgets"} & set(new), new


# -- the planner ------------------------------------------------------------------------------------
def test_outside_a_kernel_the_planner_prints_its_table(capsys):
    found = labkit.planner(dim=64, depth=2, world_size=4, strategy="FSDP")
    out = capsys.readouterr().out
    assert out.startswith("planner · MLPStack(dim=64, depth=2) · 4 ranks · fp32 · AdamW · global batch 32")
    assert [line.split()[:2] for line in out.splitlines()[2:]] == [["rank", str(r)] for r in range(4)]
    assert list(found.table().index) == [f"rank {r}" for r in range(4)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), r"world_size must be a whole number from 1 to 64, got 0\. HINT"),
    (dict(dim=2.5), r"dim must be a whole number from 32 to 8,192, got 2\.5"),
    (dict(strategy="ZeRO"), r"strategy must be one of 'all', 'one process', .* got 'ZeRO'\. HINT"),
    (dict(in_features=100), r"in_features must be one of 3072, 0, 256, got 100"),
    (dict(parameters=10), r"parameters must be a whole number from 1,000,000 to"),
])
def test_the_planner_refuses_settings_its_controls_cannot_show(kwargs, match, capsys):
    with pytest.raises(ValueError, match=match):
        labkit.planner(**kwargs)
    assert capsys.readouterr().out == ""


def test_in_a_kernel_the_controls_redraw_the_table_and_the_chart(in_kernel):
    found = labkit.planner(dim=64, depth=2, in_features=64, world_size=2)
    assert len(in_kernel) == 1 and in_kernel[0]["text/plain"] == found.text()
    assert "model_id" in in_kernel[0]["application/vnd.jupyter.widget-view+json"]
    before, chart = found._table.value, found._image.value
    assert "ZeRO-3" in before and chart[:4] == b"\x89PNG"
    found.controls["world_size"].value = 4              # as the front end syncs a slider moved
    assert found.settings["world_size"] == 4 and found._table.value != before and found._image.value != chart
    assert "4 ranks" in found._table.value
    assert found.table().equals(labkit.plan_table(Shapes.mlp_stack(dim=64, depth=2, in_features=64), world_size=4))
    found.controls["model"].value = "parameter count"
    assert found.controls["dim"].layout.display == "none" and found.controls["parameters"].layout.display is None
    assert "1,000,000,000 parameters" in found._table.value
    found.controls["strategy"].value = "TP"             # a parameter count cannot: said, not raised
    assert "says nothing of which layers" in found._table.value
