"""Models that break the protocol, for the bad-input tests."""

from __future__ import annotations

import torch
from torch import nn

from ppdsl.runtime import PipelineModel


def _batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 4, generator=g)


def _loss(out, target):
    return ((out - target) ** 2).mean()


def wrong_stage_count(num_stages: int) -> PipelineModel:
    """Always builds 3 stages."""
    return PipelineModel(3, lambda i: nn.Linear(8, 8), _loss, _batch)


def shape_mismatch(num_stages: int) -> PipelineModel:
    """Stage 0 outputs 6 features; stage 1 expects 8."""

    def stage(i: int) -> nn.Module:
        torch.manual_seed(i)
        return nn.Linear(8, 6) if i == 0 else nn.Linear(8, 4)

    return PipelineModel(num_stages, stage, _loss, _batch)


class _Scaled(nn.Module):
    """A linear layer, then x * scale: `scale` is a parameter no native split covers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.linear(x) * self.scale


def uncovered(num_stages: int) -> PipelineModel:
    """Every stage has a parameter the split does not cover (`1.scale`... its name is
    `scale`): trains correctly, with that parameter's gradient computed during B."""

    def stage(i: int) -> nn.Module:
        torch.manual_seed(i)
        return _Scaled() if i < num_stages - 1 else nn.Sequential(_Scaled(), nn.Linear(8, 4))

    return PipelineModel(num_stages, stage, _loss, _batch)
