"""Lifespans: the controllable-memory paper's design rule for a building block.

Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024, §3):
a stage's *lifespan* runs from the start of its F to the end of the pass that
frees the last of its activations (W for a split backward, B when M_W = 0, BW
for a fused one; on a stage marked `recompute` its F keeps only its input, M_I,
until R restores the rest); with the block repeated every period T, the stage holds
⌈lifespan / T⌉ microbatches at its peak, and a device the sum over its stages.

That rule counts each stage at its own peak and a full M_B until the last free.
The exact steady state (the block repeated forever) is derived here twice,
independently, and the two must agree (`steady_peaks` raises otherwise):

- from the lifespans: each stage holds pieces of activation over intervals of
  one microbatch's time ([F start, B end) for M_B - M_W, [F start, W end) for
  M_W, ...); at phase t of the period, an interval [b, e) is held by
  floor((t-b)/T) - floor((t-e)/T) microbatches; a device's peak is the largest
  sum over its stages, taken where an interval begins;
- from prefix sums: the block repeated enough times, each device's passes in
  start order, the running sum of `semantics`' memory deltas, its largest value
  among the passes that start in one period after every lifespan has filled.

Under `W fill` the W slots are not written in the block: they come from the
fill's timeline (`frontend.blocks.fill_timeline`) of a long repetition, read
for a microbatch in its middle; a fill whose W do not settle into the period
has no steady state (None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ppdsl.frontend.blocks import fill_timeline, timed_slots
from ppdsl.ir.schedule import Block, MemoryModel, Schedule
from ppdsl.semantics import PassKind

__all__ = ["Lifespan", "BlockMemory", "block_memory", "steady_peaks"]

_F, _B, _W, _BW, _R = PassKind.F, PassKind.B, PassKind.W, PassKind.BW, PassKind.R


@dataclass(frozen=True)
class Lifespan:
    """One stage's lifespan in the block, in the block's time unit."""

    stage: int
    device: int
    chunk: int
    """The stage's index among its device's stages (model order)."""
    start: Fraction
    """Start of microbatch 0's F."""
    end: Fraction
    """End of microbatch 0's pass that frees the last of its activations."""
    frees: PassKind
    """That pass's kind."""
    restored: Fraction | None = None
    """On a stage marked `recompute`, the start of microbatch 0's R (from F to
    it the stage holds only its input, M_I); None elsewhere."""

    @property
    def length(self) -> Fraction:
        """end - start."""
        return self.end - self.start

    @property
    def full_length(self) -> Fraction:
        """How long the stage holds its whole activation: from R (recomputed) or
        F to the end."""
        return self.end - (self.start if self.restored is None else self.restored)


@dataclass(frozen=True)
class BlockMemory:
    """What the lifespans say about a block's memory, per stage and device."""

    period: Fraction
    lifespans: tuple[Lifespan, ...]
    """By stage."""
    rule: tuple[Fraction, ...]
    """Per device, the paper's rule: sum over its stages of ⌈lifespan/T⌉ · M_B
    (on a recomputed stage ⌈(end - R start)/T⌉ · M_B + ⌈(R start - F start)/T⌉ · M_I;
    G times that for a grouped block of G microbatches a period)."""
    steady: tuple[Fraction, ...] | None
    """Per device, the exact steady-state peak (both derivations agree); None
    when the block has no steady state to derive (`why`)."""
    why: str | None = None
    """Why `steady` is None."""

    def held(self, stage: int) -> int:
        """⌈lifespan/T⌉ of `stage`: microbatches it holds at its peak."""
        return math.ceil(self.lifespans[stage].length / self.period)

    def held_in_full(self, stage: int) -> int:
        """⌈(end - R start)/T⌉ (⌈lifespan/T⌉ without recompute): microbatches
        whose whole activation `stage` holds at its peak."""
        return math.ceil(self.lifespans[stage].full_length / self.period)


@dataclass(frozen=True)
class _Timed:
    """Microbatch `member`'s pass of `kind` on `stage` in the steady state (the
    first group's; `member` > 0 only in a grouped block)."""

    kind: PassKind
    stage: int
    device: int
    start: Fraction
    duration: Fraction
    member: int = 0


