"""Awkward modules, as users bring them (issue 26; docs/runtime.md, "Any module"):
a learned scalar, BatchNorm and GroupNorm, buffers read in the forward, a weight
used twice, in-place activations, activation checkpointing inside a stage,
dropout, integer inputs passed through, a stage without parameters, a parameter
unused by some microbatches. Each factory follows the model protocol
(`ppdsl.runtime.model`), so `ppdsl run --model tests/dist/zoo.py:NAME` trains it."""

from __future__ import annotations

import torch
from torch import nn

from ppdsl.runtime import PipelineModel

FEATURES = 8


def _batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(batch_size, FEATURES, generator=g),
            torch.randn(batch_size, FEATURES, generator=g))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


class ScalarGate(nn.Module):
    """A Linear scaled by a learned 0-dim parameter (a gate, a ReZero alpha) plus a
    residual."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)
        self.alpha = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.alpha * torch.tanh(self.linear(x))


def _seeded(index: int, build) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(300 + index)
        return build()


def scalar(num_stages: int) -> PipelineModel:
    """Every stage holds a learned scalar (`nn.Parameter(torch.tensor(0.7))`)."""
    return PipelineModel(num_stages, lambda i: _seeded(i, ScalarGate), _mse, _batch)
