"""The exact engine: the order-form problem as a CP-SAT model (OR-Tools), solved
under a deterministic budget, with a lower bound and, where the gap closes, a
proof of optimality. docs/exact.md states the model for a scheduling reader.

The problem: per device, an order of its passes (every F, B, W or BW of every
microbatch of its stages) such that the passes run after what they need and the
device's activation memory stays within its budget; minimise the bubble (each
device's idle share of its own span, the worst device) or the makespan.

The model, in integer time (costs scaled by `time_scale`):

- one fixed-size interval per pass; one NoOverlap per device;
- a dependency edge start(q) >= end(p) + lag for every pass p that q needs, lag
  = the transfer cost when p ran on another device. The edges are the checks'
  own (`ppdsl.checks._flat.dependencies`), so the model cannot drift from what
  the compiler proves;
- per device a reservoir of its memory events, bounded by its budget: an F adds
  M_B at its start, a B frees M_B - M_W, a W frees M_W and a fused BW frees M_B
  at their end (`MemoryModel.delta`, the memory check's deltas);
- microbatches in order per stage and kind (FIFO). Not a restriction: sorting
  the start times of each (kind, stage) and handing them to microbatches 0, 1,
  ... keeps every device's busy intervals and memory events and every
  dependency (each edge joins two sorted sequences of the same kind pairwise);
- device d's span runs from the start of F(0, first stage of d) (its first pass,
  by FIFO and the forward chain) to the end of the last W (or BW) of its stages.

Objective `bubble`: the device's idle share (span - busy) / span is
1 - busy / span, and busy is fixed by the problem, so minimising the worst share
is minimising max_d span_d / busy_d: z >= span_d * (L / busy_d), L = lcm of the
busy times, all integers; the bubble is then (z - L) / z exactly. Objective
`makespan`: z >= the end of every device's last pass.

The compiler times an order as soon as possible; a solution's orders are
re-timed that way and measured in exact integer arithmetic (`measure`), and a
schedule is reported optimal only when that measure reaches the solver's lower
bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ppdsl.checks._flat import dependencies, flatten
from ppdsl.ir.schedule import Costs, MemoryModel, Pass, PassKind, Placement, Schedule
from ppdsl.simulate import SimulationError, simulate

__all__ = [
    "ExactProblem",
    "ExactOptions",
    "ExactResult",
    "Progress",
    "OBJECTIVES",
    "time_scale",
    "measure",
    "solve",
]

OBJECTIVES = ("bubble", "makespan")

_F, _B, _W, _BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW

# Cost values are kept exact when a denominator up to this reproduces them.
_MAX_DENOMINATOR = 10**6
# Integer times stay far below 2**53 (simulated exactly in float64) and 2**62 (CP-SAT).
_MAX_TIME = 2**40


@dataclass(frozen=True)
class ExactProblem:
    """What the model needs: placement, microbatches, pass kinds, costs, memory
    model and each device's memory budget (in the memory model's units)."""

    placement: Placement
    """Which device holds each stage."""
    num_microbatches: int
    """m."""
    split_backward: bool
    """F, B, W (True) or F and a fused BW (False)."""
    costs: Costs
    """Pass durations per stage and the transfer cost."""
    memory: MemoryModel
    """M_B and M_W per stage."""
    budgets: tuple[Fraction | None, ...]
    """Per device, the highest activation memory allowed (None: no bound)."""

    @property
    def num_devices(self) -> int:
        return self.placement.num_devices

    @property
    def kinds(self) -> tuple[PassKind, ...]:
        return (_F, _B, _W) if self.split_backward else (_F, _BW)

    @property
    def num_passes(self) -> int:
        return len(self.kinds) * self.placement.num_stages * self.num_microbatches

    def schedule(self, orders: Sequence[Sequence[Pass]], costs: Costs | None = None) -> Schedule:
        """These orders as a Schedule IR (for the checks' dependency rule and
        the simulator), optionally under other costs."""
        return Schedule(
            name="exact",
            file="<exact>",
            params=(),
            num_microbatches=self.num_microbatches,
            placement=self.placement,
            split_backward=self.split_backward,
            costs=costs or self.costs,
            memory=self.memory,
            orders=tuple(tuple(o) for o in orders),
        )

    def all_passes(self) -> tuple[tuple[Pass, ...], ...]:
        """Per device, every pass it must run (stage by stage, microbatch by
        microbatch): an order, not necessarily a valid one."""
        out = []
        for dev in range(self.num_devices):
            out.append(
                tuple(
                    Pass(kind, j, s)
                    for s in self.placement.chunks(dev)
                    for j in range(self.num_microbatches)
                    for kind in self.kinds
                )
            )
        return tuple(out)


@dataclass(frozen=True)
class ExactOptions:
    """How the solver runs."""

    objective: str = "bubble"
    """`bubble` (the worst device's idle share of its span) or `makespan`."""
    effort: float = 10.0
    """Budget in CP-SAT deterministic time (its count of work, about a second
    on a fast core): the same on every machine, so the result is too."""
    workers: int = 1
    """CP-SAT workers. 1 is deterministic; more run interleaved
    (`interleave_search`), which is deterministic as well."""
    time_cap: float | None = None
    """Optional wall-clock cap in seconds. When it stops the solver first, the
    result depends on the machine (the result says so)."""
    seed: int = 0
    """CP-SAT's random seed."""


@dataclass(frozen=True)
class ExactResult:
    """What the solver found and proved."""

    orders: tuple[tuple[Pass, ...], ...] | None
    """Best orders found (the hint's when the solver found nothing better); None
    when there was neither."""
    value: Fraction | None
    """Their objective, measured in exact arithmetic on the compiler's
    as-soon-as-possible timing (bubble ratio, or makespan in cost units)."""
    bound: Fraction
    """No schedule of the problem does better than this."""
    optimal: bool
    """value == bound: the found orders are optimal."""
    status: str
    """optimal, feasible (found, gap open), unknown (nothing found, no proof),
    infeasible (no schedule fits the memory budgets)."""
    objective: str
    deterministic_time: float
    """CP-SAT's deterministic time spent."""
    wall_seconds: float
    capped: bool
    """The wall-clock cap stopped the solver before its deterministic budget."""
    time_scale: int
    """Integer time unit: a cost x became x * time_scale."""
    exact_costs: bool
    """False when costs had to be rounded to the time unit (then the bound is
    the rounded problem's)."""
    from_hint: bool
    """The orders are the hint's: the solver found nothing better."""

    @property
    def gap(self) -> Fraction | None:
        """value - bound (0 when optimal)."""
        return None if self.value is None else self.value - self.bound


Progress = Callable[[Fraction | None, Fraction | None, float], None]
"""progress(incumbent, bound, fraction of the budget): called as they move."""


def _exact_fraction(x: float) -> Fraction | None:
    f = Fraction(x).limit_denominator(_MAX_DENOMINATOR)
    return f if float(f) == float(x) else None


def time_scale(problem: ExactProblem) -> tuple[int, bool]:
    """The integer time unit: the least common denominator of the costs when
    every cost is a fraction with a denominator up to 10^6 and times stay below
    2^40; otherwise a power of ten that keeps them below it, and False (the
    costs are rounded)."""
    c, S = problem.costs, problem.placement.num_stages
    values = [c.comm] + [c.duration(k, s) for k in problem.kinds for s in range(S)]
    fractions = [_exact_fraction(x) for x in values]
    total = sum(values) * problem.num_microbatches * 2 + 1
    if all(f is not None for f in fractions):
        scale = math.lcm(*(f.denominator for f in fractions if f is not None))
        if scale <= _MAX_DENOMINATOR and total * scale < _MAX_TIME:
            return scale, True
    scale = 10 ** max(0, int(math.log10(_MAX_TIME / total)) - 3)
    return min(scale, 10**6), False


def _scaled_costs(problem: ExactProblem, scale: int) -> Costs:
    c = problem.costs

    def sc(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(float(round(Fraction(x) * scale)) for x in values)

    return Costs(
        sc(c.forward), sc(c.backward_input), sc(c.backward_weight), sc(c.fused_backward),
        float(round(Fraction(c.comm) * scale)),
    )


def _memory_scale(problem: ExactProblem) -> int:
    mm = problem.memory
    values = [*mm.activation, *mm.weight_retained, *(b for b in problem.budgets if b is not None)]
    return math.lcm(*(Fraction(v).denominator for v in values)) if values else 1


@dataclass(frozen=True)
class _Measure:
    value: Fraction
    spans: tuple[int, ...]
    makespan: int


def _measure(problem: ExactProblem, orders, scaled: Costs, objective: str) -> _Measure | None:
    """The compiler's timing of `orders` under integer costs (exact in float64)."""
    try:
        timeline = simulate(problem.schedule(orders, scaled))
    except SimulationError:
        return None
    spans = tuple(int(e - s) for s, e in zip(timeline.span_start, timeline.span_end, strict=True))
    busy = tuple(int(b) for b in timeline.busy)
    makespan = int(timeline.makespan)
    if objective == "makespan":
        return _Measure(Fraction(makespan), spans, makespan)
    value = max(
        (Fraction(span - b, span) for span, b in zip(spans, busy, strict=True) if span > 0),
        default=Fraction(0),
    )
    return _Measure(value, spans, makespan)


def measure(problem: ExactProblem, orders, objective: str = "bubble") -> Fraction | None:
    """The objective of `orders` in exact arithmetic: the worst device's idle
    share of its span, or the makespan (in cost units). None when the orders
    cannot run (a cycle of waits or a missing pass)."""
    scale, _ = time_scale(problem)
    found = _measure(problem, orders, _scaled_costs(problem, scale), objective)
    if found is None:
        return None
    return found.value if objective == "bubble" else found.value / scale


def _peaks_fit(problem: ExactProblem, orders, mscale: int) -> bool:
    for dev, order in enumerate(orders):
        budget = problem.budgets[dev]
        if budget is None:
            continue
        level = top = Fraction(0)
        for p in order:
            level += problem.memory.delta(p.kind, p.stage)
            top = max(top, level)
        if top > budget:
            return False
    return True


def _busy(problem: ExactProblem, scaled: Costs) -> list[int]:
    """Per device, the integer time its passes take."""
    m = problem.num_microbatches
    return [
        m * sum(int(scaled.duration(k, s)) for s in problem.placement.chunks(dev) for k in problem.kinds)
        for dev in range(problem.num_devices)
    ]


def _weights(problem: ExactProblem, scaled: Costs, objective: str) -> tuple[int, list[int]]:
    """(L, per-device weight L / busy_d) of the bubble objective; (1, ones) for
    the makespan."""
    if objective != "bubble":
        return 1, [1] * problem.num_devices
    busy = _busy(problem, scaled)
    lcm = math.lcm(*busy)
    return lcm, [lcm // b for b in busy]


class _Model:
    """The CP-SAT model of one problem (see the module docstring)."""

    def __init__(self, problem: ExactProblem, objective: str, scaled: Costs, upper: int | None):
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.problem = problem
        self.objective = objective
        p = problem
        S, m, d = p.placement.num_stages, p.num_microbatches, p.num_devices
        sd = p.placement.stage_device
        canonical = p.schedule(p.all_passes())
        flat = flatten(canonical)
        deps = dependencies(canonical, flat)
        n = flat.size
        kinds = flat.kind
        duration = np.array(
            [int(scaled.duration(pp.kind, pp.stage)) for pp in flat.passes], dtype=np.int64
        )
        comm = int(scaled.comm)
        self.passes = flat.passes
        self.index = {pp.key: k for k, pp in enumerate(flat.passes)}
        last_kind = _W if p.split_backward else _BW
        self.busy = _busy(p, scaled)
        # earliest start of each pass: its dependencies and the FIFO chain
        est = np.zeros(n, dtype=np.int64)
        order = self._topological(p, S, m)
        edges: list[tuple[int, int, int]] = []  # (before, after, lag from before's end)
        for key in order:
            k = self.index[key]
            for need in (int(deps.dep0[k]), int(deps.dep1[k])):
                if need >= 0:
                    lag = comm if flat.device[need] != flat.device[k] else 0
                    edges.append((need, k, lag))
                    est[k] = max(est[k], est[need] + duration[need] + lag)
            kind, j, s = key
            if j > 0:
                prev = self.index[(kind, j - 1, s)]
                edges.append((prev, k, 0))
                est[k] = max(est[k], est[prev] + duration[prev])
        first_pass = [self.index[(_F, 0, p.placement.chunks(x)[0])] for x in range(d)]
        last_passes = [[self.index[(last_kind, m - 1, s)] for s in p.placement.chunks(x)] for x in range(d)]
        self.lcm, weight = _weights(p, scaled, objective)
        if upper is not None:
            if objective == "bubble":
                span_cap = [upper // w for w in weight]
                home = sd[0]
                horizon = span_cap[home] + max(span_cap)
            else:
                horizon = upper
        else:
            horizon = int(duration.sum()) + comm * n
        horizon = max(horizon, int(est.max() + duration.max()))
        model = cp_model.CpModel()
        self.model = model
        start = [
            model.new_int_var(int(est[k]), max(int(est[k]), horizon - int(duration[k])), f"s{k}")
            for k in range(n)
        ]
        self.start = start
        model.add(start[self.index[(_F, 0, 0)]] == 0)
        intervals = [
            model.new_fixed_size_interval_var(start[k], int(duration[k]), f"i{k}") for k in range(n)
        ]
        for a, b, lag in edges:
            model.add(start[b] >= start[a] + int(duration[a]) + lag)
        mscale = _memory_scale(p)
        self.mscale = mscale
        for x in range(d):
            lo, hi = int(flat.offsets[x]), int(flat.offsets[x + 1])
            model.add_no_overlap(intervals[lo:hi])
            budget = p.budgets[x]
            if budget is None:
                continue
            cap = int(math.floor(budget * mscale))
            times, changes = [], []
            for k in range(lo, hi):
                pp = flat.passes[k]
                delta = int(p.memory.delta(pp.kind, pp.stage) * mscale)
                if delta == 0:
                    continue
                at = start[k] if pp.kind is _F else start[k] + int(duration[k])
                times.append(at)
                changes.append(delta)
            if times:
                model.add_reservoir_constraint(times, changes, 0, cap)
            self._implied_memory(p, x, cap, mscale, start, duration)
        self.first = [start[k] for k in first_pass]
        self.z = model.new_int_var(0, (upper if upper is not None else horizon * max(weight)), "z")
        for x in range(d):
            last = model.new_int_var(0, horizon, f"last{x}")
            for k in last_passes[x]:
                model.add(last >= start[k] + int(duration[k]))
            model.add(last - self.first[x] >= self.busy[x])
            if objective == "bubble":
                model.add(self.z >= weight[x] * (last - self.first[x]))
            else:
                model.add(self.z >= last)
        model.minimize(self.z)
        self.duration = duration
        self.kinds = kinds

    @staticmethod
    def _topological(p: ExactProblem, S: int, m: int) -> list[tuple[PassKind, int, int]]:
        back = _B if p.split_backward else _BW
        out: list[tuple[PassKind, int, int]] = []
        for j in range(m):
            out += [(_F, j, s) for s in range(S)]
            out += [(back, j, s) for s in reversed(range(S))]
            if p.split_backward:
                out += [(_W, j, s) for s in range(S)]
        return out

    def _implied_memory(self, p, device, cap, mscale, start, duration) -> None:
        """Precedences the budget implies for one stage alone (they help the
        solver; the reservoir already holds them): while B(j) has not ended the
        stage holds at least (c+1) M_B once F(j+c) starts, and while W(j) has not
        ended at least M_B + c M_W."""
        m = p.num_microbatches
        for s in p.placement.chunks(device):
            mb = int(p.memory.activation[s] * mscale)
            mw = int(p.memory.weight_retained[s] * mscale) if p.split_backward else 0
            back = _B if p.split_backward else _BW
            for j in range(m):
                for c in range(1, m - j):
                    if (c + 1) * mb > cap:
                        b = self.index[(back, j, s)]
                        f = self.index[(_F, j + c, s)]
                        self.model.add(start[f] >= start[b] + int(duration[b]))
                        break
                if not p.split_backward or mw == 0:
                    continue
                for c in range(1, m - j):
                    if mb + c * mw > cap:
                        w = self.index[(_W, j, s)]
                        f = self.index[(_F, j + c, s)]
                        self.model.add(start[f] >= start[w] + int(duration[w]))
                        break

    def hint(self, times: dict[tuple[PassKind, int, int], int]) -> None:
        for key, t in times.items():
            self.model.add_hint(self.start[self.index[key]], t)

    def orders(self, value) -> tuple[tuple[Pass, ...], ...]:
        d = self.problem.num_devices
        sd = self.problem.placement.stage_device
        per: list[list[tuple[int, int, Pass]]] = [[] for _ in range(d)]
        for k, pp in enumerate(self.passes):
            per[sd[pp.stage]].append((int(value(self.start[k])), k, pp))
        return tuple(tuple(pp for _, _, pp in sorted(x)) for x in per)

    def to_value(self, z: int, scale: int) -> Fraction:
        """The objective value z in the problem's terms."""
        if self.objective == "bubble":
            return Fraction(max(z - self.lcm, 0), z) if z > 0 else Fraction(0)
        return Fraction(z, scale)


def _fifo_times(problem: ExactProblem, orders, scaled: Costs) -> dict | None:
    """Start times of the orders' as-soon-as-possible timing, handed to
    microbatches in order per (kind, stage) (the FIFO relabelling)."""
    try:
        timeline = simulate(problem.schedule(orders, scaled))
    except SimulationError:
        return None
    by: dict[tuple[PassKind, int], list[int]] = {}
    for dev, order in enumerate(orders):
        for pp, t in zip(order, timeline.start[dev], strict=True):
            by.setdefault((pp.kind, pp.stage), []).append(int(t))
    out = {}
    for (kind, s), times in by.items():
        for j, t in enumerate(sorted(times)):
            out[(kind, j, s)] = t
    return out


def solve(
    problem: ExactProblem,
    options: ExactOptions,
    *,
    hint: Sequence[Sequence[Pass]] | None = None,
    progress: Progress | None = None,
) -> ExactResult:
    """Solve `problem` under `options`, starting from the orders `hint` (kept
    as the answer when the solver finds nothing better)."""
    from ortools.sat.python import cp_model

    if options.objective not in OBJECTIVES:
        raise ValueError(f"objective {options.objective!r}: use bubble or makespan")
    begin = time.monotonic()
    scale, exact = time_scale(problem)
    scaled = _scaled_costs(problem, scale)
    mscale = _memory_scale(problem)
    incumbent: tuple[tuple[Pass, ...], ...] | None = None
    best: _Measure | None = None
    upper = None
    if hint is not None and _peaks_fit(problem, hint, mscale):
        best = _measure(problem, hint, scaled, options.objective)
        if best is not None:
            incumbent = tuple(tuple(o) for o in hint)
    lcm, weight = _weights(problem, scaled, options.objective)
    if best is not None:
        upper = _z_of(options.objective, weight, best)
    _check_range(problem, scaled, options.objective, lcm, weight)
    model = _Model(problem, options.objective, scaled, upper)
    if incumbent is not None:
        times = _fifo_times(problem, incumbent, scaled)
        if times is not None:
            model.hint(times)
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.num_workers = max(1, options.workers)
    if options.workers > 1:
        params.interleave_search = True
    params.max_deterministic_time = float(options.effort)
    params.random_seed = options.seed
    if options.time_cap is not None:
        params.max_time_in_seconds = float(options.time_cap)
    state: dict = {
        "incumbent": None if upper is None else model.to_value(upper, scale),
        "bound": None,
        "fraction": 0.0,
    }

    def report(fraction: float | None) -> None:
        if fraction is not None:
            state["fraction"] = fraction
        if progress is not None:
            progress(state["incumbent"], state["bound"], state["fraction"])

    class _Callback(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            state["incumbent"] = model.to_value(int(round(self.objective_value)), scale)
            report(min(1.0, self.deterministic_time / max(options.effort, 1e-9)))

    def on_bound(value: float) -> None:
        state["bound"] = model.to_value(int(math.ceil(value - 1e-9)), scale)
        report(None)

    if progress is not None:
        solver.best_bound_callback = on_bound
    status = solver.solve(model.model, _Callback() if progress is not None else None)
    wall = time.monotonic() - begin
    name = solver.status_name(status)
    found_orders = incumbent
    from_hint = incumbent is not None
    if name in ("OPTIMAL", "FEASIBLE"):
        orders = model.orders(solver.value)
        measured = _measure(problem, orders, scaled, options.objective)
        if measured is not None and _peaks_fit(problem, orders, mscale) and (
            best is None or measured.value < best.value
        ):
            best, found_orders, from_hint = measured, orders, False
    if name == "INFEASIBLE" and best is None:
        bound_z = None
    elif name == "OPTIMAL":
        bound_z = int(round(solver.objective_value))
    else:
        bound_z = int(math.ceil(solver.best_objective_bound - 1e-9))
    det = float(solver.response_proto.deterministic_time)
    capped = (
        options.time_cap is not None
        and name not in ("OPTIMAL", "INFEASIBLE")
        and det < 0.99 * options.effort
    )
    if bound_z is None:
        return ExactResult(
            None, None, Fraction(0), False, "infeasible", options.objective, det, wall, capped,
            scale, exact, False,
        )
    bound = model.to_value(max(bound_z, 0), scale)
    value = None
    if best is not None:
        value = best.value if options.objective == "bubble" else best.value / scale
    if value is not None and value < bound:  # pragma: no cover - a wrong model
        raise AssertionError(
            f"the exact model's bound {bound} is above a valid schedule's {value}: a bug in ppdsl"
        )
    optimal = value is not None and value <= bound
    status_text = "optimal" if optimal else ("feasible" if value is not None else "unknown")
    if progress is not None:
        state["incumbent"], state["bound"] = value, bound
        report(1.0)
    return ExactResult(
        found_orders, value, bound, optimal, status_text, options.objective, det, wall, capped,
        scale, exact, from_hint,
    )


def _z_of(objective: str, weight: list[int], measured: _Measure) -> int:
    """The model's objective variable for a measured timing (its upper bound)."""
    if objective == "makespan":
        return measured.makespan
    return max(w * span for w, span in zip(weight, measured.spans, strict=True))


def _check_range(
    problem: ExactProblem, scaled: Costs, objective: str, lcm: int, weight: list[int]
) -> None:
    """CP-SAT holds 64-bit integers: refuse a bubble objective whose weights
    (devices with very different busy times) would overflow them."""
    total = sum(_busy(problem, scaled)) + int(scaled.comm) * problem.num_passes
    if total * max(weight) >= 2**62:
        raise ValueError(
            "the devices' busy times differ too irregularly for an exact bubble objective "
            f"(weights up to {max(weight)}); use the makespan objective"
        )

