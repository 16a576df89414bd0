"""A run's own costs from its trace (`ppdsl trace TRACE.json -o COSTS.pp`): the
costs file `ppdsl profile -o` would have written had it measured this run, so
that `stats`, `compare` and `search --costs-from` predict from what the run did
(on a GPU, where the profile times every stage on one process, a run's trace
is the only measurement taken the way the run runs).

Each statement is measured the way the profile measures it (docs/runtime.md,
"Where the time goes"), over the compared steps (the first is left out when
there are more):

- `cost F`, `B`, `W`, `BW`, `R` per stage: the mean duration of the kind's
  passes on that stage (`semantics.pass_cost`), over every rank that holds it;
- `cost overhead`: the mean over ranks and steps of the rank's step window
  less its passes, its waits on receives, its optimizer step and its data
  batch, per pass (`profile.overhead_per_pass`: posting transfers counts);
- `cost comm` (one clock only): the transfers on the critical path, from the
  end of the pass that made a tensor to the start of the pass that took it,
  less the overhead (`trace_timeline.pipeline_latency`);
- `cost recv`: the median of the receives posted after their send, from posting
  to holding the tensor: the handshake every receive pays, which the simulator
  puts as a floor under every pass that takes a tensor from another device
  (the profile times it in a quiet pair of processes, where mean and median
  agree); in a run a few such receives also hold the rank's stalls (mean 1.09
  ms against a median of 0.28 on a tiny_gpt ZB-V run, d = 2, where the mean
  predicted its step at 0.91 of the measured one and the median at 1.04),
  which `cost jitter` and `cost comm` already carry;
- `cost optimizer[s]`: per rank, the mean over steps, on one clock from the
  moment the last rank reached its optimizer step (the gradient-norm all-reduce starts then) to the
  end of its own, less `cost norm`; on clocks of their own, the slice less
  `cost norm` (the wait for the slowest rank then stays in). A rank holding
  several stages has its time split evenly between them;
- `cost jitter`: `semantics.pass_jitter` of the pass durations.

What a trace cannot show comes from the costs the run used (its `--costs-from`
file, given again with `ppdsl trace --costs-from`): `cost norm`, the pass kinds
the schedule never ran (B and W of a fused schedule), `cost comm` on clocks of
their own, the data-parallel collectives, and the memory statements. Without
such costs in ms, a kind the run did not measure is an error that says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ppdsl.analysis.trace_check import PASS_CATEGORIES, TraceStep
from ppdsl.analysis.trace_timeline import (
    compared_steps,
    critical_transfers,
    late_receives,
    pipeline_latency,
    window_ms,
)
from ppdsl.ir.schedule import Schedule
from ppdsl.semantics import PassKind, cost_decimal, pass_cost, pass_jitter, per_stage_text

__all__ = ["Calibration", "CalibrationError", "calibrate", "costs_text"]

_WRITTEN = (PassKind.F, PassKind.B, PassKind.W, PassKind.BW, PassKind.R)
"""The pass kinds a costs file states, in its order."""


_NOT_OVERHEAD = PASS_CATEGORIES | {"optimizer", "data"}
"""The slices whose time is no part of the engine's overhead (with the waits)."""


class CalibrationError(ValueError):
    """The trace cannot give a costs file (a kind it never ran, with no costs in
    ms to take it from)."""


@dataclass(frozen=True)
class Calibration:
    """What a run's trace measured, in ms."""

    steps: tuple[int, ...]
    """The steps measured from."""
    pass_ms: dict[PassKind, tuple[float | None, ...]]
    """Per kind, per stage, the mean duration (None: no such pass ran there)."""
    overhead_ms: float
    optimizer_ms: tuple[float, ...] | None
    """Per stage (None: the trace has no optimizer slices)."""
    comm_ms: float | None
    """None: not on one clock, or no transfer on the critical path."""
    recv_ms: float | None
    """The late receives' median (module docstring); None: no receive was
    posted after its send."""
    jitter: float
    one_clock: bool


