"""The deadlock check on lowered rank programs: hand cases, the located cycle of
waits, and agreement with a brute-force executor of the same semantics."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis.checks import deadlock
from ppdsl.analysis.comm_rules import run
from ppdsl.compiler import compile_file
from ppdsl.ir.rank import Exchange, RankProgram, Transfer, TransferKind
from ppdsl.lowering.lower import lower
from tests.factories import (
    BW,
    ZB_H1,
    F,
    breadth_first_orders,
    brute_force_finishes,
    make_schedule,
    one_f_one_b_orders,
    parse_rows,
    placement,
    schedules,
)
from tests.paths import EXAMPLES


def test_one_f_one_b_does_not_deadlock():
    """1F1B's lowered programs run to the end."""
    s = make_schedule(placement("parallel", 4), 8, one_f_one_b_orders(4, 8), split_backward=False)
    assert deadlock.check(s, lower(s)) == []


def test_zb_h1_does_not_deadlock():
    """ZB-H1 (docs/papers.md's order) lowers to programs that run to the end."""
    s = make_schedule(placement("parallel", 4), 8, parse_rows(ZB_H1))
    assert deadlock.check(s, lower(s)) == []


def test_breadth_first_vshape_does_not_deadlock():
    """Breadth-first V-shape orders run to the end (sends and receives in one order)."""
    s = make_schedule(placement("vshape", 3), 4, breadth_first_orders(placement("vshape", 3), 4))
    assert deadlock.check(s, lower(s)) == []


def test_consumer_order_differs_deadlock_reported_as_cycle():
    """Rank 1 wants microbatch 1 first while rank 0 sends microbatch 0 first: valid
    dependencies, yet blocking send/recv deadlocks; one line per wait, located."""
    orders = [
        [(F, 0, 0), (F, 1, 0), (BW, 0, 0), (BW, 1, 0)],
        [(F, 1, 1), (BW, 1, 1), (F, 0, 1), (BW, 0, 1)],
    ]
    s = make_schedule(placement("parallel", 2), 2, orders, split_backward=False)
    [err] = deadlock.check(s, lower(s))
    assert "ranks 0, 1 wait on each other in a cycle" in err.message
    assert [n for _, n in err.notes] == [
        "rank 0 waits for send act(stage 0->1, mb 0) to rank 1 (output of F0:s0)",
        "rank 1 waits for recv act(stage 0->1, mb 1) from rank 0 (input of F1:s1)",
    ]
    assert err.notes[0][0] == s.orders[0][0].span
    assert err.notes[1][0] == s.orders[1][0].span
    assert err.span == s.orders[0][0].span


def test_unmatched_send_reported():
    """A send nobody receives is its own located error."""
    s = make_schedule(placement("parallel", 2), 1, one_f_one_b_orders(2, 1), split_backward=False)
    programs = list(lower(s))
    ops = [op for op in programs[1].ops if not (isinstance(op, Exchange) and op.recvs)]
    programs[1] = replace(programs[1], ops=tuple(ops))
    found = deadlock.check(s, tuple(programs))
    assert any("no rank posts the matching receive" in d.message for d in found)
    assert all(d.span is not None for d in found)


def test_hand_programs_recv_first_deadlock():
    """Two ranks that each receive before sending wait on each other."""
    a = Transfer(TransferKind.ACT, 0, 0, 1, 0, 1)
    g = Transfer(TransferKind.GRAD, 0, 1, 0, 1, 0)
    programs = (
        RankProgram(0, (Exchange((), (g,)), Exchange((a,), ()))),
        RankProgram(1, (Exchange((), (a,)), Exchange((g,), ()))),
    )
    s = make_schedule(placement("parallel", 2), 1, one_f_one_b_orders(2, 1), split_backward=False)
    [err] = deadlock.check(s, programs)
    assert [n for _, n in err.notes] == [
        "rank 0 waits for recv grad(stage 1->0, mb 0) from rank 1 (input of BW0:s0)",
        "rank 1 waits for recv act(stage 0->1, mb 0) from rank 0 (input of F0:s1)",
    ]
    assert brute_force_finishes(programs, random.Random(0)) is False


