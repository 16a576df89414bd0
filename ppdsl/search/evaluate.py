"""The search's evaluator: time a set of per-device orders as soon as possible
and measure makespan, bubble ratio and peak memory (numba).

Orders travel as flat int arrays: device `dev` owns entries
`offsets[dev]:offsets[dev+1]` of `kind` (0 F, 1 B, 2 W), `microbatch`, `stage`.
The timing rule is ppdsl's (`ppdsl.analysis.simulate`): a pass starts when its device is
free and each pass it needs has ended, plus `comm` when that pass ran on another
device. The bubble ratio is the zero-bubble paper's: (span - busy) / span of the
device with the longest span (lowest index on a tie).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

__all__ = ["Metrics", "evaluate_orders", "time_orders"]

F, B, W = 0, 1, 2


@dataclass(frozen=True)
class Metrics:
    """What one set of orders achieves."""

    makespan: float
    bubble: float
    """The zero-bubble paper's bubble ratio."""
    idle: float
    """1 - busy / (devices x makespan)."""
    peak: np.ndarray
    """Per device, peak memory in memory-scale integer units."""
    ok: bool
    """False when the orders wait on each other in a cycle."""


@numba.njit(cache=True)
def time_orders(
    offsets, kind, microbatch, stage, stage_device, dur, comm, num_microbatches
):  # pragma: no cover - numba
    """ASAP start/end per flat pass; ok=False on a cycle of waits."""
    num_devices = offsets.shape[0] - 1
    num_stages = stage_device.shape[0]
    n = kind.shape[0]
    end_of = np.full((3, num_stages, num_microbatches), -1.0)
    start = np.zeros(n)
    end = np.zeros(n)
    position = offsets[:-1].copy()
    free = np.zeros(num_devices)
    moved = True
    while moved:
        moved = False
        for dev in range(num_devices):
            k = position[dev]
            while k < offsets[dev + 1]:
                kd, j, s = kind[k], microbatch[k], stage[k]
                ready = free[dev]
                blocked = False
                if kd == F:
                    if s > 0:
                        e = end_of[F, s - 1, j]
                        if e < 0:
                            blocked = True
                        else:
                            c = comm if stage_device[s - 1] != dev else 0.0
                            ready = max(ready, e + c)
                elif kd == B:
                    e = end_of[F, s, j]
                    if e < 0:
                        blocked = True
                    else:
                        ready = max(ready, e)
                    if s < num_stages - 1:
                        e = end_of[B, s + 1, j]
                        if e < 0:
                            blocked = True
                        else:
                            c = comm if stage_device[s + 1] != dev else 0.0
                            ready = max(ready, e + c)
                else:
                    e = end_of[B, s, j]
                    if e < 0:
                        blocked = True
                    else:
                        ready = max(ready, e)
                if blocked:
                    break
                start[k] = ready
                end[k] = ready + dur[kd, s]
                end_of[kd, s, j] = end[k]
                free[dev] = end[k]
                k += 1
                moved = True
            position[dev] = k
    ok = True
    for dev in range(num_devices):
        if position[dev] < offsets[dev + 1]:
            ok = False
    return start, end, ok


@numba.njit(cache=True)
def _measure(offsets, kind, stage, start, end, dur, mem):  # pragma: no cover - numba
    num_devices = offsets.shape[0] - 1
    best_span = -1.0
    best_bubble = 0.0
    makespan = 0.0
    busy_total = 0.0
    peak = np.zeros(num_devices, dtype=np.int64)
    for dev in range(num_devices):
        a, b = offsets[dev], offsets[dev + 1]
        if a == b:
            continue
        busy = 0.0
        last = 0.0
        level = 0
        top = 0
        for k in range(a, b):
            busy += dur[kind[k], stage[k]]
            last = max(last, end[k])
            level += mem[kind[k], stage[k]]
            top = max(top, level)
        peak[dev] = top
        span = last - start[a]
        makespan = max(makespan, last)
        busy_total += busy
        if span > best_span:
            best_span = span
            best_bubble = (span - busy) / span if span > 0 else 0.0
    idle = 1.0 - busy_total / (num_devices * makespan) if makespan > 0 else 0.0
    return makespan, best_bubble, idle, peak


def evaluate_orders(offsets, kind, microbatch, stage, stage_device, dur, comm, mem, m) -> Metrics:
    """Time the orders and measure them. `dur[kind, stage]` float, `mem[kind,
    stage]` integer memory deltas (F +M_B, B -(M_B-M_W), W -M_W, scaled)."""
    start, end, ok = time_orders(offsets, kind, microbatch, stage, stage_device, dur, comm, m)
    if not ok:
        return Metrics(float("inf"), 1.0, 1.0, np.zeros(len(offsets) - 1, dtype=np.int64), False)
    makespan, bubble, idle, peak = _measure(offsets, kind, stage, start, end, dur, mem)
    return Metrics(makespan, bubble, idle, peak, True)
