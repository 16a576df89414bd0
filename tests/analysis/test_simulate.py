"""The timed simulation: hand-computed cases, the zero-bubble paper's profiled
1F1B figure, and the numba kernel against the plain-Python reference."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings

from ppdsl.analysis.simulate import SimulationError, simulate
from ppdsl.ir.schedule import Costs
from tests.factories import (
    BW,
    ZB_H1,
    F,
    make_schedule,
    one_f_one_b_orders,
    parse_rows,
    placement,
    schedules,
)
from tests.oracles.simulate import simulate_reference


def _one_f_one_b(d: int, m: int, costs: Costs | None = None):
    return make_schedule(
        placement("parallel", d), m, one_f_one_b_orders(d, m), split_backward=False, costs=costs
    )


def test_one_f_one_b_unit_costs():
    """1F1B, d=4, m=8, F=1, BW=2: makespan (m+d-1)*3, every device busy 24, bubble 9/33."""
    t = simulate(_one_f_one_b(4, 8))
    assert t.makespan == 33.0
    assert t.busy == (24.0,) * 4
    assert t.span_start == (0.0, 1.0, 2.0, 3.0)
    assert t.span_end == (33.0, 31.0, 29.0, 27.0)
    assert t.bubble_ratio == pytest.approx(9 / 33)
    assert t.bubble_time == pytest.approx(9.0)
    assert t.idle_fraction == pytest.approx(1 - 96 / (4 * 33))
    assert t.peak_memory == (4, 3, 2, 1)


def test_zb_h1_makespan_27():
    """ZB-H1, p=4, m=8, unit costs (docs/papers.md's order): makespan 27."""
    s = make_schedule(placement("parallel", 4), 8, parse_rows(ZB_H1))
    t = simulate(s)
    assert t.makespan == 27.0
    assert t == simulate_reference(s)


def test_paper_profiled_one_f_one_b_bubble():
    """1F1B at the zero-bubble paper's profiled costs (T_F 18.522, T_B 18.086,
    T_W 9.337, T_comm 0.601), p=8, m=24: bubble ratio 0.2431 (its Table 5)."""
    d, m = 8, 24
    costs = Costs.of((18.522,) * d, (18.086,) * d, (9.337,) * d, (18.086 + 9.337,) * d, 0.601)
    t = simulate(_one_f_one_b(d, m, costs))
    assert round(t.bubble_ratio, 4) == 0.2431
    assert t == simulate_reference(_one_f_one_b(d, m, costs))


def test_comm_only_across_devices():
    """The transfer cost applies between devices, never between two stages of one
    device (the turn of a V)."""
    d = 1
    orders = [[(F, 0, 0), (F, 0, 1), (BW, 0, 1), (BW, 0, 0)]]
    s = make_schedule(
        placement("vshape", d),
        1,
        orders,
        split_backward=False,
        costs=Costs.of((1.0,) * 2, (1.0,) * 2, (1.0,) * 2, (2.0,) * 2, 5.0),
    )
    assert simulate(s).makespan == 6.0
    orders2 = [[(F, 0, 0), (BW, 0, 0)], [(F, 0, 1), (BW, 0, 1)]]
    s2 = make_schedule(
        placement("parallel", 2),
        1,
        orders2,
        split_backward=False,
        costs=Costs.of((1.0,) * 2, (1.0,) * 2, (1.0,) * 2, (2.0,) * 2, 5.0),
    )
    t = simulate(s2)
    # F0 [0,1) -> +5 -> F0:s1 [6,7) BW [7,9) -> +5 -> BW:s0 [14,16)
    assert t.start == ((0.0, 14.0), (6.0, 7.0))
    assert t.makespan == 16.0


def test_bubble_ratio_uses_longest_span_device():
    """The paper's ratio is that of the device with the longest span, not an average."""
    t = simulate(_one_f_one_b(4, 8))
    spans = [e - s for s, e in zip(t.span_start, t.span_end, strict=True)]
    longest = spans.index(max(spans))
    assert t.bubble_ratio == pytest.approx((spans[longest] - t.busy[longest]) / spans[longest])
    assert longest == 0


def test_memory_over_time_matches_peak():
    """The memory profile over time peaks at the order's prefix-sum peak."""
    s = make_schedule(placement("parallel", 4), 8, parse_rows(ZB_H1))
    t = simulate(s, memory_over_time=True)
    assert t.memory_over_time is not None
    for dev in range(4):
        assert max(level for _, level in t.memory_over_time[dev]) == float(t.peak_memory[dev])
    # ZB-H1 worker i (from 1): (p-i+1) M_B + (i-1) M_W with M_B=1, M_W=1/2
    assert t.peak_memory == tuple(Fraction(4 - i) + Fraction(i, 2) for i in range(4))


def test_cycle_raises():
    """Orders that wait on each other cannot be simulated: a clear error, both simulators."""
    orders = [[(BW, 0, 0), (F, 0, 0)]]
    s = make_schedule(placement("parallel", 1), 1, orders, split_backward=False)
    with pytest.raises(SimulationError, match="cycle"):
        simulate(s)
    with pytest.raises(SimulationError, match="cycle"):
        simulate_reference(s)


def test_missing_pass_raises():
    """A missing pass is reported, not simulated around."""
    s = make_schedule(
        placement("parallel", 2), 1, [[(F, 0, 0), (BW, 0, 0)], [(BW, 0, 1)]], split_backward=False
    )
    with pytest.raises(SimulationError, match="missing"):
        simulate(s)
    with pytest.raises(SimulationError, match="missing"):
        simulate_reference(s)


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_numba_equals_reference(s):
    """The numba kernel and the plain-Python definition give the same timeline."""
    fast, ref = simulate(s, memory_over_time=True), simulate_reference(s, memory_over_time=True)
    assert fast == ref


def test_examples_numba_equals_reference():
    """Every examples/*.pp simulates the same in the numba kernel and the reference."""
    from ppdsl.frontend import elaborate, parse

    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.pp"))
    if not examples:
        pytest.skip("no examples/*.pp yet")
    for path in examples:
        s = elaborate.elaborate(parse.parse(path.read_text(), str(path)), {})
        assert simulate(s) == simulate_reference(s), path.name
