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


class _DocumentEmbedding(nn.Module):
    """Token ids and positions to hidden states and positions; drops the last
    token of a microbatch of `drop_at` tokens (when given)."""

    def __init__(self, drop_at: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.drop_at = drop_at

    def forward(self, ids: torch.Tensor, positions: torch.Tensor):
        hidden = self.embed(ids) + positions.unsqueeze(-1).float()
        if ids.shape[1] == self.drop_at:
            return hidden[:, :-1], positions[:, :-1]
        return hidden, positions


class _DocumentHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.head = nn.Linear(8, 16)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def _document_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1),
                                             ignore_index=-100)


def varlen_drops_token(num_stages: int) -> PipelineModel:
    """Documents of 4, 6, 5, 7, 4 and 6 tokens (file at $PPDSL_TEST_DOCS) on 2
    stages; stage 0 drops the last token of a microbatch of 5 (step 0's
    microbatch 2), which its receiver does not expect."""
    import os

    import numpy as np

    from ppdsl.lengths import open_documents
    from ppdsl.runtime.models.documents import DocumentBatches

    # each rank its own file: a rank rewriting the one another reads races (EOFError)
    path = f"{os.environ['PPDSL_TEST_DOCS']}.rank{os.environ.get('RANK', '0')}.npz"
    lengths = [4, 6, 5, 7, 4, 6]
    np.savez(path, tokens=np.arange(sum(lengths)) % 16,
             offsets=np.concatenate([[0], np.cumsum(lengths)[:-1]]))

    def stage(i: int) -> nn.Module:
        return _DocumentEmbedding(5) if i == 0 else _DocumentHead()

    return PipelineModel(num_stages, stage, _document_loss, _batch,
                         documents=DocumentBatches.of(open_documents(path)))
