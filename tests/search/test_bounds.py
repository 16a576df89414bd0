"""The exact engine's extra lower bounds (ppdsl/search/bounds.py, docs/exact.md
"Bounds from memory and one device at a time"): the memory precedences hold in
every valid schedule within its budget, the one-device bounds never exceed a
device's span in any valid schedule nor the proven optimum, and the model with
them keeps its optimum."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.ir.schedule import Costs, MemoryModel, Pass
from ppdsl.search import exact as exact_module
from ppdsl.search.bounds import device_span_bounds, memory_precedences
from ppdsl.search.combined import exact_problem
from ppdsl.search.exact import ExactOptions, ExactProblem, solve
from ppdsl.search.problem import build_problem
from tests.factories import placement, random_valid_orders


def _random_case(seed: int):
    """A random placement, costs and memory model, a random valid schedule of
    it, and the problem whose budgets are that schedule's own peaks."""
    rng = random.Random(seed)
    kind = rng.choice(["parallel", "vshape", "looped"])
    d = rng.randint(2, 3)
    place = placement(kind, d)
    S = place.num_stages
    m = rng.randint(2, 5)
    durations = tuple(tuple(float(rng.randint(1, 3)) for _ in range(S)) for _ in range(5))
    costs = Costs(durations, float(rng.choice([0, 1])))
    activation = tuple(Fraction(rng.randint(1, 3)) for _ in range(S))
    retained = tuple(a * Fraction(rng.randint(0, 2), 2) for a in activation)
    memory = MemoryModel(activation, retained)
    raw = random_valid_orders(place, m, True, rng)
    orders = tuple(tuple(Pass(k, j, s) for k, j, s in o) for o in raw)
    peaks = []
    for order in orders:
        level = top = Fraction(0)
        for q in order:
            level += memory.delta(q.kind, q.stage)
            top = max(top, level)
        peaks.append(top)
    problem = ExactProblem(place, m, True, costs, memory, tuple(peaks))
    return problem, orders


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6))
def test_memory_precedences_hold_in_every_valid_schedule(seed):
    """Every memory precedence (F(j+c, s) after X(j, u) ends) holds in a random
    valid schedule's timing, FIFO-relabelled as docs/exact.md's model is, when
    the budgets are that schedule's own peaks."""
    problem, orders = _random_case(seed)
    scale, _ = exact_module.time_scale(problem)
    scaled = exact_module._scaled_costs(problem, scale)
    times = exact_module._fifo_times(problem, orders, scaled)
    assert times is not None
    for before, after in memory_precedences(problem):
        end = times[before] + int(scaled.duration(before[0], before[2]))
        assert times[after] >= end, (before, after, problem.budgets)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10**6))
def test_device_bounds_never_exceed_a_valid_schedules_spans(seed):
    """Each device's one-device bound is at most that device's span in a random
    valid schedule within the budgets (the schedule's own peaks)."""
    problem, orders = _random_case(seed)
    scale, _ = exact_module.time_scale(problem)
    scaled = exact_module._scaled_costs(problem, scale)
    model = exact_module._Model(problem, "bubble", scaled, None, memory_edges=True)
    measured = exact_module._measure(problem, orders, scaled, "bubble")
    assert measured is not None
    for (bound, _, _), span in zip(device_span_bounds(model, 1.0), measured.spans, strict=True):
        assert bound <= span


@pytest.mark.slow
@pytest.mark.parametrize(
    "d,m,place,memory,wf",
    [
        (2, 4, "vshape", "1", "1"),
        (3, 3, "vshape", "2", "1"),
        (3, 4, "parallel", "1p", "1/2"),
        (2, 3, "looped(2)", "1", "1/2"),
    ],
)
def test_bounds_stay_below_the_proven_optimum_and_keep_it(d, m, place, memory, wf):
    """On small problems the plain engine proves optimal, the one-device bounds
    are at most the optimum, and the engine with them and the memory
    precedences proves the same optimum."""
    problem = exact_problem(
        build_problem(
            devices=d,
            microbatches=m,
            placement=place,
            costs=None,
            memory=memory,
            weight_fraction=wf,
        )
    )
    plain = solve(problem, ExactOptions("bubble", effort=20.0))
    assert plain.optimal
    scale, _ = exact_module.time_scale(problem)
    scaled = exact_module._scaled_costs(problem, scale)
    lcm, weight = exact_module._weights(problem, scaled, "bubble")
    model = exact_module._Model(problem, "bubble", scaled, None, memory_edges=True)
    floor = max(w * b for w, (b, _, _) in zip(weight, device_span_bounds(model, 1.0), strict=True))
    assert Fraction(floor - lcm, floor) <= plain.value
    bounded = solve(problem, ExactOptions("bubble", effort=20.0, device_bounds=1.0))
    assert bounded.optimal and bounded.value == plain.value


def _vshape_p4_m8(memory: str):
    """V-shape, unit costs, p=4, m=8, M_W = M_B, at `memory` M_B per device."""
    return exact_problem(build_problem(devices=4, microbatches=8, placement="vshape", costs=None,
                                       memory=memory, weight_fraction="1"))


@pytest.mark.slow
def test_device_bound_raises_the_v_min_bound():
    """V-shape, unit costs, V-Min's memory (2, M_W = M_B), p=4, m=8: the
    one-device bound of device 0 is above the warm-up/cool-down idle bound of
    the plain model and at most the proven optimum 59 (bubble 11/59,
    bench/results/exact.md)."""
    problem = _vshape_p4_m8("2")
    scaled = exact_module._scaled_costs(problem, 1)
    plain = exact_module._Model(problem, "bubble", scaled, None)
    model = exact_module._Model(problem, "bubble", scaled, None, memory_edges=True)
    bounds = [b for b, _, _ in device_span_bounds(model, 1.0)]
    assert max(bounds) <= 59
    assert max(bounds) > max(b + i for b, i in zip(plain.busy, plain.idle_floors, strict=True))


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10**6))
def test_span_bound_never_exceeds_a_valid_schedules_bubble(seed):
    """The whole model with one device's span as its objective (docs/exact.md,
    "One device's span on the whole model") bounds the bubble of a random valid
    schedule within the budgets (the schedule's own peaks) from below."""
    problem, orders = _random_case(seed)
    measured = exact_module.measure(problem, orders)
    assert measured is not None
    result = solve(problem, ExactOptions("bubble", effort=1.0, span_bound=1.0))
    assert result.bound <= measured


@pytest.mark.slow
def test_span_bound_reaches_the_v_half_optimum_at_p4():
    """V-shape, unit costs, V-Half's memory (3, M_W = M_B), p=4, m=8: the span
    bound of device 0 alone (2 units, no other search) is the proven optimum
    5/53 of bench/results/exact.md, above the warm-up/cool-down idle bound
    (device 0 idle 2 of its 48 busy units)."""
    problem = _vshape_p4_m8("3")
    scaled = exact_module._scaled_costs(problem, 1)
    plain = exact_module._Model(problem, "bubble", scaled, None)
    assert plain.idle_floors[0] == 2
    result = solve(problem, ExactOptions("bubble", effort=2.0, span_bound=2.0))
    assert result.bound == Fraction(5, 53)
