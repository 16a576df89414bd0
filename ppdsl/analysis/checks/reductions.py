"""Each stage's data-parallel gradient reduction follows every pass that writes
its weight gradients.

The runtime issues a stage's reduction right after the stage's last W (or BW)
in its rank's order (`semantics.reduction_point`, what the engine computes from
the compiled ops). That is correct only if no pass that adds to the stage's
weight gradients (`semantics.WRITES_WEIGHT_GRADIENTS`: B for the parameters a
split does not defer, W, BW) comes later in that order and every microbatch's
W/BW comes before it; and on the timeline, only if the reduction starts after
those passes end. Both are checked: on the per-device orders (the compute order
of the rank programs the runtime runs: lowering only adds exchanges between
passes) and on the communication lane `show` and `stats` report
(`analysis.collectives`).

Both halves find nothing on a well-formed schedule, the common case at scale, so
an array pass over the flat schedule (`_clean`) proves that first: where every
stage a device runs has a W/BW, no weight-gradient pass after the last of them,
each F's microbatch a W/BW on that device, and each device's pass ends never
decreasing along its order, neither half can find anything (the lane starts a
reduction at or after its point's end, which is then the latest end of every
pass writing the stage). Otherwise the per-pass scan below finds the messages.
"""

from __future__ import annotations

import numpy as np

from ppdsl.analysis.collectives import MODES, comm_lanes
from ppdsl.analysis.simulate import Timeline
from ppdsl.diagnostics import Diagnostic
from ppdsl.ir.flat import flatten
from ppdsl.ir.schedule import PassKind, Schedule, format_pass
from ppdsl.semantics import WRITES_WEIGHT_GRADIENTS, reduction_points

__all__ = ["check"]


def check(schedule: Schedule, timeline: Timeline | None = None) -> list[Diagnostic]:
    """Findings where a stage's reduction could start before its weight
    gradients are final (on the lane too when `timeline` is given)."""
    return [] if _clean(schedule, timeline) else scan(schedule, timeline)


def scan(schedule: Schedule, timeline: Timeline | None = None) -> list[Diagnostic]:
    """`check` pass by pass (what it runs where the array pass is not sure)."""
    found: list[Diagnostic] = []
    final = PassKind.W if schedule.split_backward else PassKind.BW
    for rank, passes in enumerate(schedule.orders):
        points = reduction_points(passes)
        finals: dict[int, set[int]] = {}
        forwards: dict[int, set[int]] = {}
        late: dict[int, list[int]] = {}
        for i, p in enumerate(passes):
            if p.kind is PassKind.F:
                forwards.setdefault(p.stage, set()).add(p.microbatch)
            if p.kind is final:
                finals.setdefault(p.stage, set()).add(p.microbatch)
            if p.kind in WRITES_WEIGHT_GRADIENTS and i > points.get(p.stage, -1):
                late.setdefault(p.stage, []).append(i)
        for stage in sorted({p.stage for p in passes}):
            at = points.get(stage)
            if at is None:
                found.append(Diagnostic(
                    "error", f"rank {rank}: stage {stage} has no {final.value} pass, so "
                    "its data-parallel gradient reduction has no point to follow"))
                continue
            # every microbatch the stage runs here (all m, or a bidirectional
            # placement's half) has its W/BW before the point
            done, ran = finals.get(stage, set()), forwards.get(stage, set())
            if ran - done:
                found.append(Diagnostic(
                    "error", f"rank {rank}: stage {stage}'s reduction after "
                    f"{format_pass(passes[at], True)} would miss microbatches "
                    f"{sorted(ran - done)}", passes[at].span))
            for i in late.get(stage, []):
                p = passes[i]
                found.append(Diagnostic(
                    "error", f"rank {rank}: {format_pass(p, True)} writes stage "
                    f"{stage}'s weight gradients after its reduction (issued after "
                    f"{format_pass(passes[at], True)})", p.span))
    if timeline is None:
        return found
    last_end = []
    for dev, order in enumerate(schedule.orders):
        ends: dict[int, float] = {}
        for i, p in enumerate(order):
            if p.kind in WRITES_WEIGHT_GRADIENTS:
                ends[p.stage] = max(ends.get(p.stage, 0.0), float(timeline.end[dev][i]))
        last_end.append(ends)
    for mode in MODES:
        lanes = comm_lanes(schedule, timeline, mode)
        for dev, lane in enumerate(lanes.lanes):
            for c in lane:
                end = last_end[dev].get(c.stage)
                if c.kind == "reduce" and end is not None and c.start < end:
                    found.append(Diagnostic(
                        "error", f"rank {dev} ({mode}): stage {c.stage}'s reduction starts at "
                        f"{c.start:g}, before its last weight-gradient pass ends at {end:g}"))
    return found


def _codes(kinds: object) -> list[int]:
    return [k.code for k in kinds]  # type: ignore[attr-defined]


def _clean(schedule: Schedule, timeline: Timeline | None) -> bool:
    """True when `check` has nothing to find (module docstring); False when it
    may (then the scan decides)."""
    flat = flatten(schedule)
    if flat.size == 0:
        return not schedule.orders or all(not o for o in schedule.orders)
    kind, stage, mb = flat.kind, flat.stage, flat.microbatch
    if (stage.min() < 0 or stage.max() >= flat.num_stages or mb.min() < 0
            or mb.max() >= flat.num_microbatches):
        return False  # a malformed schedule: the scan words it
    index = np.arange(flat.size, dtype=np.int64)
    key = flat.device * flat.num_stages + stage  # (device, stage)
    slots = flat.num_devices * flat.num_stages
    final = PassKind.W if schedule.split_backward else PassKind.BW
    points = np.full(slots, -1, dtype=np.int64)  # semantics.reduction_points
    is_point = np.isin(kind, _codes((PassKind.W, PassKind.BW)))
    np.maximum.at(points, key[is_point], index[is_point])
    last_write = np.full(slots, -1, dtype=np.int64)
    writes = np.isin(kind, _codes(WRITES_WEIGHT_GRADIENTS))
    np.maximum.at(last_write, key[writes], index[writes])
    present = np.zeros(slots, dtype=np.bool_)
    present[key] = True
    if (present & (points < 0)).any() or (last_write > points).any():
        return False
    forwards = kind == PassKind.F.code
    # the F's microbatch has its final pass on this device (where the final pass
    # repeats, the table holds one of them: a miss here only sends it to the scan)
    finals = flat.index_table()[final.code, mb[forwards], stage[forwards]]
    if (finals < 0).any() or (flat.device[np.maximum(finals, 0)] != flat.device[forwards]).any():
        return False
    if timeline is None:
        return True
    return all(
        not (np.diff(np.asarray(ends, dtype=np.float64)) < 0).any() for ends in timeline.end
    )
