"""The search itself: try building blocks and order-level heuristics, keep the
orders with the smallest bubble ratio (or makespan) within the memory budget.

Four stages, each reporting progress:
1. the building-block space (`blockspace`): every collision-free block, W by
   the fill rule;
2. a grid of order-level heuristics (`listsched`): B or F first, W policy,
   admission control, chunk priorities, in-flight caps;
3. randomised refinement: the best heuristic settings again with random
   priority perturbations, for half the evaluation budget;
4. local search on the best orders (`localsearch`) for the other half.

The budget is counted in evaluations, not seconds, and every random choice
comes from one seeded generator, so the same problem, budget and seed give the
same orders on every machine. `time_cap` only stops early where asked; the
result then says it depends on the machine's speed.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ppdsl.frontend.blocks import tighten_warm_up_and_cool_down
from ppdsl.ir.flat import flat_arrays
from ppdsl.ir.schedule import Pass
from ppdsl.search.blockspace import BlockShape, block_orders, enumerate_blocks, named_blocks
from ppdsl.search.evaluate import Metrics, evaluate_orders
from ppdsl.search.listsched import list_schedule
from ppdsl.search.localsearch import polish
from ppdsl.search.problem import (
    SearchInputError,
    SearchProblem,
    recompute_headroom,
    smallest_budget,
)
from ppdsl.semantics import KINDS, PassKind, delta_table, need_arrays

_B, _R = PassKind.B.code, PassKind.R.code

_NEEDS = need_arrays(with_optional=False)[:3]
"""The dependency arrays for list scheduling: the search places F, B, W and
BW only, never a recompute pass R, so R's optional needs are left out."""

__all__ = [
    "Arrays",
    "Candidate",
    "SearchResult",
    "search",
    "arrays_for",
    "with_recompute_passes",
    "evaluate_passes",
    "DEFAULT_EVALUATIONS",
]

DEFAULT_EVALUATIONS = 20_000
"""Refinement and local-search evaluations of `ppdsl search` (half each): a
few seconds on one core at d=8, m=24."""

@dataclass(frozen=True, eq=False)
class Arrays:
    """The problem as the kernels want it, indexed by `PassKind.code`: `dur[kind,
    stage]` the costs, `mem[kind, stage] / scale` the memory delta in M_B
    (`semantics.delta_table`), `limit` the budget in the same scale."""

    dev_stages: np.ndarray
    stage_device: np.ndarray
    dur: np.ndarray
    comm: np.ndarray
    """Per edge b, a transfer between stages b and b + 1 (`Costs.edge_costs`)."""
    mem: np.ndarray
    scale: int
    limit: int
    lanes: int = 1
    """The placement's pipelines (`Placement.lanes`: DualPipe's 2)."""


def arrays_for(problem: SearchProblem, fused: bool = True) -> Arrays:
    """The kernels' arrays. A stage marked `recompute` is searched with its R
    folded into its B (`fused`): B lasts T_R + T_B and changes memory by M_W −
    M_I, F keeps M_I, and the budget shrinks by `recompute_headroom` so that the
    orders with R put back right before each B (`with_recompute_passes`) fit;
    `fused=False`: the real table (R its own pass), to measure those orders."""
    pl, mm, c = problem.placement, problem.memory, problem.costs
    d = pl.num_devices
    dev_stages = np.array([pl.chunks(dev) for dev in range(d)], dtype=np.int64)
    stage_device = np.array(pl.stage_device, dtype=np.int64)
    dur = np.array(c.duration_table(), dtype=np.float64)  # with each pass's overhead
    headroom = recompute_headroom(mm)
    mem, scale = delta_table(
        mm.activation, mm.weight_retained, also=(problem.budget, headroom),
        kept_input=mm.kept_input,
    )
    limit = int(problem.budget * scale)
    if fused and mm.recompute:
        mem, dur = mem.copy(), dur.copy()
        for s in mm.recompute:
            mem[_B, s] += mem[_R, s]
            dur[_B, s] += dur[_R, s]
        limit -= int(headroom * scale)
    return Arrays(dev_stages, stage_device, dur, c.edge_costs(pl.num_stages), mem, scale, limit,
                  pl.lanes)


def with_recompute_passes(
    orders: Sequence[Sequence[Pass]], recompute: frozenset[int]
) -> tuple[tuple[Pass, ...], ...]:
    """The search's orders (R folded into B) with each recomputed stage's R(j, s)
    put back right before its B(j, s)."""
    if not recompute:
        return tuple(tuple(o) for o in orders)
    out = []
    for order in orders:
        row: list[Pass] = []
        for p in order:
            if p.kind is PassKind.B and p.stage in recompute:
                row.append(Pass(PassKind.R, p.microbatch, p.stage))
            row.append(p)
        out.append(tuple(row))
    return tuple(out)


