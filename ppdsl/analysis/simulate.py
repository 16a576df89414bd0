"""Timed simulation of a schedule's per-device orders under its cost model.

Each device runs its passes in its order. A pass starts as soon as its device
is free and every pass it depends on has ended, plus the transfer's cost when
that pass ran on another device (`Costs.edge_costs`: `cost comm`, latency +
bytes / bandwidth per edge, or a topology's link; none between two stages on
one device), and then no earlier than `costs.recv` after its device is free (the
receiver's own part of a transfer, `semantics.DEFAULT_RECV`; 0 unless the file
says `cost recv`). Nothing else waits: this is the "squeeze" of the controllable-memory
paper, which re-times a fixed order as early as possible. A pass holds its
device for its cost plus its stage's `overhead` (the runtime's work around a
pass); the whole step (`Timeline.step_time`, `semantics.step_time`) runs from
one gradient-norm all-reduce to the next: each device's passes start after its
own optimizer step, and the all-reduce waits for the last pass; under `cost
jitter` it is the median of seeded draws of every pass's duration
(`semantics.STEP_COSTS`), the bubble and makespan staying those of the costs.

A step's lengths (`simulate(schedule, lengths=...)`): where the costs follow
the tokens (`cost F[s] = a + b*tokens + c*tokens^2`), each pass lasts its
own microbatch's cost (`Costs.duration_cube`), and the peaks are those of the
memory model at each microbatch's length (`memory.peak_memory_at`). Without
lengths every microbatch has the file's `tokens`.

`simulate` runs a numba kernel over flat arrays; `simulate_reference`
(tests/oracles/simulate.py) is plain Python written from the definition (a
pass's start is the max of its predecessors' ends) and exists to check it.

Bubble ratio, as the zero-bubble paper measures it: per device,
(span - busy) / span, where the span runs from the start of the device's first
pass to the end of its last; the schedule's ratio is that of the device with the
longest span (the lowest-numbered one on a tie). `idle_fraction` is the
whole-pipeline 1 - busy / (devices x makespan).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ppdsl import semantics
from ppdsl.analysis.executor import missing_needs, run_flat
from ppdsl.analysis.memory import check_lengths, peak_memory, peak_memory_at
from ppdsl.ir.flat import FlatSchedule, flatten
from ppdsl.ir.schedule import Schedule
from ppdsl.semantics import NUM_KINDS, allocates_at_start

__all__ = [
    "Timeline", "SimulationError", "simulate", "pass_durations", "memory_over_time",
    "memory_over_time_by_device",
]


class SimulationError(ValueError):
    """The orders cannot be simulated: a pass is missing, or the orders wait on
    each other in a cycle (the dependency check reports which)."""


@dataclass(frozen=True)
class Timeline:
    """When every pass runs, and what follows from it. Times are in the unit of
    the file's `cost` declarations; memory in the unit of its `memory` ones."""

    start: tuple[tuple[float, ...], ...]
    """start[dev][k]: start time of schedule.orders[dev][k]."""
    end: tuple[tuple[float, ...], ...]
    """end[dev][k]: end time of schedule.orders[dev][k]."""
    makespan: float
    """End of the last pass (time starts at 0)."""
    busy: tuple[float, ...]
    """Per device, the sum of its pass durations."""
    span_start: tuple[float, ...]
    """Per device, the start of its first pass (0 for a device with no pass)."""
    span_end: tuple[float, ...]
    """Per device, the end of its last pass (0 for a device with no pass)."""
    bubble_ratio: float
    """The zero-bubble paper's bubble ratio: (span - busy) / span of the device
    with the longest span."""
    bubble_time: float
    """span - busy of that same device."""
    idle_fraction: float
    """1 - sum(busy) / (devices x makespan)."""
    peak_memory: tuple[Fraction, ...]
    """Per device, the peak activation memory (exact, from the order alone)."""
    memory_over_time: tuple[tuple[tuple[float, float], ...], ...] | None = None
    """Per device, (time, memory) after every change: an F allocates at its
    start, a B/W/BW frees at its end. None unless asked for."""
    step_time: float = 0.0
    """The whole training step (`semantics.step_time`): each device's passes
    started after its optimizer step, to the end of the last one, then the
    gradient-norm all-reduce; the makespan when the costs declare no step cost."""


