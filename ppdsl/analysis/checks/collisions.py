"""A building block is collision-free under its period (controllable-memory
paper §3): repeating it every T must never put two passes on one device at the
same time. On each device the slots, as intervals [start, start + duration)
taken modulo T on a circle of length T, must not overlap, and no slot may last
longer than T (it would collide with its own next repetition).

A grouped block (`group G every U`) puts G copies of each slot in a period,
microbatch r of the group U*r later; those copies are checked like slots.
"""

from __future__ import annotations

from bisect import bisect_left
from fractions import Fraction
from typing import NamedTuple

from ppdsl.diagnostics import Diagnostic, Span
from ppdsl.ir.schedule import Block, BlockSlot, Schedule
from ppdsl.semantics import format_number

__all__ = ["check"]


class _Copy(NamedTuple):
    """One slot for microbatch `position` of a group (0 without groups)."""

    order: int  # the slot's place in the block, then the position: the report order
    position: int
    slot: BlockSlot
    start: Fraction

    def name(self, grouped: bool) -> str:
        who = f"{self.slot.kind.value} of stage {self.slot.stage}"
        return f"{who} for microbatch {self.position}" if grouped else who


def _overlap(a: _Copy, b: _Copy, period: Fraction) -> Fraction:
    """Length of time a and b overlap when both repeat every `period`."""
    a0, b0 = a.start % period, b.start % period
    total = Fraction(0)
    # b's repetitions that can meet a's interval [a0, a0 + dur_a)
    for shift in (-period, Fraction(0), period):
        lo = max(a0, b0 + shift)
        hi = min(a0 + a.slot.duration, b0 + shift + b.slot.duration)
        if hi > lo:
            total += hi - lo
    return total


def _copies(block: Block) -> dict[int, list[_Copy]]:
    """Per device, every slot once per position in a group."""
    spacing = Fraction(block.group_spacing)
    by_device: dict[int, list[_Copy]] = {}
    for index, slot in enumerate(block.slots):
        for position in range(block.group_size):
            copy = _Copy(index, position, slot, Fraction(slot.start) + position * spacing)
            by_device.setdefault(slot.device, []).append(copy)
    return by_device


def _meeting_pairs(copies: list[_Copy], period: Fraction) -> list[tuple[_Copy, _Copy]]:
    """Pairs (earlier in the block first) where one starts inside the other
    modulo the period: every overlapping pair is among them."""
    circle = sorted(copies, key=lambda c: c.start % period)
    starts = [c.start % period for c in circle]
    pairs = set()
    for k, a in enumerate(circle):
        a0 = starts[k]
        # the copies whose start lies in [a0, a0 + duration), going round once
        end = a0 + a.slot.duration
        hits = range(bisect_left(starts, a0), bisect_left(starts, min(end, period)))
        wrapped = range(0, bisect_left(starts, end - period)) if end > period else range(0)
        for n in (*hits, *wrapped):
            if n != k:
                b = circle[n]
                pairs.add((a, b) if (a.order, a.position) < (b.order, b.position) else (b, a))
    return sorted(pairs, key=lambda p: (p[0].order, p[0].position, p[1].order, p[1].position))


def _placed_together(
    schedule: Schedule, device: int, first: int, second: int
) -> tuple[tuple[Span | None, str], ...]:
    """A note at the `place` line when two stages meet on one device because the
    placement put them there."""
    placement = schedule.placement
    if first == second or placement.span is None:
        return ()
    return ((
        placement.span,
        f"the placement ({placement.kind}) puts stages {min(first, second)} and "
        f"{max(first, second)} on device {device}",
    ),)


def check(schedule: Schedule) -> list[Diagnostic]:
    """Every pair of colliding slots on a device (error at the later slot, a note
    at the other), and every slot longer than the period."""
    block = schedule.block
    if block is None:
        return []
    period = Fraction(block.period)
    found: list[Diagnostic] = []
    if period <= 0:
        return [
            Diagnostic(
                "error", f"the block's period is {format_number(period)}; it must be positive", block.span
            )
        ]
    for slot in block.slots:
        if slot.duration > period:
            found.append(
                Diagnostic(
                    "error",
                    f"{slot.kind.value} of stage {slot.stage} on device {slot.device} lasts "
                    f"{format_number(slot.duration)}, longer than the period {format_number(period)}: "
                    "it would overlap its own next repetition; raise the period",
                    slot.span or block.span,
                )
            )
    grouped = block.group_size > 1
    for device, copies in sorted(_copies(block).items()):
        fitting = [c for c in copies if c.slot.duration <= period]
        for a, b in _meeting_pairs(fitting, period):
            overlap = _overlap(a, b, period)
            if overlap <= 0:
                continue
            a_end, b_end = a.start + a.slot.duration, b.start + b.slot.duration
            found.append(
                Diagnostic(
                    "error",
                    f"on device {device}, {b.name(grouped)} [{format_number(b.start)}, "
                    f"{format_number(b_end)}) collides with {a.name(grouped)} "
                    f"[{format_number(a.start)}, {format_number(a_end)}) modulo the period "
                    f"{format_number(period)} (at {format_number(b.start % period)} and "
                    f"{format_number(a.start % period)} mod {format_number(period)}, overlapping "
                    f"{format_number(overlap)}); move one of them or raise the period",
                    b.slot.span or block.span,
                    ((a.slot.span, f"{a.name(grouped)} starts at {format_number(a.start)} here"),
                     *_placed_together(schedule, device, a.slot.stage, b.slot.stage)),
                )
            )
    return found
