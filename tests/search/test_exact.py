"""The exact engine (ppdsl/search/exact.py): its optimum equals brute force on
tiny problems, its bounds hold for every valid schedule, it proves the papers'
optimal schedules optimal, and its integer time unit is exact where it can be."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from ppdsl.ir.schedule import Pass, PassKind
from ppdsl.search.combined import exact_problem
from ppdsl.search.driver import arrays_for, evaluate_passes
from ppdsl.search.exact import ExactOptions, ExactProblem, measure, solve, time_scale
from ppdsl.search.problem import build_problem
from ppdsl.search.references import _zb_h1
from tests.factories import one_f_one_b_orders

F, B, W = PassKind.F, PassKind.B, PassKind.W


def _problem(d, m, place="parallel", memory="1p", costs=None, wf="1/2"):
    return build_problem(
        devices=d, microbatches=m, placement=place, costs=costs, memory=memory, weight_fraction=wf
    )


def _device_orders(stage: int, m: int) -> list[tuple[Pass, ...]]:
    """Every order of one stage's passes with F < B < W per microbatch."""
    out = []
    slots = [j for j in range(m) for _ in range(3)]
    for perm in set(itertools.permutations(slots)):
        seen = [0] * m
        order = []
        for j in perm:
            order.append(Pass((F, B, W)[seen[j]], j, stage))
            seen[j] += 1
        out.append(tuple(order))
    return sorted(out, key=lambda o: [(p.kind.value, p.microbatch) for p in o])


def _brute_force(problem, objective) -> Fraction | None:
    """The best objective over every combination of per-device orders that runs
    and fits the budget (the compiler's as-soon-as-possible timing)."""
    ep = exact_problem(problem)
    a = arrays_for(problem)
    per_device = [_device_orders(s, problem.num_microbatches) for s in range(problem.num_stages)]
    best = None
    for orders in itertools.product(*per_device):
        metrics = evaluate_passes(problem, a, orders)
        if not metrics.ok or int(metrics.peak.max()) > a.limit:
            continue
        value = measure(ep, orders, objective)
        if value is not None and (best is None or value < best):
            best = value
    return best


@pytest.mark.slow
@pytest.mark.parametrize(
    "d,m,memory,costs",
    [
        (2, 2, "1", "F=2,B=3,W=1,comm=1"),
        (2, 2, "1.5", "F=2,B=3,W=1,comm=1"),
        (2, 2, "2", "F=1,B=1,W=1,comm=0"),
        (3, 2, "1", "F=1,B=2,W=1,comm=1/2"),
    ],
)
def test_optimum_equals_brute_force(d, m, memory, costs):
    """On problems small enough to try every order, the solver's proven optimum
    (bubble and makespan) is the best any order reaches under the compiler's timing."""
    problem = _problem(d, m, memory=memory, costs=costs)
    for objective in ("bubble", "makespan"):
        truth = _brute_force(problem, objective)
        result = solve(exact_problem(problem), ExactOptions(objective, effort=20.0))
        assert result.optimal, (objective, result)
        assert result.value == result.bound == truth, (objective, result.value, truth)
        assert measure(exact_problem(problem), result.orders, objective) == truth


def test_bound_holds_for_the_papers_schedules_and_proves_zb_h1_optimal():
    """ZB-H1 at p M_B (p=4, m=8, unit costs) is optimal: bubble (p-1)/(3m+p-1),
    makespan 3m+p-1; 1F1B with B/W split is above the bound."""
    problem = _problem(4, 8, memory="1p")
    ep = exact_problem(problem)
    zb = tuple(tuple(Pass((F, B, W)[k], j, s) for k, j, s in o) for o in _zb_h1(4, 8))
    for objective, want in (("bubble", Fraction(3, 27)), ("makespan", Fraction(27))):
        result = solve(ep, ExactOptions(objective, effort=10.0), hint=zb)
        assert result.optimal and result.bound == want == measure(ep, zb, objective)
    split_1f1b = tuple(
        tuple(Pass(k, j, s) for k, j, s in o) for o in one_f_one_b_orders(4, 8, split=True)
    )
    result = solve(ep, ExactOptions("bubble", effort=10.0), hint=split_1f1b)
    assert measure(ep, split_1f1b, "bubble") > result.bound