def simulate(schedule: Schedule, *, memory_over_time: bool = False,
             lengths: Sequence[int] | None = None) -> Timeline:
    """The timed simulation (numba kernel); `lengths`: microbatch j's tokens
    (`lengths[j]`) where costs or memory follow the tokens. Raises
    SimulationError when a pass is missing or the orders wait on each other in
    a cycle, ValueError when `lengths` does not fit the schedule."""
    flat = flatten(schedule)
    missing = missing_needs(flat)
    if missing:
        raise SimulationError(
            f"cannot simulate: {missing} needed passes are missing (run the checks first)"
        )
    if lengths is not None:
        check_lengths(schedule, lengths)
        lengths = [int(x) for x in lengths]
    table = np.array(schedule.costs.duration_table(), dtype=np.float64)
    # the passes of an overlapped pair take rows of their own: scaled by `overlap`
    table = np.concatenate([table, table * schedule.costs.overlap])
    per_pass = pass_durations(schedule, flat, lengths) if lengths is not None else None
    if per_pass is not None:
        # each pass its own duration: a table of ones, scaled pass by pass
        table = np.ones_like(table)
    start, end, position, _ = run_flat(flat, table,
                                       schedule.costs.edge_costs(schedule.num_stages),
                                       recv=schedule.costs.recv, scale=per_pass)
    stuck = [dev for dev in range(schedule.num_devices) if position[dev] < flat.offsets[dev + 1]]
    if stuck:
        raise SimulationError(
            f"cannot simulate: devices {stuck} wait on each other in a cycle "
            "(the dependency check shows the cycle)"
        )
    # one float object per distinct time, not one per pass (24 bytes each): the
    # same value is the same object (not where a -0.0 could turn into 0.0)
    times: dict[float, float] = {}
    intern = times.setdefault if not (np.signbit(start).any() or np.signbit(end).any()) else None
    offsets = flat.offsets.tolist()

    def rows(values: np.ndarray) -> tuple[tuple[float, ...], ...]:
        out = []
        for a, b in itertools.pairwise(offsets):
            row = values[a:b].tolist()
            out.append(tuple(map(intern, row, row)) if intern else tuple(row))
        return tuple(out)

    # the tuples replace the arrays one at a time (the peak holds two of the three)
    starts = rows(start)
    del start
    ends = rows(end)
    del end
    # fsum: correctly rounded, so both simulators agree to the last bit; device by
    # device, so that no per-pass duration array is made
    busy = [math.fsum(_durations(flat, table, a, b) if per_pass is None
                      else per_pass[a:b].tolist()) for a, b in itertools.pairwise(offsets)]
    step = (_step_time(schedule, flat, table, per_pass)
            if schedule.costs.models_step else None)
    return _timeline(schedule, starts, ends, busy, memory_over_time, step_time=step,
                     lengths=lengths)


def pass_durations(schedule: Schedule, flat: FlatSchedule, lengths: Sequence[int]) -> np.ndarray:
    """Per flat pass, how long it holds its device when microbatch j has
    `lengths[j]` tokens (`Costs.duration_cube`; a pass of an overlapped pair
    scaled by `overlap`)."""
    cube = schedule.costs.duration_cube(lengths)
    durations = cube[flat.kind, flat.stage, flat.microbatch]
    if flat.joined is not None:
        joined = flat.joined
        paired = joined | np.append(joined[1:], False)
        durations = np.where(paired, durations * schedule.costs.overlap, durations)
    return np.ascontiguousarray(durations, dtype=np.float64)


def _step_time(schedule: Schedule, flat: FlatSchedule, table: np.ndarray,
               per_pass: np.ndarray | None = None) -> float:
    """`semantics.step_time`: the orders run again with each device's passes
    starting after its optimizer step (the sum of its stages'); under `cost
    jitter`, the median of `semantics.JITTER_DRAWS` such steps, each pass's
    cost times a seeded log-normal draw of mean 1 (a cost is a mean,
    `semantics.pass_cost`)."""
    costs = schedule.costs
    optimizer = np.zeros(schedule.num_devices)
    if costs.optimizer:
        for stage, device in enumerate(schedule.placement.stage_device):
            optimizer[device] += costs.optimizer[stage]
    bounds = list(itertools.pairwise(flat.offsets.tolist()))

    def one_step(scale: np.ndarray | None) -> float:
        _, end, _, _ = run_flat(flat, table, costs.edge_costs(schedule.num_stages), optimizer, costs.recv, scale)
        last = [max([float(optimizer[dev]), *end[a:b].tolist()])
                for dev, (a, b) in enumerate(bounds)]
        return semantics.step_time(last, costs.norm)

    if not costs.jitter:
        return one_step(per_pass)
    draws = np.random.default_rng(0)
    size = int(flat.kind.shape[0])
    sigma = costs.jitter
    base = per_pass if per_pass is not None else np.ones(size)
    return float(np.median([one_step(base * draws.lognormal(-sigma * sigma / 2, sigma, size))
                            for _ in range(semantics.JITTER_DRAWS)]))


def _durations(flat: FlatSchedule, table: np.ndarray, a: int, b: int) -> list[float]:
    """The durations of flat passes a:b (`run_orders`' rows: a pass of an
    overlapped pair takes its kind's second row)."""
    row = flat.kind[a:b].astype(np.int64)
    if flat.joined is not None:
        joined = flat.joined[a : b + 1]
        paired = joined[: b - a] | np.append(joined[1:], False)[: b - a]
        row += NUM_KINDS * paired
    return table[row, flat.stage[a:b]].tolist()


