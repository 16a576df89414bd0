"""Models for the training-feature tests (tests/dist/train_worker.py and the
launches in tests/system/test_pipeline_training.py)."""

from __future__ import annotations

import os

import torch
from torch import nn

from ppdsl.runtime import PipelineModel, split_layers

FEATURES = 16
VOCAB = 32
SEQ = 8


class _First(nn.Module):
    """Token ids and a padding mask in; a dict of hidden states, the mask and a
    gate out (the gate is used only by the last stage: it passes through the
    stages in between untouched, and its gradient comes back through them)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, FEATURES)
        self.gate = nn.Linear(FEATURES, 1)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(ids)
        return {"hidden": h, "mask": mask, "gate": torch.sigmoid(self.gate(h))}


class _Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(FEATURES)
        self.linear = nn.Linear(FEATURES, FEATURES)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, gate: torch.Tensor) -> dict[str, torch.Tensor]:
        update = torch.tanh(self.linear(self.norm(hidden))) * mask.unsqueeze(-1)
        return {"hidden": hidden + update, "mask": mask, "gate": gate}


class _Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.middle = _Middle()
        self.out = nn.Linear(FEATURES, VOCAB)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = self.middle(hidden, mask, gate)["hidden"]
        return self.out(h * gate)


def _structured_stage(index: int, num_stages: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(100 + index)
        if num_stages == 1:
            raise ValueError("structured needs at least two stages")
        if index == 0:
            return _First()
        if index == num_stages - 1:
            return _Last()
        return _Middle()


def _structured_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _structured_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(4242 + step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    mask = torch.rand(batch_size, SEQ, generator=g) > 0.2
    targets = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return (ids, mask), targets


def structured(num_stages: int) -> PipelineModel:
    """Stages that take and return several tensors: stage 0 takes (ids, mask) and
    returns {"hidden", "mask" (bool), "gate"}; the last returns logits."""
    return PipelineModel(num_stages, lambda i: _structured_stage(i, num_stages),
                         _structured_loss, _structured_batch, tokens_per_sample=SEQ)


def _mlp_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 8, generator=g)


def _mlp_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def counted(num_stages: int) -> PipelineModel:
    """An MLP whose batch() appends "RANK step" to $PPDSL_TEST_BATCH_LOG.RANK each
    time it is called (which ranks build data, and how often); its inputs are
    features, not tokens."""
    log = os.environ["PPDSL_TEST_BATCH_LOG"] + "." + os.environ.get("RANK", "?")

    def batch(step: int, batch_size: int):
        with open(log, "a") as f:
            f.write(f"{step}\n")
        return _mlp_batch(step, batch_size)

    def stage(index: int) -> nn.Module:
        torch.manual_seed(index)
        return nn.Sequential(*split_layers([nn.Linear(8, 8) for _ in range(num_stages)], num_stages)[index])

    return PipelineModel(num_stages, stage, _mlp_loss, batch)
