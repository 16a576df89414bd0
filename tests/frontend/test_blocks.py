"""Repeating building blocks (ppdsl.frontend.blocks.repeat_block): the order of a
repeated block, spans, ties, W fill, and the papers' blocks built in Python."""

from __future__ import annotations

from fractions import Fraction

import pytest

from ppdsl.analysis import checks
from ppdsl.analysis.simulate import simulate
from ppdsl.diagnostics import Span
from ppdsl.frontend.blocks import _fill_w, repeat_block
from ppdsl.ir.schedule import (
    Block,
    BlockSlot,
    Costs,
    MemoryModel,
    Pass,
    PassKind,
    Placement,
    format_pass,
)
from tests.factories import ZB_H1, make_schedule, placement

F, B, W, BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW

ONE_F_ONE_B = """\
F0 F1 F2 F3 BW0 F4 BW1 F5 BW2 F6 BW3 F7 BW4 BW5 BW6 BW7
F0 F1 F2 BW0 F3 BW1 F4 BW2 F5 BW3 F6 BW4 F7 BW5 BW6 BW7
F0 F1 BW0 F2 BW1 F3 BW2 F4 BW3 F5 BW4 F6 BW5 F7 BW6 BW7
F0 BW0 F1 BW1 F2 BW2 F3 BW3 F4 BW4 F5 BW5 F6 BW6 F7 BW7
"""


def _span(line: int) -> Span:
    return Span("block.pp", line, 5, line, 20)


def make_block(place: Placement, period, rows) -> Block:
    """rows: (kind, stage, start, duration); slot k's span is on line k + 1."""
    slots = tuple(
        BlockSlot(
            kind, stage, place.stage_device[stage], Fraction(start), Fraction(dur), _span(k + 1)
        )
        for k, (kind, stage, start, dur) in enumerate(rows)
    )
    return Block(Fraction(period), slots, _span(1))


def zb_h1_block(d: int) -> tuple[Placement, Block]:
    """ZB-H1 (zero-bubble paper §3.1): F at s, B at 3d-2-2s, W at 3d-1+s, T = 3."""
    place = placement("parallel", d)
    rows = [
        r
        for s in range(d)
        for r in ((F, s, s, 1), (B, s, 3 * d - 2 - 2 * s, 1), (W, s, 3 * d - 1 + s, 1))
    ]
    return place, make_block(place, 3, rows)


def one_f_one_b_block(d: int) -> tuple[Placement, Block]:
    """1F1B: F at s, BW (lasting 2) at 3d-2-2s, T = 3."""
    place = placement("parallel", d)
    rows = [r for s in range(d) for r in ((F, s, s, 1), (BW, s, 3 * d - 2 - 2 * s, 2))]
    return place, make_block(place, 3, rows)


def zb_h2_block(d: int) -> tuple[Placement, Block]:
    """ZB-H2 (zero-bubble paper §3.1): device s runs 2d-2s-1 F before its first
    B, F B W in the steady state, W deferred by 2s microbatches."""
    place = placement("parallel", d)
    rows = [
        r
        for s in range(d)
        for r in ((F, s, s, 1), (B, s, 6 * d - 5 * s - 5, 1), (W, s, 6 * d + s - 4, 1))
    ]
    return place, make_block(place, 3, rows)


def v_block(d: int, kind: str) -> tuple[Placement, Block]:
    """V-Min / V-Half (controllable-memory paper §4): F/B slots of chunk 0
    (stage i) and chunk 1 (stage 2d-1-i), T = 6, W filled."""
    place = placement("vshape", d)
    rows = []
    for i in range(d):
        if kind == "min":
            g = 2 if d % 3 == 0 else 0
            f0, f1, b1, b0 = i, 2 * d - 1 - i, 2 * d + g + i, 4 * d + g - 1 - i
        else:
            g = 3 if d % 2 == 0 else 0
            f0, f1, b1, b0 = 2 * i, 3 * d - 2 - i, 3 * d + g - 1 + 2 * i, 6 * d + g - 2 - i
        s0, s1 = i, 2 * d - 1 - i
        rows += [(F, s0, f0, 1), (F, s1, f1, 1), (B, s1, b1, 1), (B, s0, b0, 1)]
    return place, make_block(place, 6, rows)


def schedule_of(place, block, m, *, split=True, w_fill=False, m_w=Fraction(1, 2)):
    costs = Costs.unit(place.num_stages)
    orders = repeat_block(block, place, m, split_backward=split, w_fill=w_fill, costs=costs)
    memory = MemoryModel((Fraction(1),) * place.num_stages, (m_w,) * place.num_stages)
    return make_schedule(
        place, m, orders, split_backward=split, costs=costs, memory=memory, block=block
    )


