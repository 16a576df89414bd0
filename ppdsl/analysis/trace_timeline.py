"""A measured trace (`ppdsl run --trace`) beside the simulated timeline: per
rank and pass kind, measured against predicted durations; the step's time
outside passes, by the cause the trace records; and the passes whose start
slipped most against the simulation, with what held them.

Steps are compared as the run's summary compares them: the first step (memory
meter on, caches cold) is left out unless it is the only one. A step's time on
a rank runs from the start of its first slice (its data batch, on the ranks
that load data) to the end of its last (the optimizer step).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ppdsl.analysis.simulate import simulate
from ppdsl.analysis.trace_check import PASS_CATEGORIES, TraceStep
from ppdsl.ir.schedule import Costs, Schedule
from ppdsl.semantics import PassKind, pass_cost, receives, transfer_passes

__all__ = ["KindTimes", "Slip", "TimelineReport", "compare_timeline", "compared_steps",
           "critical_transfers", "format_timeline", "late_receives", "pipeline_latency",
           "transfer_latencies", "window_ms"]

OUTSIDE_CAUSES = ("exchange", "optimizer", "data", "other")
"""What a step holds besides passes, as the trace records it: the exchanges
(posting sends and waiting on receives), the optimizer step (with its
gradient-norm all-reduce when clipping), building the batch, and the rest
(the engine's work between passes; the loss is inside the last stage's F)."""


@dataclass(frozen=True)
class KindTimes:
    """One rank's passes of one kind, over the compared steps."""

    rank: int
    kind: str
    count: int
    """Passes of this kind per step."""
    measured_ms: float
    """The mean measured duration (`pass_cost`)."""
    predicted_ms: float | None
    """The mean simulated duration under the schedule's costs (None when they
    are not in ms: no `--costs-from`)."""


@dataclass(frozen=True)
class Slip:
    """A pass whose start slipped against the simulation under the run's own
    mean pass times: `held_ms` more time between it and the rank's previous
    pass than simulated."""

    rank: int
    step: int
    name: str
    held_ms: float
    cause: str


@dataclass(frozen=True)
class TimelineReport:
    """What `compare_timeline` finds."""

    steps: tuple[int, ...]
    """The steps compared."""
    kinds: tuple[KindTimes, ...]
    step_ms: dict[int, float]
    """Per rank, the median step time."""
    passes_ms: dict[int, float]
    """Per rank, the median time in passes per step."""
    outside_ms: dict[int, dict[str, float]]
    """Per rank, per cause (`OUTSIDE_CAUSES`), the median time per step."""
    measured_step_ms: float
    """The median over steps of the longest rank's step."""
    predicted_step_ms: float | None
    """The simulated step (`Timeline.step_time`: the makespan, plus the step
    costs when the costs declare them) under the schedule's costs (None: not in ms)."""
    resimulated_step_ms: float
    """The simulated step under the run's own mean pass times."""
    slips: tuple[Slip, ...]
    """The largest slips, largest first."""
    late_receives_ms: tuple[float, ...] = ()
    """Per receive whose send its sender had posted before this rank posted
    the receive, the time from posting it to holding the tensor: what `cost
    recv` models (docs/language.md)."""
    recv_ms: float | None = None
    """The schedule's `cost recv` (None: its costs are not in ms)."""
    critical_transfers_ms: tuple[float, ...] = ()
    """On one clock, per transfer on the critical path (`transfer_latencies`:
    its receiver was ready first), ms from the end of the pass that made it to
    the start of the pass that took it (empty: not on one clock)."""
    latency_ms: float | None = None
    """What those transfers make `cost comm` (`pipeline_latency`, less the
    costs' overhead per pass; None: none, or not on one clock)."""
    comm_ms: float | None = None
    """The schedule's `cost comm` (None: its costs are not in ms)."""


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def compared_steps(steps: Sequence[TraceStep]) -> tuple[tuple[int, ...], list[TraceStep]]:
    """The steps a trace is judged by (every step after the first, which runs
    the memory meter with cold caches; the only one when there is one) and
    the ranks' slices of them."""
    every = sorted({s.step for s in steps})
    compared = tuple(every[1:] if len(every) > 1 else every)
    return compared, [s for s in steps if s.step in compared]


def window_ms(step: TraceStep) -> float:
    """A rank's step, ms from the start of its first slice to the end of its last."""
    return (max(e["ts"] + e["dur"] for e in step.events)
            - min(e["ts"] for e in step.events)) / 1e3


def critical_transfers(steps: Sequence[TraceStep], num_ranks: int, overhead_ms: float
                       ) -> dict[tuple[int, int], list[float]]:
    """`transfer_latencies` of the first pipeline's ranks (a data-parallel
    replica repeats the same passes) over `steps`, on one clock."""
    per_rank: list[list[dict[str, Any]]] = [[] for _ in range(num_ranks)]
    for s in steps:
        if s.rank < num_ranks:
            per_rank[s.rank].extend(s.passes)
    return transfer_latencies(per_rank, overhead_ms)


