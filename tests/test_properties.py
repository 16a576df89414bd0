"""The invariants, over random schedules: any valid order passes every check;
any single corruption is a located error from the check that owns it; the
simulated timeline respects every dependency and is as early as possible; the
deadlock check agrees with a brute-force executor."""

from __future__ import annotations

import random
from dataclasses import replace

from factories import brute_force_finishes, corruptions, schedules
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.checks import check_schedule, collisions, deadlock, dependencies, memory, passes
from ppdsl.checks._flat import dependencies as flat_dependencies
from ppdsl.checks._flat import flatten
from ppdsl.ir.schedule import Expect
from ppdsl.lower import lower
from ppdsl.simulate import simulate

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
    memory bound equal to its own peak."""
    peaks = memory.peak_memory(s)
    expects = tuple(
        Expect("peak_memory", "<=", peak, dev, s.span, str(peak)) for dev, peak in enumerate(peaks)
    )
    assert check_schedule(replace(s, expects=expects)) == []


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
    if c.span is not None:
        assert any(d.span == c.span for d in own), (c.what, [str(d.span) for d in own])
    if c.check != "passes":
        assert passes.check(c.schedule) == []  # exactly one guarantee broken


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_timeline_respects_dependencies_and_is_as_early_as_possible(s):
    """Every pass starts after its device's previous pass and after each pass it
    needs (+ transfer cost across devices), and at exactly the latest of those."""
    t = simulate(s)
    flat = flatten(s)
    deps = flat_dependencies(s, flat)
    start = [x for dev in range(s.num_devices) for x in t.start[dev]]
    end = [x for dev in range(s.num_devices) for x in t.end[dev]]
    for k in range(flat.size):
        dev = int(flat.device[k])
        bound = end[k - 1] if k > flat.offsets[dev] else 0.0
        for need in (int(deps.dep0[k]), int(deps.dep1[k])):
            if need >= 0:
                comm = s.costs.comm if flat.device[need] != dev else 0.0
                bound = max(bound, end[need] + comm)
        assert start[k] == bound
        p = flat.passes[k]
        assert end[k] == start[k] + s.costs.duration(p.kind, p.stage)
    assert t.makespan == max(end, default=0.0)


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
    """The peak of the timed memory profile equals the order's prefix-sum peak."""
    t = simulate(s, memory_over_time=True)
    for dev in range(s.num_devices):
        levels = [level for _, level in t.memory_over_time[dev]]
        assert max(levels, default=0.0) == float(t.peak_memory[dev]) or (
            max(levels, default=0.0) <= 0 and t.peak_memory[dev] == 0
        )
