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
"""

from __future__ import annotations

from ppdsl.analysis.collectives import MODES, comm_lanes
from ppdsl.analysis.simulate import Timeline
from ppdsl.diagnostics import Diagnostic
from ppdsl.ir.schedule import PassKind, Schedule, format_pass
from ppdsl.semantics import WRITES_WEIGHT_GRADIENTS, reduction_points

__all__ = ["check"]


def check(schedule: Schedule, timeline: Timeline | None = None) -> list[Diagnostic]:
    """Findings where a stage's reduction could start before its weight
    gradients are final (on the lane too when `timeline` is given)."""
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