def compare_timeline(
    steps: Sequence[TraceStep], schedule: Schedule, costs_in_ms: bool, top: int = 5,
    one_clock: bool = False,
) -> TimelineReport:
    """The report of `steps` (one rank's step each, `steps_of`) against `schedule`
    (the compiled schedule, its costs in ms when `costs_in_ms`); `top` slips;
    `one_clock`: every rank's times on one clock (the trace's `clock` "host"),
    so transfers are timed from one rank to another."""
    num_ranks = schedule.placement.num_devices
    compared, mine = compared_steps(steps)
    durations: dict[tuple[str, int], list[float]] = {}
    by_rank_kind: dict[tuple[int, str], list[float]] = {}
    for s in mine:
        for e in s.passes:
            ms = float(e["dur"]) / 1e3
            durations.setdefault((e["cat"], int(e["args"]["stage"])), []).append(ms)
            by_rank_kind.setdefault((s.rank, e["cat"]), []).append(ms)
    timeline = simulate(schedule)
    kinds = []
    kind_order = {k.value: i for i, k in enumerate(PassKind)}
    for (rank, kind), values in sorted(by_rank_kind.items(),
                                       key=lambda x: (x[0][0], kind_order[x[0][1]])):
        order = schedule.orders[rank % num_ranks]
        simulated = [timeline.end[rank % num_ranks][k] - timeline.start[rank % num_ranks][k]
                     for k, p in enumerate(order) if p.kind.value == kind]
        kinds.append(KindTimes(
            rank, kind, len(simulated), pass_cost(values),
            sum(simulated) / len(simulated) if costs_in_ms and simulated else None,
        ))
    step_ms: dict[int, list[float]] = {}
    passes_ms: dict[int, list[float]] = {}
    outside: dict[int, dict[str, list[float]]] = {}
    longest: dict[int, float] = {}
    for s in mine:
        window = window_ms(s)
        in_passes = sum(e["dur"] for e in s.passes) / 1e3
        by_cause = {c: sum(e["dur"] for e in s.events if e["cat"] == c) / 1e3
                    for c in OUTSIDE_CAUSES[:-1]}
        by_cause["other"] = window - in_passes - sum(by_cause.values())
        step_ms.setdefault(s.rank, []).append(window)
        passes_ms.setdefault(s.rank, []).append(in_passes)
        for cause, ms in by_cause.items():
            outside.setdefault(s.rank, {}).setdefault(cause, []).append(ms)
        longest[s.step] = max(longest.get(s.step, 0.0), window)
    own = _own_costs(schedule, durations, costs_in_ms)
    resimulated = simulate(own)
    overhead = (sum(schedule.costs.overhead) / len(schedule.costs.overhead)
                if costs_in_ms and schedule.costs.overhead else 0.0)
    critical = critical_transfers(mine, num_ranks, overhead) if one_clock else {}
    return TimelineReport(
        steps=compared,
        kinds=tuple(kinds),
        step_ms={r: _median(v) for r, v in sorted(step_ms.items())},
        passes_ms={r: _median(v) for r, v in sorted(passes_ms.items())},
        outside_ms={r: {c: _median(v[c]) for c in OUTSIDE_CAUSES}
                    for r, v in sorted(outside.items())},
        measured_step_ms=_median(list(longest.values())),
        predicted_step_ms=float(timeline.step_time) if costs_in_ms else None,
        resimulated_step_ms=float(resimulated.step_time),
        slips=tuple(_slips(mine, own, resimulated.start, resimulated.end, top)),
        late_receives_ms=tuple(late_receives(mine)),
        recv_ms=schedule.costs.recv if costs_in_ms else None,
        critical_transfers_ms=tuple(x for v in critical.values() for x in v),
        latency_ms=pipeline_latency(critical, overhead) if critical else None,
        comm_ms=schedule.costs.comm if costs_in_ms else None,
    )


