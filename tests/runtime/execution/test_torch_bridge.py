"""A ppdsl schedule under torch.distributed.pipelining's runtime
(`ppdsl.runtime.execution.torch_bridge`): what it refuses, with what to use
instead, and the runtime it builds (one rank, in this process). Its training
steps across ranks are tests/dist/train_worker.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ppdsl.runtime.execution.pipeline import load_schedule
from ppdsl.runtime.execution.torch_bridge import torch_schedule
from tests.paths import ROOT


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def test_refuses_what_torchs_runtime_cannot_run() -> None:
    """Recomputed stages (torch has no R action) and a bidirectional placement
    (torch runs one pipeline) are refused, pointing at PipelineRunner."""
    recompute = load_schedule(ROOT / "examples" / "1f1b_recompute.pp", {"d": 2, "m": 4})
    with pytest.raises(ValueError, match="no recompute action.*PipelineRunner"):
        torch_schedule(recompute, {}, _loss)
    dualpipe = load_schedule(ROOT / "examples" / "dualpipe.pp", {"d": 2, "m": 4})
    with pytest.raises(ValueError, match="runs 2 pipelines.*use PipelineRunner"):
        torch_schedule(dualpipe, {}, _loss)


def test_names_the_stages_given_no_module(one_rank) -> None:
    """Rank 0 of a two-rank 1F1B holds stage 0: given none, the error names it."""
    schedule = load_schedule(ROOT / "examples" / "1f1b.pp", {"d": 2, "m": 4})
    with pytest.raises(ValueError, match=r"rank 0 holds stages \[0\]; no module given for \[0\]"):
        torch_schedule(schedule, {1: nn.Linear(2, 2)}, _loss)


def test_one_rank_schedule_steps_like_the_plain_model(one_rank) -> None:
    """A one-rank ZB-H1 under torch's runtime: one step's gradients are those of
    the plain model's mean loss over the batch."""
    torch.manual_seed(0)
    schedule = load_schedule(ROOT / "examples" / "zb_h1.pp", {"d": 1, "m": 2})
    stage = nn.Linear(3, 2)
    plain = nn.Linear(3, 2)
    plain.load_state_dict(stage.state_dict())
    runtime = torch_schedule(schedule, {0: stage}, _loss)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    runtime.step(x, target=y)
    _loss(plain(x), y).backward()
    assert torch.allclose(stage.weight.grad, plain.weight.grad, atol=1e-6)