def rows_of(schedule) -> str:
    return "".join(" ".join(format_pass(p, False) for p in o) + "\n" for o in schedule.orders)


def errors(schedule) -> list:
    return [d for d in checks.check_schedule(schedule) if d.severity == "error"]


def test_zb_h1_block_gives_the_papers_order():
    """ZB-H1's unit block repeated 8 times on 4 devices is docs/papers.md's order, makespan 27."""
    place, block = zb_h1_block(4)
    schedule = schedule_of(place, block, 8)
    assert rows_of(schedule) == ZB_H1
    assert errors(schedule) == []
    assert simulate(schedule).makespan == 27


def test_one_f_one_b_block_gives_the_papers_order():
    """1F1B's block (BW lasting 2, period 3) is PipeDream-flush's order."""
    place, block = one_f_one_b_block(4)
    schedule = schedule_of(place, block, 8, split=False)
    assert rows_of(schedule) == ONE_F_ONE_B
    assert simulate(schedule).makespan == 33


def test_every_pass_carries_its_slots_span():
    """A pass points at the block line that made it."""
    place, block = zb_h1_block(3)
    schedule = schedule_of(place, block, 4)
    by_slot = {(s.kind, s.stage): s.span for s in block.slots}
    for order in schedule.orders:
        for p in order:
            assert p.span == by_slot[(p.kind, p.stage)]


def test_ties_follow_the_blocks_line_order():
    """Equal start times (zero-length slots) keep the order the block wrote them."""
    place = placement("parallel", 1)
    block = make_block(place, 2, [(W, 0, 1, 0), (B, 0, 1, 0), (F, 0, 0, 1)])
    orders = repeat_block(block, place, 2, split_backward=True, w_fill=False, costs=Costs.unit(1))
    assert [format_pass(p, False) for p in orders[0]] == ["F0", "W0", "B0", "F1", "W1", "B1"]


def test_microbatch_j_starts_j_periods_later():
    """A slot's passes appear once per microbatch, in microbatch order."""
    place, block = zb_h1_block(2)
    orders = repeat_block(block, place, 5, split_backward=True, w_fill=False, costs=Costs.unit(2))
    for order in orders:
        for kind in (F, B, W):
            assert [p.microbatch for p in order if p.kind is kind] == list(range(5))


def test_w_fill_needs_a_split_backward():
    """W fill in a fused-backward block is refused."""
    place, block = one_f_one_b_block(2)
    with pytest.raises(ValueError, match="split backward"):
        repeat_block(block, place, 2, split_backward=False, w_fill=True, costs=Costs.unit(2))


def test_w_fill_refuses_explicit_w_slots():
    """A W-fill block holds F and B only."""
    place, block = zb_h1_block(2)
    with pytest.raises(ValueError, match="only F and B"):
        repeat_block(block, place, 2, split_backward=True, w_fill=True, costs=Costs.unit(2))


def test_w_fill_puts_w_in_the_blocks_free_slots():
    """One device, F at 0, B at 1, period 3: W fills slot 2 after its B."""
    place = placement("parallel", 1)
    block = make_block(place, 3, [(F, 0, 0, 1), (B, 0, 1, 1)])
    orders = repeat_block(block, place, 3, split_backward=True, w_fill=True, costs=Costs.unit(1))
    assert [format_pass(p, False) for p in orders[0]] == "F0 B0 W0 F1 B1 W1 F2 B2 W2".split()
    w = [p for p in orders[0] if p.kind is W]
    assert all(p.span == block.slots[1].span for p in w)


def test_w_fill_leaves_the_rest_to_the_end():
    """With no free slot in the block, every W runs after the last F/B."""
    place = placement("parallel", 1)
    block = make_block(place, 2, [(F, 0, 0, 1), (B, 0, 1, 1)])
    orders = repeat_block(block, place, 3, split_backward=True, w_fill=True, costs=Costs.unit(1))
    assert [format_pass(p, False) for p in orders[0]] == "F0 B0 F1 B1 F2 B2 W0 W1 W2".split()


def test_no_microbatches_no_passes():
    """m = 0 gives empty orders."""
    place, block = zb_h1_block(2)
    orders = repeat_block(block, place, 0, split_backward=True, w_fill=False, costs=Costs.unit(2))
    assert orders == ((), ())


@pytest.mark.parametrize("d", [2, 4, 8])
def test_zb_h2_block_memory_and_bubble(d):
    """ZB-H2: worker i (from 1) peaks at (2p-2i+1) M_B + (2i-2) M_W; no bubble at unit costs."""
    place, block = zb_h2_block(d)
    schedule = schedule_of(place, block, 2 * d)
    assert errors(schedule) == []
    timeline = simulate(schedule)
    half = Fraction(1, 2)
    assert timeline.peak_memory == tuple((2 * d - 2 * s - 1) + 2 * s * half for s in range(d))
    assert timeline.bubble_ratio == 0