@dataclass(frozen=True)
class Candidate:
    """One set of per-device orders and what it achieves."""

    offsets: np.ndarray
    kind: np.ndarray
    microbatch: np.ndarray
    stage: np.ndarray
    metrics: Metrics
    method: str
    """How it was found, in words (goes into the .pp header)."""
    block: BlockShape | None = None

    def orders(self) -> tuple[tuple[Pass, ...], ...]:
        out = []
        for dev in range(len(self.offsets) - 1):
            a, b = self.offsets[dev], self.offsets[dev + 1]
            out.append(
                tuple(
                    Pass(KINDS[k], int(j), int(s))
                    for k, j, s in zip(
                        self.kind[a:b], self.microbatch[a:b], self.stage[a:b], strict=True
                    )
                )
            )
        return tuple(out)


@dataclass(frozen=True)
class SearchResult:
    """The best candidate and the search's bookkeeping."""

    best: Candidate
    problem: SearchProblem
    arrays: Arrays
    tried: int
    """Candidates evaluated, sweeps included."""
    seconds: float
    """Wall-clock time taken (reported, never used to decide anything)."""
    capped: bool = False
    """`time_cap` stopped the refinement or the local search before their
    evaluation budget: the result depends on the machine."""

    def peak_memory(self) -> tuple[Fraction, ...]:
        return tuple(Fraction(int(x), self.arrays.scale) for x in self.best.metrics.peak)


def evaluate_passes(problem: SearchProblem, arrays: Arrays, orders) -> Metrics:
    """Metrics of orders given as Pass tuples (for references and tests)."""
    offsets, kind, mb, st = flat_arrays(orders)
    return evaluate_orders(
        offsets,
        kind,
        mb,
        st,
        arrays.stage_device,
        arrays.dur,
        arrays.comm,
        arrays.mem,
        problem.num_microbatches,
        arrays.lanes,
    )


def metrics_key(x: Metrics, objective: str = "bubble") -> tuple[float, float, int]:
    """What `search` minimises: bubble then makespan (or makespan then bubble),
    then the peak; rounded so float noise never decides."""
    bubble, makespan = round(x.bubble, 12), round(x.makespan, 9)
    first = (makespan, bubble) if objective == "makespan" else (bubble, makespan)
    return (*first, int(x.peak.max()))


