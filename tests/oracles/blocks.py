"""Block repetition before issue 13 (ppdsl/frontend/blocks.py as it was: the
warm-up/cool-down step as a Python event loop over Pass objects and dicts, the
compaction's first fit recomputing a device's prefix sums per pass, the
repetition sorted as Fraction tuples), kept as the oracle of the array version
(tests/frontend/test_blocks_arrays.py)."""

from __future__ import annotations

from collections import deque
from fractions import Fraction

import numpy as np

from ppdsl.ir.schedule import Block, BlockSlot, Costs, Pass, PassKind, Placement
from ppdsl.semantics import memory_delta, needs

__all__ = ["repeat_block", "timed_slots", "fill_timeline", "tighten_warm_up_and_cool_down"]

_F, _B, _W, _BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW


def repeat_block(
    block: Block,
    placement: Placement,
    num_microbatches: int,
    *,
    split_backward: bool,
    w_fill: bool,
    costs: Costs,
    recompute: frozenset[int] = frozenset(),
) -> tuple[tuple[Pass, ...], ...]:
    """Per-device pass orders of `block` repeated for `num_microbatches`
    microbatches. Every Pass carries the span of the block line that made it; a
    W placed by `w_fill` carries the span of its B's line. `recompute`: the
    stages marked `recompute` (their B waits for their R)."""
    if w_fill and not split_backward:
        raise ValueError("W fill needs a split backward (F, B, W)")
    timed = timed_slots(block, placement, num_microbatches)
    if w_fill:
        orders = _fill_w(timed, costs)
    else:
        orders = tuple(
            tuple(Pass(s.kind, j, s.stage, s.span) for _, _, j, s in device_slots)
            for device_slots in timed
        )
    return tighten_warm_up_and_cool_down(orders, placement, costs, recompute)


def timed_slots(
    block: Block, placement: Placement, num_microbatches: int
) -> list[list[tuple[Fraction, int, int, BlockSlot]]]:
    """Per device, (start, slot index, microbatch, slot) of every slot repeated
    for `num_microbatches` microbatches (microbatch j shifted by
    `block.shift(j)`), sorted by start, then slot position, then microbatch
    (the plain repetition's order)."""
    shifts = [block.shift(j) for j in range(num_microbatches)]
    timed: list[list[tuple[Fraction, int, int, BlockSlot]]] = [
        [] for _ in range(placement.num_devices)
    ]
    for index, slot in enumerate(block.slots):
        start = Fraction(slot.start)
        for j, shift in enumerate(shifts):
            timed[slot.device].append((start + shift, index, j, slot))
    for device_slots in timed:
        device_slots.sort(key=lambda t: (t[0], t[1], t[2]))
    return timed


def _fill_w(
    timed: list[list[tuple[Fraction, int, int, BlockSlot]]], costs: Costs
) -> tuple[tuple[Pass, ...], ...]:
    """Insert every W into the repeated block's timeline (`fill_timeline`)."""
    return tuple(tuple(p for _, p in row) for row in fill_timeline(timed, costs))


def fill_timeline(
    timed: list[list[tuple[Fraction, int, int, BlockSlot]]], costs: Costs
) -> tuple[tuple[tuple[Fraction, Pass], ...], ...]:
    """Per device, (start, pass) of the repeated block with every W inserted, in
    order: a W becomes pending when its B ends; the oldest pending W starts
    whenever the device is free before its next F/B slot's start (a W that runs
    over that start delays the slot); the rest run at the end. `timed` holds per
    device (start, slot index, microbatch, slot) sorted by start."""
    rows = []
    for device_slots in timed:
        row: list[tuple[Fraction, Pass]] = []
        pending: deque[tuple[Fraction, Pass]] = deque()
        free: Fraction | None = None
        for start, _, j, slot in device_slots:
            if slot.kind is _W or slot.kind is _BW:
                raise ValueError(f"a W-fill block holds only F and B slots, not {slot.kind.value}")
            while pending and free is not None and free < start and pending[0][0] <= free:
                _, w = pending.popleft()
                row.append((free, w))
                free += Fraction(costs.duration(_W, w.stage))
            free = max(start, free) if free is not None else start
            row.append((free, Pass(slot.kind, j, slot.stage, slot.span)))
            free += Fraction(slot.duration)
            if slot.kind is _B:
                pending.append((free, Pass(_W, j, slot.stage, slot.span)))
        for _, w in pending:
            assert free is not None
            row.append((free, w))
            free += Fraction(costs.duration(_W, w.stage))
        rows.append(tuple(row))
    return tuple(rows)


