"""Early receives (`ppdsl.lowering.early_receives`): receives pulled into
earlier exchanges remove every deadlock of a dependency-valid order, keep the
same transfers and computes, and leave programs that already run untouched."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis.checks import deadlock
from ppdsl.ir.rank import Compute, Exchange
from ppdsl.lowering.early_receives import pull_receives_forward
from ppdsl.lowering.lower import lower
from tests.factories import BW, F, brute_force_finishes, make_schedule, placement, schedules


@settings(max_examples=60, deadline=None)
@given(schedules(), st.integers(0, 2**32 - 1))
def test_pull_receives_forward_removes_every_deadlock(s, seed):
    """For any dependency-valid order, moving receives into earlier exchanges gives
    programs that run to the end (checked by the brute-force executor), with the
    same transfers, and leaves programs that already run untouched."""
    programs = lower(s)
    repaired = pull_receives_forward(programs)
    assert deadlock.check(s, repaired) == []
    assert brute_force_finishes(repaired, random.Random(seed))
    if deadlock.check(s, programs) == []:
        assert repaired is programs

    def transfers(progs):
        return sorted(
            (str(t), r.rank)
            for r in progs
            for op in r.ops
            if isinstance(op, Exchange)
            for t in (*op.sends, *op.recvs)
        )

    assert transfers(repaired) == transfers(programs)
    computes = [[op for op in r.ops if isinstance(op, Compute)] for r in programs]
    assert [[op for op in r.ops if isinstance(op, Compute)] for r in repaired] == computes


def test_pull_receives_forward_fixes_consumer_order_deadlock():
    """The hand case above: rank 1's receive of microbatch 0 moves up to where it waits."""
    orders = [
        [(F, 0, 0), (F, 1, 0), (BW, 0, 0), (BW, 1, 0)],
        [(F, 1, 1), (BW, 1, 1), (F, 0, 1), (BW, 0, 1)],
    ]
    s = make_schedule(placement("parallel", 2), 2, orders, split_backward=False)
    repaired = pull_receives_forward(lower(s))
    assert deadlock.check(s, repaired) == []
    first = repaired[1].ops[0]
    assert isinstance(first, Exchange) and [t.microbatch for t in first.recvs] == [1, 0]
