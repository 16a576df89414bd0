"""Repeating a building block into per-device pass orders.

The controllable-memory paper (Qi et al., NeurIPS 2024, §3) builds a schedule
from one microbatch's *building block*: the start slot of every pass of every
stage, repeated every period T. Microbatch j's pass of a slot starts at
``slot.start + j * T``. Each device runs its passes in the order of those start
times; the simulator later re-times that order as soon as possible (the paper's
"squeeze"), and warm-up and cool-down are what is left of the repetitions for
the microbatches that exist (0 <= j < m).

A grouped block (`group G every U`, Megatron's microbatch groups of its
interleaved 1F1B and the zero-bubble repository's grouped building block)
shifts microbatch j by (j // G) * T + (j % G) * U instead of j * T
(`Block.shift`); everything below is the same for it.

Ties between equal start times (only possible for slots that collide, which
the collision check reports, or for zero-length slots) are broken by the
slot's position in the block (the order the file wrote it), then by
microbatch: the order is deterministic and can be steered from the source.

Warm-up and cool-down (the controllable-memory paper's last step, done in its
authors' scheduler after repeating and squeezing): the truncated repetitions
can leave a device idle where the paper's schedules are not. Two steps:

- compaction: every pass, in the order the plain repetition starts them, takes
  the earliest time on its device at which its inputs have arrived and the
  device is free (a gap before passes already placed, or after them), and at
  which the device's activation peak stays within the repetition's;
- then the orders (compacted or not) are run in time under the file's costs,
  each device taking its next pass in order, except that in its warm-up (before
  its first backward) a device that would idle runs the next *ready* forward
  further down its order instead; in its cool-down (no forward left) it runs a
  ready B/BW before pending W, so input gradients travel on while weight
  gradients fill the wait; and a device that would idle runs a pending W (its B
  done) further down its order.

A result is kept only when, on every device, the activation peak does not rise
(counted both with W holding all of M_B and with W holding none of it) and the
makespan and the longest idle time within a device's span do not grow; the
compacted one only when it is better still. Otherwise the plain block order
stands. 1F1B, ZB-H1 and ZB-H2 come out unchanged; V-ZB's repetitions lose their
warm-up and cool-down bubble; V-Half reaches its authors' bubble at unit costs.

`W fill` (the zero-bubble paper's greedy W placement, §3 and its ZB-V
scheduler): the block gives F and B slots only. A device runs its F/B passes in
block order; whenever the next one is not ready yet it runs its oldest pending
W instead, and the W still pending when its F/B passes are done run at the end.
"Ready" comes from a timed run of all devices together under the file's costs:
a pass waits for the passes it needs (`semantics.NEEDS`: F(j, s) for F(j, s-1),
B(j, s) for B(j, s+1) and F(j, s), a W for its B), plus the transfer time when
the pass it waits for ran on another device.
"""

from __future__ import annotations

import math
from collections import deque
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from ppdsl.ir.schedule import Block, BlockSlot, Costs, Pass, PassKind, PassOrder, Placement
from ppdsl.jit import kernel
from ppdsl.semantics import (
    KINDS,
    NEED_KIND,
    NEED_OPTIONAL,
    NEED_STAGE_OFFSET,
    NUM_KINDS,
    memory_delta,
)

__all__ = ["repeat_block", "timed_slots", "fill_timeline", "tighten_warm_up_and_cool_down"]

_F, _B, _W, _BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW

_EXACT = 2**62
"""Times, in units of the block's common denominator, below which the
repetition and the W fill run on int64 (exact); past it they run on Fractions."""