def _block_passes(schedule: Schedule) -> tuple[list[_Timed], str | None]:
    """Every pass of microbatch 0 in the steady state, with the block's times;
    (passes, None) or ([], why) when W fill does not settle."""
    block = schedule.block
    assert block is not None
    placement = schedule.placement
    w_fill = schedule.split_backward and not any(s.kind is _W for s in block.slots)
    size = block.group_size
    if not w_fill:
        return [
            _Timed(s.kind, s.stage, s.device, s.start + block.shift(g), s.duration, g)
            for s in block.slots
            for g in range(size)
        ], None
    period = Fraction(block.period)
    starts = [s.start for s in block.slots]
    ends = [s.start + s.duration for s in block.slots]
    reach = math.ceil((max(ends) - min(starts)) / period) + 2
    groups = 2 * reach + 2 * placement.num_stages + 8
    middle = groups // 2  # the group read off, and the next one to compare with
    timeline = fill_timeline(timed_slots(block, placement, groups * size), schedule.costs)
    at: dict[tuple[PassKind, int, int, int], Fraction] = {}
    for row in timeline:
        for start, p in row:
            group, member = divmod(p.microbatch, size)
            if group in (middle, middle + 1):
                at[(p.kind, p.stage, member, group)] = start - group * period
    passes = []
    for (kind, stage, member, group), offset in sorted(
        at.items(), key=lambda x: (x[0][1], x[0][0].code, x[0][2], x[0][3])
    ):
        if group != middle:
            continue
        if at.get((kind, stage, member, middle + 1)) != offset:
            return [], (
                f"W fill does not settle into the period: stage {stage}'s {kind.value} "
                "moves from one microbatch to the next"
            )
        device = placement.stage_device[stage]
        duration = Fraction(schedule.costs.duration(kind, stage))
        passes.append(_Timed(kind, stage, device, offset, duration, member))
    return passes, None


def _lifespans(schedule: Schedule, passes: list[_Timed]) -> tuple[Lifespan, ...]:
    placement, memory = schedule.placement, schedule.memory
    by = {(p.kind, p.stage): p for p in passes if p.member == 0}
    found = []
    for stage in range(schedule.num_stages):
        device = placement.stage_device[stage]
        if not schedule.split_backward:
            frees = _BW
        else:
            frees = _W if memory.weight_retained[stage] > 0 else _B
        first, last = by[(_F, stage)], by[(frees, stage)]
        recompute = by.get((_R, stage)) if memory.kept(stage) is not None else None
        found.append(
            Lifespan(
                stage,
                device,
                placement.chunks(device).index(stage),
                first.start,
                last.start + last.duration,
                frees,
                None if recompute is None else recompute.start,
            )
        )
    return tuple(found)


def _index(passes: list[_Timed]) -> dict[tuple[PassKind, int, int], _Timed]:
    """The passes by (kind, stage, member)."""
    return {(p.kind, p.stage, p.member): p for p in passes}


def _intervals(
    schedule: Schedule, index: dict[tuple[PassKind, int, int], _Timed], stage: int,
    member: int = 0,
) -> list[tuple[Fraction, Fraction, Fraction]]:
    """(begin, end, amount): the pieces of activation one microbatch of
    `stage` holds, over the time of microbatch `member` of the first group (the
    lifespan rule, written from the zero-bubble paper's memory model: F leaves
    M_B; B frees all but M_W; W frees M_W; a fused backward frees all; a
    recomputed stage holds M_I from F to R and the rest from R on). `index`:
    the passes by (kind, stage, member) (`_index`)."""
    memory = schedule.memory
    activation, weight = memory.activation[stage], memory.weight_retained[stage]
    begin = index[(_F, stage, member)].start
    pieces = []
    kept = memory.kept(stage)
    if kept is not None:  # recomputed: F keeps its input until R restores the rest
        pieces.append((begin, index[(_R, stage, member)].start, kept))
        begin = index[(_R, stage, member)].start

    def end(kind: PassKind) -> Fraction:
        p = index[(kind, stage, member)]
        return p.start + p.duration

    if not schedule.split_backward:
        return [*pieces, (begin, end(_BW), activation)]
    return [*pieces, (begin, end(_B), activation - weight), (begin, end(_W), weight)]