@pytest.mark.parametrize("kind", ["min", "half"])
@pytest.mark.parametrize("d", [2, 3, 4, 8, 16])
def test_v_blocks_with_w_fill_reach_the_papers_memory(kind, d):
    """V-Min / V-Half with W fill: valid, and the peak per device is 2·(p+4)//3 and
    2·(p+2)//2 chunks (in 1F1B-stage units (p+4)//3 and (p+2)//2), M_W = M_B."""
    place, block = v_block(d, kind)
    bound = 2 * ((d + 4) // 3) if kind == "min" else 2 * ((d + 2) // 2)
    for m in (d, 2 * d):
        schedule = schedule_of(place, block, m, w_fill=True, m_w=Fraction(1))
        assert errors(schedule) == []
        assert max(simulate(schedule).peak_memory) == bound


def v_zb_block(d: int) -> tuple[Placement, Block]:
    """V-ZB (controllable-memory paper §4): ZB-V's steady state as one block, T = 6."""
    place = placement("vshape", d)
    rows = []
    for i in range(d):
        s0, s1 = i, 2 * d - 1 - i
        rows += [
            (F, s0, 4 * i, 1),
            (B, s0, 12 * d - 5 - 2 * i, 1),
            (W, s0, 12 * d - 4 - 2 * i, 1),
            (F, s1, 6 * d - 3 - 2 * i, 1),
            (B, s1, 6 * d - 2 + 4 * i, 1),
            (W, s1, 6 * d - 1 + 4 * i, 1),
        ]
    return place, make_block(place, 6, rows)


def _sorted_block_order(block: Block, place: Placement, m: int) -> list[list[str]]:
    timed = [[] for _ in range(place.num_devices)]
    for index, slot in enumerate(block.slots):
        for j in range(m):
            timed[slot.device].append((slot.start + j * block.period, index, j, slot))
    return [
        [format_pass(Pass(s.kind, j, s.stage), True) for _, _, j, s in sorted(dev)] for dev in timed
    ]


@pytest.mark.parametrize("d", [2, 4, 8])
def test_warm_up_and_cool_down_make_v_zb_bubble_free(d):
    """V-ZB's repeated block idles 2d-2 per device; the warm-up/cool-down step
    removes it without raising any device's peak above 2d chunks."""
    place, block = v_zb_block(d)
    m = 2 * d
    schedule = schedule_of(place, block, m, m_w=Fraction(1))
    assert errors(schedule) == []
    timeline = simulate(schedule)
    assert timeline.bubble_ratio == 0
    assert timeline.peak_memory == (2 * d,) * d
    plain = _sorted_block_order(block, place, m)
    assert [[format_pass(p, True) for p in o] for o in schedule.orders] != plain


@pytest.mark.parametrize("d", [4, 8])
def test_warm_up_and_cool_down_keep_the_order_when_the_peak_would_rise(d):
    """V-Min: moving passes would raise a device's peak, so the sorted block order stands."""
    place, block = v_block(d, "min")
    schedule = schedule_of(place, block, 2 * d, w_fill=True, m_w=Fraction(1))
    costs = Costs.unit(place.num_stages)
    timed = [[] for _ in range(place.num_devices)]
    for index, slot in enumerate(block.slots):
        for j in range(2 * d):
            timed[slot.device].append((slot.start + j * block.period, index, j, slot))
    for dev in timed:
        dev.sort(key=lambda t: (t[0], t[1], t[2]))
    assert schedule.orders == _fill_w(timed, costs)


def test_one_f_one_b_and_zb_h_orders_are_left_alone():
    """1F1B, ZB-H1 and ZB-H2: the warm-up/cool-down step changes nothing."""
    for build, split in ((one_f_one_b_block, False), (zb_h1_block, True), (zb_h2_block, True)):
        for d in (2, 4, 8):
            place, block = build(d)
            schedule = schedule_of(place, block, 3 * d, split=split)
            got = [[format_pass(p, True) for p in o] for o in schedule.orders]
            assert got == _sorted_block_order(block, place, 3 * d)


@pytest.mark.parametrize("comm", [0.0, 0.5])
@pytest.mark.parametrize("times", [(1, 1, 1), (3, 4, 2), (2, 1, 3)])
def test_warm_up_and_cool_down_never_break_a_schedule(times, comm):
    """Under unequal costs and transfer time, every repeated block stays valid and no
    device's peak (W holding all of M_B) exceeds that of the sorted block order."""
    t_f, t_b, t_w = times
    builds = [
        (lambda d: zb_h1_block(d), False),
        (lambda d: zb_h2_block(d), False),
        (lambda d: v_block(d, "min"), True),
        (lambda d: v_block(d, "half"), True),
        (lambda d: v_zb_block(d), False),
    ]
    for build, w_fill in builds:
        for d in (2, 4):
            place, block = build(d)
            n = place.num_stages
            costs = Costs.of((t_f,) * n, (t_b,) * n, (t_w,) * n, (t_b + t_w,) * n, comm)
            m = 2 * d
            orders = repeat_block(block, place, m, split_backward=True, w_fill=w_fill, costs=costs)
            memory = MemoryModel((Fraction(1),) * n, (Fraction(1),) * n)
            schedule = make_schedule(place, m, orders, costs=costs, memory=memory, block=block)
            assert errors(schedule) == []
            plain = [[p for p in o] for o in orders]
            timed = [[] for _ in range(place.num_devices)]
            for index, slot in enumerate(block.slots):
                for j in range(m):
                    timed[slot.device].append((slot.start + j * block.period, index, j, slot))
            for dev in timed:
                dev.sort(key=lambda t: (t[0], t[1], t[2]))
            if w_fill:
                plain = _fill_w(timed, costs)
            else:
                plain = tuple(
                    tuple(Pass(s.kind, j, s.stage) for _, _, j, s in dev) for dev in timed
                )
            base = make_schedule(place, m, plain, costs=costs, memory=memory, block=block)
            got, before = simulate(schedule), simulate(base)
            assert all(a <= b for a, b in zip(got.peak_memory, before.peak_memory, strict=True))
            assert got.makespan <= before.makespan + 1e-9


# The authors' V-Half (their scheduler, zbv_greedy.py, at unit costs): per-device bubble
AUTHORS_V_HALF = {(4, 8): 0.0943, (4, 12): 0.0649, (4, 16): 0.0495,
                  (8, 16): 0.1504, (8, 24): 0.1056, (8, 32): 0.0813}


@pytest.mark.parametrize("d,m", sorted(AUTHORS_V_HALF))
def test_v_half_warm_up_and_cool_down_reach_the_authors_bubble(d, m):
    """examples/v_half.pp (the block, compacted, then early forwards and B
    before W) reaches the authors' V-Half bubble and keeps the paper's peak
    (p+2)//2 of a 1F1B stage: without the compaction it stays at 0.1111
    (d=4, m=12)."""
    from ppdsl.compiler import compile_file
    from tests.paths import EXAMPLES

    compiled = compile_file(EXAMPLES / "v_half.pp", {"d": str(d), "m": str(m)})
    assert round(compiled.timeline.bubble_ratio, 4) == AUTHORS_V_HALF[d, m]
    assert max(compiled.timeline.peak_memory) == (d + 2) // 2 * 2


def test_grouped_block_shifts_microbatches_by_group_and_position():
    """`group G every U`: microbatch j starts (j // G) T + (j % G) U after
    microbatch 0; G = 1 is the plain block's j T."""
    block = Block(Fraction(10), (), None, group_size=3, group_spacing=Fraction(2))
    assert [block.shift(j) for j in range(7)] == [0, 2, 4, 10, 12, 14, 20]
    plain = Block(Fraction(10), (), None)
    assert [plain.shift(j) for j in range(3)] == [0, 10, 20]


def test_grouped_block_runs_a_group_through_each_chunk():
    """Two chunks on one device, groups of 2: each group goes through chunk 0, then
    chunk 1, then back (a grouped breadth-first block); without groups the same
    slots run one microbatch at a time through both chunks."""
    place = placement("looped", 1, 2)
    rows = [(F, 0, 0, 1), (F, 1, 2, 1), (BW, 1, 4, 2), (BW, 0, 8, 2)]
    grouped = make_block(place, 12, rows)
    grouped = Block(grouped.period, grouped.slots, grouped.span, 2, Fraction(1))
    costs = Costs.unit(2)
    orders = repeat_block(grouped, place, 4, split_backward=False, w_fill=False, costs=costs)
    assert " ".join(format_pass(p, True) for p in orders[0]) == (
        "F0:s0 F1:s0 F0:s1 F1:s1 BW0:s1 BW1:s1 BW0:s0 BW1:s0 "
        "F2:s0 F3:s0 F2:s1 F3:s1 BW2:s1 BW3:s1 BW2:s0 BW3:s0"
    )
    plain = make_block(place, 12, rows)
    orders = repeat_block(plain, place, 2, split_backward=False, w_fill=False, costs=costs)
    assert " ".join(format_pass(p, True) for p in orders[0]) == "F0:s0 F0:s1 BW0:s1 BW0:s0 F1:s0 F1:s1 BW1:s1 BW1:s0"