def transfer_latencies(events: list[list[dict[str, Any]]], overhead_ms: float
                       ) -> dict[tuple[int, int], list[float]]:
    """Per (sender rank, receiver rank), in ms, each transfer's time from the end
    of the pass that made it to the start of the pass that takes it, where the
    receiver was ready first (its previous pass of the step, with the
    `overhead_ms` the simulator adds to it, had ended before the sender's): a
    transfer on the critical path, as the simulator's `cost comm` stands for
    it. `events`: one run's trace events per rank (microseconds on one clock,
    steps numbered). Which pass takes a tensor from which is the semantics'
    (`receives`, `transfer_passes`): an activation from F(j) of stage s to F(j) of stage
    s + 1, a gradient from B or BW(j) of stage s + 1 to B or BW(j) of stage s."""
    passes: dict[tuple[int, str, int, int], tuple[int, float, float, float | None]] = {}
    for rank, mine in enumerate(events):
        ordered = sorted((e for e in mine if e["cat"] in PASS_CATEGORIES),
                         key=lambda e: e["ts"])
        for before, e in zip([None, *ordered], ordered, strict=False):
            a = e["args"]
            ready = (before["ts"] + before["dur"]
                     if before is not None and before["args"]["step"] == a["step"] else None)
            passes[(a["step"], e["cat"], a["microbatch"], a["stage"])] = (
                rank, e["ts"], e["ts"] + e["dur"], ready)
    found: dict[tuple[int, int], list[float]] = {}
    for (step, cat, mb, stage), (rank, start, _, ready) in passes.items():
        for carried, offset in receives(PassKind(cat)):
            made = next((passes[key] for key in
                         ((step, k.value, mb, stage + offset)
                          for k in transfer_passes(carried, sending=True))
                         if key in passes), None)
            if made is None or made[0] == rank:
                continue
            if ready is None or ready + overhead_ms * 1e3 < made[2]:
                found.setdefault((made[0], rank), []).append((start - made[2]) / 1e3)
    return found


def pipeline_latency(found: dict[tuple[int, int], list[float]], overhead_ms: float
                     ) -> float | None:
    """`cost comm` from `transfer_latencies` (ms): the mean over pairs of ranks
    of the mean of their two directions' mean latency (each rank's clock starts
    after a barrier that the ranks leave at slightly different times: a skew
    that lengthens one direction's transfers as much as it shortens the
    other's), less the engine's overhead per pass, which the simulator already
    charges the sender's pass. The mean, not the median: a step adds up the
    transfers on its critical path, the rare one a stalled rank held included,
    as it adds up passes (`semantics.pass_cost`). None without a transfer on
    the critical path."""
    pairs = []
    for a, b in sorted({tuple(sorted(k)) for k in found}):
        means = [pass_cost(found[k]) for k in ((a, b), (b, a)) if found.get(k)]
        pairs.append(statistics.fmean(means))
    if not pairs:
        return None
    return max(statistics.fmean(pairs) - overhead_ms, 0.0)


def late_receives(steps: Sequence[TraceStep]) -> list[float]:
    """For each receive that its sender had posted (its exchange ended) before
    the receiving rank posted it, ms from that post to the end of the wait that
    hands over the tensor (the post itself when no wait follows)."""
    posted: dict[tuple[int, str], float] = {}
    for s in steps:
        for x in s.posts:
            for name in x["args"].get("sends", []):
                posted[(s.step, name)] = x["ts"] + x["dur"]
    found = []
    for s in steps:
        exchanges = s.exchanges
        for k, x in enumerate(exchanges):
            if x.get("name") == "wait":
                continue
            for name in x["args"].get("recvs", []):
                sent = posted.get((s.step, name))
                if sent is None or sent > x["ts"]:
                    continue
                held = next((w["ts"] + w["dur"] for w in exchanges[k + 1:]
                             if w.get("name") == "wait" and name in w["args"].get("recvs", [])),
                            x["ts"] + x["dur"])
                found.append((held - x["ts"]) / 1e3)
    return found


def _own_costs(
    schedule: Schedule, durations: dict[tuple[str, int], list[float]], costs_in_ms: bool
) -> Schedule:
    """`schedule` under the run's mean pass times (a kind not run keeps the
    schedule's cost; transfers cost what the schedule says when it is in ms)."""
    costs = schedule.costs
    per_kind = {
        kind: [pass_cost(durations[(kind.value, s)]) if durations.get((kind.value, s))
               else costs.per_stage(kind)[s] for s in range(schedule.num_stages)]
        for kind in PassKind
    }
    comm = costs.comm if costs_in_ms else 0.0
    own = Costs.by_kind(per_kind, comm, overlap=costs.overlap)
    if costs_in_ms:  # the file's step costs (overhead, optimizer, norm) and recv stay
        own = own.with_step_costs(costs.overhead, costs.optimizer, costs.norm, costs.jitter
                                  ).with_receive_cost(costs.recv)
    return replace(schedule, costs=own)