def calibrate(steps: Sequence[TraceStep], schedule: Schedule, one_clock: bool,
              norm_ms: float = 0.0) -> Calibration:
    """The costs `steps` (a trace's, `steps_of`) measured for `schedule` (the one
    the run ran: its placement says which rank holds which stage); `one_clock`:
    the trace's ranks share one clock; `norm_ms`: the norm all-reduce, taken
    out of the optimizer slices."""
    compared, mine = compared_steps(steps)
    durations: dict[tuple[PassKind, int], list[float]] = {}
    for s in mine:
        for e in s.passes:
            durations.setdefault((PassKind(e["cat"]), int(e["args"]["stage"])), []).append(
                float(e["dur"]) / 1e3)
    pass_ms = {kind: tuple(pass_cost(durations[(kind, st)]) if durations.get((kind, st)) else None
                           for st in range(schedule.num_stages)) for kind in PassKind}
    overhead = _overhead(mine)
    critical = (critical_transfers(mine, schedule.placement.num_devices, overhead)
                if one_clock else {})
    late = late_receives(mine)
    return Calibration(
        steps=compared,
        pass_ms=pass_ms,
        overhead_ms=overhead,
        optimizer_ms=_optimizer(mine, schedule, one_clock, norm_ms),
        comm_ms=pipeline_latency(critical, overhead) if critical else None,
        recv_ms=float(statistics.median(late)) if late else None,
        jitter=pass_jitter(durations),
        one_clock=one_clock,
    )


def _overhead(steps: Sequence[TraceStep]) -> float:
    """The mean over ranks and steps of the engine's work per pass: the step
    window less its passes, waits, optimizer step and data batch (a mean, as
    `pass_cost`: every pass's overhead adds to the step)."""
    found = []
    for s in steps:
        passes = s.passes
        if not passes:
            continue
        spent = sum(e["dur"] for e in s.events
                    if e["cat"] in _NOT_OVERHEAD or e.get("name") == "wait") / 1e3
        found.append(max(window_ms(s) - spent, 0.0) / len(passes))
    return pass_cost(found) if found else 0.0


def _optimizer(steps: Sequence[TraceStep], schedule: Schedule, one_clock: bool,
               norm_ms: float) -> tuple[float, ...] | None:
    """Per stage, the optimizer step (module docstring)."""
    slices: dict[int, dict[int, dict[str, Any]]] = {}
    for s in steps:
        for e in s.events:
            if e["cat"] == "optimizer":
                slices.setdefault(s.step, {})[s.rank] = e
    if not slices:
        return None
    per_rank: dict[int, list[float]] = {}
    for by_rank in slices.values():
        reached = max(e["ts"] for e in by_rank.values())
        for rank, e in by_rank.items():
            start = reached if one_clock else e["ts"]
            per_rank.setdefault(rank, []).append((e["ts"] + e["dur"] - start) / 1e3 - norm_ms)
    num_ranks = schedule.placement.num_devices
    device = schedule.placement.stage_device
    found = []
    for stage in range(schedule.num_stages):
        holds = sum(1 for d in device if d == device[stage])
        values = [x for rank, v in per_rank.items() if rank % num_ranks == device[stage] for x in v]
        found.append(max(pass_cost(values), 0.0) / holds if values else 0.0)
    return tuple(found)


def _fraction(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator} / {x.denominator}"


