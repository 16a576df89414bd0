"""Block compaction's array steps (issue 13) equal the Python scans they
replaced: the first fit (tests/oracles/first_fit.py) on random rows, the
extreme peaks against `semantics.peak_of_deltas`."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.first_fit import _first_fit as old_first_fit

from ppdsl.frontend.blocks import _CHANNELS, _extreme_delta, _first_fit, _peaks
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
    st.tuples(*(st.integers(0, 4) for _ in _CHANNELS)),
    st.sampled_from([frozenset(), frozenset({0})]),
)
def test_first_fit_equals_the_scan(row, ready, duration, kind, limit, recompute):
    """Same (index, start) or the same None, for any row, pass and memory limit,
    on a stage that keeps or recomputes its activations."""
    delta = _extreme_delta(kind, 0, recompute)
    assert _first_fit(row, ready, duration, delta, limit, recompute) == old_first_fit(
        row, ready, duration, delta, limit, recompute
    )


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(_kinds, max_size=15), min_size=1, max_size=4),
    st.sampled_from([frozenset(), frozenset({0})]),
)
def test_peaks_equal_the_fraction_sums(kinds, recompute):
    """Per device, the extreme peaks are peak_of_deltas of the memory model's
    deltas (M_W and, on a recomputed stage, M_I at 0 or M_B)."""
    orders = tuple(tuple(Pass(k, 0, 0) for k in order) for order in kinds)
    models = [
        MemoryModel((Fraction(1),), (Fraction(w),), (Fraction(i),) if recompute else ())
        for w, i in _CHANNELS
    ]
    expected = [
        tuple(peak_of_deltas(m.delta(p.kind, 0) for p in order) for m in models) for order in orders
    ]
    assert _peaks(orders, recompute) == expected
