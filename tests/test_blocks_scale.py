"""Block compaction's array steps (issue 13) equal the Python scans they
replaced: the first fit (tests/oracles/first_fit.py) on random rows, the
extreme peaks against `semantics.peak_of_deltas`."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.first_fit import _first_fit as old_first_fit

from ppdsl.frontend.blocks import _EXTREME_DELTAS, _first_fit, _peaks
from ppdsl.ir.schedule import MemoryModel, Pass, PassKind
from ppdsl.semantics import peak_of_deltas

_kinds = st.sampled_from(list(PassKind))


@st.composite
def rows(draw):
    """A device's placed passes: sorted, non-overlapping (start, end, pass)."""
    row, t = [], 0.0
    for kind in draw(st.lists(_kinds, max_size=12)):
        t += draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
        length = draw(st.sampled_from([0.5, 1.0, 1.5]))
        row.append((t, t + length, Pass(kind, 0, 0)))
        t += length
    return row


@settings(max_examples=400, deadline=None)
@given(
    rows(),
    st.sampled_from([0.0, 0.5, 1.0, 3.0, 7.5]),
    st.sampled_from([0.5, 1.0, 2.0]),
    _kinds,
    st.tuples(st.integers(0, 4), st.integers(0, 4)),
)
def test_first_fit_equals_the_scan(row, ready, duration, kind, limit):
    """Same (index, start) or the same None, for any row, pass and memory limit."""
    delta = _EXTREME_DELTAS[kind]
    assert _first_fit(row, ready, duration, delta, limit) == old_first_fit(
        row, ready, duration, delta, limit
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(_kinds, max_size=15), min_size=1, max_size=4))
def test_peaks_equal_the_fraction_sums(kinds):
    """Per device, the extreme peaks are peak_of_deltas of the memory model's deltas."""
    orders = tuple(tuple(Pass(k, 0, 0) for k in order) for order in kinds)
    models = [MemoryModel((Fraction(1),), (Fraction(w),)) for w in (1, 0)]
    expected = [
        tuple(peak_of_deltas(m.delta(p.kind, 0) for p in order) for m in models) for order in orders
    ]
    assert _peaks(orders) == expected
