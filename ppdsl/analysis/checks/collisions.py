"""A building block is collision-free under its period (controllable-memory
paper §3): repeating it every T must never put two passes on one device at the
same time. On each device the slots, as intervals [start, start + duration)
taken modulo T on a circle of length T, must not overlap, and no slot may last
longer than T (it would collide with its own next repetition).
"""

from __future__ import annotations

from fractions import Fraction

from ppdsl.diagnostics import Diagnostic
from ppdsl.ir.schedule import BlockSlot, Schedule
from ppdsl.semantics import format_number

__all__ = ["check"]


def _slot_name(slot: BlockSlot) -> str:
    return f"{slot.kind.value} of stage {slot.stage}"


def _overlap(a: BlockSlot, b: BlockSlot, period: Fraction) -> Fraction:
    """Length of time a and b overlap when both repeat every `period`."""
    a0, b0 = Fraction(a.start) % period, Fraction(b.start) % period
    total = Fraction(0)
    # b's repetitions that can meet a's interval [a0, a0 + dur_a)
    for shift in (-period, Fraction(0), period):
        lo = max(a0, b0 + shift)
        hi = min(a0 + a.duration, b0 + shift + b.duration)
        if hi > lo:
            total += hi - lo
    return total


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
    by_device: dict[int, list[BlockSlot]] = {}
    for slot in block.slots:
        if slot.duration > period:
            found.append(
                Diagnostic(
                    "error",
                    f"{_slot_name(slot)} on device {slot.device} lasts {format_number(slot.duration)}, "
                    f"longer than the period {format_number(period)}: it would overlap its own next "
                    "repetition; raise the period",
                    slot.span or block.span,
                )
            )
        by_device.setdefault(slot.device, []).append(slot)
    for device, slots in sorted(by_device.items()):
        for i, a in enumerate(slots):
            for b in slots[i + 1 :]:
                if a.duration > period or b.duration > period:
                    continue
                overlap = _overlap(a, b, period)
                if overlap <= 0:
                    continue
                a_end, b_end = a.start + a.duration, b.start + b.duration
                found.append(
                    Diagnostic(
                        "error",
                        f"on device {device}, {_slot_name(b)} [{format_number(b.start)}, {format_number(b_end)}) "
                        f"collides with {_slot_name(a)} [{format_number(a.start)}, {format_number(a_end)}) modulo "
                        f"the period {format_number(period)} (at {format_number(Fraction(b.start) % period)} and "
                        f"{format_number(Fraction(a.start) % period)} mod {format_number(period)}, overlapping "
                        f"{format_number(overlap)}); move one of them or raise the period",
                        b.span or block.span,
                        ((a.span, f"{_slot_name(a)} starts at {format_number(a.start)} here"),),
                    )
                )
    return found
