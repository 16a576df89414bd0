"""The collision check: a building block repeated every period T puts no two
passes on one device at once (slots modulo T do not overlap)."""

from __future__ import annotations

from factories import BW, B, F, W, block_slot, make_schedule, one_f_one_b_orders, placement

from ppdsl.analysis.checks import collisions
from ppdsl.ir.schedule import Block


def _with_block(slots, period, d=4):
    block = Block(period, tuple(slots), None)
    orders = one_f_one_b_orders(d, 2)
    return make_schedule(placement("parallel", d), 2, orders, split_backward=False, block=block)


def _one_f_one_b_block(d=4):
    """1F1B's block (DESIGN.md): F[s] at s, BW[s] (2 units) at 3d - 2 - 2s, period 3."""
    slots = []
    for s in range(d):
        slots.append(block_slot(F, s, s, s, 1, 10 + 2 * s))
        slots.append(block_slot(BW, s, s, 3 * d - 2 - 2 * s, 2, 11 + 2 * s))
    return slots


def test_one_f_one_b_block_is_collision_free():
    """1F1B's block under period 3 has no collision."""
    assert collisions.check(_with_block(_one_f_one_b_block(), 3)) == []


def test_no_block_no_findings():
    """An order-form schedule has no block to check."""
    s = make_schedule(placement("parallel", 2), 2, one_f_one_b_orders(2, 2), split_backward=False)
    assert collisions.check(s) == []


def test_collision_modulo_period_names_both_slots():
    """F at 0 and B at 3 collide under period 3 (both at 0 mod 3): error at one, note at the other."""
    a = block_slot(F, 0, 0, 0, 1, 10)
    b = block_slot(B, 0, 0, 3, 1, 11)
    w = block_slot(W, 0, 0, 4, 1, 12)
    [err] = collisions.check(_with_block([a, b, w], 3))
    assert err.message == (
        "on device 0, B of stage 0 [3, 4) collides with F of stage 0 [0, 1) modulo the period 3 "
        "(at 0 and 0 mod 3, overlapping 1); move one of them or raise the period"
    )
    assert err.span == b.span and err.notes[0][0] == a.span


def test_wraparound_overlap():
    """A slot crossing the period boundary collides with one at the start."""
    a = block_slot(F, 0, 0, 2, 2, 10)  # [2, 4) -> covers [2, 3) and [0, 1)
    b = block_slot(B, 0, 0, 6, 1, 11)  # 0 mod 3
    [err] = collisions.check(_with_block([a, b], 3))
    assert "overlapping 1" in err.message


def test_other_devices_never_collide():
    """Slots on different devices may share times."""
    a = block_slot(F, 0, 0, 0, 1, 10)
    b = block_slot(F, 1, 1, 0, 1, 11)
    assert collisions.check(_with_block([a, b], 3)) == []


def test_slot_longer_than_period():
    """A slot longer than T overlaps its own next repetition."""
    a = block_slot(BW, 0, 0, 0, 4, 10)
    [err] = collisions.check(_with_block([a], 3))
    assert "lasts 4, longer than the period 3" in err.message and err.span == a.span


def test_all_pairs_reported():
    """Three slots at the same time on one device: three collisions, all reported."""
    slots = [block_slot(k, 0, 0, 1, 1, 10 + i) for i, k in enumerate((F, B, W))]
    assert len(collisions.check(_with_block(slots, 3))) == 3