def tighten_warm_up_and_cool_down(
    orders: tuple[tuple[Pass, ...], ...],
    placement: Placement,
    costs: Costs,
    recompute: frozenset[int] = frozenset(),
) -> tuple[tuple[Pass, ...], ...]:
    """The orders with warm-up and cool-down tightened (module docstring), or
    the orders themselves when that would not help or would raise a peak.
    `recompute`: the stages marked `recompute`."""
    plain = _Run(orders, placement, costs, recompute, improve=False)
    if not plain.finished:
        return orders  # the dependency check reports why
    peaks = _peaks(orders, recompute)

    def acceptable(run: _Run) -> bool:
        return (
            run.finished
            and run.makespan <= plain.makespan
            and run.worst_idle <= plain.worst_idle
            and (run.makespan, run.worst_idle) != (plain.makespan, plain.worst_idle)
            and all(
                all(x <= y for x, y in zip(b, p, strict=True))
                for b, p in zip(_peaks(run.orders, recompute), peaks, strict=True)
            )
        )

    chosen: _Run | None = None
    for hoist_forwards in (True, False):
        better = _Run(
            orders, placement, costs, recompute, improve=True, hoist_forwards=hoist_forwards
        )
        if acceptable(better):
            chosen = better
            break
    # Compaction first, then the same step: kept only where strictly better.
    compact = _compact(orders, placement, costs, plain.ends, peaks, recompute)
    if compact is not None:
        for hoist_forwards in (True, False):
            better = _Run(
                compact, placement, costs, recompute, improve=True, hoist_forwards=hoist_forwards
            )
            best = chosen or plain
            if acceptable(better) and (better.worst_idle, better.makespan) < (
                best.worst_idle,
                best.makespan,
            ):
                chosen = better
    return chosen.orders if chosen is not None else orders


_CHANNELS = ((1, 1), (0, 1), (1, 0), (0, 0))
"""The extreme memory models `_peaks` counts in, as (M_W, M_I) in units of M_B:
W holding all of M_B or none of it; a recomputed stage's F keeping all of it or
none (M_I). The first counts an F as one microbatch-stage, as `_Run` does."""

_EXTREME_DELTAS = {
    (kind, recomputed): tuple(
        int(memory_delta(kind, Fraction(1), Fraction(w), Fraction(i) if recomputed else None))
        for w, i in _CHANNELS
    )
    for kind in PassKind
    for recomputed in (False, True)
}
"""A pass's memory change in microbatch-stages in each of `_CHANNELS`, on a
stage that keeps its activations (False) or recomputes them (True)."""


def _extreme_delta(kind: PassKind, stage: int, recompute: frozenset[int]) -> tuple[int, ...]:
    """A pass's memory change in microbatch-stages in each channel (whole numbers)."""
    return _EXTREME_DELTAS[(kind, stage in recompute)]


def _compact(
    orders: tuple[tuple[Pass, ...], ...],
    placement: Placement,
    costs: Costs,
    ends: dict[tuple[PassKind, int, int], float],
    peaks: list[tuple[Fraction, ...]],
    recompute: frozenset[int] = frozenset(),
) -> tuple[tuple[Pass, ...], ...] | None:
    """Compaction (the paper's reordering, done with the file's costs): every
    pass, in the order the plain repetition starts them, takes the earliest
    time on its device at which its inputs have arrived and the device is free
    (a gap before passes already placed, or after them) and at which the
    device's activation peak stays within the repetition's. None when some
    pass fits nowhere."""
    num_stages = placement.num_stages
    stage_device = placement.stage_device
    queue = sorted(
        (ends[p.key] - costs.duration(p.kind, p.stage), dev, k, p)
        for dev, order in enumerate(orders)
        for k, p in enumerate(order)
    )
    placed: list[list[tuple[float, float, Pass]]] = [[] for _ in orders]
    arrays = [_Placed(recompute) for _ in orders]
    end_of: dict[tuple[PassKind, int, int], float] = {}
    for _, dev, _, p in queue:
        ready = 0.0
        for key in needs(p.kind, p.microbatch, p.stage, num_stages, recompute=recompute):
            if key not in end_of:
                return None
            lag = costs.comm if stage_device[key[2]] != stage_device[p.stage] else 0.0
            ready = max(ready, end_of[key] + lag)
        duration = costs.duration(p.kind, p.stage)
        limit = tuple(int(x) for x in peaks[dev])
        at = arrays[dev].first_fit(ready, duration, _extreme_delta(p.kind, p.stage, recompute), limit)
        if at is None:
            return None
        index, start = at
        placed[dev].insert(index, (start, start + duration, p))
        arrays[dev].insert(index, start, start + duration, p.kind, p.stage)
        end_of[p.key] = start + duration
    return tuple(tuple(p for _, _, p in row) for row in placed)