def repeat_block(
    block: Block,
    placement: Placement,
    num_microbatches: int,
    *,
    split_backward: bool,
    w_fill: bool,
    costs: Costs,
    recompute: frozenset[int] = frozenset(),
) -> tuple[PassOrder, ...]:
    """Per-device pass orders of `block` repeated for `num_microbatches`
    microbatches. Every Pass carries the span of the block line that made it; a
    W placed by `w_fill` carries the span of its B's line. `recompute`: the
    stages marked `recompute` (their B waits for their R)."""
    if w_fill and not split_backward:
        raise ValueError("W fill needs a split backward (F, B, W)")
    repeated = _Repetition.of(block, placement.num_devices, num_microbatches)
    if w_fill:
        filled = repeated.with_w_filled(block, costs)
        if filled is None:  # times past int64: the Fraction timeline
            orders = _fill_w(timed_slots(block, placement, num_microbatches), costs)
            tight = tighten_warm_up_and_cool_down(orders, placement, costs, recompute)
            return tuple(map(PassOrder.of, tight))
        repeated = filled
    slots = block.slots
    kind_of_slot = np.array([s.kind.code for s in slots], dtype=np.int64)
    stage_of_slot = np.array([s.stage for s in slots], dtype=np.int64)
    kind = np.where(repeated.weight, _W.code, kind_of_slot[repeated.slot])
    stage = stage_of_slot[repeated.slot]
    order = _tightened(kind, repeated.microbatch, stage, repeated.bounds, placement, costs, recompute)
    if order is None:
        order = np.arange(len(kind))
    # each device's order as columns (a Pass made only when read), each pass
    # carrying its slot's span (a filled W its B's)
    spans = tuple(s.span for s in slots)
    kind, microbatch = kind[order].astype(np.int8), repeated.microbatch[order]
    stage, slot = stage[order], repeated.slot[order].astype(np.int32)
    bounds = repeated.bounds.tolist()
    return tuple(
        PassOrder(kind[lo:hi], microbatch[lo:hi], stage[lo:hi], slot[lo:hi], spans)
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    )


