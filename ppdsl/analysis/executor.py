"""The flat executor: per-device orders run over flat arrays (numba), shared by
the dependency check, the simulator and the search's metrics.

`pass_needs` applies the dependency relation (`semantics.NEED_KIND`,
`semantics.NEED_STAGE_OFFSET`) to flat passes: for each pass, the flat index of
each pass it waits for. `run_orders` runs every device's order: a pass starts
when its device is free and every pass it needs has ended, plus `comm` when
that pass ran on another device, and no earlier than `recv` after its device
is free then (the transfer rule, `semantics.receives`); it applies the same
relation to each pass as it reaches it, through the index table, so that no
per-pass array of needs is made (19 MB at 1.6M passes). `run_flat` runs a
`FlatSchedule`. `measure` is the metrics kernel: makespan,
the zero-bubble paper's bubble ratio, the idle fraction and each device's peak
memory (a prefix sum of `semantics.delta_table`). `evaluate` is the three in one
call, for a search that times thousands of candidate orders.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ppdsl.ir.flat import FlatSchedule
from ppdsl.jit import kernel
from ppdsl.semantics import NEED_KIND, NEED_OPTIONAL, NEED_STAGE_OFFSET, NUM_KINDS

__all__ = [
    "missing_needs",
    "needs_of",
    "pass_needs",
    "run_orders",
    "run_flat",
    "measure",
    "Metrics",
    "evaluate",
    "timed",
    "edge_array",
]


def edge_array(comm: float | np.ndarray, num_stages: int) -> np.ndarray:
    """The kernels' transfer costs: per edge b (stages b and b + 1), float64;
    one float is the same cost on every edge."""
    if isinstance(comm, np.ndarray):
        return np.ascontiguousarray(comm, dtype=np.float64)
    return np.full(max(num_stages - 1, 0), float(comm), dtype=np.float64)


@kernel
def pass_needs(
    kind, microbatch, stage, table, num_stages, lane_length, need_kind, need_offset,
    need_optional,
):  # pragma: no cover - numba
    """For each flat pass, the flat index of each pass it needs (int32;
    `table[kind, microbatch, stage]` is a pass's flat index, -1 when absent),
    and how many needed passes are absent. A need beyond the first or last stage of its lane
    (`lane_length` consecutive stages; `semantics.same_lane`) does not exist,
    nor an optional one whose pass the schedule does not run (R of a stage that
    keeps its activations: the passes check vouches for the set)."""
    n = kind.shape[0]
    width = need_kind.shape[1]
    needs = np.full((n, width), -1, dtype=np.int32)
    missing = 0
    for k in range(n):
        kd = kind[k]
        for slot in range(width):
            nk = need_kind[kd, slot]
            if nk < 0:
                continue
            ns = stage[k] + need_offset[kd, slot]
            if ns < 0 or ns >= num_stages or ns // lane_length != stage[k] // lane_length:
                continue
            q = table[nk, microbatch[k], ns]
            if q < 0 and need_optional[kd, slot]:
                continue
            needs[k, slot] = q
            if q < 0:
                missing += 1
    return needs, missing


def _lane_length(flat: FlatSchedule) -> int:
    return flat.num_stages // flat.lanes


def missing_needs(flat: FlatSchedule) -> int:
    """How many needed passes `flat` does not run (0 for a complete
    schedule); chunk by chunk, so the needs are never held for every pass.
    Assumes microbatches and stages are in range (the passes check runs first)."""
    table = flat.index_table()
    missing = 0
    for part in flat.chunks():
        missing += pass_needs(
            flat.kind[part], flat.microbatch[part], flat.stage[part], table, flat.num_stages,
            _lane_length(flat), NEED_KIND, NEED_STAGE_OFFSET, NEED_OPTIONAL,
        )[1]
    return int(missing)


def needs_of(flat: FlatSchedule, k: int) -> list[int]:
    """The flat indices of the passes flat pass `k` waits for (`run_orders`'
    rule: an overlapped pair's forward waits for its backward's needs too);
    -1 for a slot with no need."""
    unit = [k]
    if flat.joined is not None and k + 1 < flat.size and flat.joined[k + 1]:
        unit.append(k + 1)
    index, _ = pass_needs(
        flat.kind[unit], flat.microbatch[unit], flat.stage[unit], flat.index_table(),
        flat.num_stages, _lane_length(flat), NEED_KIND, NEED_STAGE_OFFSET, NEED_OPTIONAL,
    )
    return index.ravel().tolist()


@kernel
def run_orders(
    offsets, kind, microbatch, stage, device, table, lane_length, need_kind, need_offset,
    need_optional, joined, duration, comm, device_start, recv, scale,
):  # pragma: no cover - numba
    """Run every device's order, device dev's first pass no earlier than
    `device_start[dev]` (zeros: all from 0). Returns (start, end, position, missing):
    `position[dev]` is how far device dev got (offsets[dev+1] when it finished
    its order); `missing`, how many needed passes absent from `table` the passes
    that ran had (complete only when every device finished).

    A pass's needs are `pass_needs`' (`table[kind, microbatch, stage]` is a
    pass's flat index, -1 when absent; `lane_length` as there). Where
    `joined[k + 1]` (an overlapped pair; `joined` may be empty: none is), pass
    k waits for the needs of k + 1 as well: the pair starts as one unit (a
    backward that needs its own pair's forward then waits for itself: a cycle,
    which the dependency check reports). A device's next pass starts at
    max(device free, end of each needed pass, plus `comm` when that pass ran on
    another device: the transfer rule, and no earlier than `recv` after the
    device is free when it needs a pass of another device: the receiver's own
    part of a transfer, paid even when the data was sent long before; `comm[b]`:
    a transfer between stages b and b + 1, `Costs.edge_costs`); a device
    whose next pass needs an
    unfinished pass waits. `duration[kind, stage]` is a pass's cost,
    `duration[kind + num_kinds, stage]` (num_kinds: the rows of `need_kind`)
    that of a pass of an overlapped pair, times `scale[k]` where `scale` is
    not empty (a drawn duration per pass: `semantics.step_time`'s jitter). Sweeping the devices until none
    moves gives the same times in any sweep order, because each time is a
    function of earlier passes only."""
    num_devices = offsets.shape[0] - 1
    n = kind.shape[0]
    num_stages = table.shape[2]
    num_kinds, width = need_kind.shape
    start = np.zeros(n)
    end = np.zeros(n)
    done = np.zeros(n, dtype=np.bool_)
    position = offsets[:-1].copy()
    free = device_start.copy()
    missing = 0
    moved = True
    while moved:
        moved = False
        for dev in range(num_devices):
            k = position[dev]
            stop = offsets[dev + 1]
            while k < stop:
                ready = free[dev]
                blocked = False
                absent = 0
                last = k + 1 if k + 1 < joined.shape[0] and joined[k + 1] else k
                for p in range(k, last + 1):
                    kd = kind[p]
                    for slot in range(width):
                        nk = need_kind[kd, slot]
                        if nk < 0:
                            continue
                        ns = stage[p] + need_offset[kd, slot]
                        if ns < 0 or ns >= num_stages or ns // lane_length != stage[p] // lane_length:
                            continue
                        a = table[nk, microbatch[p], ns]
                        if a < 0:
                            if not need_optional[kd, slot] and p == k:
                                absent += 1
                            continue
                        if not done[a]:
                            blocked = True
                            break
                        if device[a] != dev:
                            edge = ns if ns < stage[p] else stage[p]
                            ready = max(ready, end[a] + comm[edge], free[dev] + recv)
                        else:
                            ready = max(ready, end[a])
                    if blocked:
                        break
                if blocked:
                    break
                row = kind[k]
                if last > k or (k < joined.shape[0] and joined[k]):
                    row += num_kinds
                start[k] = ready
                took = duration[row, stage[k]]
                if scale.shape[0] > 0:
                    took *= scale[k]
                end[k] = ready + took
                free[dev] = end[k]
                done[k] = True
                missing += absent
                k += 1
                moved = True
            position[dev] = k
    return start, end, position, missing


def run_flat(flat: FlatSchedule, duration: np.ndarray, comm: float | np.ndarray,
             device_start: np.ndarray | None = None, recv: float = 0.0,
             scale: np.ndarray | None = None):
    """`run_orders` over `flat` (`duration` with 2 * NUM_KINDS rows when a pair
    is overlapped; `comm[b]`: a transfer between stages b and b + 1, or one
    float for every edge; `device_start`: per device, when it may start, default 0;
    `recv`: the receiver's part of a transfer, `cost recv`; `scale`: per flat
    pass, a factor on its duration, default none).
    Assumes microbatches and stages are in range."""
    joined = flat.joined if flat.joined is not None else np.zeros(0, dtype=np.bool_)
    if device_start is None:
        device_start = np.zeros(flat.offsets.shape[0] - 1)
    return run_orders(
        flat.offsets, flat.kind, flat.microbatch, flat.stage,
        flat.device, flat.index_table(), _lane_length(flat), NEED_KIND, NEED_STAGE_OFFSET,
        NEED_OPTIONAL, joined, duration, edge_array(comm, flat.num_stages),
        np.asarray(device_start, dtype=np.float64),
        float(recv), np.zeros(0) if scale is None else np.asarray(scale, dtype=np.float64),
    )


@kernel
def measure(offsets, kind, stage, start, end, duration, delta):  # pragma: no cover - numba
    """(makespan, bubble ratio, idle fraction, peak[d]) of timed orders.
    `duration[kind, stage]` float, `delta[kind, stage]` integer memory deltas
    (`semantics.delta_table`). The bubble ratio is the zero-bubble paper's:
    (span - busy) / span of the device with the longest span (the lowest index
    on a tie)."""
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
            busy += duration[kind[k], stage[k]]
            last = max(last, end[k])
            level += delta[kind[k], stage[k]]
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


@kernel
def _timed(
    offsets, kind, microbatch, stage, stage_device, duration, comm, num_microbatches,
    need_kind, need_offset, need_optional, num_kinds, lanes,
):  # pragma: no cover - numba
    num_stages = stage_device.shape[0]
    n = kind.shape[0]
    table = np.full((num_kinds, num_microbatches, num_stages), -1, dtype=np.int64)
    for k in range(n):
        table[kind[k], microbatch[k], stage[k]] = k
    device = np.empty(n, dtype=np.int64)
    for dev in range(offsets.shape[0] - 1):
        device[offsets[dev] : offsets[dev + 1]] = dev
    start, end, position, missing = run_orders(
        offsets, kind, microbatch, stage, device, table, num_stages // lanes, need_kind,
        need_offset, need_optional, np.zeros(0, dtype=np.bool_), duration, comm,
        np.zeros(offsets.shape[0] - 1), 0.0, np.zeros(0),
    )
    # (the count covers every pass when every device finished its order)
    ok = missing == 0
    for dev in range(offsets.shape[0] - 1):
        if position[dev] < offsets[dev + 1]:
            ok = False
    return start, end, ok


@dataclass(frozen=True)
class Metrics:
    """What one set of orders achieves."""

    makespan: float
    bubble: float
    """The zero-bubble paper's bubble ratio."""
    idle: float
    """1 - busy / (devices x makespan)."""
    peak: np.ndarray
    """Per device, peak memory in the delta table's integer units."""
    ok: bool
    """False when the orders wait on each other in a cycle (or miss a pass)."""


@kernel
def _evaluate(
    offsets, kind, microbatch, stage, stage_device, duration, comm, delta, num_microbatches,
    need_kind, need_offset, need_optional, num_kinds, lanes,
):  # pragma: no cover - numba
    start, end, ok = _timed(
        offsets, kind, microbatch, stage, stage_device, duration, comm, num_microbatches,
        need_kind, need_offset, need_optional, num_kinds, lanes,
    )
    if not ok:
        return False, np.inf, 1.0, 1.0, np.zeros(offsets.shape[0] - 1, dtype=np.int64)
    makespan, bubble, idle, peak = measure(offsets, kind, stage, start, end, duration, delta)
    return True, makespan, bubble, idle, peak


def evaluate(
    offsets: np.ndarray,
    kind: np.ndarray,
    microbatch: np.ndarray,
    stage: np.ndarray,
    stage_device: np.ndarray,
    duration: np.ndarray,
    comm: float | np.ndarray,
    delta: np.ndarray,
    num_microbatches: int,
    lanes: int = 1,
) -> Metrics:
    """Time flat orders as soon as possible (`run_orders` under the dependency
    relation and the transfer rule) and `measure` them, in one kernel call (a
    search times thousands of candidates). `comm`: per edge (`Costs.edge_costs`)
    or one float for every edge. `duration[kind code, stage]` and
    `delta[kind code, stage]` as in `measure`; `lanes`: the placement's pipelines."""
    ok, makespan, bubble, idle, peak = _evaluate(
        offsets, kind, microbatch, stage, stage_device, duration,
        edge_array(comm, stage_device.shape[0]), delta, num_microbatches, NEED_KIND,
        NEED_STAGE_OFFSET, NEED_OPTIONAL, NUM_KINDS, lanes,
    )
    return Metrics(makespan, bubble, idle, peak, ok)


def timed(
    offsets: np.ndarray,
    kind: np.ndarray,
    microbatch: np.ndarray,
    stage: np.ndarray,
    stage_device: np.ndarray,
    duration: np.ndarray,
    comm: float | np.ndarray,
    num_microbatches: int,
    lanes: int = 1,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(start, end, ok) of flat orders timed as soon as possible (`lanes`: the
    placement's pipelines)."""
    return _timed(
        offsets, kind, microbatch, stage, stage_device, duration,
        edge_array(comm, stage_device.shape[0]), num_microbatches, NEED_KIND,
        NEED_STAGE_OFFSET, NEED_OPTIONAL, NUM_KINDS, lanes,
    )