def costs_text(found: Calibration, schedule: Schedule, costs_in_ms: bool,
               header: Sequence[str] = (), memory: bool = True) -> str:
    """`found` as a costs file for `--costs-from` (`header`: its first comment
    lines); what the trace cannot show from `schedule`'s costs when
    `costs_in_ms`, else a `CalibrationError` for a pass kind it needs;
    `memory`: whether `schedule`'s memory model is the one the run used (else
    the file states none, and says so)."""
    costs = schedule.costs
    n = schedule.num_stages
    lines = [f"# {h}" for h in header]
    kinds = []
    taken = []
    for kind in _WRITTEN:
        measured = found.pass_ms[kind]
        if kind is PassKind.R and any(v is not None for v in measured):
            # R runs on the recomputed stages only; T_R stays T_F on the others
            measured = tuple(r if r is not None else f
                             for r, f in zip(measured, found.pass_ms[PassKind.F], strict=True))
        if all(v is None for v in measured):
            if kind is PassKind.R or (kind is PassKind.BW and not costs_in_ms):
                continue  # R = F and BW = B + W by default (docs/language.md)
            if not costs_in_ms:
                raise CalibrationError(
                    f"the run ran no {kind.value} pass and its costs are not in ms: give the "
                    "costs file it ran with (or a profile's), `--costs-from FILE`, for the "
                    "kinds a trace of this schedule cannot measure")
            values = list(costs.per_stage(kind))
            taken.append(kind.value)
        elif any(v is None for v in measured):
            missing = [s for s, v in enumerate(measured) if v is None]
            if not costs_in_ms:
                raise CalibrationError(
                    f"the run ran no {kind.value} pass on stage{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} and its costs are not in ms: give "
                    "`--costs-from FILE` for them")
            values = [v if v is not None else costs.per_stage(kind)[s]
                      for s, v in enumerate(measured)]
            taken.append(f"{kind.value} on stages {', '.join(map(str, missing))}")
        else:
            values = [v for v in measured if v is not None]
        kinds.append(f"    cost {kind.value}[s] = " + per_stage_text([cost_decimal(v) for v in values]))
    comm = found.comm_ms if found.comm_ms is not None else (costs.comm if costs_in_ms else 0.0)
    if found.comm_ms is None:
        taken.append("comm" if costs_in_ms else "comm (none measured: 0)")
    lines += [
        f"# measured over steps {', '.join(map(str, found.steps))}: the passes' mean durations, "
        "the engine's overhead per pass, "
        + ("the transfers on the critical path (one clock), " if found.comm_ms is not None else "")
        + ("the late receives, " if found.recv_ms is not None else "")
        + ("the optimizer step per stage" + (" after the last rank reached it" if found.one_clock
                                             else " (its slice: the wait for the slowest rank "
                                             "stays in)")
           if found.optimizer_ms is not None else "")
        + ", the passes' spread",
    ]
    shown = taken + (["norm"] if costs_in_ms and costs.norm > 0 else []) + (
        ["memory"] if memory and costs_in_ms else [])
    if shown:
        lines.append("# from the run's costs (a trace does not show them): " + ", ".join(shown))
    if not memory:
        lines.append("# no memory statements: the trace does not hold the run's memory model; "
                     "give the run's costs file with --costs-from to carry them over")
    lines += ["# Use with: ppdsl check|show|stats|compare|search ... --costs-from THIS_FILE",
              f"schedule {schedule.name}_run {{", f"    let profiled_stages = {n}", *kinds,
              f"    cost comm = {cost_decimal(comm)}"]
    recv = found.recv_ms if found.recv_ms is not None else (costs.recv if costs_in_ms else 0.0)
    if recv > 0:
        lines.append(f"    cost recv = {cost_decimal(recv)}")
    if costs_in_ms:
        for name, row in costs.declared_collectives().items():
            lines.append(f"    cost {name}[s] = " + per_stage_text([cost_decimal(x) for x in row]))
    lines.append(f"    cost overhead = {cost_decimal(found.overhead_ms)}")
    if found.optimizer_ms is not None:
        lines.append("    cost optimizer[s] = "
                     + per_stage_text([cost_decimal(x) for x in found.optimizer_ms]))
    if costs_in_ms and costs.norm > 0:
        lines.append(f"    cost norm = {cost_decimal(costs.norm)}")
    if found.jitter > 0:
        lines.append(f"    cost jitter = {cost_decimal(found.jitter)}")
    model = schedule.memory
    if memory:
        lines.append("    memory M_B[s] = " + per_stage_text([_fraction(x) for x in model.activation]))
        lines.append("    memory M_W[s] = "
                     + per_stage_text([_fraction(x) for x in model.weight_retained]))
        if model.kept_input:
            lines.append("    memory M_I[s] = " + per_stage_text(
                [_fraction(x) if x is not None else "0" for x in model.kept_input]))
    lines.append("}")
    return "\n".join(lines) + "\n"
