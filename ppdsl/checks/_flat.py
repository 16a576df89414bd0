"""The schedule IR as flat arrays, shared by the checks and the simulator.

Every pass of every device gets one flat index: device 0's order first, then
device 1's, ... (`offsets[dev]` is where device `dev` starts). Checks and the
simulator work on integer arrays over these indices, which is what keeps them
fast at d=64, m=1024, v=2 (about 400k passes).

`run_orders` is the one executor both the dependency check and the timed
simulation use: every device runs its order; a pass starts when its device is
free and its (at most two) dependencies have ended, plus the transfer cost
when a dependency ran on another device.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numba
import numpy as np

from ppdsl.ir.schedule import Pass, PassKind, Schedule

__all__ = [
    "KIND_CODE",
    "CODE_KIND",
    "Flat",
    "flatten",
    "Dependencies",
    "dependencies",
    "run_orders",
]

# F, B, W, BW as small integers (the first axis of the pass table).
KIND_CODE = {PassKind.F: 0, PassKind.B: 1, PassKind.W: 2, PassKind.BW: 3}
CODE_KIND = (PassKind.F, PassKind.B, PassKind.W, PassKind.BW)
_F, _B, _W, _BW = 0, 1, 2, 3


@dataclass(frozen=True, eq=False)
class Flat:
    """All passes of a schedule, flattened device by device."""

    offsets: np.ndarray  # int64[d + 1]: device dev's passes are offsets[dev]:offsets[dev+1]
    kind: np.ndarray  # int64 kind codes (KIND_CODE)
    microbatch: np.ndarray  # int64
    stage: np.ndarray  # int64
    device: np.ndarray  # int64: the device whose order holds the pass
    passes: tuple[Pass, ...]  # the Pass objects, for spans and messages

    @property
    def size(self) -> int:
        return len(self.passes)


_flat_cache: list[tuple[weakref.ref, Flat]] = []


def flatten(schedule: Schedule) -> Flat:
    """Flat arrays of `schedule`'s passes (the last result is reused for the
    same schedule object, so the checks in a row flatten once)."""
    for ref, flat in _flat_cache:
        if ref() is schedule:
            return flat
    passes: list[Pass] = []
    offsets = [0]
    for order in schedule.orders:
        passes.extend(order)
        offsets.append(len(passes))
    code = KIND_CODE
    n = len(passes)
    kind = np.fromiter((code[p.kind] for p in passes), dtype=np.int64, count=n)
    microbatch = np.fromiter((p.microbatch for p in passes), dtype=np.int64, count=n)
    stage = np.fromiter((p.stage for p in passes), dtype=np.int64, count=n)
    offs = np.asarray(offsets, dtype=np.int64)
    device = np.repeat(np.arange(len(schedule.orders), dtype=np.int64), np.diff(offs))
    flat = Flat(offs, kind, microbatch, stage, device, tuple(passes))
    _flat_cache[:] = [(weakref.ref(schedule), flat)]
    return flat


@dataclass(frozen=True, eq=False)
class Dependencies:
    """Per flat pass, the flat indices of the passes it needs (-1: none) and
    what is missing. `table[code, microbatch, stage]` is a pass's flat index."""

    dep0: np.ndarray
    dep1: np.ndarray
    table: np.ndarray
    missing: int  # how many needed passes are absent (0 for a complete schedule)


def dependencies(schedule: Schedule, flat: Flat) -> Dependencies:
    """The data dependencies of each pass (§2 of the zero-bubble paper):
    F(j,s) needs F(j,s-1); B(j,s) and BW(j,s) need F(j,s) and the backward of
    (j,s+1); W(j,s) needs B(j,s). Assumes microbatches and stages are in range
    (the passes check runs first)."""
    m, S = schedule.num_microbatches, schedule.num_stages
    table = np.full((4, m, S), -1, dtype=np.int64)
    table[flat.kind, flat.microbatch, flat.stage] = np.arange(flat.size, dtype=np.int64)
    bk = _B if schedule.split_backward else _BW
    kind, mb, st = flat.kind, flat.microbatch, flat.stage
    dep0 = np.full(flat.size, -1, dtype=np.int64)
    dep1 = np.full(flat.size, -1, dtype=np.int64)
    missing = 0

    sel = (kind == _F) & (st > 0)
    dep0[sel] = table[_F, mb[sel], st[sel] - 1]
    missing += int(np.count_nonzero(dep0[sel] < 0))

    sel = (kind == _B) | (kind == _BW)
    dep0[sel] = table[_F, mb[sel], st[sel]]
    missing += int(np.count_nonzero(dep0[sel] < 0))
    sel &= st < S - 1
    dep1[sel] = table[bk, mb[sel], st[sel] + 1]
    missing += int(np.count_nonzero(dep1[sel] < 0))

    sel = kind == _W
    dep0[sel] = table[_B, mb[sel], st[sel]]
    missing += int(np.count_nonzero(dep0[sel] < 0))
    return Dependencies(dep0, dep1, table, missing)


@numba.njit(cache=True)
def run_orders(offsets, dep0, dep1, duration, comm0, comm1):  # pragma: no cover - numba
    """Run every device's order. Returns (start, end, position): `position[dev]`
    is how far device dev got (offsets[dev+1] when it finished its order).

    A device's next pass starts at max(device free, end of each dependency +
    its transfer cost); a device whose next pass needs an unfinished pass waits.
    Sweeping the devices until none moves gives the same times in any sweep
    order, because each time is a function of earlier passes only."""
    num_devices = offsets.shape[0] - 1
    n = dep0.shape[0]
    start = np.zeros(n)
    end = np.zeros(n)
    done = np.zeros(n, dtype=np.bool_)
    position = offsets[:-1].copy()
    free = np.zeros(num_devices)
    moved = True
    while moved:
        moved = False
        for dev in range(num_devices):
            k = position[dev]
            stop = offsets[dev + 1]
            while k < stop:
                ready = free[dev]
                a = dep0[k]
                if a >= 0:
                    if not done[a]:
                        break
                    ready = max(ready, end[a] + comm0[k])
                b = dep1[k]
                if b >= 0:
                    if not done[b]:
                        break
                    ready = max(ready, end[b] + comm1[k])
                start[k] = ready
                end[k] = ready + duration[k]
                free[dev] = end[k]
                done[k] = True
                k += 1
                moved = True
            position[dev] = k
    return start, end, position
