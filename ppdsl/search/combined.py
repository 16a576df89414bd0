"""`ppdsl search` end to end: the heuristics, then the exact engine.

The heuristics (`driver.search`) always run, under their evaluation budget.
Their best orders then seed CP-SAT (`exact.solve`) as its hint and upper bound:
always with `exact=True`, and otherwise when the problem has at most
`AUTO_EXACT_PASSES` passes (where a few units of deterministic time usually
improve or certify the heuristic's answer). Every budget is counted in work, so
the same options give the same orders on every machine; only `time_cap` can
make a run stop early, and the outcome says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from ppdsl.ir.schedule import Pass
from ppdsl.search.driver import (
    DEFAULT_EVALUATIONS,
    SearchResult,
    arrays_for,
    evaluate_passes,
    search,
    with_recompute_passes,
)
from ppdsl.search.evaluate import Metrics
from ppdsl.search.exact import ExactOptions, ExactProblem, ExactResult, solve
from ppdsl.search.problem import SearchProblem

__all__ = [
    "SearchOptions",
    "Outcome",
    "find",
    "exact_problem",
    "AUTO_EXACT_PASSES",
    "AUTO_EFFORT",
    "EXACT_EFFORT",
]

AUTO_EXACT_PASSES = 1200
"""Without --exact, CP-SAT runs after the heuristics up to this many passes
(d=8, m=24 on a parallel placement has 576; a V-shape at d=8, m=32, 1536)."""

AUTO_EFFORT = 10.0
"""CP-SAT deterministic time after the heuristics when not asked for --exact."""

EXACT_EFFORT = 60.0
"""CP-SAT deterministic time of --exact."""


@dataclass(frozen=True)
class SearchOptions:
    """How `find` searches."""

    objective: str = "bubble"
    """`bubble` (the worst device's idle share of its span) or `makespan`."""
    evaluations: int = DEFAULT_EVALUATIONS
    """Heuristic refinement and local-search evaluations."""
    seed: int = 0
    """Seed of the heuristics' random choices (and CP-SAT's)."""
    exact: bool = False
    """Always run the exact engine, with `EXACT_EFFORT` unless `effort` says."""
    effort: float | None = None
    """CP-SAT deterministic time; None: EXACT_EFFORT with `exact`, else
    AUTO_EFFORT for problems up to AUTO_EXACT_PASSES passes; 0: no solver."""
    time_cap: float | None = None
    """Optional wall-clock cap in seconds over everything; when it bites the
    outcome is `capped` (and depends on the machine)."""
    workers: int = 1
    """CP-SAT workers (1, or more interleaved: deterministic either way)."""
    device_bounds: float = 0.0
    """Deterministic time per device for the exact engine's one-device bounds
    and memory precedences (`ExactOptions.device_bounds`); 0: off."""
    span_bound: float = 0.0
    """Deterministic time for the exact engine's whole model with the worst
    device's span as its objective (`ExactOptions.span_bound`); 0: off."""


@dataclass(frozen=True)
class Outcome:
    """The answer and how it was reached."""

    orders: tuple[tuple[Pass, ...], ...]
    metrics: Metrics
    """The search evaluator's measure of `orders`."""
    peak: tuple[Fraction, ...]
    """Per device, the peak memory of `orders` in M_B."""
    method: str
    """In words, for the .pp header."""
    heuristic: SearchResult
    exact: ExactResult | None
    """The solver's result (its bound, gap, optimality); None when it did not run."""
    capped: bool
    """The wall-clock cap stopped some stage before its budget."""
    seconds: float


def exact_problem(problem: SearchProblem) -> ExactProblem:
    """The search problem as the exact engine states it (one budget for every
    device, split backward)."""
    return ExactProblem(
        problem.placement,
        problem.num_microbatches,
        True,
        problem.costs,
        problem.memory,
        (problem.budget,) * problem.num_devices,
    )


def _effort(problem: ExactProblem, options: SearchOptions) -> float:
    if problem.placement.lanes > 1:  # the exact model runs every microbatch down one pipeline
        return 0.0
    if options.effort is not None:
        return options.effort
    if options.exact:
        return EXACT_EFFORT
    return AUTO_EFFORT if problem.num_passes <= AUTO_EXACT_PASSES else 0.0


def find(
    problem: SearchProblem,
    options: SearchOptions,
    *,
    progress: Callable[[str, float], None] | None = None,
    solver_progress: Callable[[Fraction | None, Fraction | None, float], None] | None = None,
    seeds: Sequence[tuple[Sequence[Sequence[Pass]], str]] = (),
) -> Outcome:
    """Heuristics, then (where `options` say) the exact engine from their best.
    `seeds`: more candidate orders for the heuristics (`driver.search`)."""
    begin = time.monotonic()
    heuristic = search(
        problem,
        evaluations=options.evaluations,
        seed=options.seed,
        objective=options.objective,
        time_cap=options.time_cap,
        progress=progress,
        seeds=seeds,
    )
    best = heuristic.best
    orders, metrics, method = best.orders(), best.metrics, best.method
    capped = heuristic.capped
    exact = None
    recompute = problem.memory.recompute
    if recompute:
        # R put back before each B, measured as the compiler will (R may now start
        # before the gradient arrives, so nothing ends later than searched); the
        # exact model has no R, so no bound
        orders = with_recompute_passes(orders, recompute)
        real = arrays_for(problem, fused=False)
        metrics = evaluate_passes(problem, real, orders)
        method = f"{method}; stages {sorted(recompute)} recompute (R right before B)"
        peak = tuple(Fraction(int(x), real.scale) for x in metrics.peak)
        return Outcome(
            orders, metrics, peak, method, heuristic, None, capped, time.monotonic() - begin
        )
    ep = exact_problem(problem)
    effort = _effort(ep, options)
    if effort > 0:
        cap = None
        if options.time_cap is not None:
            cap = max(0.0, options.time_cap - (time.monotonic() - begin))
        exact = solve(
            ep,
            ExactOptions(
                options.objective, effort, options.workers, cap, options.seed,
                options.device_bounds, span_bound=options.span_bound,
            ),
            hint=orders,
            progress=solver_progress,
        )
        capped = capped or exact.capped
        if exact.orders is not None and not exact.from_hint:
            found = evaluate_passes(problem, heuristic.arrays, exact.orders)
            orders, metrics = exact.orders, found
            method = f"CP-SAT on the exact model (docs/exact.md), started from: {best.method}"
    scale = heuristic.arrays.scale
    peak = tuple(Fraction(int(x), scale) for x in metrics.peak)
    return Outcome(
        orders, metrics, peak, method, heuristic, exact, capped, time.monotonic() - begin
    )
