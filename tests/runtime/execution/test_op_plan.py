"""ppdsl/runtime/execution/op_plan.py: what a step does around each op, decided
once from a rank's order."""

from __future__ import annotations

from ppdsl.compiler import compile_file
from ppdsl.ir.rank import Compute, Exchange, TransferKind
from ppdsl.ir.schedule import PassKind
from ppdsl.runtime.execution.op_plan import op_plans, stage_points
from tests.paths import ROOT


def _ops(rank: int):
    compiled = compile_file(ROOT / "examples" / "1f1b.pp", {"d": "2", "m": "3"})
    return next(p for p in compiled.programs if p.rank == rank).ops


def test_plans_name_hooks_and_arrivals_where_the_order_puts_them():
    """The first pass runs the first-pass hooks; each stage's first F and last
    BW/W are marked; F takes an activation and B/BW a gradient; an exchange
    points at the next exchange (the last at none)."""
    ops = _ops(1)
    first_forward, grads_final = stage_points(ops)
    computes = [i for i, op in enumerate(ops) if isinstance(op, Compute)]
    plans = op_plans(ops, computes[0], first_forward, grads_final)
    assert [p.first_pass for p in plans].count(True) == 1 and plans[computes[0]].first_pass
    for stage, at in first_forward.items():
        assert plans[at].forward_of == stage and ops[at].pass_.kind is PassKind.F
    for stage, at in grads_final.items():
        assert plans[at].final_of == stage
        later = [op.pass_ for op in ops[at + 1:] if isinstance(op, Compute)]
        assert all(p.stage != stage or p.kind is PassKind.F for p in later)
    for plan in plans:
        if plan.compute is not None and plan.compute.pass_.kind is PassKind.F:
            assert plan.arriving == (TransferKind.ACT, plan.compute.pass_.microbatch, 1)
    exchanges = [p for p in plans if p.exchange is not None]
    assert [p.next_exchange for p in exchanges] == [e.exchange for e in exchanges[1:]] + [None]
    assert all(isinstance(p.op, Exchange) == (p.exchange is not None) for p in plans)
