"""A rank's passes (ppdsl/runtime/execution/engine.py, docs/runtime.md): the engine run
directly on compiled rank programs in one process (a one-rank gloo group, every
stage on rank 0, so stages hand over without transfers), against plain autograd
on the same model; transfers between ranks are tests/system/test_pipeline_dist.py's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ppdsl.ir.rank import Compute
from ppdsl.runtime.execution.engine import Engine
from ppdsl.runtime.execution.group import LaneEnds
from ppdsl.runtime.execution.pipeline import load_schedule
from ppdsl.runtime.execution.structure import flatten
from ppdsl.semantics import PassKind
from tests.paths import ROOT

M = 2  # microbatches
ROWS = 3  # rows per microbatch


def _stages(num_stages: int) -> dict[int, nn.Module]:
    torch.manual_seed(0)
    return {s: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Dropout(0.25))
            for s in range(num_stages)}


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batch() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(M * ROWS, 4, generator=g)
    targets = torch.randn(M * ROWS, 4, generator=g)
    return list(inputs.split(ROWS)), list(targets.split(ROWS))


def _engine(example: str, stages: dict[int, nn.Module], **options) -> Engine:
    schedule = load_schedule(ROOT / "examples" / f"{example}.pp", {"d": 1, "m": M})
    plan = schedule.plan
    assert set(plan.stage_device) == {0}
    engine = Engine(0, schedule.ops[0], plan.stage_device, M, plan.memory, stages, _loss,
                    torch.device("cpu"), lane_ends=LaneEnds.of(plan), **options)
    x = torch.zeros(ROWS, 4)
    specs = {}
    for s in sorted(stages):  # what the runner's probe learns
        x = stages[s](x)
        specs[s] = flatten(x)[1]
    engine.set_specs(specs)
    return engine


def _reference(stages: dict[int, nn.Module]) -> tuple[float, list[torch.Tensor]]:
    """The batch's mean loss and every gradient by plain autograd, microbatch by
    microbatch, with the RNG as the engine's forwards draw it."""
    inputs, targets = _batch()
    torch.manual_seed(2)
    total = 0.0
    for x, y in zip(inputs, targets, strict=True):
        for s in sorted(stages):
            x = stages[s](x)
        loss = _loss(x, y) / M
        loss.backward()
        total += float(loss.detach())
    return total, [p.grad.clone() for s in sorted(stages) for p in stages[s].parameters()]


@pytest.mark.parametrize(("example", "release"), [
    ("v_zb", "at-b"), ("v_zb", "at-w"), ("interleaved_1f1b", "at-b"), ("1f1b_recompute", "at-b"),
])
def test_step_equals_plain_autograd(one_rank, example: str, release: str) -> None:
    """The engine's F, B, W (split, freeing at B or at W), BW and R passes on two
    local stages (or one recomputed) leave the gradients and the mean loss that
    plain autograd gives for the same microbatches: stage 0 reads the inputs and
    the last stage computes the loss (the lane ends from the plan)."""
    num_stages = 1 if example == "1f1b_recompute" else 2
    stages = _stages(num_stages)
    reference = copy.deepcopy(stages)
    engine = _engine(example, stages, release=release)
    inputs, targets = _batch()
    torch.manual_seed(2)  # every order here draws dropout's masks in the plain run's order
    result = engine.step(inputs, targets)
    want_loss, want_grads = _reference(reference)
    got = [p.grad for s in sorted(stages) for p in stages[s].parameters()]
    assert result.loss is not None and float(result.loss) == pytest.approx(want_loss, rel=1e-6)
    for g, w in zip(got, want_grads, strict=True):
        torch.testing.assert_close(g, w)
    assert result.step_time >= result.compute_time > 0
    assert all(t > 0 for k, t in engine.compute_time.items()
               if any(isinstance(op, Compute) and op.pass_.kind is k for op in engine.ops))


def test_hooks_run_at_the_points_the_order_defines(one_rank) -> None:
    """Before the first pass, before each stage's first F, after each stage's last
    W (its gradients then final: equal to the step's end) and after the passes,
    each once, in order of the compiled order (docs/runtime.md, hooks)."""
    stages = _stages(2)
    engine = _engine("v_zb", stages)
    seen: list[tuple[str, int | None]] = []
    final_at: dict[int, list[torch.Tensor]] = {}
    engine.hooks.before_first_pass.append(lambda: seen.append(("first pass", None)))
    engine.hooks.before_stage_forward.append(lambda s: seen.append(("forward", s)))

    def ready(s: int) -> None:
        seen.append(("grads ready", s))
        final_at[s] = [p.grad.clone() for p in stages[s].parameters()]

    engine.hooks.stage_grads_ready.append(ready)
    engine.hooks.after_passes.append(lambda: seen.append(("after", None)))
    inputs, targets = _batch()
    engine.step(inputs, targets)
    # v_zb at d=1: F0 F1 B1 W1 ... W1 (mb 1) B0 W0 (mb 1): stage 1 is final first
    assert seen == [("first pass", None), ("forward", 0), ("forward", 1), ("grads ready", 1),
                    ("grads ready", 0), ("after", None)]
    for s, at in engine.grads_final.items():
        last = engine.ops[at]
        assert isinstance(last, Compute) and last.pass_.kind is PassKind.W and last.pass_.stage == s
        for early, p in zip(final_at[s], stages[s].parameters(), strict=True):
            assert torch.equal(early, p.grad)
    assert engine.first_forward == {0: 0, 1: 1}


def test_measured_memory_in_the_compilers_units(one_rank) -> None:
    """A measured step gives each stage's bytes of one microbatch's activation and
    its M_W/M_B: above 0 and below 1 when B frees what W does not need, 1 when the
    graph is kept until W (release at-w)."""
    ratios = {}
    for release in ("at-b", "at-w"):
        stages = _stages(2)
        engine = _engine("v_zb", stages, release=release)
        inputs, targets = _batch()
        engine.step(inputs, targets, measure=True)
        assert set(engine.stage_bytes()) == {0, 1} and min(engine.stage_bytes().values()) > 0
        ratios[release] = engine.measured_mw_ratio()
    assert all(0 < r < 1 for r in ratios["at-b"].values())
    assert all(r == 1 for r in ratios["at-w"].values())
