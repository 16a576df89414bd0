"""Facts about a compiled schedule in the shapes the commands print: the stats
table and the machine-readable JSON of `check --json` / `stats --json`."""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from functools import partial
from typing import Any

from ppdsl.analysis.collectives import MODES, comm_lanes, state_bytes
from ppdsl.analysis.lifespans import BlockMemory, block_memory
from ppdsl.analysis.simulate import memory_over_time_by_device
from ppdsl.compiler import Compiled
from ppdsl.diagnostics import Diagnostic, Span
from ppdsl.ir.schedule import torch_actions
from ppdsl.json_text import Deferred
from ppdsl.semantics import JITTER_DRAWS, format_decimal, format_exact

__all__ = [
    "memory_bounds",
    "stats_table",
    "lifespan_table",
    "lifespan_notes",
    "dp_table",
    "dp_json",
    "schedule_json",
    "diagnostic_json",
]


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
        *([f"  step time         {format_decimal(t.step_time)}   (each device's passes after "
           "its optimizer step, with their engine overhead, then the norm all-reduce "
           f"{format_decimal(s.costs.norm)}"
           + (f"; the median of {JITTER_DRAWS} draws of the passes under jitter "
              f"{format_decimal(s.costs.jitter)}" if s.costs.jitter else "")
           + ")"] if s.costs.models_step else []),
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
    found = block_memory(s)
    if found is not None:
        lines += ["", *lifespan_table(compiled, found)]
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
    return [
        "  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
        for r in (header, *rows)
    ]


def lifespan_table(compiled: Compiled, found: BlockMemory) -> list[str]:
    """The block's lifespans (controllable-memory paper §3): per stage, its
    lifespan and ⌈l/T⌉; per device, the ⌈l/T⌉ rule, the exact steady state and
    the elaborated peak; then where they differ and why."""
    s = compiled.schedule
    T = format_exact(found.period)
    if not found.lifespans:
        return [f"block period {T}: no lifespans ({found.why})"]
    lines = [
        f"block period T = {T}: lifespans, from the start of F to the end of the pass "
        "freeing the last activation (controllable-memory paper: a stage holds ⌈l/T⌉ "
        "microbatches)"
    ]
    recomputes = any(x.restored is not None for x in found.lifespans)
    extra = ["R starts", "in full", "ceil"] if recomputes else []
    lines += _table(
        ["stage", "rank", "chunk", "F starts", "freed by", "ends", "lifespan", "ceil(l/T)", *extra],
        [
            [str(x.stage), str(x.device), str(x.chunk), format_exact(x.start), x.frees.value,
             format_exact(x.end), format_exact(x.length), str(found.held(x.stage))]
            + (
                [format_exact(x.restored) if x.restored is not None else "-",
                 format_exact(x.full_length), str(found.held_in_full(x.stage))]
                if recomputes else []
            )
            for x in found.lifespans
        ],
    )
    if recomputes:
        lines.append(
            "  (recompute: F keeps only its input, M_I, until R; the whole activation is held "
            "from R's start)"
        )
    peaks = compiled.timeline.peak_memory
    rows = []
    for dev in range(s.num_devices):
        rows.append([
            str(dev),
            format_exact(found.rule[dev]),
            format_exact(found.steady[dev]) if found.steady is not None else "-",
            format_exact(peaks[dev]),
        ])
    rule = "sum ceil(l/T)*M_B" + (" (+M_I)" if s.recompute else "")
    lines += _table(["rank", rule, "steady state", "elaborated peak"], rows)
    lines += lifespan_notes(compiled, found)
    return lines


