"""Peak activation memory from the order alone, exactly, and every
`expect peak_memory` bound checked per device."""

from __future__ import annotations

from fractions import Fraction

from ppdsl.analysis.checks import memory
from ppdsl.diagnostics import Span
from ppdsl.ir.schedule import Expect, MemoryModel
from tests.factories import BW, FILE, F, make_schedule, one_f_one_b_orders, placement

SPAN = Span(FILE, 40, 5, 40, 30)


def _zb_like(d=4, m=8, expects=(), mem=None):
    return make_schedule(
        placement("parallel", d),
        m,
        one_f_one_b_orders(d, m, split=True),
        expects=expects,
        memory=mem,
    )


def test_peak_of_one_f_one_b():
    """1F1B with B then W right away: device i holds d - i microbatches at peak,
    after M_B(d-i) minus nothing (B/W free after the peak)."""
    assert memory.peak_memory(_zb_like()) == (4, 3, 2, 1)


def test_exact_fractions():
    """Per-stage thirds stay exact (no float rounding)."""
    mem = MemoryModel(
        tuple(Fraction(1, 3) for _ in range(4)), tuple(Fraction(1, 7) for _ in range(4))
    )
    peaks = memory.peak_memory(_zb_like(mem=mem))
    assert peaks == (Fraction(4, 3), Fraction(1), Fraction(2, 3), Fraction(1, 3))


def test_fused_backward_frees_all():
    """A fused BW frees all of M_B: memory returns to 0."""
    orders = one_f_one_b_orders(2, 3)
    s = make_schedule(placement("parallel", 2), 3, orders, split_backward=False)
    assert memory.peak_memory(s) == (2, 1)
    twice = make_schedule(
        placement("parallel", 1),
        2,
        [[(F, 0, 0), (BW, 0, 0), (F, 1, 0), (BW, 1, 0)]],
        split_backward=False,
    )
    assert memory.peak_memory(twice) == (1,)


def test_bound_violation_per_device():
    """`expect peak_memory <= 2` fails on devices 0 and 1, each at the expect line,
    with a note at the pass where the peak is first reached."""
    e = Expect("peak_memory", "<=", Fraction(2), None, SPAN, "d / 2 * M_B")
    found = memory.check(_zb_like(expects=(e,)))
    assert [x.message for x in found] == [
        "peak activation memory on device 0 is 4, above the bound 2 (`expect peak_memory <= "
        "d / 2 * M_B`); keep fewer microbatches in flight on that device (run its backward "
        "passes earlier) or raise the bound",
        "peak activation memory on device 1 is 3, above the bound 2 (`expect peak_memory <= "
        "d / 2 * M_B`); keep fewer microbatches in flight on that device (run its backward "
        "passes earlier) or raise the bound",
    ]
    assert all(x.span == SPAN for x in found)
    s = _zb_like()
    assert found[0].notes[0] == (
        s.orders[0][3].span,
        "device 0 first reaches 4 after F3 (pass 3 of its order)",
    )


def test_single_device_bound_and_other_ops():
    """peak_memory[k] checks only device k; >= and == are checked too."""
    ok = Expect("peak_memory", "==", Fraction(3), 1, SPAN, "3")
    low = Expect("peak_memory", ">=", Fraction(5), 3, SPAN, "5")
    found = memory.check(_zb_like(expects=(ok, low)))
    assert len(found) == 1 and "device 3 is 1, below the bound 5" in found[0].message


def test_bad_device_index():
    """peak_memory[9] on 4 devices is a located error, not an IndexError."""
    e = Expect("peak_memory", "<=", Fraction(5), 9, SPAN, "5")
    [err] = memory.check(_zb_like(expects=(e,)))
    assert "there is no device 9" in err.message


def test_empty_device_holds_nothing():
    """A device with no passes has peak 0."""
    s = make_schedule(placement("parallel", 1), 0, [[]])
    assert memory.peak_memory(s) == (0,)


def test_a_valid_schedule_without_a_bound_is_warned_at_its_name():
    """No `expect peak_memory`: compiling succeeds with one warning, located at the
    schedule's name, quoting the peak and the line to add; with a bound, none."""
    from ppdsl.compiler import compile_source

    text = """schedule zb_h1 {
    param d = 4
    param m = 8
    place parallel
    backward split
    block period 3 {
        F at s
        B at 3*d - 2 - 2*s
        W at 3*d - 1 + s
    }
}
"""
    compiled = compile_source(text, "nobound.pp")
    (warning,) = compiled.warnings
    assert warning.severity == "warning"
    assert (warning.span.file, warning.span.line, warning.span.column) == ("nobound.pp", 1, 10)
    assert "`expect peak_memory <= 4 * M_B`" in warning.message
    bounded = text.replace("    }\n}", "    }\n    expect peak_memory <= d * M_B\n}")
    assert compile_source(bounded, "bounded.pp").warnings == ()
