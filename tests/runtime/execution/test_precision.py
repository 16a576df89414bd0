"""Mixed precision (`ppdsl.runtime.execution.precision`). bf16 autocast on one
rank in this process (a one-rank gloo group): the step casts each weight once
(docs/runtime.md, precision), so the microbatches in flight share one
low-precision copy, which the meter counts apart from the activations, and
M_W / M_B reads what it reads in fp32. fp16's loss scale follows GradScaler."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ppdsl.runtime.execution.pipeline import PipelineRunner, load_schedule
from ppdsl.runtime.execution.precision import LossScaler

SOURCE = """schedule two_stages_one_rank {
    param d = 1
    param m = 4
    place [0, 0]
    backward split
    order {
        for j in 0..m { F(j, 0); F(j, 1) }
        for j in 0..m { B(j, 1); W(j, 1); B(j, 0); W(j, 0) }
    }
}
"""
HIDDEN = 512


def _stage(s: int) -> nn.Module:
    torch.manual_seed(s)
    return nn.Sequential(*(nn.Linear(HIDDEN, HIDDEN) for _ in range(4)))


def _run(tmp_path: Path, precision: str) -> PipelineRunner:
    path = tmp_path / "two.pp"
    path.write_text(SOURCE)
    runner = PipelineRunner(load_schedule(path), _stage, lambda y, t: ((y.float() - t) ** 2).mean(),
                            device="cpu", precision=precision, note=lambda _: None)
    torch.manual_seed(9)
    inputs, targets = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    runner.step(inputs, targets, measure_memory=True)
    return runner


def test_weights_cast_once_per_step_and_counted_apart(one_rank, tmp_path: Path) -> None:
    """Four microbatches in flight on two stages of four 512x512 linears: the
    weight copies autograd saved are at most one bf16 copy of each weight (not
    one per microbatch), counted apart; M_W / M_B of the first stage is fp32's
    (1: a linear's input is all it saves), the last's (which also holds the
    loss's fp32 difference) over one half, not the copy-swamped 0.015 of before."""
    runner = _run(tmp_path, "bf16")
    meter = runner.engine.meter
    weights = sum(2 * m.weight.numel() for st in runner.stages.values() for m in st)
    assert 0 < meter.peak_weight_copy_bytes <= weights
    fp32 = _run(tmp_path, "fp32").engine.measured_mw_ratio()
    bf16 = runner.engine.measured_mw_ratio()
    assert fp32[0] == bf16[0] == 1 and bf16[1] > 0.5, (fp32, bf16)


def test_loss_scale_follows_grad_scaler() -> None:
    """Halved on inf/NaN, doubled after growth_interval clean steps, restored from
    its state."""
    scaler = LossScaler(torch.device("cpu"), growth_interval=2)
    scaler.update(True)
    assert float(scaler.scale) == 32768.0
    scaler.update(False)
    scaler.update(False)
    assert float(scaler.scale) == 65536.0 and scaler.growth_tracker == 0
    other = LossScaler(torch.device("cpu"))
    other.load_state_dict(scaler.state_dict())
    assert float(other.scale) == 65536.0


def test_bf16_parameters_step_fp32_masters(one_rank, tmp_path: Path) -> None:
    """--param-dtype bf16 on one rank: the stages' parameters are bf16 (so are
    their gradients and the activations), the optimizer holds fp32 masters whose
    Adam state is fp32, and after each step every parameter is its master
    rounded to bf16 (docs/runtime.md, parameter dtype)."""
    from ppdsl.runtime.execution.precision import MasterWeights
    from ppdsl.runtime.training.optim import OptimizerStep

    path = tmp_path / "two.pp"
    path.write_text(SOURCE)
    runner = PipelineRunner(load_schedule(path), _stage, lambda y, t: ((y.float() - t) ** 2).mean(),
                            device="cpu", note=lambda _: None, param_dtype=torch.bfloat16)
    master = MasterWeights(runner.parameters())
    optimizer = torch.optim.Adam(master.parameters(runner.parameters()), lr=1e-3)
    stepper = OptimizerStep(runner, optimizer, master=master)
    torch.manual_seed(9)
    inputs, targets = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        runner.step(inputs, targets)
        assert {p.grad.dtype for p, _ in master.pairs} == {torch.bfloat16}
        stepper.step()
    assert {p.dtype for p in runner.parameters()} == {torch.bfloat16}
    assert len(master.pairs) == len(runner.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if v.is_floating_point()]
    assert states and {v.dtype for v in states} == {torch.float32}
    for p, m in master.pairs:
        assert m.dtype == torch.float32 and torch.equal(p, m.to(torch.bfloat16))
    # the masters moved by less than a bf16 rounding step somewhere: they are not
    # themselves rounded (an optimizer over the bf16 parameters would be)
    assert any(not torch.equal(m, p.float()) for p, m in master.pairs)
