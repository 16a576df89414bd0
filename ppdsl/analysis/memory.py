"""Peak activation memory per device, from the per-device order alone.

A device's memory after its k-th pass is the prefix sum of the memory deltas
(`semantics.MEMORY_COEFFICIENTS`) over its order, so its peak is fixed by the
order, whatever the timing. The sums are exact: the deltas are scaled to
integers over their common denominator (`semantics.delta_table`); `semantics.memory_peak` is the one peak.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

from ppdsl.ir.flat import flatten
from ppdsl.ir.schedule import Schedule
from ppdsl.semantics import memory_peak

__all__ = ["peak_positions", "peak_memory"]


def peak_positions(schedule: Schedule) -> tuple[tuple[Fraction, int | None], ...]:
    """Per device, (peak memory, index in its order of the pass after which the
    peak is first reached; None when memory never rises above 0)."""
    flat = flatten(schedule)
    mem = schedule.memory
    longest = max((len(o) for o in schedule.orders), default=0)
    table, scale = mem.delta_table(longest_order=longest)
    return tuple(
        memory_peak(table, scale, flat.kind[a:b], flat.stage[a:b])  # per device: no whole-schedule array
        for a, b in itertools.pairwise(flat.offsets.tolist())
    )


def peak_memory(schedule: Schedule) -> tuple[Fraction, ...]:
    """Per device, the peak activation memory over its order (never below 0:
    an empty device holds nothing)."""
    return tuple(peak for peak, _ in peak_positions(schedule))