def _first_fit(
    row: list[tuple[float, float, Pass]],
    ready: float,
    duration: float,
    delta: tuple[int, ...],
    limit: tuple[int, ...],
    recompute: frozenset[int] = frozenset(),
) -> tuple[int, float] | None:
    """(index, start) of the earliest place in `row` where a pass of
    `duration` fits from `ready` on without raising the peak over `limit`."""
    placed = _Placed(recompute)
    for k, (s, e, q) in enumerate(row):
        placed.insert(k, s, e, q.kind, q.stage)
    return placed.first_fit(ready, duration, delta, limit)


class _Placed:
    """A device's placed passes as arrays, in start order: starts, ends and each
    pass's deltas under every memory extreme (`_CHANNELS`)."""

    def __init__(self, recompute: frozenset[int] = frozenset()) -> None:
        self.recompute = recompute
        self.starts = np.zeros(0, dtype=np.float64)
        self.ends = np.zeros(0, dtype=np.float64)
        self.deltas = np.zeros((len(_CHANNELS), 0), dtype=np.int64)

    def insert(self, index: int, start: float, end: float, kind: PassKind, stage: int) -> None:
        def put(a: np.ndarray, value: float | int) -> np.ndarray:
            return np.concatenate((a[:index], np.array([value], dtype=a.dtype), a[index:]))

        self.starts = put(self.starts, start)
        self.ends = put(self.ends, end)
        extreme = np.array(_extreme_delta(kind, stage, self.recompute), dtype=np.int64)
        self.deltas = np.concatenate(
            (self.deltas[:, :index], extreme[:, None], self.deltas[:, index:]), axis=1
        )

    def first_fit(
        self, ready: float, duration: float, delta: tuple[int, ...], limit: tuple[int, ...]
    ) -> tuple[int, float] | None:
        """`_first_fit`, every place at once: the levels after each placed pass
        and their running maxima from both ends, for every memory extreme."""
        n = len(self.starts)
        fits = np.ones(n + 1, dtype=bool)
        for c in range(len(_CHANNELS)):
            levels = np.zeros(n + 1, dtype=np.int64)  # level after the first i passes
            np.cumsum(self.deltas[c], out=levels[1:])
            before = np.maximum.accumulate(levels)
            after = np.full(n + 1, -(10**9), dtype=np.int64)  # the highest level after i
            if n:
                after[:n] = np.maximum.accumulate(levels[:0:-1])[::-1]
            top = np.maximum(np.maximum(before, levels + delta[c]), after + delta[c])
            fits &= top <= limit[c]
        start = np.maximum(np.concatenate(([0.0], self.ends)), ready)
        following = np.concatenate((self.starts, [np.inf]))
        fits &= start + duration <= following + 1e-9
        found = np.flatnonzero(fits)
        if len(found) == 0:
            return None
        index = int(found[0])
        return index, float(start[index])


def _peaks(
    orders: tuple[tuple[Pass, ...], ...], recompute: frozenset[int] = frozenset()
) -> list[tuple[Fraction, ...]]:
    """Per device, the peak number of microbatch-stages holding activations in
    each of `_CHANNELS`: W releasing them (M_W = M_B) or B (M_W = 0); a
    recomputed stage's F holding them (M_I = M_B) or R (M_I = 0) (whole numbers:
    prefix sums of `_EXTREME_DELTAS`, never below 0)."""
    found = []
    for order in orders:
        deltas = np.array(
            [_extreme_delta(p.kind, p.stage, recompute) for p in order], dtype=np.int64
        ).reshape(len(order), len(_CHANNELS))
        tops = np.cumsum(deltas, axis=0).max(axis=0, initial=0)
        found.append(tuple(Fraction(int(x)) for x in tops))
    return found


