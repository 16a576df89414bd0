"""`expect bubble|idle|makespan OP bound` against the simulated timeline.

`peak_memory` expectations are the memory check's (`ppdsl.analysis.checks.memory`):
they need only the order, and are reported there, once; `lifespan` ones are the
block's (`ppdsl.analysis.checks.lifespans`).

The timeline is in floats (pass costs are floats) and bounds are exact
rationals, so a comparison allows a relative slack of 1e-9: `bubble == 1/9`
holds for a simulated 0.11111111111111112.
"""

from __future__ import annotations

from fractions import Fraction

from ppdsl.analysis.simulate import Timeline
from ppdsl.diagnostics import Diagnostic, Span
from ppdsl.ir.schedule import Expect, Schedule, format_pass
from ppdsl.semantics import format_decimal, format_exact

__all__ = ["check", "TOLERANCE"]

TOLERANCE = 1e-9
_WHAT = {
    "bubble": "bubble ratio",
    "idle": "idle fraction",
    "makespan": "makespan",
}
_BREAKS = {"<=": "above", "<": "not below", "==": "not equal to", ">=": "below", ">": "not above"}


def _holds(value: float, op: str, bound: Fraction) -> bool:
    b = float(bound)
    slack = TOLERANCE * max(1.0, abs(b))
    if op == "<=":
        return value <= b + slack
    if op == "<":
        return value < b - slack
    if op == "==":
        return abs(value - b) <= slack
    if op == ">=":
        return value >= b - slack
    if op == ">":
        return value > b + slack
    raise ValueError(op)


def _device_bubble(timeline: Timeline, device: int) -> tuple[float, float, float]:
    span = timeline.span_end[device] - timeline.span_start[device]
    busy = timeline.busy[device]
    return ((span - busy) / span if span > 0 else 0.0), span, busy


def _longest(timeline: Timeline) -> int:
    spans = [e - s for s, e in zip(timeline.span_start, timeline.span_end, strict=True)]
    return max(range(len(spans)), key=lambda d: (spans[d], -d)) if spans else 0


def _check_one(schedule: Schedule, timeline: Timeline, e: Expect) -> Diagnostic | None:
    if e.metric not in _WHAT:
        return Diagnostic(
            "error",
            f"unknown expectation metric {e.metric!r}; use peak_memory, bubble, idle or makespan",
            e.span,
        )
    name = _WHAT[e.metric]
    notes: list[tuple] = []
    if e.device is not None:
        if e.metric != "bubble":
            return Diagnostic(
                "error",
                f"{e.metric}[{e.device}]: {name} is one figure for the whole schedule; "
                f"write `expect {e.metric} {e.op} ...` without a device",
                e.span,
            )
        if not 0 <= e.device < schedule.num_devices:
            return Diagnostic(
                "error",
                f"bubble[{e.device}]: there is no device {e.device} "
                f"(devices are 0..{schedule.num_devices - 1})",
                e.span,
            )
        value, span, busy = _device_bubble(timeline, e.device)
        subject = f"device {e.device}'s bubble ratio"
        notes.append((None, f"device {e.device}: span {format_decimal(span)}, busy {format_decimal(busy)}"))
    elif e.metric == "bubble":
        value = timeline.bubble_ratio
        subject = "the bubble ratio"
        dev = _longest(timeline)
        _, span, busy = _device_bubble(timeline, dev)
        notes.append(
            (
                None,
                f"device {dev} has the longest span, {format_decimal(span)}, of which it is busy "
                f"{format_decimal(busy)} (the zero-bubble paper's ratio is (span - busy) / span)",
            )
        )
    elif e.metric == "idle":
        value = timeline.idle_fraction
        subject = "the idle fraction"
        notes.append(
            (
                None,
                f"1 - busy / (devices x makespan) = 1 - {format_decimal(sum(timeline.busy))} / "
                f"({schedule.num_devices} x {format_decimal(timeline.makespan)})",
            )
        )
    else:
        value = timeline.makespan
        subject = "the makespan"
    if _holds(value, e.op, e.bound):
        return None
    notes += _behind(schedule, timeline, e, value)
    advice = (
        "the simulation under the declared costs differs from what the file expects: "
        "check the costs and the order (`ppdsl show` draws the timeline)"
    )
    return Diagnostic(
        "error",
        f"{subject} is {format_decimal(value)}, {_BREAKS[e.op]} the bound {format_exact(e.bound, 6)} "
        f"(`expect {e.metric}{'' if e.device is None else f'[{e.device}]'} {e.op} {e.text}`); "
        f"{advice}",
        e.span,
        tuple(notes),
    )


def _behind(
    schedule: Schedule, timeline: Timeline, e: Expect, value: float
) -> list[tuple[Span | None, str]]:
    """The line behind a broken expectation: for a bubble or idle figure, the pass
    that waits longest on the device that sets it; for the makespan, the pass
    that ends last."""
    if e.metric == "makespan" or (e.metric == "idle" and e.device is None):
        device = max(
            range(schedule.num_devices),
            key=lambda d: (timeline.end[d][-1] if timeline.end[d] else 0.0, -d),
        )
        if not timeline.end[device]:
            return []
        last = schedule.orders[device][len(timeline.end[device]) - 1]
        return [(last.span, f"the last pass to end, {format_pass(last, True)} on device {device}, "
                 f"ends at {format_decimal(timeline.end[device][-1])}")]
    device = e.device if e.device is not None else _longest(timeline)
    starts, ends = timeline.start[device], timeline.end[device]
    if len(starts) < 2:
        return []
    gaps = [starts[k] - ends[k - 1] for k in range(1, len(starts))]
    k = max(range(len(gaps)), key=lambda n: (gaps[n], -n)) + 1
    if gaps[k - 1] <= 0:
        return []
    p = schedule.orders[device][k]
    return [(p.span, f"device {device} waits longest, {format_decimal(gaps[k - 1])}, before "
             f"{format_pass(p, True)} (pass {k} of its order)")]


def check(schedule: Schedule, timeline: Timeline) -> list[Diagnostic]:
    """Every bubble, idle and makespan expectation; one error per broken one."""
    found = []
    for e in schedule.expects:
        if e.metric in ("peak_memory", "lifespan"):  # the memory and lifespans checks'
            continue
        d = _check_one(schedule, timeline, e)
        if d is not None:
            found.append(d)
    return found
