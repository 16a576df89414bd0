"""The memory–throughput frontier: the best schedule found at every reachable
peak-memory level, from the smallest feasible budget to where the bubble
reaches its floor, over one or more placements under the same costs.

Memory levels. Every peak is a sum of memory deltas (F +M_B, B −(M_B−M_W), W
−M_W per stage), so the reachable peaks are the multiples of their greatest
common divisor, the *granularity* g, from the smallest budget
(`problem.smallest_budget`: one microbatch in flight) up. For each placement
the frontier searches those levels in turn (`combined.find`: the heuristics,
then CP-SAT under `effort` for the level's lower bound), each level seeded with
the best orders of the level below (they fit the larger budget too). The floor
is what the search finds at the *top* level, every forward of every
microbatch in flight (m · the fullest device's chunks); the walk stops at the
first level that reaches it. Too many levels are thinned to `max_levels` by
stepping a multiple of g.

Points. A level's schedule has some peak (at most its budget). The frontier is
the Pareto set over every placement: a point is kept when its objective is
strictly below that of every point at no more memory. A level's lower bound,
proven at its budget b, holds at any memory up to b, so also at the point's
own peak.

Placements compare under the same model. Costs are those of one 1F1B stage
(1/d of the model); a placement with v chunks per device runs each chunk in 1/v
of them (`problem.chunk_costs`), and memory is in 1F1B-stage units (a chunk's
M_B is 1/v), so bubble, makespan and memory mean the same on every placement.
A transfer costs the same on every placement.

Named schedules (`named_points`): the papers' schedules, as `.pp` files
(examples/) compiled under the same costs and memory model, or the search's
own `references`; each is then set against the frontier at its memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

from ppdsl.ir.schedule import Costs, MemoryModel, Pass, PassKind
from ppdsl.search.combined import Outcome, SearchOptions, find
from ppdsl.search.driver import arrays_for
from ppdsl.search.problem import (
    SearchInputError,
    SearchProblem,
    smallest_budget,
    with_recompute,
)
from ppdsl.search.references import references
from ppdsl.semantics import format_short
from ppdsl.topology import Topology

__all__ = [
    "FRONTIER_EVALUATIONS",
    "FrontierOptions",
    "FrontierPoint",
    "Frontier",
    "NamedPoint",
    "granularity",
    "top_budget",
    "levels",
    "frontier",
    "pareto",
    "named_points",
    "compile_named",
    "frontier_at",
    "recompute_floor",
    "extra_copies_memory",
]

FRONTIER_EVALUATIONS = 2_000
"""Refinement and local-search evaluations per memory level (a tenth of a
plain `ppdsl search`: a frontier runs one search per level)."""

_EPS = 1e-12


@dataclass(frozen=True)
class FrontierOptions:
    """How `frontier` walks the memory levels."""

    search: SearchOptions = SearchOptions(evaluations=FRONTIER_EVALUATIONS, effort=0.0)
    """The search run at each level (its `effort` is CP-SAT's per level: 0, no bound)."""
    low: Fraction | None = None
    """The smallest budget searched (M_B per device); None: the smallest feasible."""
    high: Fraction | None = None
    """The largest budget searched; None: every forward in flight (`top_budget`)."""
    max_levels: int = 48
    """At most this many levels per placement (more are thinned to a coarser step)."""
    recompute: tuple[int, ...] = ()
    """Recomputation variants: for each K, the stages of devices 0..K-1 recompute
    (K = d: every stage), searched at the same levels as the plain placement from
    the variant's own floor up, until the plain placement does as well. Compare
    them with `objective="makespan"`: R is busy time, so a bubble hides its cost."""
    kept_input: Fraction = Fraction(1, 16)
    """M_I / M_B of a recomputed stage (what its F keeps: its input)."""
    dp: int = 1
    """Data-parallel replicas: above 1, each point's step time adds the gradient
    reductions still running after the device's last pass (`cost reduce`,
    `ppdsl.analysis.collectives`), and `objective="makespan"` compares step
    times (the breadth-first paper's point: an order that ends a stage's
    backwards early hides its reduction)."""
    parameter_memory: Fraction = Fraction(0)
    """The model state (weights, gradients, optimizer state) of one 1F1B stage,
    in M_B. A placement that holds the model's parameters more than once per
    device (DualPipe: twice, `Placement.lanes`) adds this for each extra copy
    to its points' memory, so every placement is charged for what a device
    holds beyond one copy of its share of the model (0: activations only)."""


@dataclass(frozen=True, eq=False)
class FrontierPoint:
    """The best schedule found at one memory level."""

    memory: Fraction
    """Its peak activation memory, the fullest device's, in M_B (1F1B-stage units)."""
    budget: Fraction
    """The budget it was searched under (>= memory)."""
    bubble: float
    makespan: float
    bound: float | None
    """The exact engine's lower bound on the objective at `budget`, for this
    placement; None when it did not run."""
    optimal: bool
    """The bound is reached: nothing on this placement does better within `budget`
    (docs/exact.md)."""
    placement: str
    """The placement's spelling (`parallel`, `vshape`, `looped(2)`)."""
    problem: SearchProblem
    """The search problem at `budget`."""
    outcome: Outcome
    """The search's answer (orders, method, the exact engine's result)."""
    recompute: tuple[int, ...] = ()
    """The stages that recompute their activations (none: the search places no R)."""
    step: float = 0.0
    """The step time: the makespan plus, with data parallelism, the reductions
    still running after the last pass (`exposed`)."""
    exposed: float = 0.0
    """The data-parallel reduction time the step waits for (0 without --dp)."""
    copies: int = 1
    """How many copies of its share of the model's parameters a device holds
    (2 on DualPipe); `memory` includes the extra copies' `parameter_memory`."""

    @property
    def activation(self) -> Fraction:
        """The peak activation memory alone (M_B), the fullest device's."""
        return max(self.outcome.peak)

    @property
    def orders(self) -> tuple[tuple[Pass, ...], ...]:
        return self.outcome.orders

    @property
    def method(self) -> str:
        return self.outcome.method


@dataclass(frozen=True)
class Frontier:
    """A frontier and every level searched to draw it."""

    points: tuple[FrontierPoint, ...]
    """The Pareto frontier over every placement, by memory."""
    searched: tuple[FrontierPoint, ...]
    """Every level searched, every placement (by placement, then budget)."""
    objective: str
    """`bubble` or `makespan`: what the points minimise."""


@dataclass(frozen=True)
class NamedPoint:
    """A named schedule of the papers under the frontier's costs and memory model."""

    name: str
    placement: str
    memory: Fraction
    bubble: float
    makespan: float
    source: str
    """Where it comes from: the `.pp` file compiled, or `ppdsl.search.references`."""
    step: float = 0.0
    """Its step time with the data-parallel reductions (`FrontierOptions.dp`);
    the makespan without."""
    orders: tuple[tuple[Pass, ...], ...] | None = field(default=None, compare=False, repr=False)
    """Its per-device orders when the search can take them as a candidate (F, B
    and W only: no fused backward, overlapped pair or R); None otherwise."""


def granularity(problem: SearchProblem) -> Fraction:
    """The greatest common divisor of the memory deltas (and the smallest
    budget): every peak is a multiple of it."""
    arrays = arrays_for(problem)
    values = [abs(int(x)) for x in arrays.mem.ravel() if int(x) != 0]
    scale = arrays.scale
    floor = smallest_budget(problem.placement, problem.memory)
    values.append(int(floor * scale) if (floor * scale).denominator == 1 else 1)
    step = math.gcd(*values) if values else 1
    return Fraction(step, scale)


def top_budget(problem: SearchProblem) -> Fraction:
    """Every forward of every microbatch in flight on the fullest device: no
    schedule needs more (with lanes, a stage sees its lane's microbatches only)."""
    pl, mm, m = problem.placement, problem.memory, problem.num_microbatches
    through = [0] * pl.num_stages  # microbatches through each stage
    for j in range(m):
        lane = pl.microbatch_lane(j, m)
        for s in range(pl.num_stages):
            through[s] += pl.lane_of_stage(s) == lane
    return max(
        sum((through[s] * mm.activation[s] for s in pl.chunks(dev)), Fraction(0))
        for dev in range(pl.num_devices)
    )


def levels(problem: SearchProblem, options: FrontierOptions) -> list[Fraction]:
    """The budgets to search for `problem`'s placement, increasing; the last is
    the top one (where the floor is measured)."""
    step = granularity(problem)
    floor = smallest_budget(problem.placement, problem.memory)
    top = top_budget(problem)
    if options.high is not None:
        top = max(min(top, options.high), floor)
    low = floor if options.low is None else max(floor, options.low)
    low = math.ceil(low / step) * step  # a reachable level
    if low > top:
        return [top]
    count = math.floor((top - low) / step) + 1
    if count > options.max_levels:
        step *= math.ceil(count / options.max_levels)
    out = []
    level = low
    while level < top:
        out.append(level)
        level += step
    out.append(top)
    return out


def _step(problem: SearchProblem, orders, dp: int) -> tuple[float, float]:
    """(step time, exposed reduction) of `orders`: the compiler's timeline and
    data-parallel lane (`comm_lanes`, replicate) when `dp` > 1 and a reduction
    costs something; else the makespan and 0."""
    from ppdsl.analysis.collectives import comm_lanes
    from ppdsl.analysis.simulate import simulate
    from ppdsl.search.combined import exact_problem

    if dp <= 1 or not problem.costs.declared_collectives():
        return 0.0, 0.0
    schedule = exact_problem(problem).schedule(orders)
    lanes = comm_lanes(schedule, simulate(schedule))
    return lanes.makespan, max(lanes.exposed)


def extra_copies_memory(lanes: int, parameter_memory: Fraction) -> Fraction:
    """What a placement holding the parameters `lanes` times per device holds
    beyond one copy (`FrontierOptions.parameter_memory` per copy)."""
    return (lanes - 1) * parameter_memory


def _point(
    problem: SearchProblem, outcome: Outcome, placement: str, dp: int = 1,
    parameter_memory: Fraction = Fraction(0),
) -> FrontierPoint:
    exact = outcome.exact
    bound = None
    optimal = False
    step, exposed = _step(problem, outcome.orders, dp)
    if dp > 1 and step:  # the solver's bound is on the makespan without the reductions
        exact = None
    if exact is not None and exact.status != "infeasible" and exact.bound is not None:
        bound = float(exact.bound)
        optimal = bool(exact.optimal)
    return FrontierPoint(
        memory=max(outcome.peak)
        + extra_copies_memory(problem.placement.lanes, parameter_memory),
        budget=problem.budget,
        bubble=outcome.metrics.bubble,
        makespan=outcome.metrics.makespan,
        bound=bound,
        optimal=optimal,
        placement=placement,
        problem=problem,
        outcome=outcome,
        recompute=tuple(sorted(problem.memory.recompute)),
        step=step or outcome.metrics.makespan,
        exposed=exposed,
        copies=problem.placement.lanes,
    )


def _key(point: FrontierPoint, objective: str) -> tuple[float, float]:
    bubble, makespan = round(point.bubble, 12), round(point.step, 9)
    return (makespan, bubble) if objective == "makespan" else (bubble, makespan)


def pareto(points: Sequence[FrontierPoint], objective: str = "bubble") -> tuple[FrontierPoint, ...]:
    """The points whose objective no other beats at no more memory, by memory
    (at one memory the better second measure wins, then the earlier point: the
    first placement given)."""
    order = sorted(range(len(points)), key=lambda n: (points[n].memory, _key(points[n], objective), n))
    kept: list[FrontierPoint] = []
    for n in order:
        p = points[n]
        if kept and _key(p, objective)[0] >= _key(kept[-1], objective)[0]:
            continue
        if kept and kept[-1].memory == p.memory:  # pragma: no cover - sorted: better first
            continue
        kept.append(p)
    return tuple(kept)


def frontier(
    problems: Sequence[SearchProblem],
    options: FrontierOptions,
    *,
    progress: Callable[[str, float], None] | None = None,
    named: Sequence[NamedPoint] = (),
) -> Frontier:
    """Search every memory level of every problem's placement (`levels`), then
    keep the Pareto frontier. Each problem's own budget is ignored. The `named`
    schedules whose orders the search can take (`NamedPoint.orders`) are
    candidates at every level of their placement they fit (not in the
    recompute variants, whose memory differs). Deterministic: every level's
    search is (`combined.find`), and the levels are fixed by the problem."""
    objective = options.search.objective
    searched: list[FrontierPoint] = []
    for problem in problems:
        pl = problem.placement
        name = pl.spelling()

        def report(stage: str, fraction: float, _name=name) -> None:
            if progress is not None:
                progress(f"{_name}: {stage}", fraction)

        budgets = levels(problem, options)
        mine = [n for n in named if n.placement == name and n.orders is not None]
        plain = _walk(problem, budgets, options, name, report, named=mine)
        searched += plain
        by_budget = {p.budget: _key(p, objective)[0] for p in plain}
        for k in options.recompute:
            stages = frozenset(s for dev in range(min(k, pl.num_devices)) for s in pl.chunks(dev))
            if not stages:
                continue
            variant = with_recompute(problem, stages, options.kept_input)
            low = recompute_floor(variant)
            step = granularity(problem)
            low = math.ceil(low / step) * step
            below = [low + step * n for n in range(int((budgets[0] - low) / step))]
            searched += _walk(variant, below + budgets, options, name, report, by_budget)
    return Frontier(pareto(searched, objective), tuple(searched), objective)


def recompute_floor(problem: SearchProblem) -> Fraction:
    """A floor no schedule of `problem` (with recomputed stages) goes below: its
    fullest device's F of one microbatch on every chunk (M_I on a recomputed
    one, M_B on the others)."""
    pl, mm = problem.placement, problem.memory

    def held(stage: int) -> Fraction:
        kept = mm.kept(stage)
        return mm.activation[stage] if kept is None else kept

    return max(
        sum((held(s) for s in pl.chunks(dev)), Fraction(0)) for dev in range(pl.num_devices)
    )


def _walk(
    problem: SearchProblem,
    budgets: Sequence[Fraction],
    options: FrontierOptions,
    name: str,
    report: Callable[[str, float], None],
    plain: dict[Fraction, float] | None = None,
    named: Sequence[NamedPoint] = (),
) -> list[FrontierPoint]:
    """Search `budgets` in turn, each seeded with the best orders below it; the
    last budget is the top one, searched first for the floor. The walk stops at
    the first level that reaches the floor, or (`plain`: a recompute variant,
    with the plain placement's objective per budget) at the first that does no
    better than the plain placement there. A budget nothing fits is skipped.
    `named` schedules are candidates at every budget they fit."""
    objective = options.search.objective
    top = budgets[-1]
    def papers(budget: Fraction) -> list[tuple[tuple[tuple[Pass, ...], ...], str]]:
        return [
            (n.orders, f"the named schedule {n.name} ({n.source})")
            for n in named
            if n.orders is not None and n.memory <= budget
        ]

    floor = find(replace(problem, budget=top), options.search, progress=report, seeds=papers(top))
    floor_point = _point(
        replace(problem, budget=top), floor, name, options.dp, options.parameter_memory
    )
    floor_key = _key(floor_point, objective)[0]
    seeds: list[tuple[tuple[tuple[Pass, ...], ...], str]] = []
    mine: list[FrontierPoint] = []
    for budget in budgets[:-1]:
        at = replace(problem, budget=budget)
        try:
            outcome = find(at, options.search, progress=report, seeds=seeds + papers(budget))
        except SearchInputError:  # nothing fits this budget (a recompute variant's floor)
            continue
        point = _point(at, outcome, name, options.dp, options.parameter_memory)
        mine.append(point)
        # a variant's orders hold R: its seed is the search's own (R folded into B)
        best = outcome.heuristic.best.orders() if problem.memory.recompute else outcome.orders
        seeds = [(best, f"the best at {format_short(budget)} M_B: {outcome.method}")]
        key = _key(point, objective)[0]
        if key <= floor_key + _EPS:
            break
        if plain is not None and budget in plain and key >= plain[budget] - _EPS:
            break
    else:  # no level below the top reached the floor
        mine.append(floor_point)
    return mine


def frontier_at(points: Sequence[FrontierPoint], memory: Fraction) -> FrontierPoint | None:
    """The frontier's best point using at most `memory` (None: none fits)."""
    fitting = [p for p in points if p.memory <= memory]
    return fitting[-1] if fitting else None


def _costs_statements(costs: Costs, memory: MemoryModel) -> tuple:
    from ppdsl.frontend import ast
    from ppdsl.search.emit import cost_statements, memory_statements

    # the overlap of an F&B pair too (DualPipe's files assume their own): the
    # search overlaps nothing, so a named schedule runs its pairs under the same costs
    overlap = ast.Cost("overlap", None, ast.number(Fraction(costs.overlap)), ast.GENERATED,
                       ast.GENERATED)
    return (*cost_statements(costs), overlap,
            *memory_statements(memory.activation, memory.weight_retained))


def compile_named(
    path: str | Path,
    problem_for: Callable[[str], SearchProblem],
    num_devices: int,
    num_microbatches: int,
    dp: int = 1,
    parameter_memory: Fraction = Fraction(0),
    topology: Topology | None = None,
) -> NamedPoint:
    """Compile the `.pp` file at `path` with `-D d=.. -D m=..` under the costs and
    memory model `problem_for(its placement)` gives (the file's own cost and
    memory statements replaced, as `--costs-from` does), and measure it: every
    check of the compiler runs. Its name is the file's schedule name. Its
    memory adds `parameter_memory` per extra copy of the parameters
    (`FrontierOptions.parameter_memory`: DualPipe's second); `topology` times its
    transfers and reductions over those links, as the search's problems are."""
    from ppdsl.compiler import compile_source
    from ppdsl.costs_file import CostsFile
    from ppdsl.frontend.ast import GENERATED
    from ppdsl.frontend.elaborate import elaborate
    from ppdsl.frontend.parse import parse

    text = Path(path).read_text(encoding="utf-8")
    overrides = {"d": str(num_devices), "m": str(num_microbatches)}
    designed = elaborate(parse(text, str(path)), overrides)
    pl = designed.placement
    spelling = pl.spelling()
    problem = problem_for(spelling)
    statements = _costs_statements(problem.costs, problem.memory)
    costs = CostsFile("<frontier costs>", statements, pl.num_stages, None, GENERATED)
    compiled = compile_source(text, str(path), overrides, costs=costs, topology=topology, dp=dp)
    peak = max(_peaks(compiled.schedule)) + extra_copies_memory(pl.lanes, parameter_memory)
    step = compiled.timeline.makespan
    if dp > 1 and problem.costs.declared_collectives():
        from ppdsl.analysis.collectives import comm_lanes

        step = comm_lanes(compiled.schedule, compiled.timeline).makespan
    orders = tuple(tuple(order) for order in compiled.schedule.orders)
    searchable = compiled.schedule.split_backward and not any(
        p.overlapped or p.kind not in (PassKind.F, PassKind.B, PassKind.W)
        for order in orders for p in order
    )
    return NamedPoint(
        designed.name,
        spelling,
        peak,
        compiled.timeline.bubble_ratio,
        compiled.timeline.makespan,
        str(path),
        step,
        orders if searchable else None,
    )


def _peaks(schedule) -> tuple[Fraction, ...]:
    from ppdsl.analysis.memory import peak_memory

    return peak_memory(schedule)


def named_points(problems: Sequence[SearchProblem], dp: int = 1) -> list[NamedPoint]:
    """The search's own `references` (1F1B, ZB-H1, ZB-H2 on a parallel placement;
    V-Min, V-Half, V-ZB on a V-shape) under each problem's costs and memory;
    none under data parallelism with a reduction cost (they carry no orders to
    time the reductions on: give their `.pp` files to `compile_named`)."""
    out: list[NamedPoint] = []
    if dp > 1 and any(p.costs.declared_collectives() for p in problems):
        return out
    for problem in problems:
        pl = problem.placement
        spelling = pl.spelling()
        for ref in references(problem):
            out.append(
                NamedPoint(ref.name, spelling, ref.peak, ref.bubble, ref.makespan,
                           "ppdsl.search.references", ref.makespan)
            )
    return out