def _held(t: Fraction, begin: Fraction, end: Fraction, period: Fraction) -> int:
    """How many microbatches j hold [begin + jT, end + jT) at time t."""
    return math.floor((t - begin) / period) - math.floor((t - end) / period)


_EXACT_BITS = 62
"""Both derivations run in int64 over a common denominator while every sum
provably stays below 2**62; past that, in Fractions (the same values)."""


def _denominator(values) -> int:  # type: ignore[no-untyped-def]
    return math.lcm(*(Fraction(v).denominator for v in values))


def _by_lifespans(schedule: Schedule, passes: list[_Timed], period: Fraction) -> list[Fraction]:
    assert schedule.block is not None
    index = _index(passes)
    peaks = []
    for device in range(schedule.num_devices):
        pieces = [
            piece
            for stage in schedule.placement.chunks(device)
            for member in range(schedule.block.group_size)
            for piece in _intervals(schedule, index, stage, member)
        ]
        peaks.append(_lifespan_peak(pieces, period))
    return peaks


def _lifespan_peak(pieces: list[tuple[Fraction, Fraction, Fraction]], period: Fraction) -> Fraction:
    """The largest level of `pieces` where one begins: at t, the sum of amount ·
    (floor((t-b)/T) - floor((t-e)/T)); all pieces against all at once, in
    integers over the common denominators of the times and of the amounts."""
    if not pieces:
        return Fraction(0)
    unit = _denominator([period, *(x for b, e, _ in pieces for x in (b, e))])
    share = _denominator([a for _, _, a in pieces])
    begins = [int(b * unit) for b, _, _ in pieces]
    ends = [int(e * unit) for _, e, _ in pieces]
    amounts = [int(a * share) for _, _, a in pieces]
    T = int(period * unit)
    reach = max(map(abs, begins + ends)) * 2
    most_held = reach // T + 2
    if reach >= 2**_EXACT_BITS or max(map(abs, amounts)) * most_held * len(pieces) >= 2**_EXACT_BITS:
        return max(
            sum((a * _held(t, b, e, period) for b, e, a in pieces), Fraction(0))
            for t, _, _ in pieces
        )
    b = np.array(begins, dtype=np.int64)
    e = np.array(ends, dtype=np.int64)
    held = (b[:, None] - b[None, :]) // T - (b[:, None] - e[None, :]) // T  # [t, piece]
    levels = held @ np.array(amounts, dtype=np.int64)
    return Fraction(int(levels.max()), share)


def _by_prefix_sums(schedule: Schedule, passes: list[_Timed], period: Fraction) -> list[Fraction]:
    memory: MemoryModel = schedule.memory
    first = min(p.start for p in passes)
    last = max(p.start + p.duration for p in passes)
    fill = math.ceil((last - first) / period)
    low, high = first + fill * period, first + (fill + 1) * period
    mine: list[list[_Timed]] = [[] for _ in range(schedule.num_devices)]
    for p in passes:
        mine[p.device].append(p)
    return [_prefix_peak(memory, device_passes, period, fill, low, high)
            for device_passes in mine]


