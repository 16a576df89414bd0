"""The dependency check: the orders admit a global order, and when they do not,
the cycle of waits is reported with one located note per wait."""

from __future__ import annotations

import random
import time

import pytest

from ppdsl.analysis.checks import dependencies
from tests.factories import (
    BW,
    B,
    F,
    W,
    make_schedule,
    one_f_one_b_orders,
    placement,
    random_valid_orders,
)


def test_one_f_one_b_is_valid():
    """1F1B has a global order."""
    s = make_schedule(placement("parallel", 4), 8, one_f_one_b_orders(4, 8, split=True))
    assert dependencies.check(s) == []


def test_same_device_cycle():
    """A device that runs B before the F it needs: a one-device cycle, both passes named."""
    orders = one_f_one_b_orders(2, 2, split=True)
    i = orders[1].index((B, 1, 1))
    f = orders[1].index((F, 1, 1))
    orders[1].insert(f, orders[1].pop(i))
    s = make_schedule(placement("parallel", 2), 2, orders)
    [err] = dependencies.check(s)
    assert "device 1's order runs a pass before one it needs" in err.message
    notes = [n for _, n in err.notes]
    assert notes == [
        "device 1 runs B1:s1 (pass 3) before F1:s1 (pass 4), which it needs",
        "F1:s1 comes later in device 1's order",
    ]
    assert all(span is not None for span, _ in err.notes)
    assert err.span == s.orders[1][f].span


def test_cross_device_cycle():
    """Device 0 runs BW0:s0 before F1:s0 while device 1 needs F1:s0 before BW0:s1:
    a two-device cycle, one note per wait."""
    orders = [
        [(F, 0, 0), (BW, 0, 0), (F, 1, 0), (BW, 1, 0)],
        [(F, 0, 1), (F, 1, 1), (BW, 0, 1), (BW, 1, 1)],
    ]
    s = make_schedule(placement("parallel", 2), 2, orders, split_backward=False)
    [err] = dependencies.check(s)
    assert "devices 0, 1 wait on each other in a cycle" in err.message
    notes = [n for _, n in err.notes]
    assert notes == [
        "device 0 waits at BW0:s0 (pass 1) for BW0:s1 from device 1",
        "device 1 runs BW0:s1 (pass 2) only after F1:s1",
        "device 1 waits at F1:s1 (pass 1) for F1:s0 from device 0",
        "device 0 runs F1:s0 (pass 2) only after BW0:s0",
    ]


def test_two_independent_cycles_two_errors():
    """Every cycle is its own finding."""
    orders = [
        [(BW, 0, 0), (F, 0, 0)],
        [(BW, 0, 1), (F, 0, 1)],
    ]
    s = make_schedule(placement("parallel", 2), 1, orders, split_backward=False)
    found = dependencies.check(s)
    assert len(found) == 2


def test_w_before_b():
    """W(j,s) needs B(j,s)."""
    orders = [[(F, 0, 0), (W, 0, 0), (B, 0, 0)]]
    s = make_schedule(placement("parallel", 1), 1, orders)
    [err] = dependencies.check(s)
    assert "W0:s0" in err.notes[0][1] and "B0:s0" in err.notes[0][1]


@pytest.mark.slow
def test_fast_at_scale():
    """d=64, m=1024, vshape (393k passes): the check runs well under 5 s."""
    place = placement("vshape", 64)
    s = make_schedule(place, 1024, random_valid_orders(place, 1024, True, random.Random(1)))
    t0 = time.perf_counter()
    assert dependencies.check(s) == []
    assert time.perf_counter() - t0 < 5