class _Search:
    def __init__(
        self,
        problem: SearchProblem,
        progress: Callable[[str, float], None] | None,
        objective: str = "bubble",
        deadline: float | None = None,
    ):
        self.problem = problem
        self.objective = objective
        self.deadline = deadline
        self.capped = False
        self.arrays = arrays_for(problem)
        self.progress = progress or (lambda stage, fraction: None)
        self.best: Candidate | None = None
        self.tried = 0
        a = self.arrays
        S, m = problem.num_stages, problem.num_microbatches
        self.no_noise = np.zeros((2, S, m))
        d = problem.num_devices
        self.limits = np.full(d, a.limit, dtype=np.int64)

    def consider(self, offsets, kind, mb, stage, ok, method, block=None) -> Metrics | None:
        self.tried += 1
        if not ok:
            return None
        a = self.arrays
        metrics = evaluate_orders(
            offsets,
            kind,
            mb,
            stage,
            a.stage_device,
            a.dur,
            a.comm,
            a.mem,
            self.problem.num_microbatches,
            a.lanes,
        )
        if not metrics.ok:  # the orders wait on each other in a cycle
            return None
        if int(metrics.peak.max()) > a.limit:
            return None
        if self._better(metrics, self.best.metrics if self.best else None):
            self.best = Candidate(offsets, kind, mb, stage, metrics, method, block)
        return metrics

    def _better(self, a: Metrics, b: Metrics | None) -> bool:
        return b is None or metrics_key(a, self.objective) < metrics_key(b, self.objective)

    def _out_of_time(self) -> bool:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.capped = True
        return self.capped

    # 1. building blocks
    def blocks(self) -> None:
        """Every block of the swept space and the placement's hand-made blocks,
        repeated with W in the free slots; then, on the best of them, the
        controllable-memory paper's last step (ppdsl.frontend.blocks: early forwards in the
        warm-up, B before W in the cool-down; never above the block's peak). None on
        a placement of several lanes (DualPipe): a block runs each microbatch through
        every stage (docs/language.md)."""
        p = self.problem
        if p.placement.lanes > 1:
            return
        named = named_blocks(p.placement)
        shapes = [(shape, f" ({name})") for name, shape in named.items()]
        seen = set(named.values())
        shapes += [(shape, "") for shape in enumerate_blocks(p.placement) if shape not in seen]
        scored = []
        for n, (shape, name) in enumerate(shapes):
            if n % 16 == 0:
                self.progress("building blocks", 0.8 * n / len(shapes))
            orders = block_orders(p.placement, shape, p.num_microbatches)
            if orders is None:
                continue
            text = f"building block{name} {_shape_text(shape)}, W fill"
            metrics = self.consider(*orders, True, text, shape)
            if metrics is not None:
                scored.append((metrics.bubble, metrics.makespan, n, shape, text, orders))
        scored.sort(key=lambda x: x[:3])
        best = scored[:_TIGHTENED]
        for n, (_, _, _, shape, text, orders) in enumerate(best):
            self.progress("building blocks", 0.8 + 0.2 * n / len(best))
            plain = Candidate(*orders, None, text).orders()  # type: ignore[arg-type]
            tight = tighten_warm_up_and_cool_down(plain, p.placement, p.costs)
            if tight != plain:
                flat = flat_arrays(tight)
                self.consider(*flat, True, text + ", warm-up and cool-down tightened", shape)
        self.progress("building blocks", 1.0)

    def _caps(self, alpha: float) -> np.ndarray:
        """In-flight cap per stage: alpha x (time from F(s) to B(s) on the
        critical path) / (the device's F+B time per microbatch)."""
        p, a = self.problem, self.arrays
        S = p.num_stages
        length = S // a.lanes
        caps = np.zeros(S, dtype=np.int64)
        for s in range(S):
            end = (s // length + 1) * length  # the end of s's lane
            path = a.dur[0, s:end].sum() + a.dur[1, s:end].sum() + 2 * a.comm[s:end - 1].sum()
            dev = a.stage_device[s]
            per = sum(a.dur[0, x] + a.dur[1, x] for x in a.dev_stages[dev])
            caps[s] = max(1, math.ceil(alpha * path / per - 1e-9))
        return np.minimum(caps, p.num_microbatches + 1)

    def grid(self) -> list[tuple[float, np.ndarray, float]]:
        a, p = self.arrays, self.problem
        v = p.chunks_per_device
        settings = list(
            itertools.product(
                (1, 0),  # b_first
                (0, 1, 2),  # w_mode
                # admission: strict, or a slack of 2 or 5 F; with lanes (DualPipe):
                # room kept for the first lane's next microbatch, or not
                (0, 1, 3, 6) if v > 1 and p.placement.lanes == 1 else (0, 1) if v > 1 else (0,),
                (0, 1) if v > 1 else (0,),  # f_priority
                (0, 1) if v > 1 else (0,),  # b_priority
                (0.75, 1.0, 1.5, 2.0, 3.0, 1e9),  # in-flight cap factor
                (1, 0),  # prefer_pair
                (2, 1, 0),  # gated: wait at a send until the receiver reaches its
                # consumer (2: the wait costs no time, as in ppdsl's timing)
            )
        )
        scored = []
        for n, (bf, wm, adm, fp, bp, alpha, pair, gated) in enumerate(settings):
            if n % 8 == 0:
                self.progress("heuristics", n / len(settings))
            params = np.array(
                [bf, wm, adm, fp, bp, pair, min(gated, 1), int(gated == 1)], dtype=np.int64
            )
            caps = self._caps(alpha)
            out = list_schedule(
                a.dev_stages,
                a.stage_device,
                p.num_microbatches,
                a.dur,
                a.comm,
                a.mem,
                self.limits,
                caps,
                params,
                self.no_noise,
                *_NEEDS,
                a.lanes,
            )
            method = (
                f"list scheduling ({'B' if bf else 'F'} first, W {_W_TEXT[wm]}"
                f"{', admission control' if adm else ''}, in-flight cap x{alpha:g}"
                f"{', sends wait for their receiver' if gated else ''})"
            )
            metrics = self.consider(*out, method)  # type: ignore[call-arg]
            if metrics is not None:
                scored.append((metrics.bubble, params, alpha))
        self.progress("heuristics", 1.0)
        scored.sort(key=lambda x: x[0])
        return scored

    def refine(self, scored, tries: int, seed: int) -> None:
        """`tries` runs of the best grid settings with seeded random noise."""
        a, p = self.arrays, self.problem
        if not scored:
            return
        rng = np.random.default_rng(seed)
        top = scored[: min(6, len(scored))]
        S, m = p.num_stages, p.num_microbatches
        n = 0
        while n < tries and not self._out_of_time():
            _, params, alpha = top[n % len(top)]
            scale = rng.choice((0.3, 1.0, 3.0))
            noise = rng.random((2, S, m)) * scale
            caps = self._caps(alpha * rng.choice((0.9, 1.0, 1.1)))
            out = list_schedule(
                a.dev_stages,
                a.stage_device,
                m,
                a.dur,
                a.comm,
                a.mem,
                self.limits,
                caps,
                params,
                noise,
                *_NEEDS,
                a.lanes,
            )
            self.consider(*out, f"randomised list scheduling (seed {seed}, try {n})")  # type: ignore[call-arg]
            n += 1
            if n % 32 == 0:
                self.progress("refining", n / tries)
        self.progress("refining", 1.0)

    def polish(self, moves: int, seed: int) -> None:
        """`moves` seeded one-pass moves on the best orders."""
        if self.best is None:
            return
        c = self.best
        kind, mb, stage, metrics, tries, capped = polish(
            c.offsets,
            c.kind,
            c.microbatch,
            c.stage,
            c.metrics,
            self.arrays,
            self.problem.num_microbatches,
            moves,
            seed,
            lambda fraction: self.progress("local search", fraction),
            objective=self.objective,
            deadline=self.deadline,
        )
        self.capped = self.capped or capped
        self.tried += tries
        if metrics_key(metrics, self.objective)[:2] < metrics_key(c.metrics, self.objective)[:2]:
            self.best = Candidate(
                c.offsets,
                kind,
                mb,
                stage,
                metrics,
                f"{c.method}, then local search (moves of one pass)",
            )
        self.progress("local search", 1.0)


_W_TEXT = {0: "fills every gap", 1: "fills gaps >= T_W", 2: "right after B"}


_TIGHTENED = 32
"""How many of the best blocks get the warm-up/cool-down step (a Python pass).
Under a tight budget few blocks fit and all of them get it: the best after the
step can be far down the list before it (V-Min's memory at d=8: 26 fit, and the
best, 0.1933 at m=16, is 0.3725 before)."""


def _shape_text(shape: BlockShape) -> str:
    head = (
        f", step {shape.head_offset} across the first {shape.head} devices" if shape.head else ""
    )
    return (
        f"(F offsets {list(shape.f_offset)}, turn {shape.f_turn}, gap {shape.gap}, "
        f"B offsets {list(shape.b_offset)}, turn {shape.b_turn}, period {shape.period}{head})"
    )


def search(
    problem: SearchProblem,
    *,
    evaluations: int = DEFAULT_EVALUATIONS,
    seed: int = 0,
    objective: str = "bubble",
    time_cap: float | None = None,
    progress: Callable[[str, float], None] | None = None,
    seeds: Sequence[tuple[Sequence[Sequence[Pass]], str]] = (),
) -> SearchResult:
    """Find the orders with the smallest bubble (`objective="makespan"`: the
    smallest makespan) within `problem.budget`. The blocks and the grid always
    run; `evaluations` more go half to the randomised refinement, half to the
    local search, drawn from `seed`: the same arguments give the same orders on
    every machine. `time_cap` (seconds) stops them early and marks the result
    `capped`. `seeds` are more candidates, (orders, how they were found),
    weighed beside the blocks (a frontier hands each budget the best orders of
    the budget below it). Raises SearchInputError, naming the smallest budget
    any tried schedule needs, when nothing fits."""
    begin = time.monotonic()
    deadline = None if time_cap is None else begin + time_cap
    run = _Search(problem, progress, objective, deadline)
    run.blocks()
    for orders, method in seeds:
        run.consider(*flat_arrays(orders), True, method)
    scored = run.grid()
    run.refine(scored, evaluations // 2, seed)
    run.polish(evaluations - evaluations // 2, seed)
    if run.best is None:  # pragma: no cover - build_problem rejects budgets below the floor
        raise SearchInputError(
            f"no schedule found within {problem.budget} M_B per device; the smallest "
            f"feasible budget is {smallest_budget(problem.placement, problem.memory)} M_B"
        )
    return SearchResult(
        run.best, problem, run.arrays, run.tried, time.monotonic() - begin, run.capped
    )
