"""An order chosen per step (`ppdsl run --reorder`, issue 38): which of the
step's microbatches fills which of the schedule's microbatch slots.

The search (`ppdsl.analysis.reorder.choose_order`, the simulator under the
per-token costs, within 50 ms) stops on a clock, so two ranks could find
different orders: rank 0 of the pipeline chooses and broadcasts it, and
every rank runs the same. Any permutation of the slots keeps the compiled
proofs of order, dependencies and deadlock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ppdsl.runtime.execution.group import global_rank

__all__ = ["Choice", "agreed_order"]


@dataclass(frozen=True)
class Choice:
    """A step's order, as every rank runs it."""

    slots: tuple[int, ...]
    """slots[k]: the step's microbatch that runs in the schedule's slot k."""
    seconds: float | None
    """How long choosing took on rank 0 (None elsewhere)."""
    given: float | None
    """The predicted step in the order given (rank 0; None elsewhere)."""
    predicted: float | None
    """The predicted step in the order chosen (rank 0; None elsewhere)."""


def agreed_order(program: Any, lengths: Sequence[int], group: dist.ProcessGroup | None,
                 *, time_budget_s: float = 0.05) -> Choice:
    """The order rank 0 of `group` chooses for microbatches of `lengths` tokens
    under `program`'s per-token costs (a plan or schedule), broadcast so that
    every rank holds the same. Collective over `group`."""
    from ppdsl.analysis.reorder import choose_order

    slots = torch.zeros(len(lengths), dtype=torch.int64)
    seconds = given = predicted = None
    if dist.get_rank(group) == 0:
        began = time.perf_counter()
        choice = choose_order(program, lengths, time_budget_s=time_budget_s)
        seconds = time.perf_counter() - began
        given, predicted = choice.baseline, choice.predicted
        slots = torch.tensor(choice.inverse, dtype=torch.int64)
    dist.broadcast(slots, src=global_rank(group, 0), group=group)
    return Choice(tuple(slots.tolist()), seconds, given, predicted)