def _shuffle_exchanges(programs, rng: random.Random):
    """Swap two exchanges on one rank: often a deadlock, sometimes not."""
    programs = list(programs)
    r = rng.randrange(len(programs))
    ops = list(programs[r].ops)
    where = [i for i, op in enumerate(ops) if isinstance(op, Exchange)]
    if len(where) >= 2:
        i, j = rng.sample(where, 2)
        ops[i], ops[j] = ops[j], ops[i]
    programs[r] = replace(programs[r], ops=tuple(ops))
    return tuple(programs)


@settings(max_examples=80, deadline=None)
@given(schedules(), st.integers(0, 2**32 - 1), st.booleans(), st.booleans())
def test_agrees_with_brute_force(s, seed, shuffle, sends_block):
    """The check reports a deadlock exactly when the brute-force executor gets stuck
    (blocking sends or not)."""
    rng = random.Random(seed)
    programs = lower(s)
    if shuffle:
        programs = _shuffle_exchanges(programs, rng)
    cycles, unmatched, duplicates = deadlock.stuck_waits(programs, sends_block)
    assert not unmatched and not duplicates
    assert (cycles == []) == brute_force_finishes(programs, rng, sends_block)
    found = deadlock.check(s, programs, sends_block=sends_block)
    assert (found == []) == (cycles == [])
    assert all(d.span is not None and all(sp is not None for sp, _ in d.notes) for d in found)


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_valid_orders_never_deadlock_when_sends_do_not_block(s):
    """With sends finishing in the background, only receives wait, so any order
    the dependency check accepts runs to the end."""
    assert deadlock.check(s, lower(s), sends_block=False) == []


def test_ring_of_sends_deadlocks_only_when_sends_block():
    """Every rank sending to its left neighbour before receiving from its right
    one: a ring of blocked sends under batch semantics, fine when sends do not block."""
    t = [Transfer(TransferKind.GRAD, 0, r + 4, r + 3, r, (r - 1) % 3) for r in range(3)]
    programs = tuple(
        RankProgram(r, (Exchange((t[r],), ()), Exchange((), (t[(r + 1) % 3],)))) for r in range(3)
    )
    s = make_schedule(placement("parallel", 3), 1, one_f_one_b_orders(3, 1), split_backward=False)
    [err] = deadlock.check(s, programs)
    assert "ranks 0, 2, 1 wait on each other" in err.message
    assert deadlock.check(s, programs, sends_block=False) == []
    assert brute_force_finishes(programs, random.Random(0)) is False
    assert brute_force_finishes(programs, random.Random(0), sends_block=False) is True


def test_duplicated_transfer_reported():
    """A transfer sent twice is a located error (a lowering bug, not a user error)."""
    s = make_schedule(placement("parallel", 2), 1, one_f_one_b_orders(2, 1), split_backward=False)
    programs = list(lower(s))
    ops = list(programs[0].ops)
    first = next(op for op in ops if isinstance(op, Exchange) and op.sends)
    ops.append(Exchange(first.sends, ()))
    programs[0] = replace(programs[0], ops=tuple(ops))
    found = deadlock.check(s, tuple(programs))
    assert any("sends act(mb 0, stage 0->1, rank 0->1) twice" in d.message for d in found)


EXAMPLE_FILES = sorted(EXAMPLES.glob("*.pp"))


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_examples_run_under_nccl_rules(path):
    """Every example's lowered programs, as the runtime's NCCL transport posts
    them (one group per exchange), finish under NCCL's rules
    (ppdsl/analysis/comm_rules.py) once their receives follow the send order."""
    compiled = compile_file(path, comm_model="nccl")
    items = deadlock.runtime_items(compiled.schedule, compiled.lowered)
    assert run(items, "nccl").ok


def test_early_receives_cross_a_v_shape_under_nccl():
    """Without the send-order step, ZB-V's early receives post a later-sent
    tensor's receive first: NCCL meets it with the wrong send (a crossed pair),
    which the nccl check reports as a cycle of the two ranks."""
    compiled = compile_file(EXAMPLES / "zb_v.pp")
    found = deadlock.check(compiled.schedule, compiled.lowered, comm_model="nccl")
    assert found and all(d.severity == "error" for d in found)
    assert "crossed pair" in found[0].notes[0][1]
    assert found[0].span is not None and found[0].span.file.endswith("zb_v.pp")