class _Repetition(NamedTuple):
    """A block's passes, device after device, each device's in the order the
    plain repetition starts them: per pass its slot's index in the block, its
    microbatch, whether it is the W that `W fill` made for the slot's B, and its
    start in units of 1 / `scale` (None: past int64, ordered as Fractions)."""

    slot: np.ndarray
    microbatch: np.ndarray
    weight: np.ndarray
    bounds: np.ndarray
    start: np.ndarray | None
    scale: int

    @staticmethod
    def of(block: Block, num_devices: int, num_microbatches: int) -> _Repetition:
        """`block` repeated for `num_microbatches` microbatches (`timed_slots`'
        order: start, then slot position, then microbatch)."""
        slots, m, size = block.slots, num_microbatches, block.group_size
        period, spacing = Fraction(block.period), Fraction(block.group_spacing)
        starts = [Fraction(s.start) for s in slots]
        scale = math.lcm(period.denominator, spacing.denominator, *(x.denominator for x in starts))
        slot_device = np.array([s.device for s in slots], dtype=np.int64)
        by_device = np.argsort(slot_device, kind="stable")  # block order within a device
        slot = np.repeat(by_device, m)
        microbatch = np.tile(np.arange(m, dtype=np.int64), len(slots))
        counts = np.bincount(slot_device, minlength=num_devices) * m
        bounds = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        weight = np.zeros(len(slot), dtype=np.bool_)
        whole = [int(x * scale) for x in starts]
        reach = max(map(abs, whole), default=0) + abs(int(period * scale)) * max(m - 1, 0) // size
        reach += abs(int(spacing * scale)) * (size - 1)
        if reach < _EXACT:
            j = np.arange(m, dtype=np.int64)
            shift = (j // size) * int(period * scale) + (j % size) * int(spacing * scale)
            start = np.array(whole, dtype=np.int64)[slot] + shift[microbatch]
            ranked = np.lexsort((start, slot_device[slot]))  # stable: ties keep (slot, microbatch)
            return _Repetition(
                slot[ranked], microbatch[ranked], weight, bounds, start[ranked], scale
            )
        shifts = [block.shift(j) for j in range(m)]
        ranked_lists = []
        for dev in range(num_devices):
            lo, hi = int(bounds[dev]), int(bounds[dev + 1])
            ranked_lists.extend(
                sorted(
                    range(lo, hi),
                    key=lambda k: (starts[slot[k]] + shifts[microbatch[k]], slot[k], microbatch[k]),
                )
            )
        ranked = np.array(ranked_lists, dtype=np.int64)
        return _Repetition(slot[ranked], microbatch[ranked], weight, bounds, None, scale)

    def with_w_filled(self, block: Block, costs: Costs) -> _Repetition | None:
        """The repetition with every W inserted as `fill_timeline` does; None
        when its times would pass int64 (exact Fractions are needed)."""
        slots = block.slots
        wrong = np.flatnonzero(np.array([s.kind in (_W, _BW) for s in slots], dtype=bool)[self.slot])
        if len(wrong):
            kind = slots[int(self.slot[wrong[0]])].kind
            raise ValueError(f"a W-fill block holds only F and B slots, not {kind.value}")
        if self.start is None:
            return None
        durations = [Fraction(s.duration) for s in slots]
        weights = [Fraction(costs.duration(_W, s.stage)) if s.kind is _B else Fraction(0)
                   for s in slots]
        scale = math.lcm(self.scale, *(x.denominator for x in durations + weights))
        factor = scale // self.scale
        length = max(len(self.slot), 1) * (
            max(map(abs, durations), default=0) + max(map(abs, weights), default=0)
        )
        reach = (int(np.abs(self.start).max(initial=0)) + 1) * factor + math.ceil(length * scale)
        if reach >= _EXACT:
            return None
        slot, microbatch, weight, bounds = _w_filled(
            self.bounds,
            self.start * factor,
            self.slot,
            self.microbatch,
            np.array([s.kind is _B for s in slots], dtype=np.bool_),
            np.array([int(x * scale) for x in durations], dtype=np.int64),
            np.array([int(x * scale) for x in weights], dtype=np.int64),
        )
        return _Repetition(slot, microbatch, weight, bounds, None, scale)


@kernel
def _w_filled(
    bounds, start, slot, microbatch, backward, duration, weight_duration
):  # pragma: no cover - numba
    """`fill_timeline` on integer times: per device the passes (slot, microbatch,
    whether a filled W) in the order the fill runs them, and the new bounds."""
    num_devices = bounds.shape[0] - 1
    n = start.shape[0]
    extra = 0
    for i in range(n):
        if backward[slot[i]]:
            extra += 1
    out_slot = np.empty(n + extra, dtype=np.int64)
    out_microbatch = np.empty(n + extra, dtype=np.int64)
    out_weight = np.zeros(n + extra, dtype=np.bool_)
    out_bounds = np.zeros(num_devices + 1, dtype=np.int64)
    pending_at = np.empty(n, dtype=np.int64)  # a W is pending from its B's end
    pending_slot = np.empty(n, dtype=np.int64)
    pending_microbatch = np.empty(n, dtype=np.int64)
    o = 0
    for dev in range(num_devices):
        first = 0
        last = 0
        started = False
        free = 0
        for i in range(bounds[dev], bounds[dev + 1]):
            at = start[i]
            while first < last and started and free < at and pending_at[first] <= free:
                out_slot[o] = pending_slot[first]
                out_microbatch[o] = pending_microbatch[first]
                out_weight[o] = True
                o += 1
                free += weight_duration[pending_slot[first]]
                first += 1
            free = max(at, free) if started else at
            started = True
            out_slot[o] = slot[i]
            out_microbatch[o] = microbatch[i]
            o += 1
            free += duration[slot[i]]
            if backward[slot[i]]:
                pending_at[last] = free
                pending_slot[last] = slot[i]
                pending_microbatch[last] = microbatch[i]
                last += 1
        while first < last:
            out_slot[o] = pending_slot[first]
            out_microbatch[o] = pending_microbatch[first]
            out_weight[o] = True
            o += 1
            first += 1
        out_bounds[dev + 1] = o
    return out_slot, out_microbatch, out_weight, out_bounds


def timed_slots(
    block: Block, placement: Placement, num_microbatches: int
) -> list[list[tuple[Fraction, int, int, BlockSlot]]]:
    """Per device, (start, slot index, microbatch, slot) of every slot repeated
    for `num_microbatches` microbatches (microbatch j shifted by
    `block.shift(j)`), sorted by start, then slot position, then microbatch
    (the plain repetition's order)."""
    repeated = _Repetition.of(block, placement.num_devices, num_microbatches)
    starts = [Fraction(s.start) for s in block.slots]
    slot, microbatch = repeated.slot.tolist(), repeated.microbatch.tolist()
    if repeated.start is not None:
        at = [Fraction(x, repeated.scale) for x in repeated.start.tolist()]
    else:
        at = [starts[i] + block.shift(j) for i, j in zip(slot, microbatch, strict=True)]
    bounds = repeated.bounds.tolist()
    return [
        [(at[k], slot[k], microbatch[k], block.slots[slot[k]]) for k in range(lo, hi)]
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    ]


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
    device (start, slot index, microbatch, slot) sorted by start. (Exact, on
    Fractions; `repeat_block` runs the same rule on integer times.)"""
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
    `recompute`: the stages marked `recompute`. The orders hold every pass once
    (a pass twice, or a stage out of range, leaves them as they are)."""
    flat = [p for order in orders for p in order]
    n = len(flat)
    kind = np.fromiter((p.kind.code for p in flat), dtype=np.int64, count=n)
    microbatch = np.fromiter((p.microbatch for p in flat), dtype=np.int64, count=n)
    stage = np.fromiter((p.stage for p in flat), dtype=np.int64, count=n)
    bounds = np.concatenate(([0], np.cumsum([len(o) for o in orders]))).astype(np.int64)
    chosen = _tightened(kind, microbatch, stage, bounds, placement, costs, recompute)
    if chosen is None:
        return orders
    taken = chosen.tolist()
    edges = bounds.tolist()
    return tuple(
        tuple(flat[k] for k in taken[lo:hi]) for lo, hi in zip(edges, edges[1:], strict=False)
    )


_CHANNELS = ((1, 1), (0, 1), (1, 0), (0, 0))
"""The extreme memory models the peaks are counted in, as (M_W, M_I) in units
of M_B: W holding all of M_B or none of it; a recomputed stage's F keeping all
of it or none (M_I). The first counts an F as one microbatch-stage, as the
warm-up's forward count does."""

_EXTREME = np.array(
    [
        [
            [
                int(memory_delta(kind, Fraction(1), Fraction(w), Fraction(i) if recomputed else None))
                for w, i in _CHANNELS
            ]
            for recomputed in (False, True)
        ]
        for kind in KINDS
    ],
    dtype=np.int64,
)
"""A pass's memory change in microbatch-stages [kind code, recomputed, channel
of `_CHANNELS`], on a stage that keeps its activations (0) or recomputes them (1)."""


def _pass_needs(
    kind: np.ndarray,
    microbatch: np.ndarray,
    stage: np.ndarray,
    stage_device: np.ndarray,
    recomputed: np.ndarray,
) -> np.ndarray | None:
    """Per pass and need slot (`semantics.NEED_KIND`), the pass it waits for as
    2 * its index, + 1 when that pass runs on another device (its end arrives
    `comm` later); -1 for no need, -2 for a need on a pass the orders do not
    hold (never ready). None when a pass is there twice or out of range."""
    n, num_stages = len(kind), len(stage_device)
    if n == 0:
        return np.zeros((0, NEED_KIND.shape[1]), dtype=np.int64)
    if microbatch.min() < 0 or stage.min() < 0 or stage.max() >= num_stages:
        return None
    table = np.full((NUM_KINDS, int(microbatch.max()) + 1, num_stages), -1, dtype=np.int64)
    table[kind, microbatch, stage] = np.arange(n)
    if np.count_nonzero(table >= 0) != n:
        return None
    other = stage[:, None] + NEED_STAGE_OFFSET[kind]
    inside = np.clip(other, 0, num_stages - 1)
    exists = (NEED_KIND[kind] >= 0) & (other == inside)
    exists &= (NEED_OPTIONAL[kind] == 0) | (recomputed[inside] == 1)
    found = table[np.maximum(NEED_KIND[kind], 0), microbatch[:, None], inside]
    crosses = stage_device[inside] != stage_device[stage][:, None]
    return np.where(exists, np.where(found >= 0, 2 * found + crosses, -2), -1)


def _tightened(
    kind: np.ndarray,
    microbatch: np.ndarray,
    stage: np.ndarray,
    bounds: np.ndarray,
    placement: Placement,
    costs: Costs,
    recompute: frozenset[int],
) -> np.ndarray | None:
    """`tighten_warm_up_and_cool_down` on passes given as arrays (kind code,
    microbatch, stage), device after device (`bounds`): the chosen order of
    their indices, or None for the orders as they are."""
    num_stages = placement.num_stages
    recomputed = np.zeros(num_stages, dtype=np.int64)
    recomputed[[s for s in recompute if 0 <= s < num_stages]] = 1
    stage_device = np.array(placement.stage_device, dtype=np.int64)
    needs = _pass_needs(kind, microbatch, stage, stage_device, recomputed)
    if needs is None:
        return None
    duration = np.array(costs.durations, dtype=np.float64)[kind, stage]
    # how far down its order a device looks for a pass to run early: far enough
    # for a V-shape warm-up, which hoists up to 2S forwards past 3 passes each
    window = 8 * num_stages + 16
    # one transfer cost for every edge: the slowest, where edges differ (a heuristic's
    # order; the simulator then times it edge by edge)
    comm = float(costs.edge_costs(num_stages).max(initial=costs.comm))
    changed, order = _tighten(
        bounds, kind, stage, duration, needs, _EXTREME, recomputed, comm, window
    )
    return order if changed else None


@kernel
def _tighten(
    bounds, kind, stage, duration, needs, extreme, recomputed, comm, window
):  # pragma: no cover - numba
    """The warm-up/cool-down step (the module docstring) on the passes in
    their given order (device after device, `bounds`): (whether another order
    is chosen, that order of pass indices). `needs` as `_pass_needs` makes
    them; `duration` per pass; `extreme[kind, recomputed, channel]` the memory
    changes the peaks are counted in; `window` how far down its order a device
    looks for a pass to run early.

    `run` runs orders in time, all devices together; `compact` is the
    compaction; `peaks` a device's highest level in each channel. A result is
    kept only when it finishes, neither its makespan nor its worst idle time
    grows, one of them shrinks, and no device's peak rises in any channel; the
    compacted one only when better still."""
    f_code, b_code, w_code, bw_code = 0, 1, 2, 3
    num_devices = bounds.shape[0] - 1
    n = kind.shape[0]
    width = needs.shape[1]
    channels = extreme.shape[2]

    def peaks(order):
        """Per device and channel the highest level of its order's prefixes (never below 0)."""
        found = np.zeros((num_devices, channels), dtype=np.int64)
        for dev in range(num_devices):
            for c in range(channels):
                level = 0
                for i in range(bounds[dev], bounds[dev + 1]):
                    p = order[i]
                    level += extreme[kind[p], recomputed[stage[p]], c]
                    if level > found[dev, c]:
                        found[dev, c] = level
        return found

    def run(order, allowed, improve, hoist_forwards):
        """The orders run in time. `improve=False` keeps every device to its
        order: that is the simulator's as-soon-as-possible timing. With
        `improve`, a device that cannot run its next pass looks `window`
        positions down its order: in its cool-down (no forward left) its
        first B/BW goes first when ready; in its warm-up, while it holds fewer
        than `allowed[device]` forwards' activations and `hoist_forwards`, its
        first ready F; then its first ready W.

        Returns (the passes in the order each device ran them, each pass's
        end, whether every pass ran, the makespan, the longest idle time
        within a device's span). The devices at the earliest free time pick
        in device order, again until none can; then the waiting ones skip to
        the next time something changes. A pass's ready time is fixed once
        the passes it needs have run: each device's ready F and W are kept in
        heaps of their positions, the passes not yet ready in a heap of ready
        times."""
        # who waits for each pass, and how many of its needs have not run
        unmet = np.zeros(n, dtype=np.int64)
        first_waiter = np.zeros(n + 1, dtype=np.int64)
        for p in range(n):
            for slot in range(width):
                q = needs[p, slot]
                if q >= 0:
                    unmet[p] += 1
                    first_waiter[(q >> 1) + 1] += 1
                elif q == -2:
                    unmet[p] += n + 1  # a pass that is not there: never ready
        for p in range(n):
            first_waiter[p + 1] += first_waiter[p]
        waiter = np.empty(first_waiter[n], dtype=np.int64)
        filled = first_waiter[:n].copy()
        for p in range(n):
            for slot in range(width):
                q = needs[p, slot]
                if q >= 0:
                    waiter[filled[q >> 1]] = p
                    filled[q >> 1] += 1
        position = np.empty(n, dtype=np.int64)
        device = np.empty(n, dtype=np.int64)
        for dev in range(num_devices):
            for i in range(bounds[dev], bounds[dev + 1]):
                position[order[i]] = i
                device[order[i]] = dev
        ends = np.full(n, np.nan)
        ready_at = np.full(n, np.nan)
        # ready F (0) and W (1) positions, a min-heap per device in its segment
        heap = np.empty((2, n), dtype=np.int64)
        heap_size = np.zeros((2, num_devices), dtype=np.int64)
        # F and W whose ready time is known but may be later than now: a min-heap of times
        pending_at = np.empty(n)
        pending = np.empty(n, dtype=np.int64)
        num_pending = 0
        for p in range(n):
            if unmet[p] == 0:
                ready_at[p] = 0.0
                if improve and (kind[p] == f_code or kind[p] == w_code):
                    pending_at[num_pending] = 0.0  # equal times: a heap in any order
                    pending[num_pending] = p
                    num_pending += 1
        taken = np.zeros(n, dtype=np.bool_)
        head = bounds[:num_devices].copy()
        next_backward = bounds[:num_devices].copy()  # a device's first B/BW not taken
        forwards_left = np.zeros(num_devices, dtype=np.int64)
        for dev in range(num_devices):
            stop = bounds[dev + 1]
            q = next_backward[dev]
            while q < stop and kind[order[q]] != b_code and kind[order[q]] != bw_code:
                q += 1
            next_backward[dev] = q
            for i in range(bounds[dev], stop):
                if kind[order[i]] == f_code:
                    forwards_left[dev] += 1
        in_warm_up = np.ones(num_devices, dtype=np.bool_)
        live = np.zeros(num_devices, dtype=np.int64)
        free = np.zeros(num_devices)
        first = np.zeros(num_devices)
        started = np.zeros(num_devices, dtype=np.bool_)
        busy = np.zeros(num_devices)
        result = np.full(n, -1, dtype=np.int64)
        ran = np.zeros(num_devices, dtype=np.int64)
        active = np.zeros(num_devices, dtype=np.bool_)
        waiting = np.empty(num_devices, dtype=np.int64)
        finished = True
        while True:
            now = np.inf
            any_active = False
            for dev in range(num_devices):
                active[dev] = head[dev] < bounds[dev + 1]
                if active[dev]:
                    any_active = True
                    if free[dev] < now:
                        now = free[dev]
            if not any_active:
                break
            progressed = False
            num_waiting = 0
            for dev in range(num_devices):
                if not active[dev] or free[dev] != now:
                    continue
                # the F and W ready by now join their device's heap
                while num_pending > 0 and pending_at[0] <= now:
                    p = pending[0]
                    num_pending -= 1
                    moved_at, moved = pending_at[num_pending], pending[num_pending]
                    k = 0
                    while True:
                        child = 2 * k + 1
                        if child >= num_pending:
                            break
                        if child + 1 < num_pending and pending_at[child + 1] < pending_at[child]:
                            child += 1
                        if pending_at[child] >= moved_at:
                            break
                        pending_at[k], pending[k] = pending_at[child], pending[child]
                        k = child
                    pending_at[k], pending[k] = moved_at, moved
                    which = 0 if kind[p] == f_code else 1
                    base = bounds[device[p]]
                    k = heap_size[which, device[p]]
                    heap_size[which, device[p]] += 1
                    while k > 0 and heap[which, base + (k - 1) // 2] > position[p]:
                        heap[which, base + k] = heap[which, base + (k - 1) // 2]
                        k = (k - 1) // 2
                    heap[which, base + k] = position[p]
                h = head[dev]
                stop = bounds[dev + 1]
                limit = min(stop, h + window)
                pick = -1
                if improve and forwards_left[dev] == 0:
                    q = next_backward[dev]
                    if q < limit and ready_at[order[q]] <= now:
                        pick = q
                if pick < 0 and ready_at[order[h]] <= now:
                    pick = h
                if pick < 0 and improve:
                    for which in range(2):
                        if which == 0 and not (
                            hoist_forwards and in_warm_up[dev] and live[dev] < allowed[dev]
                        ):
                            continue
                        base = bounds[dev]
                        while heap_size[which, dev] > 0 and taken[heap[which, base]]:
                            size = heap_size[which, dev] - 1
                            heap_size[which, dev] = size
                            moved = heap[which, base + size]
                            k = 0
                            while True:
                                child = 2 * k + 1
                                if child >= size:
                                    break
                                if (
                                    child + 1 < size
                                    and heap[which, base + child + 1] < heap[which, base + child]
                                ):
                                    child += 1
                                if heap[which, base + child] >= moved:
                                    break
                                heap[which, base + k] = heap[which, base + child]
                                k = child
                            heap[which, base + k] = moved
                        if heap_size[which, dev] > 0 and heap[which, base] < limit:
                            pick = heap[which, base]
                            break
                if pick < 0:
                    waiting[num_waiting] = dev
                    num_waiting += 1
                    continue
                p = order[pick]
                taken[pick] = True
                while head[dev] < stop and taken[head[dev]]:
                    head[dev] += 1
                kd = kind[p]
                if kd == b_code or kd == bw_code:
                    q = next_backward[dev]
                    while q < stop and (
                        taken[q] or (kind[order[q]] != b_code and kind[order[q]] != bw_code)
                    ):
                        q += 1
                    next_backward[dev] = q
                length = duration[p]
                if not started[dev]:
                    first[dev] = now
                    started[dev] = True
                free[dev] = now + length
                busy[dev] += length
                ends[p] = free[dev]
                result[bounds[dev] + ran[dev]] = p
                ran[dev] += 1
                progressed = True
                if kd == f_code:
                    forwards_left[dev] -= 1
                    live[dev] += 1
                elif kd == w_code or kd == bw_code:
                    live[dev] -= 1
                if kd == b_code or kd == bw_code:
                    in_warm_up[dev] = False
                for e in range(first_waiter[p], first_waiter[p + 1]):
                    r = waiter[e]
                    unmet[r] -= 1
                    if unmet[r] != 0:
                        continue
                    at = 0.0
                    for slot in range(width):
                        q = needs[r, slot]
                        if q >= 0:
                            end = ends[q >> 1]
                            if q & 1:
                                end += comm
                            if end > at:
                                at = end
                    ready_at[r] = at
                    if improve and (kind[r] == f_code or kind[r] == w_code):
                        k = num_pending
                        num_pending += 1
                        while k > 0 and pending_at[(k - 1) // 2] > at:
                            pending_at[k] = pending_at[(k - 1) // 2]
                            pending[k] = pending[(k - 1) // 2]
                            k = (k - 1) // 2
                        pending_at[k] = at
                        pending[k] = r
            if progressed:
                continue
            later = np.inf
            found = False
            for dev in range(num_devices):
                if active[dev] and free[dev] > now:
                    found = True
                    later = min(later, free[dev])
            for i in range(num_waiting):
                at = ready_at[order[head[waiting[i]]]]
                if at > now:  # (False while unknown: NaN)
                    found = True
                    later = min(later, at)
            if not found:
                finished = False
                break
            for i in range(num_waiting):
                free[waiting[i]] = later
        makespan = 0.0
        worst_idle = 0.0
        for dev in range(num_devices):
            idle = free[dev] - first[dev] - busy[dev]
            if dev == 0 or free[dev] > makespan:
                makespan = free[dev]
            if dev == 0 or idle > worst_idle:
                worst_idle = idle
        return result, ends, finished, makespan, worst_idle

    def compact(plain_ends, limit):
        """Compaction (the paper's reordering, done with the file's costs):
        every pass, in the order the plain run starts them (ties by
        position), takes the earliest time on its device at which its inputs
        have arrived and the device is free (a gap before passes already
        placed, or after them) and at which the device's level stays within
        `limit[device, channel]` in every channel. Returns (whether every pass
        fitted, the devices' rows of pass indices).

        A device's row keeps its passes' starts and ends, the level after each
        prefix and the running maximum of those levels. The first fit skips,
        by bisection, the places where the next pass starts before this one
        could end (while the row's starts are sorted), and takes the maxima of
        the levels after a place only over the places it looks at: passes land
        near the row's end, so a fit and an insertion cost what lies after
        them, not the whole row."""
        rows = np.full(n, -1, dtype=np.int64)
        key = np.empty(n)
        device = np.empty(n, dtype=np.int64)
        longest = 0
        for dev in range(num_devices):
            longest = max(longest, bounds[dev + 1] - bounds[dev])
            for p in range(bounds[dev], bounds[dev + 1]):
                device[p] = dev
                key[p] = plain_ends[p] - duration[p]
        queue = np.argsort(key, kind="mergesort")
        row_start = np.empty(n)
        row_end = np.empty(n)
        count = np.zeros(num_devices, dtype=np.int64)
        # device dev's levels sit at bounds[dev] + dev + (0 .. its count)
        levels = np.zeros((channels, n + num_devices), dtype=np.int64)
        tops = np.zeros((channels, n + num_devices), dtype=np.int64)
        after = np.empty((channels, longest + 1), dtype=np.int64)
        sorted_starts = np.ones(num_devices, dtype=np.bool_)
        end_of = np.full(n, np.nan)
        for t in range(n):
            p = queue[t]
            dev = device[p]
            ready = 0.0
            for slot in range(width):
                q = needs[p, slot]
                if q == -1:
                    continue
                if q == -2:
                    return False, rows
                end = end_of[q >> 1]
                if end != end:  # not placed yet
                    return False, rows
                arrives = end + (comm if q & 1 else 0.0)
                if arrives > ready:
                    ready = arrives
            base = bounds[dev]
            low = base + dev
            placed = count[dev]
            length = duration[p]
            kd = kind[p]
            rc = recomputed[stage[p]]
            # before `first`, the next pass starts before this one could end
            first = 0
            if sorted_starts[dev]:
                hi = placed
                while first < hi:
                    mid = (first + hi) // 2
                    if row_start[base + mid] + 1e-9 >= ready + length:
                        hi = mid
                    else:
                        first = mid + 1
            for c in range(channels):
                top = -(10**9)  # the highest level after place k
                after[c, placed - first] = top
                for k in range(placed - 1, first - 1, -1):
                    if levels[c, low + k + 1] > top:
                        top = levels[c, low + k + 1]
                    after[c, k - first] = top
            place = -1
            start = 0.0
            for k in range(first, placed + 1):
                over = False  # the running maximum only grows: over here, over from here on
                for c in range(channels):
                    if tops[c, low + k] > limit[dev, c]:
                        over = True
                if over:
                    break
                free = row_end[base + k - 1] if k > 0 else 0.0
                at = free if free >= ready else ready
                following = row_start[base + k] if k < placed else np.inf
                if not at + length <= following + 1e-9:
                    continue
                fits = True
                for c in range(channels):
                    delta = extreme[kd, rc, c]
                    peak = max(tops[c, low + k], levels[c, low + k] + delta, after[c, k - first] + delta)
                    if peak > limit[dev, c]:
                        fits = False
                if fits:
                    place = k
                    start = at
                    break
            if place < 0:
                return False, rows
            for k in range(placed, place, -1):
                row_start[base + k] = row_start[base + k - 1]
                row_end[base + k] = row_end[base + k - 1]
                rows[base + k] = rows[base + k - 1]
            row_start[base + place] = start
            row_end[base + place] = start + length
            rows[base + place] = p
            for c in range(channels):
                delta = extreme[kd, rc, c]
                for k in range(placed, place - 1, -1):
                    levels[c, low + k + 1] = levels[c, low + k] + delta
                for k in range(place + 1, placed + 2):
                    tops[c, low + k] = max(tops[c, low + k - 1], levels[c, low + k])
            count[dev] = placed + 1
            end_of[p] = start + length
            if (place > 0 and row_start[base + place - 1] > start) or (
                place < placed and start > row_start[base + place + 1]
            ):
                sorted_starts[dev] = False
        return True, rows

    given = np.arange(n)
    most = peaks(given)
    plain_order, plain_ends, plain_finished, plain_makespan, plain_idle = run(
        given, most[:, 0].copy(), False, False
    )
    if not plain_finished:
        return False, given  # the dependency check reports why
    chosen = given
    changed = False
    best_makespan, best_idle = plain_makespan, plain_idle
    source = given
    source_most = most
    # the given orders hoisting forwards, then not; the compacted ones the same
    for attempt in range(4):
        if attempt < 2 and changed:
            continue  # the first acceptable of the given orders' two stands
        if attempt == 2:
            fitted, source = compact(plain_ends, most)
            if not fitted:
                break
            source_most = peaks(source)
        order, _, finished, makespan, idle = run(
            source, source_most[:, 0].copy(), True, attempt % 2 == 0
        )
        acceptable = (
            finished
            and makespan <= plain_makespan
            and idle <= plain_idle
            and (makespan != plain_makespan or idle != plain_idle)
        )
        if acceptable:
            acceptable = bool(np.all(peaks(order) <= most))
        if acceptable and (
            attempt < 2 or idle < best_idle or (idle == best_idle and makespan < best_makespan)
        ):
            chosen, changed = order, True
            best_makespan, best_idle = makespan, idle
    return changed, chosen
