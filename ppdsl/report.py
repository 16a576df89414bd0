"""Facts about a compiled schedule in the shapes the commands print: the stats
table and the machine-readable JSON of `check --json` / `stats --json`."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from ppdsl.analysis.collectives import MODES, comm_lanes, state_bytes
from ppdsl.analysis.simulate import memory_over_time
from ppdsl.compiler import Compiled
from ppdsl.diagnostics import Diagnostic
from ppdsl.ir.schedule import torch_action
from ppdsl.semantics import format_decimal, format_exact

__all__ = ["memory_bounds", "stats_table", "dp_table", "dp_json", "schedule_json", "diagnostic_json"]


def memory_bounds(compiled: Compiled) -> list[Fraction | None]:
    """Per device, the tightest declared `peak_memory` bound (None if none)."""
    s = compiled.schedule
    bounds: list[Fraction | None] = [None] * s.num_devices
    for e in s.expects:
        if e.metric != "peak_memory":
            continue
        for dev in range(s.num_devices) if e.device is None else (e.device,):
            current = bounds[dev]
            bounds[dev] = e.bound if current is None else min(current, e.bound)
    return bounds


def stats_table(compiled: Compiled) -> str:
    """Schedule-wide figures, then one row per device."""
    s, t = compiled.schedule, compiled.timeline
    lines = [
        f"schedule {s.name}: {s.num_devices} devices, {s.num_stages} stages, "
        f"{s.num_microbatches} microbatches, placement {s.placement.kind}, "
        f"{'split' if s.split_backward else 'fused'} backward",
        f"  makespan          {format_decimal(t.makespan)}",
        f"  bubble ratio      {float(t.bubble_ratio):.4f}   (zero-bubble paper: (span - busy) / span of the longest-span device)",
        f"  bubble time       {format_decimal(t.bubble_time)}",
        f"  idle fraction     {float(t.idle_fraction):.4f}   (1 - busy / (devices x makespan))",
        "",
    ]
    bounds = memory_bounds(compiled)
    header = [
        "rank", "passes", "busy", "span", "idle in span", "peak memory", "bound", "headroom",
        "recv buffers",
    ]
    rows = []
    for dev in range(s.num_devices):
        span = float(t.span_end[dev] - t.span_start[dev])
        busy = float(t.busy[dev])
        peak = t.peak_memory[dev]
        bound = bounds[dev]
        rows.append([
            str(dev),
            str(len(s.orders[dev])),
            format_decimal(busy),
            format_decimal(span),
            f"{(span - busy) / span:.4f}" if span > 0 else "-",
            format_exact(peak),
            format_exact(bound) if bound is not None else "-",
            format_exact(bound - peak) if bound is not None else "-",
            str(compiled.lowered.receive_buffers_peaks()[dev]),
        ])
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    where = getattr(compiled, "costs_from", None)
    units = (
        f"costs and memory from {where}, in its units"
        if where else "memory in units of the file's M_B/M_W declarations"
    )
    lines.append(
        f"{units}; recv buffers: the most received "
        "tensors a rank holds before the passes that use them (transfer buffers, outside the "
        "memory model)"
    )
    return "\n".join(lines) + "\n"


def _bytes(x: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if x >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def dp_table(compiled: Compiled, mode: str, dp: int, num_params: float | None = None) -> str:
    """The data-parallel communication lane per device (`cost reduce`/`cost
    gather`): total, exposed, the step's end with it; with `num_params`, the
    parameter, gradient and optimizer-state bytes per device."""
    s, t = compiled.schedule, compiled.timeline
    lanes = comm_lanes(s, t, mode)
    kinds = "reductions" + (" and gathers" if mode == "shard" else "")
    lines = [
        "",
        f"data parallel ({mode}, dp {dp}): each stage's {kinds} on a communication lane per device, "
        "beside compute (cost reduce[s] / gather[s])",
        f"  step end with communication {format_decimal(lanes.makespan)} "
        f"(makespan {format_decimal(t.makespan)})",
    ]
    header = ["rank", "collectives", "comm total", "exposed", "hidden", "step end"]
    rows = []
    for dev in range(s.num_devices):
        total, exposed = lanes.total[dev], lanes.exposed[dev]
        rows.append([str(dev), str(len(lanes.lanes[dev])), format_decimal(total),
                     format_decimal(exposed), format_decimal(max(total - exposed, 0.0)),
                     format_decimal(lanes.step_end[dev])])
    lines += _columns(header, rows)
    lines.append("exposed: a gather still running when its stage's first pass is due, plus "
                 "reductions still running after the device's last pass")
    if num_params is not None:
        lines += ["", f"model state per device for {num_params:g} parameters (split evenly over "
                  f"{s.num_stages} stages; fp32 parameters and gradients, Adam's 2 fp32 moments), "
                  f"dp {dp}, replicate vs shard:"]
        header = ["rank", "mode", "params", "gathered", "grads", "grad buffers", "optimizer", "total"]
        rows = []
        for dev in range(s.num_devices):
            for each in MODES:
                b = state_bytes(s, t, comm_lanes(s, t, each), num_params, dp)
                rows.append([str(dev), each, _bytes(b.params[dev]), _bytes(b.gathered[dev]),
                             _bytes(b.grads[dev]), _bytes(b.grad_buffers[dev]),
                             _bytes(b.optimizer[dev]), _bytes(b.total(dev))])
        lines += _columns(header, rows)
        lines.append("gathered: whole parameters held at once (shard); grad buffers: gradients in "
                     "flight (replicate: reduced buckets until the step ends; shard: whole "
                     "gradients until their reduce-scatter ends); activations are the peak "
                     "memory column above")
    return "\n".join(lines) + "\n"


def dp_json(compiled: Compiled, mode: str, dp: int, num_params: float | None = None) -> dict[str, Any]:
    """`dp_table`'s figures as JSON."""
    s, t = compiled.schedule, compiled.timeline
    lanes = comm_lanes(s, t, mode)
    out: dict[str, Any] = {
        "mode": mode, "dp": dp, "step_end": lanes.makespan,
        "devices": [{"rank": dev, "comm_total": lanes.total[dev], "exposed": lanes.exposed[dev],
                     "step_end": lanes.step_end[dev],
                     "lane": [{"kind": c.kind, "stage": c.stage, "start": c.start, "end": c.end}
                              for c in lanes.lanes[dev]]}
                    for dev in range(s.num_devices)],
    }
    if num_params is not None:
        for each in MODES:
            b = state_bytes(s, t, comm_lanes(s, t, each), num_params, dp)
            for dev, d in enumerate(out["devices"]):
                d.setdefault("bytes", {})[each] = {
                    "params": b.params[dev], "gathered": b.gathered[dev], "grads": b.grads[dev],
                    "grad_buffers": b.grad_buffers[dev], "optimizer": b.optimizer[dev],
                    "total": b.total(dev)}
    return out


