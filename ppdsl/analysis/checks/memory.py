"""Every `expect peak_memory` bound against the peak activation memory of each
device (`ppdsl.analysis.memory`: a prefix sum of the memory deltas over the
device's order, exact, whatever the timing), and the warning for a schedule
that states no bound.
"""

from __future__ import annotations

import operator
from fractions import Fraction

from ppdsl.analysis.memory import peak_memory, peak_positions
from ppdsl.diagnostics import Diagnostic
from ppdsl.frontend.ast import format_expr, peak_bound
from ppdsl.ir.schedule import Expect, Schedule, format_pass
from ppdsl.semantics import format_exact

__all__ = ["check", "missing_bound"]

_OPS = {
    "<=": operator.le,
    "<": operator.lt,
    "==": operator.eq,
    ">=": operator.ge,
    ">": operator.gt,
}
_BREAKS = {"<=": "above", "<": "not below", "==": "not equal to", ">=": "below", ">": "not above"}


def _violation(
    schedule: Schedule, expect: Expect, device: int, peak: Fraction, where: int | None
) -> Diagnostic:
    bound = expect.bound
    what = _BREAKS[expect.op]
    advice = (
        "keep fewer microbatches in flight on that device (run its backward passes "
        "earlier) or raise the bound"
        if expect.op in ("<=", "<", "==")
        else "the schedule holds less than the bound asks; lower the bound"
    )
    message = (
        f"peak activation memory on device {device} is {format_exact(peak)}, {what} the bound "
        f"{format_exact(bound)} (`expect peak_memory{'' if expect.device is None else f'[{expect.device}]'} {expect.op} {expect.text}`); {advice}"
    )
    notes: tuple = ()
    if where is not None:
        p = schedule.orders[device][where]
        multi = len(schedule.placement.chunks(device)) > 1
        notes = (
            (
                p.span,
                f"device {device} first reaches {format_exact(peak)} after "
                f"{format_pass(p, multi)} (pass {where} of its order)",
            ),
        )
    return Diagnostic("error", message, expect.span, notes)


def check(schedule: Schedule) -> list[Diagnostic]:
    """Every `expect peak_memory` bound, device by device; one error per device
    that breaks a bound, at the expect's line, with a note at the pass where
    the peak is first reached."""
    expects = [e for e in schedule.expects if e.metric == "peak_memory"]
    if not expects:
        return []
    peaks = peak_positions(schedule)
    found: list[Diagnostic] = []
    for e in expects:
        if e.device is not None and not 0 <= e.device < schedule.num_devices:
            found.append(
                Diagnostic(
                    "error",
                    f"peak_memory[{e.device}]: there is no device {e.device} "
                    f"(devices are 0..{schedule.num_devices - 1})",
                    e.span,
                )
            )
            continue
        devices = range(schedule.num_devices) if e.device is None else (e.device,)
        for dev in devices:
            peak, where = peaks[dev]
            if not _OPS[e.op](peak, e.bound):
                found.append(_violation(schedule, e, dev, peak, where))
    return found


def missing_bound(schedule: Schedule) -> list[Diagnostic]:
    """A warning for a valid schedule that states no `expect peak_memory`: proving
    a schedule within its memory bound is the point of writing one down."""
    if any(e.metric == "peak_memory" for e in schedule.expects):
        return []
    highest = max(peak_memory(schedule), default=Fraction(0))
    unit = schedule.memory.activation[0] if schedule.memory.activation else Fraction(0)
    return [
        Diagnostic(
            "warning",
            f"schedule {schedule.name} states no memory bound: its peak activation memory "
            f"({format_exact(highest)} on the fullest device) is computed but checked against "
            f"nothing; add e.g. `expect peak_memory <= {format_expr(peak_bound(highest, unit))}`",
            schedule.span,
        )
    ]
