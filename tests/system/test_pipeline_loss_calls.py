"""The user's loss is called as docs/runtime.md documents: once per microbatch
per step, always in the engine's forward with gradients enabled, never by the
first step's shape probe (a loss that logs or accumulates metrics sees only the
training's microbatches). One rank in this process (a one-rank gloo group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppdsl.runtime.execution.pipeline import PipelineRunner, load_schedule

SOURCE = """schedule two_stages_one_rank {{
    param d = 1
    param m = 3
    place [0, 0]
    {backward}
    order {{
        for j in 0..m {{ F(j, 0); F(j, 1) }}
        for j in 0..m {{ {passes} }}
    }}
}}
"""
SPLIT = "B(j, 1); W(j, 1); B(j, 0); W(j, 0)"
FUSED = "BW(j, 1); BW(j, 0)"


@pytest.mark.parametrize("backward,passes", [("backward split", SPLIT), ("backward fused", FUSED)])
def test_loss_called_once_per_microbatch_per_step(one_rank, tmp_path: Path, backward: str,
                                                  passes: str) -> None:
    """Split and fused schedules, m = 3, three steps: the loss is called 3 times a
    step, the first step included, each time with gradients enabled."""
    path = tmp_path / "s.pp"
    path.write_text(SOURCE.format(backward=backward, passes=passes))
    calls: list[bool] = []

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return torch.nn.functional.mse_loss(out, target)

    torch.manual_seed(0)
    runner = PipelineRunner(load_schedule(path), lambda s: torch.nn.Linear(4, 4), loss,
                            device="cpu", note=lambda _: None)
    for step in range(3):
        runner.step(torch.randn(6, 4), torch.randn(6, 4))
        assert calls == [True] * 3 * (step + 1), (step, calls)


def test_loss_returning_no_scalar_is_named(one_rank, tmp_path: Path) -> None:
    """A loss that returns a vector is refused at its first call with a message
    naming the shape, the stage and the microbatch."""
    from ppdsl.runtime.models.model import LossError

    path = tmp_path / "s.pp"
    path.write_text(SOURCE.format(backward="backward split", passes=SPLIT))
    runner = PipelineRunner(load_schedule(path), lambda s: torch.nn.Linear(4, 4),
                            lambda out, target: (out - target).sum(0), device="cpu",
                            note=lambda _: None)
    with pytest.raises(LossError, match=r"must return a scalar tensor, not shape \[4\] \(stage 1, "
                                        r"microbatch 0\)"):
        runner.step(torch.randn(6, 4), torch.randn(6, 4))
