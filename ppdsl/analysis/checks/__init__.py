"""Static checks on the schedule IR, one module per property.

`check_schedule` runs the checks that need only the schedule IR, in order:
passes (every pass exactly once, on its device), dependencies (a global order
exists), collisions (the building block repeats cleanly), memory (every
`expect peak_memory`), lifespans (every `expect lifespan`; a block's
steady-state peak derived two ways must agree). When the passes check fails the others are skipped:
they assume every pass exists exactly once. The deadlock check needs the
lowered rank programs and the expectations check the timeline; the driver
calls them later (`ppdsl.analysis.checks.deadlock`, `.expectations`).
"""

from __future__ import annotations

from ppdsl.analysis.checks import collisions, dependencies, lifespans, memory, passes
from ppdsl.diagnostics import Diagnostic, sorted_diagnostics
from ppdsl.ir.schedule import Schedule

__all__ = ["check_schedule"]


def check_schedule(schedule: Schedule, *, with_memory: bool = True) -> list[Diagnostic]:
    """All findings of passes, dependencies, collisions, memory and lifespans,
    sorted by location (the later ones only when passes found no error; the
    lifespans only for a block that does not collide). `with_memory=False`
    leaves the memory bounds to the caller (the driver reports them together
    with the timeline's expectations)."""
    found = passes.check(schedule)
    if any(d.severity == "error" for d in found):
        return sorted_diagnostics(found)
    for module in (dependencies, collisions, memory):
        if module is memory and not with_memory:
            continue
        found += module.check(schedule)
    if not any(d.severity == "error" for d in found):
        found += lifespans.check(schedule)
    return sorted_diagnostics(found)
