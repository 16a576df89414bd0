"""The invariants, over random schedules: any valid order passes every check
(and a memory bound just below its peak fails); any single corruption is a
located error from the check that owns it; both simulators' timelines equal the
definition's; the deadlock check agrees with a brute-force executor. The
oracles (the dependency rule, the memory deltas, the timeline) are written in
tests/factories.py from the papers, not taken from the code under test."""

from __future__ import annotations

import random
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis.checks import check_schedule, collisions, deadlock, dependencies, memory, passes
from ppdsl.analysis.simulate import simulate
from ppdsl.ir.schedule import Expect, Schedule
from ppdsl.lowering.lower import lower
from tests.factories import (
    brute_force_finishes,
    corruptions,
    oracle_peaks,
    oracle_timeline,
    schedules,
)
from tests.oracles.simulate import simulate_reference

MODULES = {
    "passes": passes,
    "dependencies": dependencies,
    "collisions": collisions,
    "memory": memory,
}


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_valid_orders_pass_every_check(s):
    """A random topological interleaving passes all schedule checks, including a
    memory bound equal to its peak (the paper's model, computed by the test);
    the same bound less 1/4 fails on every device whose peak is above 0."""

    def bounded(delta: Fraction) -> Schedule:
        expects = tuple(
            Expect("peak_memory", "<=", peak - delta, dev, s.span, str(peak - delta))
            for dev, peak in enumerate(oracle_peaks(s))
        )
        return replace(s, expects=expects)

    assert check_schedule(bounded(Fraction(0))) == []
    below = memory.check(bounded(Fraction(1, 4)))
    assert len(below) == s.num_devices  # every device's peak is >= 1/2 (one F)


@pytest.mark.slow
@settings(max_examples=120, deadline=None)
@given(corruptions())
def test_each_corruption_is_a_located_error_of_its_check(c):
    """Breaking one guarantee gives errors, all located, and the owning check reports it."""
    found = check_schedule(c.schedule)
    errors = [d for d in found if d.severity == "error"]
    assert errors, c.what
    assert all(d.span is not None for d in errors)
    own = MODULES[c.check].check(c.schedule)
    assert own, f"{c.check} did not report: {c.what}"
    assert all(d in found for d in own)
    # a dropped pass no longer exists: its error points at the loop or neighbour
    # that should have made it (issue 40's rule, tests/frontend/test_order_form.py)
    if c.span is not None and not c.what.startswith("drop "):
        assert any(d.span == c.span for d in own), (c.what, [str(d.span) for d in own])
    if c.check != "passes":
        assert passes.check(c.schedule) == []  # exactly one guarantee broken


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_timeline_is_the_definitions(s):
    """Both simulators give exactly the timeline of the definition (every pass
    as early as its device and the passes it needs allow, + transfer cost
    across devices), with the dependency rule written independently in the
    test's oracle."""
    start, end = oracle_timeline(s)
    for t in (simulate(s), simulate_reference(s)):
        assert [list(x) for x in t.start] == start
        assert [list(x) for x in t.end] == end
        assert t.makespan == max((e for row in end for e in row), default=0.0)


@settings(max_examples=60, deadline=None)
@given(schedules(), st.integers(0, 2**32 - 1))
def test_deadlock_check_agrees_with_brute_force(s, seed):
    """Lowered programs of any valid order: a deadlock is reported exactly when the
    brute-force executor gets stuck."""
    programs = lower(s)
    found = deadlock.check(s, programs)
    assert (found == []) == brute_force_finishes(programs, random.Random(seed))


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_memory_profile_peak_equals_order_peak(s):
    """The peak of the timed memory profile equals the order's prefix-sum peak,
    and both equal the paper's model computed by the test."""
    t = simulate(s, memory_over_time=True)
    assert t.peak_memory == oracle_peaks(s)
    for dev in range(s.num_devices):
        levels = [level for _, level in t.memory_over_time[dev]]
        assert max(levels, default=0.0) == float(t.peak_memory[dev]) or (
            max(levels, default=0.0) <= 0 and t.peak_memory[dev] == 0
        )


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_memory_over_time_equals_the_exact_fractions(s):
    """The memory profile from integer prefix sums equals the reference's,
    summed in Fractions pass by pass, to the last bit."""
    fast = simulate(s, memory_over_time=True)
    assert fast.memory_over_time == simulate_reference(s, memory_over_time=True).memory_over_time
