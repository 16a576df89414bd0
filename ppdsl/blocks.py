"""Repeating a building block into per-device pass orders.

The controllable-memory paper (Qi et al., NeurIPS 2024, §3) builds a schedule
from one microbatch's *building block*: the start slot of every pass of every
stage, repeated every period T. Microbatch j's pass of a slot starts at
``slot.start + j * T``. Each device runs its passes in the order of those start
times; the simulator later re-times that order as soon as possible (the paper's
"squeeze"), and warm-up and cool-down are what is left of the repetitions for
the microbatches that exist (0 <= j < m).

Ties between equal start times (only possible for slots that collide, which
the collision check reports, or for zero-length slots) are broken by the
slot's position in the block (the order the file wrote it), then by
microbatch: the order is deterministic and can be steered from the source.

`W fill` (the zero-bubble paper's greedy W placement, §3 and its ZB-V
scheduler): the block gives F and B slots only. A device runs its F/B passes in
block order; whenever the next one is not ready yet it runs its oldest pending
W instead, and the W still pending when its F/B passes are done run at the end.
"Ready" comes from a timed run of all devices together under the file's costs:
F(j, s) waits for F(j, s-1), B(j, s) for B(j, s+1) and F(j, s), a W for its B,
plus the transfer time when the pass it waits for ran on another device.
"""

from __future__ import annotations

from collections import deque
from fractions import Fraction

from ppdsl.ir.schedule import Block, BlockSlot, Costs, Pass, PassKind, Placement

__all__ = ["repeat_block"]

_F, _B, _W, _BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW


def repeat_block(
    block: Block,
    placement: Placement,
    num_microbatches: int,
    *,
    split_backward: bool,
    w_fill: bool,
    costs: Costs,
) -> tuple[tuple[Pass, ...], ...]:
    """Per-device pass orders of `block` repeated for `num_microbatches`
    microbatches. Every Pass carries the span of the block line that made it; a
    W placed by `w_fill` carries the span of its B's line."""
    if w_fill and not split_backward:
        raise ValueError("W fill needs a split backward (F, B, W)")
    period = Fraction(block.period)
    timed: list[list[tuple[Fraction, int, int, BlockSlot]]] = [
        [] for _ in range(placement.num_devices)
    ]
    for index, slot in enumerate(block.slots):
        for j in range(num_microbatches):
            start = Fraction(slot.start) + j * period
            timed[slot.device].append((start, index, j, slot))
    for device_slots in timed:
        device_slots.sort(key=lambda t: (t[0], t[1], t[2]))
    if w_fill:
        return _fill_w(timed, costs)
    return tuple(
        tuple(Pass(s.kind, j, s.stage, s.span) for _, _, j, s in device_slots)
        for device_slots in timed
    )


def _fill_w(
    timed: list[list[tuple[Fraction, int, int, BlockSlot]]], costs: Costs
) -> tuple[tuple[Pass, ...], ...]:
    """Insert every W into the repeated block's timeline, device by device: a
    W becomes pending when its B ends; the oldest pending W starts whenever the
    device is free before its next F/B slot's start; the rest run at the end."""
    orders = []
    for device_slots in timed:
        order: list[Pass] = []
        pending: deque[tuple[Fraction, Pass]] = deque()
        free: Fraction | None = None
        for start, _, j, slot in device_slots:
            if slot.kind not in (_F, _B):
                raise ValueError(f"a W-fill block holds only F and B slots, not {slot.kind.value}")
            while pending and free is not None and free < start and pending[0][0] <= free:
                _, w = pending.popleft()
                order.append(w)
                free += Fraction(costs.duration(_W, w.stage))
            free = max(start, free) if free is not None else start
            free += Fraction(slot.duration)
            order.append(Pass(slot.kind, j, slot.stage, slot.span))
            if slot.kind is _B:
                pending.append((free, Pass(_W, j, slot.stage, slot.span)))
        order += [w for _, w in pending]
        orders.append(tuple(order))
    return tuple(orders)