def _prefix_peak(memory: MemoryModel, mine: list[_Timed], period: Fraction, fill: int,
                 low: Fraction, high: Fraction) -> Fraction:
    """A device's running sum of memory deltas over its passes repeated fill + 3
    times in start order (ties by position), its largest value among the
    passes starting in [low, high) (0 if lower); in integers over common
    denominators where they provably fit."""
    if not mine:
        return Fraction(0)
    deltas = [memory.delta(p.kind, p.stage) for p in mine]
    unit = _denominator([period, low, high, *(p.start for p in mine)])
    share = _denominator(deltas)
    starts = [int(p.start * unit) for p in mine]
    steps = [int(x * share) for x in deltas]
    T = int(period * unit)
    count = (fill + 3) * len(mine)
    reach = max(map(abs, [*starts, int(low * unit), int(high * unit)])) + (fill + 3) * T
    if reach >= 2**_EXACT_BITS or max(map(abs, steps)) * count >= 2**_EXACT_BITS:
        repeated = sorted(
            (p.start + j * period, k, p) for j in range(fill + 3) for k, p in enumerate(mine)
        )
        level, peak = Fraction(0), Fraction(0)
        for start, _, p in repeated:
            level += memory.delta(p.kind, p.stage)
            if low <= start < high:
                peak = max(peak, level)
        return peak
    times = (np.array(starts, dtype=np.int64)[None, :]
             + np.arange(fill + 3, dtype=np.int64)[:, None] * T).ravel()
    position = np.tile(np.arange(len(mine)), fill + 3)
    order = np.lexsort((position, times))
    levels = np.cumsum(np.tile(np.array(steps, dtype=np.int64), fill + 3)[order])
    times = times[order]
    inside = (times >= int(low * unit)) & (times < int(high * unit))
    top = max(0, int(levels[inside].max())) if inside.any() else 0
    return Fraction(top, share)


def _overlap(passes: list[_Timed], period: Fraction, num_devices: int) -> str | None:
    """Why the steady state cannot be read off (two passes of a device overlap
    modulo the period, or a pass takes no time), or None."""
    for device in range(num_devices):
        spans = []
        for p in passes:
            if p.device != device:
                continue
            if p.duration <= 0:
                return f"stage {p.stage}'s {p.kind.value} takes no time"
            begin = p.start % period
            spans += [(begin, begin + p.duration), (begin + period, begin + period + p.duration)]
        spans.sort()
        if sum(e - b for b, e in spans) > 2 * period or any(
            b2 < e1 for (_, e1), (b2, _) in zip(spans, spans[1:], strict=False)
        ):
            return f"passes of device {device} overlap modulo the period"
    return None


def steady_peaks(schedule: Schedule) -> tuple[tuple[Fraction, ...] | None, str | None]:
    """Per device, the block's steady-state peak, derived from the lifespans and
    from prefix sums over the repeated block; (None, why) when the block has no
    steady state. Raises AssertionError when the two derivations disagree (a
    bug in ppdsl, not in the input)."""
    block: Block | None = schedule.block
    assert block is not None
    passes, why = _block_passes(schedule)
    period = Fraction(block.period)
    if why is None:
        why = _overlap(passes, period, schedule.num_devices)
    if why is not None:
        return None, why
    by_lifespans = _by_lifespans(schedule, passes, period)
    by_prefix_sums = _by_prefix_sums(schedule, passes, period)
    if by_lifespans != by_prefix_sums:
        raise AssertionError(
            f"schedule {schedule.name}: the block's steady-state peak per device is "
            f"{[str(x) for x in by_lifespans]} by its lifespans but "
            f"{[str(x) for x in by_prefix_sums]} by prefix sums over its repetition"
        )
    return tuple(by_lifespans), None


def block_memory(schedule: Schedule) -> BlockMemory | None:
    """The lifespans of a block schedule, the ⌈l/T⌉ rule per device and the
    exact steady-state peak; None for a schedule written as an order."""
    if schedule.block is None:
        return None
    period = Fraction(schedule.block.period)
    passes, why = _block_passes(schedule)
    if why is not None:
        return BlockMemory(period, (), (), None, why)
    spans = _lifespans(schedule, passes)
    memory = schedule.memory

    def by_rule(x: Lifespan) -> Fraction:
        full = math.ceil(x.full_length / period) * memory.activation[x.stage]
        if x.restored is None:
            return full
        kept = memory.kept(x.stage) or Fraction(0)
        return full + math.ceil((x.restored - x.start) / period) * kept

    size = schedule.block.group_size  # a grouped block repeats G microbatches a period
    rule = tuple(
        size * sum((by_rule(spans[s]) for s in schedule.placement.chunks(device)), Fraction(0))
        for device in range(schedule.num_devices)
    )
    steady, why = steady_peaks(schedule)
    return BlockMemory(period, spans, rule, steady, why)
