"""Parameters held more than once (`ppdsl.runtime.execution.ties`): ties made one
Parameter on one rank, checked, and across ranks kept equal through the
transport; a DualPipe placement's stage copies alike. The exchanges across
real ranks are tests/system/test_pipeline_training.py's (`test_tied_*`) and
tests/system/test_pipeline_dist.py's (DualPipe)."""

from __future__ import annotations

import types
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from ppdsl.runtime.errors import ModelError
from ppdsl.runtime.execution.engine import Hooks
from ppdsl.runtime.execution.group import copy_tag, tie_tag
from ppdsl.runtime.execution.pipeline import load_schedule
from ppdsl.runtime.execution.ties import Ties, check_ties, copy_groups, tie_parameters
from tests.paths import ROOT


def test_tie_parameters_makes_one_parameter_on_one_rank() -> None:
    """Both owners on this rank: the higher stage's parameter becomes the lowest
    stage's (the same object, nested names followed); a tie with one owner
    here is left alone."""
    stages = {0: nn.Embedding(5, 3), 2: nn.Sequential(nn.Linear(3, 5, bias=False))}
    tie_parameters(stages, [{0: "weight", 2: "0.weight"}, {2: "0.weight", 3: "weight"}])
    assert stages[2][0].weight is stages[0].weight
    assert [n for n, _ in stages[2].named_parameters()] == ["0.weight"]


@pytest.mark.parametrize(("tied", "message"), [
    ([{0: "weight"}], "a tie names at least two stages"),
    ([{0: "weight", 7: "weight"}], "no stage 7 in a 4-stage schedule"),
    ([{0: "weight", 1: "nope"}], "stage 1 has no parameter 'nope'"),
    ([{0: "weight", 1: "weight"}], r"shapes differ \(\[\(3, 2\), \(4, 3\)\]\)"),
])
def test_check_ties_names_what_is_wrong(tied: list[dict[int, str]], message: str) -> None:
    """Each bad tie is a ModelError quoting the tie and what to fix."""
    modules = {0: nn.Linear(3, 4), 1: nn.Linear(2, 3)}
    with pytest.raises(ModelError, match=message):
        check_ties(tied, 4, modules)


def test_copy_groups_pair_a_model_stages_copies_on_one_rank() -> None:
    """Under two lanes, the copies of one model stage that sit on this rank are
    grouped per parameter; a copy alone here, or one lane, groups nothing."""
    plan = types.SimpleNamespace(lanes=2, num_model_stages=2)
    modules = {1: nn.Linear(2, 2), 3: nn.Linear(2, 2), 0: nn.Linear(2, 2)}
    assert copy_groups(plan, modules) == [{1: "weight", 3: "weight"}, {1: "bias", 3: "bias"}]  # type: ignore[arg-type]
    assert copy_groups(types.SimpleNamespace(lanes=1, num_model_stages=4), modules) == []  # type: ignore[arg-type]


class _Pending:
    def __init__(self, what: int, value: torch.Tensor | None = None) -> None:
        self.what = what
        self.value = value

    def wait(self, timeout: Any) -> torch.Tensor | None:
        return self.value


class _Transport:
    """Records what is posted; each receive gets `theirs[peer]`."""

    def __init__(self, theirs: dict[int, torch.Tensor]) -> None:
        self.theirs = theirs
        self.sent: list[tuple[list[float], int, int]] = []

    def post(self, sends: list[Any], recvs: list[Any]) -> tuple[list[_Pending], list[_Pending]]:
        self.sent += [(t.tolist(), peer, tag) for t, peer, tag, _ in sends]
        return ([_Pending(what) for *_, what in sends],
                [_Pending(what, self.theirs[peer].clone()) for _, _, peer, _, what in recvs])


def _tied_pair(rank: int, theirs: dict[int, torch.Tensor]) -> tuple[Ties, nn.Linear, _Transport]:
    plan = types.SimpleNamespace(stage_device=(0, 1), lanes=1)
    stage = nn.Linear(2, 1, bias=False)
    transport = _Transport(theirs)
    ties = Ties(plan, rank, [{0: "weight", 1: "weight"}], {rank: stage}, transport,  # type: ignore[arg-type]
                None, timedelta(seconds=1))
    return ties, stage, transport


def test_tie_across_ranks_starts_equal_and_sums_gradients() -> None:
    """A tie of stage 0 (rank 0) and stage 1 (rank 1), seen from rank 1: its
    values come from rank 0; after the passes (the hook attached) its gradient
    is rank 0's plus its own, in rank order, and its own went to rank 0 under
    the tie's tag; the norm leaves it out here (counted on rank 0)."""
    ties, stage, transport = _tied_pair(1, {0: torch.tensor([[10.0, 20.0]])})
    ties.sync_values()
    assert stage.weight.tolist() == [[10.0, 20.0]] and transport.sent == []
    hooks = Hooks()
    ties.attach(hooks)
    stage.weight.grad = torch.tensor([[1.0, 2.0]])
    transport.theirs = {0: torch.tensor([[100.0, 200.0]])}
    for after in hooks.after_passes:
        after()
    assert stage.weight.grad.tolist() == [[101.0, 202.0]]
    assert transport.sent == [([[1.0, 2.0]], 0, tie_tag(0))]
    assert ties.not_counted() == {id(stage.weight)}


def test_lowest_owner_sends_its_values_and_counts_the_parameter() -> None:
    """Rank 0, the lowest owner: it sends its values to rank 1 and keeps its own,
    and counts the parameter in the norm."""
    ties, stage, transport = _tied_pair(0, {})
    with torch.no_grad():
        stage.weight.copy_(torch.tensor([[3.0, 4.0]]))
    ties.sync_values()
    assert transport.sent == [([[3.0, 4.0]], 1, tie_tag(0))] and ties.not_counted() == set()


def test_dualpipe_copies_are_exchanged_per_parameter() -> None:
    """DualPipe at d=2: rank 0 holds stage 0 (model stage 0) and stage 3 (model
    stage 1), whose other copies sit on rank 1; each parameter of each is an
    exchange tagged by model stage and position, in model-stage order, and no
    hook is needed where nothing spans ranks."""
    plan = load_schedule(ROOT / "examples" / "dualpipe.pp", {"d": 2, "m": 4}).plan
    stages = {0: nn.Linear(2, 2), 3: nn.Linear(2, 2)}
    ties = Ties(plan, 0, [], stages, _Transport({}), None, timedelta(seconds=1))  # type: ignore[arg-type]
    assert [(tag, ranks) for tag, _, ranks in ties.peers] == [
        (copy_tag(0, 0), [0, 1]), (copy_tag(0, 1), [0, 1]),
        (copy_tag(1, 0), [0, 1]), (copy_tag(1, 1), [0, 1])]
    assert ties.peers[2][1] is stages[3].weight and ties.not_counted() == set()
    alone = Ties(types.SimpleNamespace(stage_device=(0, 0), lanes=1), 0, [{0: "weight", 1: "weight"}],  # type: ignore[arg-type]
                 {0: nn.Linear(2, 2), 1: nn.Linear(2, 2)}, _Transport({}), None, timedelta(seconds=1))  # type: ignore[arg-type]
    hooks = Hooks()
    alone.attach(hooks)
    assert alone.peers == [] and hooks.after_passes == []
