"""Each stage's data-parallel gradient reduction follows every pass that writes
its weight gradients.

The runtime issues a stage's reduction right after the stage's last W (or BW)
in its rank's order (`semantics.reduction_point`, what the engine computes from
the compiled ops). That is correct only if no pass that adds to the stage's
weight gradients (`semantics.WRITES_WEIGHT_GRADIENTS`: B for the parameters a
split does not defer, W, BW) comes later in that order and every microbatch's
W/BW comes before it; and on the timeline, only if the reduction starts after
those passes end. Both are checked, on the rank programs the runtime runs and
on the communication lane `show` and `stats` report (`analysis.collectives`).
"""

from __future__ import annotations

from ppdsl.analysis.collectives import MODES, comm_lanes
from ppdsl.analysis.simulate import Timeline
from ppdsl.diagnostics import Diagnostic
from ppdsl.ir.rank import Compute, RankProgram
from ppdsl.ir.schedule import PassKind, Schedule, format_pass
from ppdsl.semantics import WRITES_WEIGHT_GRADIENTS, reduction_point

__all__ = ["check"]


def check(schedule: Schedule, programs: tuple[RankProgram, ...], timeline: Timeline) -> list[Diagnostic]:
    """Findings where a stage's reduction could start before its weight
    gradients are final."""
    found: list[Diagnostic] = []
    m = schedule.num_microbatches
    final = PassKind.W if schedule.split_backward else PassKind.BW
    for program in programs:
        passes = [op.pass_ for op in program.ops if isinstance(op, Compute)]
        for stage in schedule.placement.chunks(program.rank):
            at = reduction_point(passes, stage)
            if at is None:
                found.append(Diagnostic(
                    "error", f"rank {program.rank}: stage {stage} has no {final.value} pass, so "
                    "its data-parallel gradient reduction has no point to follow"))
                continue
            done = {p.microbatch for p in passes[: at + 1] if p.stage == stage and p.kind is final}
            if len(done) != m:
                found.append(Diagnostic(
                    "error", f"rank {program.rank}: stage {stage}'s reduction after "
                    f"{format_pass(passes[at], True)} would miss microbatches "
                    f"{sorted(set(range(m)) - done)}", passes[at].span))
            for p in passes[at + 1:]:
                if p.stage == stage and p.kind in WRITES_WEIGHT_GRADIENTS:
                    found.append(Diagnostic(
                        "error", f"rank {program.rank}: {format_pass(p, True)} writes stage "
                        f"{stage}'s weight gradients after its reduction (issued after "
                        f"{format_pass(passes[at], True)})", p.span))
    for mode in MODES:
        lanes = comm_lanes(schedule, timeline, mode)
        for dev, lane in enumerate(lanes.lanes):
            order = schedule.orders[dev]
            for c in lane:
                if c.kind != "reduce":
                    continue
                ends = [timeline.end[dev][i] for i, p in enumerate(order)
                        if p.stage == c.stage and p.kind in WRITES_WEIGHT_GRADIENTS]
                if ends and c.start < max(ends):
                    found.append(Diagnostic(
                        "error", f"rank {dev} ({mode}): stage {c.stage}'s reduction starts at "
                        f"{c.start:g}, before its last weight-gradient pass ends at {max(ends):g}"))
    return found