@pytest.mark.slow
def test_v_half_memory_p4_m8_is_proven_at_the_authors_bubble():
    """V-shape, unit costs, V-Half's memory ((p+2)//2 = 3, M_W = M_B), p=4, m=8:
    the solver proves 5/53 (the authors' V-Half, 0.0943) optimal."""
    problem = _problem(4, 8, place="vshape", memory="3", wf="1")
    result = solve(exact_problem(problem), ExactOptions("bubble", effort=60.0))
    assert result.optimal and result.value == Fraction(5, 53)
    metrics = evaluate_passes(problem, arrays_for(problem), result.orders)
    assert metrics.ok and int(metrics.peak.max()) <= arrays_for(problem).limit


def test_infeasible_budget_is_reported():
    """A per-device budget below one microbatch's activation has no schedule."""
    problem = _problem(2, 2, memory="1")
    ep = exact_problem(problem)
    tight = ExactProblem(ep.placement, 2, True, ep.costs, ep.memory, (Fraction(1, 2),) * 2)
    assert solve(tight, ExactOptions("makespan", effort=5.0)).status == "infeasible"


def test_time_unit_is_exact_for_decimals_and_fractions():
    """The profiled costs scale by 1000 exactly, thirds by 3; costs no small
    denominator reproduces are rounded and flagged."""
    profiled = exact_problem(_problem(8, 4, costs="F=18.522,B=18.086,W=9.337,comm=0.601"))
    assert time_scale(profiled) == (1000, True)
    thirds = exact_problem(_problem(2, 2, costs="F=1/3,B=2/3,W=1,comm=0"))
    assert time_scale(thirds) == (3, True)
    odd = exact_problem(_problem(2, 2, costs="F=1.23456789123,B=1,W=1,comm=0"))
    assert time_scale(odd)[1] is False


def test_unbounded_memory_and_fused_backward():
    """Without a memory bound (None) and with a fused backward the model still
    solves: 1F1B's makespan at p=2, m=2 (unit costs, BW = 2) is 3m + 2(p-1) + ... as simulated."""
    problem = _problem(2, 3)
    ep = exact_problem(problem)
    fused = ExactProblem(ep.placement, 3, False, ep.costs, ep.memory, (None, None))
    orders = tuple(
        tuple(Pass(k, j, s) for k, j, s in o) for o in one_f_one_b_orders(2, 3, split=False)
    )
    result = solve(fused, ExactOptions("makespan", effort=10.0), hint=orders)
    assert result.optimal
    assert result.value <= measure(fused, orders, "makespan")


def test_irregular_busy_times_keep_a_valid_bound():
    """Devices busy for irregular times (per-stage costs with six decimals): the
    weights L/busy_d would overflow, rounded weights keep the bound below the
    true optimum (brute force) and the found schedule is measured exactly."""
    problem = _problem(2, 2, memory="1.5", costs="F=1.000003:2.000011,B=1.5:2.700001,W=1,comm=0.1")
    ep = exact_problem(problem)
    from ppdsl.search import exact as exact_module

    scale, exact_costs = time_scale(ep)
    lcm, _ = exact_module._weights(ep, exact_module._scaled_costs(ep, scale), "bubble")
    busy = exact_module._busy(ep, exact_module._scaled_costs(ep, scale))
    assert exact_costs and lcm != math.lcm(*busy)  # the rounded weights are in use
    truth = _brute_force(problem, "bubble")
    result = solve(ep, ExactOptions("bubble", effort=10.0))
    assert result.bound <= truth <= result.value
    assert measure(ep, result.orders, "bubble") == result.value


def test_search_times_each_pass_with_its_overhead():
    """`cost overhead[s]` (docs/language.md) is part of every pass's time for the
    search as for the simulator: the heuristic's and the exact model's tables
    hold each duration plus its stage's overhead, and the found file states it."""
    import dataclasses

    from ppdsl.search import exact as exact_module

    problem = _problem(2, 4, costs="F=1,B=1,W=1,comm=0")
    costs = dataclasses.replace(problem.costs, overhead=(0.5, 0.25))
    problem = dataclasses.replace(problem, costs=costs)
    assert arrays_for(problem).dur.tolist() == costs.duration_table()
    assert costs.duration_table()[0] == [1.5, 1.25]
    ep = exact_problem(problem)
    scale, exact = time_scale(ep)
    assert exact and scale == 4
    scaled = exact_module._scaled_costs(ep, scale)
    assert [list(row) for row in scaled.durations] == [
        [x * scale for x in row] for row in ep.costs.duration_table()]
    # the written schedule states it, so that its own simulation times it so too
    from ppdsl.search.emit import cost_statements

    assert any(getattr(st, "name", None) == "overhead" for st in cost_statements(costs))