def _timeline(
    schedule: Schedule,
    start: tuple[tuple[float, ...], ...],
    end: tuple[tuple[float, ...], ...],
    busy: list[float],
    with_memory: bool,
    profile_of: Callable[
        [Schedule, tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]],
        tuple[tuple[tuple[float, float], ...], ...],
    ] | None = None,
    step_time: float | None = None,
    lengths: Sequence[int] | None = None,
) -> Timeline:
    num_devices = schedule.num_devices
    span_start = tuple(s[0] if s else 0.0 for s in start)
    span_end = tuple(max(e) if e else 0.0 for e in end)
    makespan = max(span_end, default=0.0)
    spans = [span_end[d] - span_start[d] for d in range(num_devices)]
    longest = max(range(num_devices), key=lambda d: (spans[d], -d)) if num_devices else 0
    bubble_time = spans[longest] - busy[longest] if num_devices else 0.0
    bubble_ratio = bubble_time / spans[longest] if num_devices and spans[longest] > 0 else 0.0
    total = num_devices * makespan
    idle_fraction = 1.0 - sum(busy) / total if total > 0 else 0.0
    profile: tuple[tuple[tuple[float, float], ...], ...] | None
    if with_memory and lengths is not None and schedule.memory.follows_tokens:
        profile = tuple(_exact_profile(schedule, dev, start[dev], end[dev], lengths)
                        for dev in range(num_devices))
    else:
        profile = (profile_of or _memory_over_time)(schedule, start, end) if with_memory else None
    step = makespan if step_time is None else step_time
    return Timeline(
        start=start,
        end=end,
        makespan=makespan,
        busy=tuple(busy),
        span_start=span_start,
        span_end=span_end,
        bubble_ratio=bubble_ratio,
        bubble_time=bubble_time,
        idle_fraction=idle_fraction,
        peak_memory=peak_memory(schedule) if lengths is None else peak_memory_at(schedule, lengths),
        memory_over_time=profile,
        step_time=step,
    )


def _memory_over_time(
    schedule: Schedule, start: tuple[tuple[float, ...], ...], end: tuple[tuple[float, ...], ...]
) -> tuple[tuple[tuple[float, float], ...], ...]:
    return tuple(_device_profiles(schedule, start, end))


def _device_profiles(
    schedule: Schedule, start: tuple[tuple[float, ...], ...], end: tuple[tuple[float, ...], ...]
) -> Iterator[tuple[tuple[float, float], ...]]:
    """Per device, (time, level) after each pass, device by device: the level a
    prefix sum of the exact integer deltas (`semantics.delta_table`), divided by
    their scale once (the same float as the exact Fraction's, while both fit a
    float exactly; a device where they might not is summed in Fractions)."""
    memory = schedule.memory
    flat = flatten(schedule)
    longest = max((len(o) for o in schedule.orders), default=0)
    table, scale = memory.delta_table(longest_order=longest)  # M_I of recomputed stages too
    at_start = np.array([allocates_at_start(k) for k in semantics.KINDS])
    # the times are the timeline's own float objects, and one float object per
    # distinct level (an integer over a positive scale: never -0.0)
    same_level: dict[float, float] = {}
    for dev in range(schedule.num_devices):
        a, b = int(flat.offsets[dev]), int(flat.offsets[dev + 1])
        kind = flat.kind[a:b]
        levels = np.cumsum(table[kind, flat.stage[a:b]]) if table.dtype == np.int64 else None
        if levels is None or scale >= 2**53 or (len(levels) and np.abs(levels).max() >= 2**53):
            yield _exact_profile(schedule, dev, start[dev], end[dev])
            continue
        times = [
            s if first else e
            for s, e, first in zip(start[dev], end[dev], at_start[kind].tolist(), strict=True)
        ]
        values = (levels.astype(np.float64) / scale).tolist()
        values = list(map(same_level.setdefault, values, values))
        yield tuple(zip(times, values, strict=True))


def _exact_profile(
    schedule: Schedule, dev: int, start: tuple[float, ...], end: tuple[float, ...],
    lengths: Sequence[int] | None = None,
) -> tuple[tuple[float, float], ...]:
    memory = schedule.memory
    level = Fraction(0)
    points: list[tuple[float, float]] = []
    for p, s, e in zip(schedule.orders[dev], start, end, strict=True):
        at = memory if lengths is None else memory.at(lengths[p.microbatch])
        level += at.delta(p.kind, p.stage)
        points.append((s if allocates_at_start(p.kind) else e, float(level)))
    return tuple(points)


def memory_over_time_by_device(
    schedule: Schedule, timeline: Timeline
) -> Iterator[tuple[tuple[float, float], ...]]:
    """`memory_over_time`, made one device at a time as the iterator is
    advanced (a caller that writes them out holds one device's at once)."""
    if timeline.memory_over_time is not None:
        return iter(timeline.memory_over_time)
    return _device_profiles(schedule, timeline.start, timeline.end)


def memory_over_time(
    schedule: Schedule, timeline: Timeline
) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Per device, `(time, level)` after each pass of an already simulated
    `timeline` (an F allocates at its start, a B or W frees at its end)."""
    if timeline.memory_over_time is not None:
        return timeline.memory_over_time
    return _memory_over_time(schedule, timeline.start, timeline.end)
