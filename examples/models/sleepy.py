"""Stages whose passes take a set time: for checking the simulator against a run.

Each stage is one split-aware layer (`ppdsl.runtime.execution.split`) whose forward sleeps
T_F, whose B sleeps T_B and whose W sleeps T_W (a fused backward: T_B + T_W), and
which still computes real gradients (y = x * gain), so the run is an ordinary
training run whose pass times are known. Sleeping takes no CPU, so the ranks do
not compete for cores: what the run adds to the simulator's makespan is the
runtime's own cost (transfers, Python, start of each pass).

`PPDSL_SLEEP_PARAMS=N` gives each stage a further parameter of N floats that the
passes do not use (`bulk`): a stage as heavy to reduce or gather as a real
one's weights, for data-parallel measurements (set its `.grad` yourself).

The times come from the environment, in milliseconds (defaults F=20, B=20, W=10):

    PPDSL_SLEEP_MS="F=20,B=20,W=10" ppdsl run examples/zb_h1.pp \\
        --model examples/models/sleepy.py:stages --costs-from sleepy_costs.pp

and `costs_pp(num_stages)` writes the matching costs file.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from ppdsl.runtime import PipelineModel, split

FEATURES = 8


def sleep_ms() -> dict[str, float]:
    """The pass times (ms) from PPDSL_SLEEP_MS, e.g. "F=20,B=20,W=10"."""
    times = {"F": 20.0, "B": 20.0, "W": 10.0}
    for item in os.environ.get("PPDSL_SLEEP_MS", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() in times and value.strip():
            times[key.strip()] = float(value)
    return times


@split.split_aware
class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gain, times):
        time.sleep(times["F"] / 1e3)
        ctx.save_for_backward(x, gain)
        ctx.times = times
        return x * gain

    @staticmethod
    def backward(ctx, dy):
        x, gain = ctx.saved_tensors
        time.sleep(ctx.times["B"] / 1e3)

        def weight_grad() -> None:
            time.sleep(ctx.times["W"] / 1e3)
            split.accumulate_grad(gain, (dy * x).sum(0))

        split.defer(ctx, weight_grad, activations=(x,), gradients=(dy,))
        return dy * gain, None, None


class SleepyStage(nn.Module):
    """One stage: y = x * gain, its passes sleeping the set times."""

    def __init__(self, times: dict[str, float]) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(FEATURES))
        self.times = times
        bulk = int(os.environ.get("PPDSL_SLEEP_PARAMS", "0") or 0)
        if bulk:
            self.bulk = nn.Parameter(torch.zeros(bulk))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.gain, self.times)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, FEATURES, generator=g), torch.randn(batch_size, FEATURES, generator=g)


def stages(num_stages: int) -> PipelineModel:
    """The protocol's factory: `num_stages` sleepy stages."""
    times = sleep_ms()
    return PipelineModel(num_stages, lambda index: SleepyStage(times), _loss, _batch)


def costs_pp(num_stages: int, comm_ms: float = 0.0) -> str:
    """A costs file (`--costs-from`) stating the sleep times as the pass costs."""
    t = sleep_ms()
    return (
        "# the pass times of examples/models/sleepy.py (PPDSL_SLEEP_MS), in ms\n"
        "schedule sleepy {\n"
        f"    let profiled_stages = {num_stages}\n"
        f"    cost F = {t['F']:g}\n    cost B = {t['B']:g}\n    cost W = {t['W']:g}\n"
        f"    cost BW = {t['B'] + t['W']:g}\n    cost comm = {comm_ms:g}\n"
        "}\n"
    )
