"""Awkward modules, as users bring them (issue 26; docs/runtime.md, "Any module"):
a learned scalar, BatchNorm and GroupNorm, buffers read in the forward, a weight
used twice, in-place activations, activation checkpointing inside a stage,
dropout, integer inputs passed through, a stage without parameters, a parameter
unused by some microbatches. Each factory follows the model protocol
(`ppdsl.runtime.models.model`), so `ppdsl run --model tests/dist/zoo.py:NAME` trains it."""

from __future__ import annotations

import torch
from torch import nn

from ppdsl.runtime import PipelineModel

FEATURES = 8


def _batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(batch_size, FEATURES, generator=g),
            torch.randn(batch_size, FEATURES, generator=g))


def _eval_batch(index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out data: seeds no training step uses."""
    return _batch(10_000 + index, batch_size)


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
    return PipelineModel(num_stages, lambda i: _seeded(i, ScalarGate), _mse, _batch,
                         eval_batch=_eval_batch)


class Norms(nn.Module):
    """A Linear, then BatchNorm1d (even stages: running statistics and a batch
    counter updated by every training forward) or GroupNorm (odd stages), then an
    in-place ReLU."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)
        self.norm = nn.BatchNorm1d(FEATURES) if index % 2 == 0 else nn.GroupNorm(2, FEATURES)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.linear(x))) + x


def norms(num_stages: int) -> PipelineModel:
    """BatchNorm and GroupNorm stages with in-place activations."""
    return PipelineModel(num_stages, lambda i: _seeded(i, lambda: Norms(i)), _mse, _batch,
                         eval_batch=_eval_batch)


class Buffers(nn.Module):
    """Buffers read in the forward (a float scale, a bool mask), an integer counter
    the forward increments, a frozen integer parameter, a non-contiguous weight
    (a transposed matrix) and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(FEATURES, FEATURES).t() / FEATURES ** 0.5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, FEATURES))
        self.register_buffer("keep", torch.arange(FEATURES) % 3 != 0)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(FEATURES), persistent=False)
        self.shift = nn.Parameter(torch.tensor([1, 2], dtype=torch.long), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            with torch.no_grad():
                self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        h = torch.tanh(x @ self.weight) * self.scale * self.keep
        return x + h * float(self.shift.sum()) / 3


def buffers(num_stages: int) -> PipelineModel:
    """Buffers of every dtype, read and written in the forward."""
    return PipelineModel(num_stages, lambda i: _seeded(i, Buffers), _mse, _batch)


class Shared(nn.Module):
    """One Linear applied twice, the second time inside activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)

    def _inner(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x))
        h = torch.utils.checkpoint.checkpoint(self._inner, h, use_reentrant=False)
        return x + h


def shared(num_stages: int) -> PipelineModel:
    """A weight used twice in a stage, once under activation checkpointing."""
    return PipelineModel(num_stages, lambda i: _seeded(i, Shared), _mse, _batch)


class Dropped(nn.Module):
    """A Linear, dropout, a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.linear(x)))


def dropout(num_stages: int) -> PipelineModel:
    """Dropout in every stage (each rank draws from its own RNG stream)."""
    return PipelineModel(num_stages, lambda i: _seeded(i, Dropped), _mse, _batch)


class Passing(nn.Module):
    """Takes (x, ids) and returns (x, ids): the integer ids pass through every
    stage. Stage 1 has no parameters; the others hold a parameter used only by the
    microbatches whose first id is odd."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        if index != 1:
            self.linear = nn.Linear(FEATURES, FEATURES)
            self.rare = nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index == 1:
            return x * (1 + ids.unsqueeze(-1) % 2), ids
        h = torch.tanh(self.linear(x))
        if int(ids[0]) % 2:
            h = h + self.rare(h)
        return x + h, ids


def _passing_batch(step: int, batch_size: int):
    (x, y), g = _batch(step, batch_size), torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, 5, (batch_size,), generator=g)
    if step == 0:  # the second half's microbatches (a --dp 2 replica's) never use `rare`
        ids[batch_size // 2:] = 2 * (ids[batch_size // 2:] // 2)
    return (x, ids), y


def _passing_loss(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return _mse(out[0], target)


def passing(num_stages: int) -> PipelineModel:
    """Integer inputs passed through, a stage without parameters, a parameter
    unused by some microbatches."""
    return PipelineModel(num_stages, lambda i: _seeded(i, lambda: Passing(i)), _passing_loss,
                         _passing_batch)


class Ends(nn.Module):
    """The first and the last stage: a learned scalar and a transposed (non-contiguous)
    weight, both tied between the two (`tied`); stages between are Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.5))
        self.w = nn.Parameter(torch.randn(FEATURES, FEATURES).t() / FEATURES ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.alpha * torch.tanh(x @ self.w)


def _tied_stage(index: int, num_stages: int) -> nn.Module:
    if index in (0, num_stages - 1):
        return _seeded(0, Ends)  # the same values at both ends: tied ones start equal
    return _seeded(index, lambda: nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh()))


def tied(num_stages: int) -> PipelineModel:
    """A scalar and a non-contiguous weight tied between the first and last stage."""
    return PipelineModel(num_stages, lambda i: _tied_stage(i, num_stages), _mse, _batch,
                         tied=({0: "alpha", num_stages - 1: "alpha"}, {0: "w", num_stages - 1: "w"}),
                         eval_batch=_eval_batch)


ZOO = ("scalar", "norms", "buffers", "shared", "dropout", "passing", "tied")
"""Every factory of the zoo."""
