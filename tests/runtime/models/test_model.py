"""The runtime's pieces in one process: the model protocol, the plan (manifest)
round trip, the memory model's prediction (the split and the meter are in
tests/runtime/execution/test_split.py)."""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch

from ppdsl.backend.plan import Plan, plan_from_schedule, predicted_peak
from ppdsl.ir.schedule import MemoryModel, Pass, PassKind, PassOrder
from ppdsl.lowering.lower import lower
from ppdsl.runtime import split_layers
from ppdsl.runtime.models.model import ModelError, build_model, load_factory
from tests.dist.orders import python_schedules
from tests.paths import ROOT

TINY = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages"


def test_predicted_peak_is_prefix_sum() -> None:
    """The memory model's peak of F F B W B W with M_B=1, M_W=1/2 is 2."""
    mem = MemoryModel((Fraction(1),), (Fraction(1, 2),))
    kinds = [PassKind.F, PassKind.F, PassKind.B, PassKind.W, PassKind.B, PassKind.W]
    order = PassOrder.of([Pass(k, j, 0) for k, j in zip(kinds, [0, 1, 0, 0, 1, 1], strict=True)])
    assert predicted_peak(order, mem) == 2


def test_split_layers() -> None:
    """Contiguous, sizes differ by at most one, earlier stages larger; too few layers
    is an error that says what to do."""
    assert split_layers(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ModelError, match="at least as many layers"):
        split_layers([1, 2], 3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tiny_gpt", "expected FILE.py:FACTORY"),
        ("nowhere/x.py:f", "no such file"),
        ("no_such_module_xyz:f", "cannot import module"),
        (TINY.replace(":stages", ":nope"), "no callable named 'nope'"),
    ],
)
def test_load_factory_errors(spec: str, message: str) -> None:
    """A bad --model names what is wrong."""
    with pytest.raises(ModelError, match=message):
        load_factory(spec)


def test_tiny_gpt_protocol_and_determinism() -> None:
    """tiny_gpt builds any stage count; a stage built twice has identical weights;
    the batch is the same for the same step; stages chain to a scalar loss."""
    model = build_model(TINY, 4)
    a, b = model.stage(2), model.stage(2)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    x, y = model.batch(3, 4)
    assert torch.equal(x, model.batch(3, 4)[0])
    for i in range(4):
        x = model.stage(i)(x)
    assert model.loss(x, y).dim() == 0
    one = build_model(TINY, 1).stage(0)
    assert sum(p.numel() for p in one.parameters()) == sum(
        p.numel() for i in range(4) for p in model.stage(i).parameters()
    )


def test_plan_json_round_trip() -> None:
    """The manifest's plan reads back equal (orders from the torch action strings)."""
    for s in python_schedules(2, 4):
        plan = plan_from_schedule(s, lower(s))
        back = Plan.from_json(copy.deepcopy(plan.to_json()))
        assert back == plan


def test_runtime_prediction_is_the_compilers() -> None:
    """The plan's predicted peak (what the runtime prints) equals
    ppdsl.analysis.checks.memory.peak_memory for every Python-built schedule at d=2,4,8."""
    memory = pytest.importorskip("ppdsl.analysis.checks.memory")
    for d in (2, 4, 8):
        for s in python_schedules(d, 2 * d):
            plan = plan_from_schedule(s, lower(s))
            assert tuple(memory.peak_memory(s)) == tuple(plan.predicted_peak(r) for r in range(d))
