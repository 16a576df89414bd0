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
  = the transfer cost when p ran on another device. The edges are the
  dependency rule every check uses (`ppdsl.semantics.needs`), so the model
  cannot drift from what the compiler proves;
- per device a reservoir of its memory events, bounded by its budget: an F adds
  M_B at its start, a B frees M_B - M_W, a W frees M_W and a fused BW frees M_B
  at their end (`MemoryModel.delta` and `semantics.allocates_at_start`, the
  memory check's deltas);
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

from ppdsl.analysis.simulate import SimulationError, simulate
from ppdsl.ir.schedule import Costs, MemoryModel, Pass, PassKind, Placement, Schedule
from ppdsl.search.bounds import device_span_bounds, memory_precedences
from ppdsl.semantics import allocates_at_start, needs, pass_kinds

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
        return pass_kinds(self.split_backward)

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
    device_bounds: float = 0.0
    """Deterministic time per device for the one-device relaxation
    (`ppdsl.search.bounds`), run before the whole model: its bounds floor each
    device's span, and the model then also carries the memory precedences.
    Counted in `effort`. 0: neither (the model of docs/exact.md alone)."""
    span_bound: float = 0.0
    """Deterministic time for the whole model with one device's span as its
    objective (the device with the worst span in the incumbent; device 0
    without one), run before the whole model: its bound floors that device's
    span, and so the objective (docs/exact.md, "One device's span on the whole
    model"). Counted in `effort`. 0: off."""


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
    values = ([float(x) for x in c.edge_costs(S)] or [c.comm]) + [
        c.duration(k, s) for k in problem.kinds for s in range(S)]
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
    return Costs(
        # each pass with its stage's engine overhead, as the simulator times it
        tuple(tuple(float(round(Fraction(x) * scale)) for x in row) for row in c.duration_table()),
        float(round(Fraction(c.comm) * scale)),
        edges=tuple(float(round(Fraction(float(x)) * scale))
                    for x in c.edge_costs(len(c.durations[0]))),
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
    """(K, per-device weight w_d) of the bubble objective z >= w_d * span_d:
    K = lcm of the busy times and w_d = K / busy_d, exact, when that fits 64-bit
    integers; otherwise (devices busy for very different, irregular times) a
    large K and w_d = floor(K / busy_d) <= K / busy_d, so z / K still bounds the
    worst span / busy from below and the bound stays valid (the solver then
    optimises that rounded objective; the schedule is measured exactly). For the
    makespan: (1, ones)."""
    if objective != "bubble":
        return 1, [1] * problem.num_devices
    busy = _busy(problem, scaled)
    horizon = sum(busy) + int(max(scaled.edges, default=0.0)) * problem.num_passes + 1
    limit = 2**62 // horizon
    lcm = math.lcm(*busy)
    if lcm <= limit:
        return lcm, [lcm // b for b in busy]
    k = min(limit, max(busy) * 2**30)
    return k, [k // b for b in busy]


class _Model:
    """The CP-SAT model of one problem (see the module docstring)."""

    def __init__(
        self,
        problem: ExactProblem,
        objective: str,
        scaled: Costs,
        upper: int | None,
        memory_edges: bool = False,
        span_floors: Sequence[int] | None = None,
    ):
        from ortools.sat.python import cp_model

        self.problem = problem
        self.objective = objective
        p = problem
        S, m, d = p.placement.num_stages, p.num_microbatches, p.num_devices
        sd = p.placement.stage_device
        # every pass, device by device: device x owns passes offsets[x]:offsets[x+1]
        self.passes = tuple(pp for order in p.all_passes() for pp in order)
        offsets = np.cumsum([0] + [len(o) for o in p.all_passes()])
        n = len(self.passes)
        device = np.array([sd[pp.stage] for pp in self.passes], dtype=np.int64)
        duration = np.array(
            [int(scaled.duration(pp.kind, pp.stage)) for pp in self.passes], dtype=np.int64
        )
        edge = [int(x) for x in scaled.edges]  # a transfer between stages b and b + 1
        self.index = {pp.key: k for k, pp in enumerate(self.passes)}
        last_kind = _W if p.split_backward else _BW
        self.busy = _busy(p, scaled)
        # earliest start of each pass: its dependencies and the FIFO chain
        est = np.zeros(n, dtype=np.int64)
        order = self._topological(p, S, m)
        self.topological_keys = order
        implied: dict[tuple[PassKind, int, int], list[tuple[PassKind, int, int]]] = {}
        for before, after in memory_precedences(p) if memory_edges else ():
            implied.setdefault(after, []).append(before)
        edges: list[tuple[int, int, int]] = []  # (before, after, lag from before's end)
        for key in order:
            k = self.index[key]
            kind, j, s = key
            for before in implied.get(key, ()):
                need = self.index[before]
                edges.append((need, k, 0))
                est[k] = max(est[k], est[need] + duration[need])
            # the dependency relation and the transfer rule: ppdsl.semantics
            for need_key in needs(kind, j, s, S):
                need = self.index[need_key]
                lag = edge[min(need_key[2], s)] if device[need] != device[k] else 0
                edges.append((need, k, lag))
                est[k] = max(est[k], est[need] + duration[need] + lag)
            if j > 0:
                prev = self.index[(kind, j - 1, s)]
                edges.append((prev, k, 0))
                est[k] = max(est[k], est[prev] + duration[prev])
        first_pass = [self.index[(_F, 0, p.placement.chunks(x)[0])] for x in range(d)]
        self._first_pass = first_pass
        self.first_pass = first_pass
        self.edges = edges
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
            horizon = int(duration.sum()) + max(edge, default=0) * n
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
            lo, hi = int(offsets[x]), int(offsets[x + 1])
            model.add_no_overlap(intervals[lo:hi])
            budget = p.budgets[x]
            if budget is None:
                continue
            cap = int(math.floor(budget * mscale))
            times, changes = [], []
            for k in range(lo, hi):
                pp = self.passes[k]
                delta = int(p.memory.delta(pp.kind, pp.stage) * mscale)
                if delta == 0:
                    continue
                at = start[k] if allocates_at_start(pp.kind) else start[k] + int(duration[k])
                times.append(at)
                changes.append(delta)
            if times:
                model.add_reservoir_constraint(times, changes, 0, cap)
            self._implied_memory(p, x, cap, mscale, start, duration)
        self.first = [start[k] for k in first_pass]
        self.last_passes = last_passes
        self.weight = weight
        self.last = []
        self.idle_floors: list[int] = []
        """Per device, the idle time it cannot avoid (`_idle`)."""
        # with an incumbent, only strictly better schedules are asked for (the
        # caller keeps the incumbent; infeasible then means it is optimal)
        self.z = model.new_int_var(
            0, (upper - 1 if upper is not None else horizon * max(weight)), "z"
        )
        for x in range(d):
            last = model.new_int_var(0, horizon, f"last{x}")
            self.last.append(last)
            for k in last_passes[x]:
                model.add(last >= start[k] + int(duration[k]))
            idle = self._idle(x, est, duration, mscale)
            self.idle_floors.append(idle)
            model.add(last - self.first[x] >= self.busy[x] + idle)
            if span_floors is not None:
                model.add(last - self.first[x] >= span_floors[x])
            if objective == "bubble":
                model.add(self.z >= weight[x] * (last - self.first[x]))
            else:
                model.add(self.z >= last)
        model.minimize(self.z)
        self.duration = duration

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

    def _idle(self, device: int, est, duration, mscale: int) -> int:
        """Idle time device `device` cannot avoid in its warm-up and cool-down.

        Warm-up: from its first pass, F(0, s*) of its lowest stage, to its first
        backward, B(0, s) of one of its stages (FIFO), lies at least microbatch
        0's chain between them; meanwhile it can run only forwards, and every
        forward started then still holds its activation (nothing is freed before
        a backward ends), so at most a budget's worth of them.

        Cool-down: from the end of its last forward, F(m-1, s^) of its highest
        stage, to its last W (BW) lies at least microbatch m-1's chain; meanwhile
        it runs only backwards and W of activations it holds when that forward
        ends, so at most a budget's worth of them (M_B for a pending B and its
        W, M_W for a pending W).

        The two idle times add up when the budget cannot hold every forward of
        the device at once (then some forward runs after the first backward, so
        the two intervals do not meet); otherwise the larger counts."""
        p = self.problem
        m = p.num_microbatches
        split = p.split_backward
        back = _B if split else _BW
        stages = p.placement.chunks(device)
        t = {key: int(est[k]) for key, k in self.index.items() if key[1] == 0}
        dur = {key: int(duration[k]) for key, k in self.index.items() if key[1] == 0}
        first = t[(_F, 0, stages[0])]
        warm_wait = min(t[(back, 0, s)] - first for s in stages)
        last_f = t[(_F, 0, stages[-1])] + dur[(_F, 0, stages[-1])]
        end_kind = _W if split else _BW
        cool_wait = max(t[(end_kind, 0, s)] + dur[(end_kind, 0, s)] - last_f for s in stages)
        forward = [dur[(_F, 0, s)] for s in stages]
        budget = p.budgets[device]
        if budget is None:
            return 0
        capacity = int(math.floor(budget * mscale))
        size_f = [int(p.memory.activation[s] * mscale) for s in stages]
        warm = max(0, warm_wait - _most_work(forward, size_f, capacity, m))
        if split:
            works = [dur[(_B, 0, s)] + dur[(_W, 0, s)] for s in stages]
            works += [dur[(_W, 0, s)] for s in stages]
            sizes = size_f + [int(p.memory.weight_retained[s] * mscale) for s in stages]
        else:
            works, sizes = [dur[(_BW, 0, s)] for s in stages], size_f
        cool = max(0, cool_wait - _most_work(works, sizes, capacity, m))
        if m * sum(size_f) > capacity:
            return warm + cool
        return max(warm, cool)

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
        """A complete hint (every start, every device's last end, the
        objective), which CP-SAT takes as its first solution."""
        for key, t in times.items():
            self.model.add_hint(self.start[self.index[key]], t)
        z = 0
        for x, last in enumerate(self.last):
            end = max(times[self.passes[k].key] + int(self.duration[k]) for k in self.last_passes[x])
            self.model.add_hint(last, end)
            first = times[self.passes[self._first_pass[x]].key]
            z = max(z, self.weight[x] * (end - first) if self.objective == "bubble" else end)
        self.model.add_hint(self.z, z)

    def orders(self, value) -> tuple[tuple[Pass, ...], ...]:
        d = self.problem.num_devices
        sd = self.problem.placement.stage_device
        per: list[list[tuple[int, int, Pass]]] = [[] for _ in range(d)]
        for k, pp in enumerate(self.passes):
            per[sd[pp.stage]].append((int(value(self.start[k])), k, pp))
        return tuple(tuple(pp for _, _, pp in sorted(x)) for x in per)


def _most_work(durations: list[int], sizes: list[int], capacity: int, count: int) -> int:
    """The most total duration of items (at most `count` of each kind) whose
    sizes fit `capacity` (a bounded knapsack; exact for small capacities, the
    fractional relaxation above, which only loosens the bound)."""
    if any(size <= 0 for size in sizes):
        return count * sum(durations)
    if capacity <= 100_000 and len(durations) * capacity * min(count, capacity) <= 10**7:
        best = [0] * (capacity + 1)
        for dur, size in zip(durations, sizes, strict=True):
            for _ in range(min(count, capacity // size)):
                for c in range(capacity, size - 1, -1):
                    best[c] = max(best[c], best[c - size] + dur)
        return best[capacity]
    left: float = capacity
    total = 0.0
    for dur, size in sorted(zip(durations, sizes, strict=True), key=lambda x: -x[0] / x[1]):
        take = min(count, left / size)
        total += take * dur
        left -= take * size
    return int(math.ceil(total))


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


def _fifo_orders(problem: ExactProblem, times: dict) -> tuple[tuple[Pass, ...], ...]:
    """Per device, the passes in the order of `times` (ties: F, B, W, BW)."""
    rank = {_F: 0, _B: 1, _W: 2, _BW: 3}
    sd = problem.placement.stage_device
    per: list[list[tuple[int, int, int, int, Pass]]] = [[] for _ in range(problem.num_devices)]
    for (kind, j, s), t in times.items():
        per[sd[s]].append((t, rank[kind], j, s, Pass(kind, j, s)))
    return tuple(tuple(x[-1] for x in sorted(dev)) for dev in per)


class _Run:
    """One solve: the incumbent, the best bound, the budget spent, progress."""

    def __init__(self, problem, options, scaled, scale, weight, progress, begin):
        self.problem, self.options = problem, options
        self.scaled, self.scale, self.weight = scaled, scale, weight
        self.progress, self.begin = progress, begin
        self.orders: tuple[tuple[Pass, ...], ...] | None = None
        self.best: _Measure | None = None
        self.from_hint = True
        self.bound_z = 0
        self.spent = 0.0
        self.capped = False
        self.infeasible = False
        self.lcm = _weights(problem, scaled, options.objective)[0]
        self.span_floors: list[int] | None = None

    def model(self) -> _Model:
        """The whole model under the incumbent (and the device bounds, if run)."""
        return _Model(
            self.problem, self.options.objective, self.scaled, self.upper,
            memory_edges=self.options.device_bounds > 0 or self.options.span_bound > 0,
            span_floors=self.span_floors,
        )

    def bound_devices(self) -> None:
        """The one-device relaxation of every device (`ppdsl.search.bounds`):
        each bound floors that device's span, and for the bubble their worst
        bounds the objective."""
        model = _Model(self.problem, self.options.objective, self.scaled, None, memory_edges=True)
        found = device_span_bounds(model, self.options.device_bounds, self.options.seed)
        # a relaxation stopped by its budget may prove less than the idle bound
        self.span_floors = [
            max(span, busy + idle)
            for (span, _, _), busy, idle in zip(found, model.busy, model.idle_floors, strict=True)
        ]
        self.spent += sum(det for _, _, det in found)
        if self.options.objective == "bubble":
            floor = max(w * span for w, span in zip(self.weight, self.span_floors, strict=True))
            upper = self.upper
            self.bound_z = max(self.bound_z, floor if upper is None else min(floor, upper))

    def bound_one_span(self) -> None:
        """The whole model with the incumbent's worst device's span as the
        objective, within `options.span_bound`: every valid schedule has at
        least the bound it proves on that span, so weight * bound (at most the
        incumbent's) bounds the problem, and the span floors the later models.
        The model does not carry the incumbent's `z <= z* - 1`: asked only for
        better schedules, CP-SAT proves far less on the span (measured: at
        p=4, V-Half's memory, m=8, nothing in 2 units against the optimum
        without it)."""
        p = self.problem
        device = 0
        if self.best is not None:
            scored = [w * span for w, span in zip(self.weight, self.best.spans, strict=True)]
            device = scored.index(max(scored))
        model = _Model(
            p, self.options.objective, self.scaled, None,
            memory_edges=True, span_floors=self.span_floors,
        )
        if self.orders is not None:
            times = _fifo_times(p, self.orders, self.scaled)
            if times is not None:
                model.hint(times)
        model.model.minimize(model.last[device] - model.first[device])
        name, solver = self.run_solver(model, self.options.span_bound, callback=False)
        upper = self.upper
        if name == "INFEASIBLE":  # no schedule at all fits the budgets
            self.infeasible = True
            return
        if name in ("OPTIMAL", "FEASIBLE"):
            # the solution is a schedule of the problem (any objective): keep it if better
            if self.offer(model.orders(solver.value)):
                self.from_hint = False
        span = int(math.ceil(solver.best_objective_bound - 1e-9))
        floors = self.span_floors or [0] * p.num_devices
        floors[device] = max(floors[device], span)
        self.span_floors = floors
        if self.options.objective == "bubble":
            floor = self.weight[device] * span
            self.bound_z = max(self.bound_z, floor if upper is None else min(floor, upper))

    # the objective variable z and the problem's terms
    def value_of(self, z: int) -> Fraction:
        if self.options.objective == "bubble":
            return Fraction(max(z - self.lcm, 0), z) if z > 0 else Fraction(0)
        return Fraction(z, self.scale)

    @property
    def upper(self) -> int | None:
        return None if self.best is None else _z_of(self.options.objective, self.weight, self.best)

    def report(self, fraction: float | None = None) -> None:
        if self.progress is None:
            return
        if fraction is None:
            fraction = self.spent / max(self.options.effort, 1e-9)
        upper = self.upper
        self.progress(
            None if upper is None else self.value_of(upper),
            self.value_of(self.bound_z),
            min(1.0, fraction),
        )

    def offer(self, orders) -> bool:
        """Keep `orders` if they run, fit the budgets and beat the incumbent."""
        measured = _measure(self.problem, orders, self.scaled, self.options.objective)
        if measured is None or not _peaks_fit(self.problem, orders, _memory_scale(self.problem)):
            return False
        if self.best is not None and measured.value >= self.best.value:
            return False
        self.best, self.orders = measured, tuple(tuple(o) for o in orders)
        return True

    def remaining_time(self) -> float | None:
        if self.options.time_cap is None:
            return None
        return self.options.time_cap - (time.monotonic() - self.begin)

    def run_solver(self, model: _Model, effort: float, callback: bool):
        """Solve `model` within `effort` (and the wall-clock cap); returns
        (status name, solver)."""
        from ortools.sat.python import cp_model

        solver = cp_model.CpSolver()
        params = solver.parameters
        params.num_workers = max(1, self.options.workers)
        if self.options.workers > 1:
            params.interleave_search = True
        params.max_deterministic_time = max(effort, 1e-3)
        params.random_seed = self.options.seed
        left = self.remaining_time()
        if left is not None:
            params.max_time_in_seconds = max(left, 1e-3)
        run = self
        spent_before = self.spent

        class _Callback(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(self) -> None:
                if run.progress is not None:
                    done = (spent_before + self.deterministic_time) / max(run.options.effort, 1e-9)
                    run.progress(
                        run.value_of(int(round(self.objective_value))),
                        run.value_of(run.bound_z),
                        min(1.0, done),
                    )

        def on_bound(value: float) -> None:
            # a bound of the model asking for better than the incumbent: with the
            # incumbent, min(upper, bound) bounds the problem
            lower = int(math.ceil(value - 1e-9))
            upper = run.upper
            run.bound_z = max(run.bound_z, lower if upper is None else min(lower, upper))
            run.report()

        use_callbacks = callback and self.progress is not None
        if use_callbacks:
            solver.best_bound_callback = on_bound
        status = solver.solve(model.model, _Callback() if use_callbacks else None)
        det = float(solver.response_proto.deterministic_time)
        self.spent += det
        name = solver.status_name(status)
        if left is not None and name not in ("OPTIMAL", "INFEASIBLE") and det < 0.99 * effort:
            self.capped = True
        return name, solver

    def absorb(self, model: _Model, name: str, solver, full: bool) -> None:
        """Take a solve's solution and, from the full model, its bound."""
        upper = self.upper
        if name in ("OPTIMAL", "FEASIBLE"):
            if self.offer(model.orders(solver.value)):
                self.from_hint = False
        if not full:
            return
        if name == "INFEASIBLE":
            if upper is None:
                self.infeasible = True
            else:  # nothing strictly better than the incumbent exists
                self.bound_z = max(self.bound_z, upper)
        elif name == "OPTIMAL":
            z = int(round(solver.objective_value))
            self.bound_z = max(self.bound_z, z if upper is None else min(z, upper))
        else:
            lower = int(math.ceil(solver.best_objective_bound - 1e-9))
            self.bound_z = max(self.bound_z, lower if upper is None else min(lower, upper))

    def proven(self) -> bool:
        upper = self.upper
        return self.infeasible or (upper is not None and self.bound_z >= upper)

    def out_of_time(self) -> bool:
        left = self.remaining_time()
        if left is not None and left <= 0:
            self.capped = True
        return self.capped


_LNS_WINDOWS = 7
"""Large-neighbourhood steps slide a window of a quarter of the timeline by an
eighth: seven windows cover it."""


def _full(run: _Run, effort: float) -> None:
    """The whole model (bound, proof, and better schedules if any)."""
    model = run.model()
    if run.orders is not None:
        times = _fifo_times(run.problem, run.orders, run.scaled)
        if times is not None:
            model.hint(times)
    name, solver = run.run_solver(model, effort, callback=True)
    run.absorb(model, name, solver, full=True)
    run.report()


def _neighbourhoods(run: _Run, effort: float) -> None:
    """Large-neighbourhood search: keep every device's order outside one time
    window of the incumbent, let the solver rearrange the passes inside it for
    a strictly better objective; slide the window until a whole sweep finds
    nothing or the effort is spent. Deterministic: the windows, the order of
    steps and each step's budget depend on the incumbent alone."""
    step = max(0.25, min(2.0, effort / (2 * _LNS_WINDOWS)))
    stop_at = run.spent + effort
    idle = 0
    window = 0
    while idle < _LNS_WINDOWS and run.spent + step <= stop_at + 1e-9 and not run.out_of_time():
        times = _fifo_times(run.problem, run.orders, run.scaled)
        if times is None:  # pragma: no cover - the incumbent always runs
            return
        orders = _fifo_orders(run.problem, times)
        run.offer(orders)  # the FIFO relabelling, kept if it happens to be better
        model = run.model()
        times = _fifo_times(run.problem, run.orders, run.scaled)
        assert times is not None
        model.hint(times)
        horizon = max(t + int(model.duration[model.index[k]]) for k, t in times.items())
        low = horizon * window // 8
        high = horizon * (window + 2) // 8 + 1
        for order in _fifo_orders(run.problem, times):
            kept = [q for q in order if not low <= times[q.key] < high]
            for a, b in zip(kept, kept[1:], strict=False):
                ia, ib = model.index[a.key], model.index[b.key]
                model.model.add(model.start[ib] >= model.start[ia] + int(model.duration[ia]))
        name, solver = run.run_solver(model, step, callback=False)
        before = run.best
        run.absorb(model, name, solver, full=False)
        idle = 0 if run.best is not before else idle + 1
        window = (window + 1) % _LNS_WINDOWS
        run.report()


def solve(
    problem: ExactProblem,
    options: ExactOptions,
    *,
    hint: Sequence[Sequence[Pass]] | None = None,
    progress: Progress | None = None,
) -> ExactResult:
    """Solve `problem` under `options`, starting from the orders `hint` (kept
    as the answer when the solver finds nothing better).

    Three steps share the effort (after the one-device bounds, when
    `options.device_bounds` asks for them): the whole model for a quarter (the lower
    bound, and often the proof); if the gap is open and there is an
    incumbent, large-neighbourhood steps for up to half; the whole model again
    for the rest, from the improved incumbent."""
    if options.objective not in OBJECTIVES:
        raise ValueError(f"objective {options.objective!r}: use bubble or makespan")
    begin = time.monotonic()
    scale, exact = time_scale(problem)
    scaled = _scaled_costs(problem, scale)
    lcm, weight = _weights(problem, scaled, options.objective)
    run = _Run(problem, options, scaled, scale, weight, progress, begin)
    if hint is not None:
        run.offer(hint)
    run.report(0.0)
    effort = float(options.effort)
    if options.device_bounds > 0:
        run.bound_devices()
        run.report()
        effort = max(effort - run.spent, 1e-3)
    if options.span_bound > 0 and not run.proven():
        run.bound_one_span()
        run.report()
        effort = max(float(options.effort) - run.spent, 1e-3)
    if not run.proven():
        _full(run, effort / 4 if run.best is not None else effort)
    if not run.proven() and run.best is not None and not run.out_of_time():
        _neighbourhoods(run, effort / 2)
        rest = float(options.effort) - run.spent
        if rest > 0 and not run.proven() and not run.out_of_time():
            _full(run, rest)
    wall = time.monotonic() - begin
    if run.infeasible:
        return ExactResult(
            None, None, Fraction(0), False, "infeasible", options.objective, run.spent, wall,
            run.capped, scale, exact, False,
        )
    value = None
    if run.best is not None:
        value = run.best.value if options.objective == "bubble" else run.best.value / scale
    bound = run.value_of(run.bound_z)
    if value is not None and value < bound:  # pragma: no cover - a wrong model
        raise AssertionError(
            f"the exact model's bound {bound} is above a valid schedule's {value}: a bug in ppdsl"
        )
    optimal = value is not None and value <= bound
    status = "optimal" if optimal else ("feasible" if value is not None else "unknown")
    if progress is not None:
        progress(value, bound, 1.0)
    return ExactResult(
        run.orders, value, bound, optimal, status, options.objective, run.spent, wall,
        run.capped, scale, exact, run.from_hint,
    )


def _z_of(objective: str, weight: list[int], measured: _Measure) -> int:
    """The model's objective variable for a measured timing (its upper bound)."""
    if objective == "makespan":
        return measured.makespan
    return max(w * span for w, span in zip(weight, measured.spans, strict=True))
