"""The collision check: a building block repeated every period T puts no two
passes on one device at once (slots modulo T do not overlap)."""

from __future__ import annotations

import re
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis.checks import collisions
from ppdsl.ir.schedule import Block
from tests.factories import BW, B, F, W, block_slot, make_schedule, one_f_one_b_orders, placement


def _with_block(slots, period, d=4):
    block = Block(period, tuple(slots), None)
    orders = one_f_one_b_orders(d, 2)
    return make_schedule(placement("parallel", d), 2, orders, split_backward=False, block=block)


def _one_f_one_b_block(d=4):
    """1F1B's block (docs/papers.md's order): F[s] at s, BW[s] (2 units) at 3d - 2 - 2s, period 3."""
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


def test_grouped_copies_collide_by_microbatch():
    """In a grouped block every slot repeats for each microbatch of the group, U
    apart: two microbatches' copies of one slot collide when U is too small, and
    the message names the microbatches."""
    a = block_slot(BW, 0, 0, 0, 2, 10)
    block = Block(8, (a,), None, group_size=2, group_spacing=1)
    s = make_schedule(placement("parallel", 1), 2, one_f_one_b_orders(1, 2), split_backward=False, block=block)
    [err] = collisions.check(s)
    assert err.message.startswith(
        "on device 0, BW of stage 0 for microbatch 1 [1, 3) collides with BW of stage 0 "
        "for microbatch 0 [0, 2) modulo the period 8"
    )
    spaced = Block(8, (a,), None, group_size=2, group_spacing=2)
    assert collisions.check(replace(s, block=spaced)) == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 1), st.integers(-6, 20), st.integers(0, 5)), min_size=1, max_size=7
    ),
    st.integers(1, 12),
    st.integers(1, 3),
    st.integers(1, 5),
)
def test_every_colliding_pair_is_found(slots, period, group_size, spacing):
    """The sweep reports exactly the pairs that share time modulo T, each with its
    overlap, counted independently here cell by cell (integer times)."""
    made = [block_slot(F, k, dev, start, dur, 10 + k) for k, (dev, start, dur) in enumerate(slots)]
    block = Block(period, tuple(made), None, group_size=group_size, group_spacing=spacing)
    s = make_schedule(placement("parallel", 2), 2, one_f_one_b_orders(2, 2), split_backward=False, block=block)
    copies = [
        (slot.device, k, r, {(slot.start + r * spacing + t) % period for t in range(int(slot.duration))})
        for k, slot in enumerate(made)
        if slot.duration <= period
        for r in range(group_size)
    ]
    expected = sorted(
        f"stage {b[1]} for microbatch {b[2]}/stage {a[1]} for microbatch {a[2]}: {len(a[3] & b[3])}"
        for x, a in enumerate(copies)
        for b in copies[x + 1 :]
        if a[0] == b[0] and a[3] & b[3]
    )
    found = []
    for diag in collisions.check(s):
        if "longer than the period" in diag.message:
            continue
        hit = re.match(r"on device \d, F of (.+?) \[.*? collides with F of (.+?) \[.*overlapping (\d+)\)", diag.message)
        assert hit, diag.message
        found.append(f"{hit[1]}/{hit[2]}: {hit[3]}")
    if group_size == 1:
        expected = [e.replace(" for microbatch 0", "") for e in expected]
    assert sorted(found) == expected


def test_collision_of_two_stages_notes_the_placement():
    """Two stages meeting on one device name the `place` line that put them there."""
    import pytest

    from ppdsl.compiler import compile_source
    from ppdsl.diagnostics import CompileError

    text = (
        "schedule s {\n    param d = 2\n    param m = 4\n    place looped(2)\n"
        "    backward fused\n    block period 3 {\n        F at s\n        BW at 3*d - 2 - 2*s\n"
        "    }\n}\n"
    )
    with pytest.raises(CompileError) as info:
        compile_source(text, "placed.pp")
    notes = [(span.line if span else None, note) for d in info.value.diagnostics for span, note in d.notes]
    assert any(line == 4 and note.startswith("the placement (looped) puts stages") for line, note in notes)
