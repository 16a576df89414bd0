"""Peak activation memory per device, from the per-device order alone.

A device's memory after its k-th pass is the prefix sum of the memory deltas
(`semantics.MEMORY_COEFFICIENTS`) over its order, so its peak is fixed by the
order, whatever the timing. The sums are exact: the deltas are scaled to
integers over their common denominator (`semantics.delta_table`); `semantics.memory_peak` is the one peak.

Where the memory model follows the tokens (`memory M_B = a + b*tokens`),
`peak_memory_at` takes a step's lengths: each pass's delta is its
microbatch's, still summed exactly. The order fixes the peak for any given
lengths; different lengths give a different (exact) peak.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from ppdsl import semantics
from ppdsl.ir.flat import flatten
from ppdsl.ir.schedule import MemoryModel, Schedule
from ppdsl.semantics import memory_peak

__all__ = ["peak_positions", "peak_memory", "peak_memory_at", "check_lengths"]


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


def check_lengths(schedule: Schedule, lengths: Sequence[int]) -> None:
    """Raise ValueError unless `lengths` gives every microbatch of `schedule`
    a length of at least 1 token."""
    if len(lengths) != schedule.num_microbatches:
        raise ValueError(f"{len(lengths)} lengths for {schedule.num_microbatches} microbatches: "
                         "give one length per microbatch of the step")
    bad = [x for x in lengths if not isinstance(x, int | np.integer) or x < 1]
    if bad:
        raise ValueError(f"a microbatch's length is a whole number of tokens >= 1, got {bad[0]!r}")


@functools.lru_cache(maxsize=16)
def _token_deltas(mem: MemoryModel) -> tuple[list[list[list[int]]], int]:
    """Per power of tokens (1, t, t^2), the exact delta per (kind code,
    stage) over one common scale (a step reuses its plan's model)."""
    tables = []
    for power in range(3):
        b, w, i = ([p[power] for p in row] for row in mem.tokens)
        kept = [None if k is None else x for k, x in zip(mem.kept_input, i, strict=False)]
        tables.append(semantics.delta_table(b, w, (), 0, kept))
    scale = math.lcm(*(sc for _, sc in tables))
    return [[[int(x) * (scale // sc) for x in row] for row in np.asarray(table).tolist()]
            for table, sc in tables], scale


def peak_memory_at(schedule: Schedule, lengths: Sequence[int]) -> tuple[Fraction, ...]:
    """Per device, the exact peak activation memory when microbatch j holds
    `lengths[j]` tokens (the memory model's amounts at each microbatch's
    length; `peak_memory` where the model does not follow tokens). A pass's
    delta is linear in M_B, M_W and M_I, so it is d0 + d1*t + d2*t^2 with each
    d the delta of one power's coefficients: three `delta_table`s over one
    scale, summed in integers."""
    check_lengths(schedule, lengths)
    mem = schedule.memory
    if not mem.follows_tokens:
        return peak_memory(schedule)
    flat = flatten(schedule)
    longest = max((len(o) for o in schedule.orders), default=0)
    rows, scale = _token_deltas(mem)
    t = np.asarray([int(x) for x in lengths], dtype=object)[flat.microbatch]
    big = max(max((abs(x) for x in row), default=0) for c in rows for row in c)
    top = max(int(x) for x in lengths)
    exact_int64 = big * (1 + top + top * top) * max(1, longest) < 2**62
    coef = [np.array(c, dtype=np.int64 if exact_int64 else object) for c in rows]
    if exact_int64:
        t = t.astype(np.int64)
    steps = (coef[0][flat.kind, flat.stage] + coef[1][flat.kind, flat.stage] * t
             + coef[2][flat.kind, flat.stage] * t * t)
    peaks = []
    for a, b in itertools.pairwise(flat.offsets.tolist()):
        top_level = max(0, int(np.max(np.cumsum(steps[a:b])))) if b > a else 0
        peaks.append(Fraction(top_level, scale))
    return tuple(peaks)