def lifespan_notes(compiled: Compiled, found: BlockMemory) -> list[str]:
    """Where the ⌈l/T⌉ rule, the block's exact steady state and the elaborated
    schedule's peak differ, device by device, and why."""
    s = compiled.schedule
    if found.steady is None:
        return [f"  steady state: - ({found.why})"]
    notes = []
    peaks = compiled.timeline.peak_memory
    for dev in range(s.num_devices):
        rule, steady, peak = found.rule[dev], found.steady[dev], peaks[dev]
        if rule != steady:
            why = []
            stages = s.placement.chunks(dev)
            if len(stages) > 1:
                why.append("its stages do not all peak at once")
            if s.block is not None and s.block.group_size > 1:
                why.append(
                    f"the rule counts each of a group's {s.block.group_size} microbatches at "
                    "its own peak"
                )
            if any(s.memory.weight_retained[x] < s.memory.activation[x] for x in stages) and s.split_backward:
                why.append("B frees M_B - M_W before W ends the lifespan")
            if any(x in s.recompute for x in stages):
                why.append("a recomputed stage's ⌈l/T⌉ counts M_I and M_B at their own peaks")
            notes.append(
                f"  note: rank {dev}: the ⌈l/T⌉ rule counts {format_exact(rule)}, the steady "
                f"state holds {format_exact(steady)} ({'; '.join(why) or 'rounding up'})"
            )
        if peak != steady:
            how = "below" if peak < steady else "above"
            why_peak = (
                f"its warm-up and cool-down never fill the steady state with m = "
                f"{s.num_microbatches} microbatches"
                if peak < steady
                else "the tightened warm-up/cool-down holds more than the repeated block"
            )
            notes.append(
                f"  note: rank {dev}: the elaborated peak {format_exact(peak)} is {how} the "
                f"block's steady state {format_exact(steady)}: {why_peak}"
            )
    return notes


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
    at its end), from the simulated timeline.

    The per-pass lists are `json_text.Deferred`: made device by device as
    `json_text` writes the document (a million-pass schedule's are never all
    held at once)."""
    s, t = compiled.schedule, compiled.timeline
    bounds = memory_bounds(compiled)
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
        **({"step_time": float(t.step_time)} if s.costs.models_step else {}),
        "bubble_ratio": float(t.bubble_ratio),
        "bubble_time": float(t.bubble_time),
        "idle_fraction": float(t.idle_fraction),
        "devices": [
            {
                "rank": dev,
                "actions": Deferred(partial(torch_actions, s.orders[dev])),
                "peak_memory": _jsonable(t.peak_memory[dev]),
                "memory_bound": _jsonable(bounds[dev]) if bounds[dev] is not None else None,
                "receive_buffers_peak": compiled.lowered.receive_buffers_peaks()[dev],
                "busy": float(t.busy[dev]),
                "span": float(t.span_end[dev] - t.span_start[dev]),
            }
            for dev in range(s.num_devices)
        ],
    }
    found = block_memory(s)
    if found is not None:
        result["block"] = _block_json(found)
    if memory_profile:
        profiles = _InOrder(memory_over_time_by_device(s, t))
        for dev, entry in enumerate(result["devices"]):
            # (time, level) tuples: the JSON's pairs, not copied into lists
            entry["memory_over_time"] = Deferred(partial(profiles.get, dev))
    return result


class _InOrder:
    """Per-device values from an iterator that makes them in device order, handed
    out in that order (the order `json_text` reaches the devices in)."""

    def __init__(self, values: Iterator[Any]):
        self._values = values
        self._next = 0

    def get(self, dev: int) -> Any:
        if dev != self._next:
            raise RuntimeError(f"device {dev}'s value asked for before device {self._next}'s")
        self._next += 1
        return list(next(self._values))


def _block_json(found: BlockMemory) -> dict[str, Any]:
    return {
        "period": _jsonable(found.period),
        "lifespans": [
            {
                "stage": x.stage,
                "rank": x.device,
                "chunk": x.chunk,
                "start": _jsonable(x.start),
                "end": _jsonable(x.end),
                "freed_by": x.frees.value,
                "lifespan": _jsonable(x.length),
                "ceil_lifespan_over_period": found.held(x.stage),
                "recompute_start": _jsonable(x.restored) if x.restored is not None else None,
                "held_in_full": _jsonable(x.full_length),
                "ceil_held_in_full_over_period": found.held_in_full(x.stage),
            }
            for x in found.lifespans
        ],
        "devices": [
            {
                "rank": dev,
                "lifespan_rule_peak": _jsonable(found.rule[dev]),
                "steady_state_peak": (
                    _jsonable(found.steady[dev]) if found.steady is not None else None
                ),
            }
            for dev in range(len(found.rule))
        ],
        "no_steady_state": found.why,
    }


def _location(span: Span | None) -> dict[str, Any] | None:
    if span is None:
        return None
    return {"file": span.file, "line": span.line, "column": span.column}


def diagnostic_json(d: Diagnostic) -> dict[str, Any]:
    """A diagnostic as JSON: severity, message, location, notes (each with its
    own location) and fixes (each a description and LSP-style edits: 1-based,
    end exclusive, positions in the file before the fix)."""
    return {
        "severity": d.severity,
        "message": d.message,
        "location": _location(d.span),
        "notes": [{"message": note, "location": _location(span)} for span, note in d.notes],
        "fixes": [
            {
                "description": fix.description,
                "edits": [
                    {
                        "line": e.line, "column": e.column, "end_line": e.end_line,
                        "end_column": e.end_column, "text": e.text,
                    }
                    for e in fix.edits
                ],
            }
            for fix in d.fixes
        ],
    }