def _slips(
    steps: Sequence[TraceStep],
    schedule: Schedule,
    start: tuple[tuple[float, ...], ...],
    end: tuple[tuple[float, ...], ...],
    top: int,
) -> list[Slip]:
    """Per pass, the measured gap since the rank's previous pass (since the step's
    first pass on any rank, for a rank's first) less the simulated one."""
    num_ranks = schedule.placement.num_devices
    origin: dict[int, float] = {}
    for s in steps:
        if s.passes:
            first = min(e["ts"] for e in s.passes)
            origin[s.step] = min(origin.get(s.step, first), first)
    found: list[Slip] = []
    for s in steps:
        device = s.rank % num_ranks
        passes = s.passes
        if len(passes) != len(schedule.orders[device]):
            continue  # a trace that does not conform has no simulated twin
        previous_end, simulated_previous_end = origin[s.step], 0.0
        for k, e in enumerate(passes):
            gap = (e["ts"] - previous_end) / 1e3
            held = gap - (start[device][k] - simulated_previous_end)
            between = [x for x in s.exchanges if previous_end <= x["ts"] < e["ts"]]
            found.append(Slip(s.rank, s.step, e["name"], held, _cause(between, gap)))
            previous_end, simulated_previous_end = e["ts"] + e["dur"], end[device][k]
    found.sort(key=lambda x: (-x.held_ms, x.step, x.rank))
    return found[:top]


def _cause(exchanges: list[dict[str, Any]], gap_ms: float) -> str:
    waited = sum(x["dur"] for x in exchanges) / 1e3
    recvs = [t for x in exchanges for t in x["args"].get("recvs", [])]
    sends = [t for x in exchanges for t in x["args"].get("sends", [])]
    if recvs:
        return (f"waited {waited:.2f} ms on recv {', '.join(recvs)}"
                + (f" (with send {', '.join(sends)})" if sends else ""))
    if sends:
        return f"spent {waited:.2f} ms sending {', '.join(sends)}"
    return f"{gap_ms:.2f} ms of engine work between passes, no transfer"


def format_timeline(report: TimelineReport) -> str:
    """The report as text tables."""
    lines = [f"steps compared: {', '.join(str(s) for s in report.steps)} "
             "(the first step is left out when there are more)", "",
             "rank  kind  per step  measured ms  predicted ms  measured/predicted"]
    for k in report.kinds:
        predicted = f"{k.predicted_ms:12.3f}" if k.predicted_ms is not None else f"{'-':>12}"
        ratio = (f"{k.measured_ms / k.predicted_ms:18.2f}" if k.predicted_ms else f"{'-':>18}")
        lines.append(f"{k.rank:4d}  {k.kind:<4}  {k.count:8d}  {k.measured_ms:11.3f}  "
                     f"{predicted}  {ratio}")
    lines += ["", "time per step (median ms): in passes and outside them, by cause",
              "rank      step    passes  " + "  ".join(f"{c:>9}" for c in OUTSIDE_CAUSES)]
    for rank, step in report.step_ms.items():
        causes = "  ".join(f"{report.outside_ms[rank][c]:9.3f}" for c in OUTSIDE_CAUSES)
        lines.append(f"{rank:4d}  {step:8.3f}  {report.passes_ms[rank]:8.3f}  {causes}")
    lines.append("")
    lines.append(f"step: measured {report.measured_step_ms:.3f} ms (median of the longest "
                 "rank's)")
    if report.predicted_step_ms is not None:
        lines.append(f"      predicted {report.predicted_step_ms:.3f} ms under the schedule's "
                     f"costs: measured/predicted "
                     f"{report.measured_step_ms / report.predicted_step_ms:.2f}")
    else:
        lines.append("      no prediction in ms: the costs are the file's own units "
                     "(give --costs-from, or run with it)")
    lines.append(f"      {report.resimulated_step_ms:.3f} ms simulated under the run's own "
                 "mean pass times: measured/that "
                 f"{report.measured_step_ms / max(report.resimulated_step_ms, 1e-12):.2f}")
    if report.late_receives_ms:
        late = report.late_receives_ms
        lines.append(f"receives posted after their data was sent: {len(late)}, from posting to "
                     f"holding the tensor median {_median(late):.3f} ms"
                     + (f" (cost recv {report.recv_ms:.3f} ms)" if report.recv_ms is not None
                        else ""))
    if report.critical_transfers_ms:
        held = report.critical_transfers_ms
        lines.append(f"transfers on the critical path (their receiver ready first): {len(held)}, "
                     f"from the sender's pass end to the receiver's pass start mean "
                     f"{pass_cost(held):.3f} ms, median {_median(held):.3f} ms; as `cost comm` "
                     f"(less the overhead per pass) {report.latency_ms:.3f} ms"
                     + (f" (cost comm {report.comm_ms:.3f} ms)" if report.comm_ms is not None
                        else ""))
    if report.slips:
        lines += ["", "passes held longest against the simulation (own pass times):"]
        for s in report.slips:
            lines.append(f"  rank {s.rank}, step {s.step}, {s.name}: +{s.held_ms:.3f} ms; "
                         f"{s.cause}")
    return "\n".join(lines) + "\n"
