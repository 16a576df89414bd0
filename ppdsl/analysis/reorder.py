"""An order chosen per step: which microbatch of a step runs in which of the
schedule's microbatch slots, chosen to shorten the simulated step under the
memory bound (issue 38). Torch-free: the runtime calls it once per step with
the plan it already holds (`CompiledPipeline.plan`, or the manifest's).

The schedule's passes name microbatch *slots* 0..m-1. A permutation only says
which of the step's microbatches fills which slot; the per-device orders, the
dependencies between passes and the lowered programs' sends and receives are
those of the slots, so what the compiler proved of them (every pass once,
dependencies respected, no collision, no deadlock) holds for every
permutation unchanged (docs/language.md, "Proofs for any lengths"). What the
lengths change is each pass's duration and each microbatch's memory: the
step's time, which the search minimises, and the byte peak per rank, which is
computed exactly again for the permutation returned and checked against
`memory_limit`.

    choice = choose_order(runner.plan, lengths)      # lengths[j]: microbatch j's tokens
    slot_of = choice.permutation                     # microbatch j runs in slot slot_of[j]

`simulate(plan, lengths)` is the predicted step with microbatch j in slot j.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from ppdsl import semantics
from ppdsl.analysis import simulate as _simulate
from ppdsl.analysis.executor import missing_needs, pass_needs
from ppdsl.analysis.memory import check_lengths, peak_memory_at
from ppdsl.backend.plan import Plan
from ppdsl.ir.flat import FlatSchedule, flatten
from ppdsl.ir.schedule import MEMORY_NAMES, Schedule
from ppdsl.jit import kernel
from ppdsl.semantics import KINDS, NEED_KIND, NEED_OPTIONAL, NEED_STAGE_OFFSET

__all__ = ["Reorder", "ReorderError", "choose_order", "simulate", "slot_lengths",
           "as_schedule"]


class ReorderError(ValueError):
    """No order of the step's microbatches keeps every rank within the memory
    limit (the message names the rank, the lengths and the bound)."""


@dataclass(frozen=True)
class Reorder:
    """The order chosen for one step."""

    permutation: tuple[int, ...]
    """permutation[j]: the schedule's microbatch slot that the step's
    microbatch j runs in (its inverse, slot k -> microbatch, is `inverse`)."""
    predicted: float
    """The simulated step under this order (the cost file's unit)."""
    bound: tuple[Fraction, ...]
    """Per rank, the exact peak activation memory under these lengths and this
    order (the memory model's unit: bytes for a profiled costs file)."""
    proof: tuple[str, ...]
    """What was checked of this permutation, one line each."""
    baseline: float
    """The simulated step with microbatch j in slot j (no reordering)."""
    evaluated: int
    """How many orders the search simulated."""

    @property
    def inverse(self) -> tuple[int, ...]:
        """inverse[k]: the step's microbatch that runs in slot k."""
        inverse = [0] * len(self.permutation)
        for j, k in enumerate(self.permutation):
            inverse[k] = j
        return tuple(inverse)


def as_schedule(program: Any) -> Schedule:
    """The schedule of `program`: a `Schedule`, a `Plan`, or an object holding
    one (`CompiledPipeline.plan`, `compiler.Compiled.schedule`)."""
    if isinstance(program, Schedule):
        return program
    if isinstance(program, Plan):
        return program.schedule()
    for name in ("plan", "schedule"):
        inner = getattr(program, name, None)
        if isinstance(inner, Plan | Schedule):
            return as_schedule(inner)
    raise TypeError(f"expected a Plan, a Schedule or an object holding one, not "
                    f"{type(program).__name__}")


def slot_lengths(lengths: Sequence[int], permutation: Sequence[int]) -> list[int]:
    """The tokens of each slot when microbatch j (of `lengths[j]` tokens) runs
    in slot `permutation[j]`."""
    slots = [0] * len(lengths)
    for j, k in enumerate(permutation):
        slots[k] = int(lengths[j])
    return slots


def simulate(program: Any, lengths: Sequence[int]) -> float:
    """The predicted step (`Timeline.step_time`: the makespan unless the costs
    declare step costs) when microbatch j has `lengths[j]` tokens and runs in
    slot j, under the per-token costs."""
    return _simulate.simulate(as_schedule(program), lengths=list(lengths)).step_time


# one prepared search per program the runtime calls with (a step calls again
# with the same plan); a few kept, the oldest dropped
_PREPARED: dict[int, tuple[Any, _Search]] = {}
_KEEP = 4


def choose_order(
    program: Any,
    lengths: Sequence[int],
    *,
    memory_limit: float | Fraction | Sequence[float | Fraction] | None = None,
    time_budget_s: float = 0.05,
    seed: int = 0,
) -> Reorder:
    """The permutation of the step's microbatches (`lengths[j]`: microbatch j's
    tokens) that the search finds shortest under the simulated step, every
    rank's exact peak within `memory_limit` (one value, or one per rank, in
    the memory model's unit; None: no limit). A local search (pairwise swaps
    of slots, first improvement) seeded by the best of: as given,
    longest-first and shortest-first; it stops when no swap improves or
    most of `time_budget_s` has passed (the rest is for the exact check; the
    first call with a program also prepares it, and compiles the numba kernel
    once per machine). Which order it returns may depend on how far it got. Raises ReorderError when no order tried keeps
    within the limit, ValueError when `lengths` does not fit the program."""
    began = time.perf_counter()
    search = _search_for(program)
    schedule = search.schedule
    check_lengths(schedule, lengths)
    m = schedule.num_microbatches
    limits = _limits(memory_limit, schedule.num_devices)
    given = [int(x) for x in lengths]

    caps = np.array([np.inf] * schedule.num_devices if limits is None
                    else [float(x) for x in limits])

    def cost(order: Sequence[int]) -> float:
        step, fits = search.timed(np.array(slot_lengths(given, order), dtype=np.float64), caps)
        return step if fits else np.inf

    identity = list(range(m))
    if not schedule.costs.follows_tokens and not schedule.memory.follows_tokens:
        # every order times and peaks alike: nothing to choose
        step = cost(identity)
        if not np.isfinite(step):
            raise ReorderError(_over_limit(schedule, given, limits))
        return _proven(schedule, given, tuple(identity), step, step, 1, limits)
    longest = sorted(range(m), key=lambda j: (-given[j], j))
    shortest = sorted(range(m), key=lambda j: (given[j], j))
    seeds = [identity, _slots_of(longest), _slots_of(shortest)]
    scored = [(cost(p), n, p) for n, p in enumerate(seeds)]
    evaluated = len(scored)
    baseline = scored[0][0]
    best_cost, _, best = min(scored)
    best = list(best)
    pairs = [(a, b) for a, b in itertools.combinations(range(m), 2)]
    random.Random(seed).shuffle(pairs)
    # the exact check of the permutation returned takes the rest of the budget
    deadline = began + 0.8 * time_budget_s
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for a, b in pairs:
            # swapping two microbatches of one length changes nothing
            if given[best.index(a)] == given[best.index(b)]:
                continue
            trial = [b if k == a else a if k == b else k for k in best]
            c = cost(trial)
            evaluated += 1
            if c < best_cost:
                best_cost, best, improved = c, trial, True
            if time.perf_counter() >= deadline:
                break
    if not np.isfinite(best_cost):
        raise ReorderError(_over_limit(schedule, given, limits))
    return _proven(schedule, given, tuple(best), best_cost, baseline, evaluated, limits)


def _slots_of(by_rank: Sequence[int]) -> list[int]:
    """The permutation putting microbatch by_rank[k] into slot k."""
    slots = [0] * len(by_rank)
    for k, j in enumerate(by_rank):
        slots[j] = k
    return slots


def _limits(memory_limit: Any, num_devices: int) -> list[Fraction] | None:
    if memory_limit is None:
        return None
    if isinstance(memory_limit, int | float | Fraction):
        return [Fraction(memory_limit)] * num_devices
    values = [Fraction(x) for x in memory_limit]
    if len(values) != num_devices:
        raise ValueError(f"memory_limit: {len(values)} values for {num_devices} ranks")
    return values


def _over_limit(schedule: Schedule, lengths: list[int], limits: list[Fraction] | None) -> str:
    peaks = peak_memory_at(schedule, lengths)
    assert limits is not None
    over = [r for r, (p, cap) in enumerate(zip(peaks, limits, strict=True)) if p > cap]
    rank = over[0] if over else 0
    return (f"no order of the step's microbatches (lengths {lengths}) keeps every rank within "
            f"the memory limit: in the order given rank {rank} peaks at "
            f"{semantics.format_number(peaks[rank])} over its limit "
            f"{semantics.format_number(limits[rank])}")


def _proven(schedule: Schedule, lengths: list[int], permutation: tuple[int, ...],
            predicted: float, baseline: float, evaluated: int,
            limits: list[Fraction] | None) -> Reorder:
    """The chosen permutation, checked: a bijection of the slots (so every
    order proof holds), and its exact peaks within the limits."""
    m = schedule.num_microbatches
    if sorted(permutation) != list(range(m)):
        raise AssertionError(f"not a permutation of 0..{m - 1}: {permutation}")
    slots = slot_lengths(lengths, permutation)
    peaks = peak_memory_at(schedule, slots)
    proof = [
        f"a permutation of the {m} microbatch slots: the compile-time proofs of order, "
        "dependencies and deadlock hold unchanged (docs/language.md)",
        "exact per-rank peak under these lengths: "
        + ", ".join(semantics.format_number(p) for p in peaks),
    ]
    if limits is not None:
        over = [r for r, (p, cap) in enumerate(zip(peaks, limits, strict=True)) if p > cap]
        if over:
            raise AssertionError(f"rank {over[0]} over its limit after the search: {peaks}")
        proof.append("every rank within its limit: "
                     + ", ".join(semantics.format_number(x) for x in limits))
    return Reorder(permutation, float(predicted), peaks, tuple(proof), float(baseline), evaluated)


def _search_for(program: Any) -> _Search:
    key = id(program)
    held = _PREPARED.get(key)
    if held is not None and held[0] is program:
        return held[1]
    search = _Search(as_schedule(program))
    if len(_PREPARED) >= _KEEP:
        _PREPARED.pop(next(iter(_PREPARED)))
    _PREPARED[key] = (program, search)
    return search


class _Search:
    """One schedule prepared for timing many slot lengths. The passes are
    taken in one topological order of the device orders and the dependencies,
    found once: a pass's start depends only on passes before it, whatever the
    durations, so one sweep times any lengths (`_timed_step`; the same times,
    to the bit, as `executor.run_orders`, which sweeps the devices until none
    moves). Each pass's duration and memory delta are kept as coefficients of
    1, tokens and tokens^2."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        flat = flatten(schedule)
        if missing_needs(flat):
            raise ValueError("the program misses needed passes (run the checks first)")
        self.flat: FlatSchedule = flat
        costs = schedule.costs
        n = flat.size
        needs, _ = pass_needs(flat.kind, flat.microbatch, flat.stage, flat.index_table(),
                              flat.num_stages, flat.num_stages // flat.lanes, NEED_KIND,
                              NEED_STAGE_OFFSET, NEED_OPTIONAL)
        paired = np.zeros(n, dtype=np.bool_)
        consumer = np.repeat(flat.stage[:, None].astype(np.int64), needs.shape[1], axis=1)
        if flat.joined is not None:
            # an overlapped pair starts as one unit: its first pass waits for
            # the second's needs too (`run_orders`)
            second = np.flatnonzero(flat.joined[1:n]) + 1
            extra = np.full_like(needs, -1)
            extra[second - 1] = needs[second]
            needs = np.concatenate([needs, extra], axis=1)
            after = consumer.copy()
            after[second - 1] = consumer[second]
            consumer = np.concatenate([consumer, after], axis=1)
            paired = flat.joined[:n] | np.append(flat.joined[1:n], False)
        self._needs = np.ascontiguousarray(needs, dtype=np.int64)
        offsets = flat.offsets.astype(np.int64)
        self._prev = np.arange(n, dtype=np.int64) - 1
        self._prev[offsets[:-1][offsets[:-1] < offsets[1:]]] = -1
        self._device = flat.device.astype(np.int64)
        self._topo = _topological(self._prev, self._needs)
        self._microbatch = flat.microbatch.astype(np.int64)
        # per need, the cost of its transfer where it crosses devices: the edge
        # between the needed pass's stage and the stage that waits for it
        edges = np.append(costs.edge_costs(flat.num_stages), 0.0)
        edge = np.minimum(flat.stage.astype(np.int64)[np.maximum(needs, 0)], consumer)
        self._lag = np.ascontiguousarray(np.where(needs >= 0, edges[edge], 0.0))
        self._optimizer = np.zeros(schedule.num_devices)
        if costs.optimizer:
            for stage, device in enumerate(schedule.placement.stage_device):
                self._optimizer[device] += costs.optimizer[stage]
        # per flat pass, its duration's terms (`Costs.coefficients`) and factor
        self._time = np.ascontiguousarray(costs.coefficients()[:, flat.kind, flat.stage])
        self._factor = np.where(paired, costs.overlap, 1.0)
        self._paired = paired
        self._memory = np.ascontiguousarray(self._memory_terms(schedule, flat))
        self._offsets = offsets
        # compiled now (numba's cache: once per machine), not on some later step
        self._timed_step = _timed_step.eager()

    @staticmethod
    def _memory_terms(schedule: Schedule, flat: FlatSchedule) -> np.ndarray:
        mem = schedule.memory
        rows = np.zeros((3, len(KINDS), schedule.num_stages))
        for power in range(3):
            for k, kind in enumerate(KINDS):
                for s in range(schedule.num_stages):
                    amounts: dict[str, Fraction]
                    if mem.tokens:
                        amounts = {n: row[s][power] for n, row in zip(MEMORY_NAMES, mem.tokens,
                                                                       strict=True)}
                    elif power == 0:
                        amounts = {"M_B": mem.activation[s], "M_W": mem.weight_retained[s],
                                   "M_I": mem.kept(s) or Fraction(0)}
                    else:
                        continue
                    kept = amounts["M_I"] if mem.kept(s) is not None else None
                    rows[power, k, s] = float(semantics.memory_delta(
                        kind, amounts["M_B"], amounts["M_W"], kept))
        return rows[:, flat.kind, flat.stage]

    def timed(self, slots: np.ndarray, limits: np.ndarray) -> tuple[float, bool]:
        """(the simulated step, whether every rank's peak is within `limits`)
        when slot k has `slots[k]` tokens. The peaks are summed in floats,
        with a little room: the permutation returned is checked exactly."""
        costs = self.schedule.costs
        a, b, c, o = self._time
        last, fits = self._timed_step(
            self._topo, self._prev, self._needs, self._device, self._microbatch, slots,
            a, b, c, o, self._factor, self._paired, self._lag, costs.recv,
            self._optimizer,
            self._memory, self._offsets, limits,
        )
        if not costs.models_step:
            return float(last.max()) if last.size else 0.0, bool(fits)
        return semantics.step_time(last.tolist(), costs.norm), bool(fits)


def _topological(prev: np.ndarray, needs: np.ndarray) -> np.ndarray:
    """The passes in an order where each comes after its device predecessor
    and every pass it needs (Kahn's algorithm; the programs compiled, so the
    graph has no cycle)."""
    n = prev.shape[0]
    waits = (prev >= 0).astype(np.int64) + (needs >= 0).sum(axis=1)
    followers: list[list[int]] = [[] for _ in range(n)]
    for k, p in enumerate(prev.tolist()):
        if p >= 0:
            followers[p].append(k)
    for k, row in enumerate(needs.tolist()):
        for q in row:
            if q >= 0:
                followers[q].append(k)
    ready = [k for k in range(n) if waits[k] == 0]
    order: list[int] = []
    while ready:
        k = ready.pop()
        order.append(k)
        for f in followers[k]:
            waits[f] -= 1
            if waits[f] == 0:
                ready.append(f)
    if len(order) != n:
        raise ValueError("the program's orders wait on each other in a cycle")
    return np.array(order, dtype=np.int64)


@kernel
def _timed_step(
    topo, prev, needs, device, microbatch, slots, a, b, c, o, factor, paired, lag,
    recv, device_start, memory, offsets, limits,
):  # pragma: no cover - numba
    """Per device, the end of its last pass (its start where it has none), and
    whether every device's memory stays within `limits[dev]` (floats, room
    1e-9). The transfer rule of `executor.run_orders`: a pass starts at
    max(device free, each needed pass's end, plus its transfer `lag[k, slot]` and no earlier than
    `recv` after the device is free where that pass ran on another device)."""
    n = topo.shape[0]
    num_devices = offsets.shape[0] - 1
    end = np.zeros(n)
    for i in range(n):
        k = topo[i]
        dev = device[k]
        free = end[prev[k]] if prev[k] >= 0 else device_start[dev]
        ready = free
        for slot in range(needs.shape[1]):
            q = needs[k, slot]
            if q < 0:
                continue
            if device[q] != dev:
                ready = max(ready, end[q] + lag[k, slot], free + recv)
            else:
                ready = max(ready, end[q])
        t = slots[microbatch[k]]
        took = a[k] + b[k] * t + c[k] * t * t + o[k]
        if paired[k]:
            took = took * factor[k]
        end[k] = ready + took
    last = device_start.copy()
    fits = True
    for dev in range(num_devices):
        level = 0.0
        for k in range(offsets[dev], offsets[dev + 1]):
            last[dev] = max(last[dev], end[k])
            t = slots[microbatch[k]]
            level += memory[0, k] + memory[1, k] * t + memory[2, k] * t * t
            if level > limits[dev] * (1 + 1e-9):
                fits = False
    return last, fits
