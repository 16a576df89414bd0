"""Peak activation memory per device, from the per-device order alone.

A device's memory after its k-th pass is the prefix sum of the memory deltas
(`semantics.MEMORY_COEFFICIENTS`) over its order, so its peak is fixed by the
order, whatever the timing. The sums are exact: the deltas are scaled to
integers over their common denominator (`semantics.delta_table`).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from ppdsl.ir.flat import flatten
from ppdsl.ir.schedule import Schedule

__all__ = ["peak_positions", "peak_memory"]


def peak_positions(schedule: Schedule) -> tuple[tuple[Fraction, int | None], ...]:
    """Per device, (peak memory, index in its order of the pass after which the
    peak is first reached; None when memory never rises above 0)."""
    flat = flatten(schedule)
    mem = schedule.memory
    longest = max((len(o) for o in schedule.orders), default=0)
    table, scale = mem.delta_table(longest_order=longest)
    found: list[tuple[Fraction, int | None]] = []
    for dev in range(schedule.num_devices):
        a, b = int(flat.offsets[dev]), int(flat.offsets[dev + 1])
        if a == b:
            found.append((Fraction(0), None))
            continue
        levels = np.cumsum(table[flat.kind[a:b], flat.stage[a:b]])  # per device: no whole-schedule array
        k = int(np.argmax(levels))
        peak = int(levels[k])
        if peak <= 0:
            found.append((Fraction(0), None))
        else:
            found.append((Fraction(peak, scale), k))
    return tuple(found)


def peak_memory(schedule: Schedule) -> tuple[Fraction, ...]:
    """Per device, the peak activation memory over its order (never below 0:
    an empty device holds nothing)."""
    return tuple(peak for peak, _ in peak_positions(schedule))