class _Run:
    """The orders run in time, all devices together (see the module docstring).
    `improve=False` keeps every device to its order: that is the simulator's
    as-soon-as-possible timing."""

    def __init__(
        self,
        orders: tuple[tuple[Pass, ...], ...],
        placement: Placement,
        costs: Costs,
        recompute: frozenset[int],
        *,
        improve: bool,
        hoist_forwards: bool = True,
    ) -> None:
        self.stage_device = placement.stage_device
        self.num_stages = placement.num_stages
        self.costs = costs
        self.recompute = recompute
        # how far down its order a device looks for a pass to run early: far enough
        # for a V-shape warm-up, which hoists up to 2S forwards past 3 passes each
        self.window = 8 * placement.num_stages + 16
        self.ends: dict[tuple[PassKind, int, int], float] = {}
        n = len(orders)
        self.remaining = [list(o) for o in orders]
        self.head = [0] * n  # passes before head are taken; None marks a taken one
        forwards_left = [sum(1 for p in o if p.kind is _F) for o in orders]
        in_warm_up = [True] * n
        live = [0] * n
        allowed = [peaks[0] for peaks in _peaks(orders, recompute)]
        result: list[list[Pass]] = [[] for _ in orders]
        free = [0.0] * n
        first: list[float | None] = [None] * n
        busy = [0.0] * n
        self.finished = True
        while True:
            active = [dev for dev in range(n) if self.head[dev] < len(self.remaining[dev])]
            if not active:
                break
            now = min(free[dev] for dev in active)
            waiting = []
            progressed = False
            for dev in active:
                if free[dev] != now:
                    continue
                k = self._pick(
                    dev,
                    now,
                    improve=improve,
                    cool_down=forwards_left[dev] == 0,
                    hoist=improve
                    and hoist_forwards
                    and in_warm_up[dev]
                    and live[dev] < allowed[dev],
                )
                if k is None:
                    waiting.append(dev)
                    continue
                p = self._take(dev, k)
                duration = costs.duration(p.kind, p.stage)
                if first[dev] is None:
                    first[dev] = now
                free[dev] = now + duration
                busy[dev] += duration
                self.ends[p.key] = free[dev]
                result[dev].append(p)
                progressed = True
                if p.kind is _F:
                    forwards_left[dev] -= 1
                    live[dev] += 1
                elif p.kind in (_W, _BW):
                    live[dev] -= 1
                if p.kind in (_B, _BW):
                    in_warm_up[dev] = False
            if progressed:
                continue
            later = [free[dev] for dev in active if free[dev] > now]
            for dev in waiting:
                at = self._ready_at(self.remaining[dev][self.head[dev]])
                if at is not None and at > now:
                    later.append(at)
            if not later:
                self.finished = False
                break
            step = min(later)
            for dev in waiting:
                free[dev] = step
        self.orders = tuple(tuple(o) for o in result)
        self.makespan = max(free, default=0.0)
        self.worst_idle = max(
            (free[d] - (first[d] or 0.0) - busy[d] for d in range(n)), default=0.0
        )

    def _ready_at(self, p: Pass) -> float | None:
        """When p's inputs are all there; None while one has not run yet."""
        at = 0.0
        for key in needs(p.kind, p.microbatch, p.stage, self.num_stages, recompute=self.recompute):
            end = self.ends.get(key)
            if end is None:
                return None
            if self.stage_device[key[2]] != self.stage_device[p.stage]:
                end += self.costs.comm
            at = max(at, end)
        return at

    def _ready(self, p: Pass, now: float) -> bool:
        at = self._ready_at(p)
        return at is not None and at <= now

    def _pick(
        self, dev: int, now: float, *, improve: bool, cool_down: bool, hoist: bool
    ) -> int | None:
        """Index (into the device's remaining list) of the pass to run now, or None."""
        rem, head = self.remaining[dev], self.head[dev]
        if improve and cool_down:
            for k in self._window(dev):
                if rem[k].kind in (_B, _BW):
                    if self._ready(rem[k], now):
                        return k
                    break
        if self._ready(rem[head], now):
            return head
        if not improve:
            return None
        window = self._window(dev)
        if hoist:
            for k in window:
                if rem[k].kind is _F and self._ready(rem[k], now):
                    return k
        for k in window:
            if rem[k].kind is _W and self._ready(rem[k], now):
                return k
        return None

    def _window(self, dev: int) -> list[int]:
        rem, head = self.remaining[dev], self.head[dev]
        return [k for k in range(head, min(len(rem), head + self.window)) if rem[k] is not None]

    def _take(self, dev: int, k: int) -> Pass:
        rem = self.remaining[dev]
        p = rem[k]
        rem[k] = None  # type: ignore[call-overload]
        while self.head[dev] < len(rem) and rem[self.head[dev]] is None:
            self.head[dev] += 1
        return p
