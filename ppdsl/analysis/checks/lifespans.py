"""`expect lifespan[s] OP bound` against the block's lifespans
(`ppdsl.analysis.lifespans`, the controllable-memory paper's design rule), and
the block's steady-state peak derived both from its lifespans and from prefix
sums over its repetition: the two must agree (an internal error otherwise).
"""

from __future__ import annotations

import operator

from ppdsl.analysis.lifespans import BlockMemory, block_memory
from ppdsl.diagnostics import Diagnostic
from ppdsl.ir.schedule import Expect, Schedule
from ppdsl.semantics import format_exact

__all__ = ["check"]

_OPS = {"<=": operator.le, "<": operator.lt, "==": operator.eq, ">=": operator.ge, ">": operator.gt}
_BREAKS = {"<=": "above", "<": "not below", "==": "not equal to", ">=": "below", ">": "not above"}


def _violations(schedule: Schedule, found: BlockMemory, e: Expect) -> list[Diagnostic]:
    stages = range(schedule.num_stages) if e.device is None else (e.device,)
    block = schedule.block
    assert block is not None
    out = []
    for stage in stages:
        life = found.lifespans[stage]
        if _OPS[e.op](life.length, e.bound):
            continue
        where = next(
            (s.span for s in block.slots if s.stage == stage and s.kind.value == "F"), block.span
        )
        advice = (
            "start its backward earlier (or its F later) in the block, or raise the bound"
            if e.op in ("<=", "<", "==")
            else "the stage frees its activations sooner than the bound asks; lower the bound"
        )
        index = "" if e.device is None else f"[{e.device}]"
        out.append(
            Diagnostic(
                "error",
                f"stage {stage}'s lifespan is {format_exact(life.length)}, {_BREAKS[e.op]} the "
                f"bound {format_exact(e.bound)} (`expect lifespan{index} {e.op} {e.text}`); {advice}",
                e.span,
                (
                    (
                        where,
                        f"stage {stage} (chunk {life.chunk} of device {life.device}): F starts at "
                        f"{format_exact(life.start)}, its {life.frees.value} ends at "
                        f"{format_exact(life.end)}; it holds ⌈{format_exact(life.length)} / "
                        f"{format_exact(found.period)}⌉ = {found.held(stage)} microbatches",
                    ),
                ),
            )
        )
    return out


def check(schedule: Schedule) -> list[Diagnostic]:
    """Every `expect lifespan` bound (an error at the expect per stage that
    breaks it, with a note at the stage's F slot); for any block schedule, the
    two derivations of its steady-state peak (`block_memory` raises when they
    disagree)."""
    expects = [e for e in schedule.expects if e.metric == "lifespan"]
    found = block_memory(schedule) if schedule.block is not None else None
    if not expects:
        return []
    if found is None:
        return [
            Diagnostic(
                "error",
                "`expect lifespan` needs a building block (`block period T { ... }`); this "
                "schedule is written as an order, whose passes have no lifespan in a period",
                e.span,
            )
            for e in expects
        ]
    if not found.lifespans:
        return [
            Diagnostic("error", f"the block has no lifespans to check: {found.why}", e.span)
            for e in expects
        ]
    return [d for e in expects for d in _violations(schedule, found, e)]
