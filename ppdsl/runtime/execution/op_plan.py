"""What a rank's step does around each op of its order, decided once from the
order and not per pass (`ppdsl.runtime.execution.engine` runs it): which hooks
are due before and after a pass, which exchange's receives are posted a pass
ahead, which value a pass takes (host work a GPU would wait on:
`ppdsl.runtime.measure.hostops` counts it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppdsl.ir.rank import Compute, Exchange, Op, TransferKind
from ppdsl.ir.schedule import PassKind
from ppdsl.runtime.execution.step_state import Key
from ppdsl.semantics import reduction_points

__all__ = ["OpPlan", "next_exchanges", "op_plans", "stage_points"]


def next_exchanges(ops: Sequence[Op]) -> dict[int, Exchange | None]:
    """For each exchange's index in `ops`, the exchange after it (None for the last)."""
    found: dict[int, Exchange | None] = {}
    upcoming: Exchange | None = None
    for index in range(len(ops) - 1, -1, -1):
        op = ops[index]
        if isinstance(op, Exchange):
            found[index] = upcoming
            upcoming = op
    return found


def stage_points(ops: Sequence[Op]) -> tuple[dict[int, int], dict[int, int]]:
    """Per stage, the index in `ops` of its first F, and of its last W/BW, after
    which its gradients are final (`semantics.reduction_point`, the rule the
    compiler's reductions check proves)."""
    computes = [(i, op.pass_) for i, op in enumerate(ops) if isinstance(op, Compute)]
    first_forward: dict[int, int] = {}
    for i, p in computes:
        if p.kind is PassKind.F:
            first_forward.setdefault(p.stage, i)
    grads_final = {stage: computes[at][0]
                   for stage, at in reduction_points([p for _, p in computes]).items()}
    return first_forward, grads_final


@dataclass(frozen=True)
class OpPlan:
    """One op of the rank's order and what the step does around it, decided once
    from the order (not per pass)."""

    op: Op
    exchange: Exchange | None
    """The op, when it is an exchange."""
    compute: Compute | None
    """The op, when it is a compute pass."""
    next_exchange: Exchange | None = None
    """An exchange's next exchange: its receives are posted a pass ahead."""
    first_pass: bool = False
    """The step's first pass: `Hooks.before_first_pass` runs before it."""
    forward_of: int | None = None
    """The stage whose first F this is: `Hooks.before_stage_forward` runs before it."""
    final_of: int | None = None
    """The stage whose gradients are final after this pass: `Hooks.stage_grads_ready`."""
    arriving: Key | None = None
    """The value this pass takes, which may be a pending receive: F's activation,
    B's or BW's gradient."""


def op_plans(ops: Sequence[Op], first_compute: int | None, first_forward: dict[int, int],
              grads_final: dict[int, int]) -> tuple[OpPlan, ...]:
    """Each op's `OpPlan`."""
    next_exchange = next_exchanges(ops)
    forward_at = {i: s for s, i in first_forward.items()}
    final_at = {i: s for s, i in grads_final.items()}
    plans = []
    for index, op in enumerate(ops):
        if isinstance(op, Exchange):
            plans.append(OpPlan(op, op, None, next_exchange[index]))
            continue
        p = op.pass_
        arriving: Key | None = None
        if p.kind is PassKind.F:
            arriving = (TransferKind.ACT, p.microbatch, p.stage)
        elif p.kind in (PassKind.B, PassKind.BW):
            arriving = (TransferKind.GRAD, p.microbatch, p.stage)
        plans.append(OpPlan(op, None, op, None, index == first_compute, forward_at.get(index),
                             final_at.get(index), arriving))
    return tuple(plans)
