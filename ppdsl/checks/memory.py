"""Peak activation memory per device, and every `expect peak_memory` bound.

Memory follows the zero-bubble paper's model (`MemoryModel.delta`): an F leaves
M_B on its device, B frees M_B - M_W, W the last M_W, a fused BW all of M_B.
A device's memory after its k-th pass is the prefix sum of those deltas over its
order, so its peak is fixed by the order alone, whatever the timing. The sums
are exact: the deltas are scaled to integers over their common denominator.
"""

from __future__ import annotations

import math
import operator
from fractions import Fraction

import numpy as np

from ppdsl.checks._flat import flatten
from ppdsl.diagnostics import Diagnostic
from ppdsl.ir.schedule import Expect, Schedule, format_pass

__all__ = ["peak_memory", "peak_positions", "check", "missing_bound", "bound_text"]

_OPS = {
    "<=": operator.le,
    "<": operator.lt,
    "==": operator.eq,
    ">=": operator.ge,
    ">": operator.gt,
}
_BREAKS = {"<=": "above", "<": "not below", "==": "not equal to", ">=": "below", ">": "not above"}


def _delta_table(schedule: Schedule) -> tuple[np.ndarray, int]:
    """Per (kind code, stage), the memory delta times the common denominator."""
    mem = schedule.memory
    values = [Fraction(x) for x in (*mem.activation, *mem.weight_retained)]
    denominator = math.lcm(*(v.denominator for v in values)) if values else 1
    rows = []
    for code in range(4):
        kind = ("F", "B", "W", "BW")[code]
        row = []
        for s in range(schedule.num_stages):
            a, w = Fraction(mem.activation[s]), Fraction(mem.weight_retained[s])
            delta = {"F": a, "B": w - a, "W": -w, "BW": -a}[kind]
            row.append(int(delta * denominator))
        rows.append(row)
    biggest = max((abs(x) for r in rows for x in r), default=0)
    total = biggest * max((len(o) for o in schedule.orders), default=0)
    dtype = np.int64 if total < 2**62 else object
    return np.array(rows, dtype=dtype).reshape(4, schedule.num_stages), denominator


def peak_positions(schedule: Schedule) -> tuple[tuple[Fraction, int | None], ...]:
    """Per device, (peak memory, index in its order of the pass after which the
    peak is first reached; None when memory never rises above 0)."""
    flat = flatten(schedule)
    table, denominator = _delta_table(schedule)
    deltas = table[flat.kind, flat.stage]
    found: list[tuple[Fraction, int | None]] = []
    for dev in range(schedule.num_devices):
        a, b = int(flat.offsets[dev]), int(flat.offsets[dev + 1])
        if a == b:
            found.append((Fraction(0), None))
            continue
        levels = np.cumsum(deltas[a:b])
        k = int(np.argmax(levels))
        peak = int(levels[k])
        if peak <= 0:
            found.append((Fraction(0), None))
        else:
            found.append((Fraction(peak, denominator), k))
    return tuple(found)


def peak_memory(schedule: Schedule) -> tuple[Fraction, ...]:
    """Per device, the peak activation memory over its order (never below 0:
    an empty device holds nothing)."""
    return tuple(peak for peak, _ in peak_positions(schedule))


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
        f"peak activation memory on device {device} is {_num(peak)}, {what} the bound "
        f"{_num(bound)} (`expect peak_memory{'' if expect.device is None else f'[{expect.device}]'} {expect.op} {expect.text}`); {advice}"
    )
    notes: tuple = ()
    if where is not None:
        p = schedule.orders[device][where]
        multi = len(schedule.placement.chunks(device)) > 1
        notes = (
            (
                p.span,
                f"device {device} first reaches {_num(peak)} after "
                f"{format_pass(p, multi)} (pass {where} of its order)",
            ),
        )
    return Diagnostic("error", message, expect.span, notes)


def _num(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x} ({float(x):.4g})"


def bound_text(peak: Fraction, schedule: Schedule) -> str:
    """`peak` as the right-hand side of an `expect peak_memory`, in multiples of
    the file's M_B (that of stage 0) when it declares one."""
    unit = schedule.memory.activation[0] if schedule.memory.activation else Fraction(0)
    return f"{peak / unit} * M_B" if unit else str(peak)


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
    return [
        Diagnostic(
            "warning",
            f"schedule {schedule.name} states no memory bound: its peak activation memory "
            f"({_num(highest)} on the fullest device) is computed but checked against "
            f"nothing; add e.g. `expect peak_memory <= {bound_text(highest, schedule)}`",
            schedule.span,
        )
    ]