def _columns(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
    return ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))] + [
        "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def _jsonable(x: Any) -> Any:
    if isinstance(x, Fraction):
        return int(x) if x.denominator == 1 else float(x)
    return x


def schedule_json(compiled: Compiled, *, memory_profile: bool = False) -> dict[str, Any]:
    """Everything `--json` promises: per device the order as torch action strings,
    its peak memory and bound; overall makespan and bubble ratio. With
    `memory_profile`, each device also gets its activation memory over time:
    `[time, level]` after each pass (an F allocates at its start, a B or W frees
    at its end), from the simulated timeline."""
    s, t = compiled.schedule, compiled.timeline
    bounds = memory_bounds(compiled)
    profile = memory_over_time(s, t) if memory_profile else None
    result: dict[str, Any] = {
        "name": s.name,
        "file": s.file,
        "params": {k: _jsonable(v) for k, v in s.params},
        "num_devices": s.num_devices,
        "num_stages": s.num_stages,
        "num_microbatches": s.num_microbatches,
        "placement": {"kind": s.placement.kind, "stage_device": list(s.placement.stage_device)},
        "split_backward": s.split_backward,
        "makespan": float(t.makespan),
        "bubble_ratio": float(t.bubble_ratio),
        "bubble_time": float(t.bubble_time),
        "idle_fraction": float(t.idle_fraction),
        "devices": [
            {
                "rank": dev,
                "actions": [torch_action(p) for p in s.orders[dev]],
                "peak_memory": _jsonable(t.peak_memory[dev]),
                "memory_bound": _jsonable(bounds[dev]) if bounds[dev] is not None else None,
                "receive_buffers_peak": compiled.lowered.receive_buffers_peaks()[dev],
                "busy": float(t.busy[dev]),
                "span": float(t.span_end[dev] - t.span_start[dev]),
            }
            for dev in range(s.num_devices)
        ],
    }
    if profile is not None:
        for dev, points in enumerate(profile):
            # (time, level) tuples: the JSON's pairs, not copied into lists
            result["devices"][dev]["memory_over_time"] = list(points)
    return result


def diagnostic_json(d: Diagnostic) -> dict[str, Any]:
    """A diagnostic as JSON: severity, message, location, notes."""
    where = None
    if d.span is not None:
        where = {"file": d.span.file, "line": d.span.line, "column": d.span.column}
    return {
        "severity": d.severity,
        "message": d.message,
        "location": where,
        "notes": [n for _, n in d.notes],
    }
