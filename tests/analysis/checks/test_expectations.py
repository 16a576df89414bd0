"""bubble / idle / makespan expectations against the simulated timeline."""

from __future__ import annotations

from fractions import Fraction

from ppdsl.analysis.checks import expectations
from ppdsl.analysis.simulate import simulate
from ppdsl.diagnostics import Span
from ppdsl.ir.schedule import Expect
from tests.factories import FILE, make_schedule, one_f_one_b_orders, placement

SPAN = Span(FILE, 30, 5, 30, 40)


def _check(*expects):
    s = make_schedule(
        placement("parallel", 4), 8, one_f_one_b_orders(4, 8), split_backward=False, expects=expects
    )
    return expectations.check(s, simulate(s))


def test_exact_bounds_hold():
    """1F1B d=4 m=8: makespan == 33, bubble == 9/33, idle == 1 - 96/132, with float slack."""
    assert (
        _check(
            Expect("makespan", "==", Fraction(33), None, SPAN, "3*m + d - 1"),
            Expect("bubble", "==", Fraction(9, 33), None, SPAN, "9/33"),
            Expect("idle", "==", 1 - Fraction(96, 132), None, SPAN, "..."),
            Expect("bubble", "==", Fraction(0), 3, SPAN, "0"),
        )
        == []
    )


def test_violated_bubble_names_device_and_bound():
    """A bubble above its bound is an error at the expect line naming the longest-span device."""
    [err] = _check(Expect("bubble", "<=", Fraction(1, 10), None, SPAN, "1/10"))
    assert err.message.startswith(
        "the bubble ratio is 0.272727, above the bound 1/10 (0.1) (`expect bubble <= 1/10`)"
    )
    assert err.span == SPAN
    assert "device 0 has the longest span, 33, of which it is busy 24" in err.notes[0][1]


def test_violated_makespan_and_peak_memory_ignored():
    """makespan < 30 fails; peak_memory is the memory check's and not reported here."""
    found = _check(
        Expect("makespan", "<", Fraction(30), None, SPAN, "30"),
        Expect("peak_memory", "<=", Fraction(1), None, SPAN, "1"),
    )
    assert [d.message.split(";")[0] for d in found] == [
        "the makespan is 33, not below the bound 30 (`expect makespan < 30`)"
    ]


def test_per_device_forms():
    """bubble[k] checks device k; makespan[k] is an error; a missing device too."""
    found = _check(
        Expect("bubble", ">", Fraction(1, 2), 1, SPAN, "1/2"),
        Expect("makespan", "<=", Fraction(100), 0, SPAN, "100"),
        Expect("bubble", "<=", Fraction(1), 7, SPAN, "1"),
    )
    text = "\n".join(d.message for d in found)
    assert "device 1's bubble ratio is 0.2, not above the bound 1/2" in text
    assert "makespan is one figure for the whole schedule" in text
    assert "there is no device 7" in text
