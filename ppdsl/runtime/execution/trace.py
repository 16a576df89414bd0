"""What each rank did when: its passes and exchanges, timed, as a Chrome/Perfetto
trace (`--trace OUT.json`), and the per-pass times that let the simulator be
checked against the run.

On CPU a pass is timed with `time.perf_counter` around it. On CUDA, where a pass
only queues kernels, each pass is bracketed by CUDA events and read back once per
step (one synchronisation), so the times are the GPU's. Times count from an
epoch every rank takes right after a barrier, so the ranks' rows line up (to
within the barrier's skew; one machine's clock is shared, across nodes NTP's).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ppdsl.ir.schedule import Costs, MemoryModel, Pass, PassKind, Placement, Schedule
from ppdsl.semantics import pass_cost

if TYPE_CHECKING:
    from ppdsl.analysis.simulate import Timeline

__all__ = [
    "Tracer", "chrome_trace", "write_chrome_trace", "mean_costs", "simulated_makespan",
    "simulated_timeline", "GapSource", "gap_sources", "OUTSIDE",
]

OUTSIDE = ("exchange", "optimizer", "data")
"""The traced slices outside passes whose durations `Tracer.durations` keeps:
the engine's exchanges (posting sends, waiting on receives), the optimizer step
(with the gradient-norm all-reduce and the wait for the other ranks in it), and
building the batch (outside the timed step)."""


class Tracer:
    """Records one rank's passes and exchanges."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.events: list[dict[str, Any]] = []
        """Chrome trace events ("X" slices), times in microseconds from the epoch."""
        self.durations: dict[tuple[str, int], list[float]] = {}
        """(pass kind letter, stage) -> durations in ms of the steps marked `timed`;
        the slices outside passes under (their category, -1): `OUTSIDE` ("exchange",
        "optimizer", "data")."""
        self._epoch = 0.0
        self._epoch_event: Any = None
        self._pending: list[tuple[dict[str, Any], Any, Any]] = []
        self._open: Any = None
        self.step = 0
        self.timed = False
        self.shared_clock = False
        """Whether `start` took rank 0's epoch (one clock with it)."""

    def start(self) -> None:
        """Take the epoch: call right after a barrier, on every rank of the
        default process group at once (when there is one). On CPU a rank on the
        same host as rank 0 then takes rank 0's epoch: `perf_counter` is the host's monotonic clock, so their
        times compare exactly; a barrier alone leaves each rank's epoch where
        it left the barrier, milliseconds apart on busy cores (3.5 ms seen
        between two gloo ranks on 2 cores)."""
        if self.cuda:
            torch.cuda.synchronize()
            self._epoch_event = torch.cuda.Event(enable_timing=True)
            self._epoch_event.record()
        self._epoch = time.perf_counter()
        if not self.cuda:
            import socket

            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                every: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(every, (socket.gethostname(), self._epoch))
                if every[0][0] == socket.gethostname():
                    self._epoch = every[0][1]
                    self.shared_clock = True

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self) -> None:
        """Mark the start of the next slice."""
        self._open = self._now()

    def end(self, name: str, category: str, args: dict[str, Any], kind_stage: tuple[str, int] | None) -> None:
        """Close the slice opened by `begin`; `kind_stage` files its duration as a
        pass of that kind and stage."""
        event = {"name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": 0,
                 "args": {**args, "step": self.step}}
        if kind_stage is not None:
            event["_kind_stage"] = kind_stage
        self._pending.append((event, self._open, self._now()))
        self._open = None

    def flush(self) -> None:
        """Turn the step's pending slices into events (on CUDA: one synchronisation)."""
        if self.cuda and self._pending:
            torch.cuda.synchronize()
        for event, start, end in self._pending:
            if self.cuda:
                ts = self._epoch_event.elapsed_time(start) * 1e3
                dur = start.elapsed_time(end) * 1e3
            else:
                ts = (start - self._epoch) * 1e6
                dur = (end - start) * 1e6
            event["ts"], event["dur"] = ts, dur
            kind_stage = event.pop("_kind_stage", None)
            if kind_stage is None and event["cat"] in OUTSIDE:
                kind_stage = (event["cat"], -1)
            if kind_stage is not None and self.timed:
                self.durations.setdefault(kind_stage, []).append(dur / 1e3)
            self.events.append(event)
        self._pending.clear()


def chrome_trace(per_rank: list[list[dict[str, Any]]], names: list[str], meta: dict[str, Any]) -> dict[str, Any]:
    """One trace of every rank: a process per rank (named by `names`), slices as
    recorded, and `meta` under otherData."""
    events: list[dict[str, Any]] = []
    for rank, (evs, name) in enumerate(zip(per_rank, names, strict=True)):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        events.extend(evs)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def write_chrome_trace(path: str | Path, trace: dict[str, Any]) -> None:
    """Write the trace as JSON (open it in ui.perfetto.dev or chrome://tracing)."""
    out = Path(path)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace), encoding="utf-8")


def mean_costs(
    durations: dict[tuple[str, int], list[float]], num_stages: int, fallback: Costs
) -> Costs:
    """Per kind and stage, the mean measured pass time (ms: `pass_cost`); where a
    kind was not run (B/W in a fused schedule), `fallback`'s value."""

    def pick(letter: str, values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(
            pass_cost(durations[(letter, s)]) if durations.get((letter, s)) else values[s]
            for s in range(num_stages)
        )

    return Costs.of(
        pick("F", fallback.forward),
        pick("B", fallback.backward_input),
        pick("W", fallback.backward_weight),
        pick("BW", fallback.fused_backward),
        fallback.comm,
    ).with_step_costs(fallback.overhead, fallback.optimizer, fallback.norm, fallback.jitter
                      ).with_receive_cost(fallback.recv)


def simulated_makespan(
    orders: Sequence[Sequence[tuple[PassKind, int, int]]],
    stage_device: tuple[int, ...],
    num_microbatches: int,
    split_backward: bool,
    costs: Costs,
    memory: MemoryModel,
    lanes: int = 1,
) -> float:
    """The simulator's makespan of these per-rank orders under `costs` (`lanes`:
    the placement's pipelines, 2 under DualPipe)."""
    return float(simulated_timeline(orders, stage_device, num_microbatches, split_backward,
                                    costs, memory, lanes).makespan)


def simulated_timeline(
    orders: Sequence[Sequence[tuple[PassKind, int, int]]],
    stage_device: tuple[int, ...],
    num_microbatches: int,
    split_backward: bool,
    costs: Costs,
    memory: MemoryModel,
    lanes: int = 1,
) -> Timeline:
    """The simulator's timeline of these per-rank orders under `costs` (its
    `step_time` is the whole step when `costs` declare step costs)."""
    from ppdsl.analysis.simulate import simulate

    schedule = Schedule(
        name="run",
        file="run",
        params=(),
        num_microbatches=num_microbatches,
        placement=Placement("list", len(orders), stage_device, lanes),
        split_backward=split_backward,
        costs=costs,
        memory=memory,
        orders=tuple(tuple(Pass(k, mb, s) for k, mb, s in order) for order in orders),
    )
    return simulate(schedule)


@dataclass(frozen=True)
class GapSource:
    """One cause of time in a step, on the rank where it exceeds the prediction
    most: what this run measured against what the simulator predicted."""

    cause: str
    rank: int
    measured_ms: float
    """Per step (median step's worth: the timed steps' total over their count)."""
    predicted_ms: float

    @property
    def excess_ms(self) -> float:
        """How much longer it took than predicted."""
        return self.measured_ms - self.predicted_ms


def gap_sources(
    timeline: Timeline,
    orders: Sequence[Sequence[tuple[PassKind, int, int]]],
    stage_device: tuple[int, ...],
    costs: Costs,
    durations: Sequence[dict[tuple[str, int], list[float]]],
    num_steps: int,
    measured_step_ms: float,
) -> list[GapSource]:
    """Where the measured step's time went against the simulated one, largest
    excess first: per cause, the pipeline rank where it exceeds its prediction
    most. `timeline`: the simulation under `costs` (ms); `durations`: each
    rank's `Tracer.durations` (pipeline ranks first); `num_steps`: the timed
    steps they cover. Causes: the passes (their costs), the engine's work
    between passes (`cost overhead`), the exchanges (waits on receives and
    sends, against the simulated idle time of the rank, transfers included),
    and the optimizer step (with the norm all-reduce: `cost optimizer`, `cost
    norm`)."""
    steps = max(num_steps, 1)
    found: dict[str, GapSource] = {}

    def offer(source: GapSource) -> None:
        best = found.get(source.cause)
        if best is None or source.excess_ms > best.excess_ms:
            found[source.cause] = source

    optimizer_of = [0.0] * len(orders)
    for stage, device in enumerate(stage_device):
        if costs.optimizer:
            optimizer_of[device] += costs.optimizer[stage]
    for rank, order in enumerate(orders):
        mine = durations[rank] if rank < len(durations) else {}

        def total(key: tuple[str, int], mine: dict[tuple[str, int], list[float]] = mine) -> float:
            return sum(mine.get(key, ())) / steps

        passes = sum(sum(v) for (k, st), v in mine.items() if st >= 0) / steps
        exchange, optimizer = total(("exchange", -1)), total(("optimizer", -1))
        predicted_passes = sum(costs.durations[k.code][st] for k, _, st in order)
        predicted_overhead = sum(costs.overhead[st] for _, _, st in order) if costs.overhead else 0.0
        busy = timeline.busy[rank]
        offer(GapSource("passes", rank, passes, predicted_passes))
        offer(GapSource("exchanges (waiting on receives, sending)", rank, exchange,
                        max(timeline.makespan - busy, 0.0)))
        offer(GapSource("optimizer step (with the norm all-reduce)", rank, optimizer,
                        optimizer_of[rank] + costs.norm))
        engine = max(measured_step_ms - passes - exchange - optimizer, 0.0)
        offer(GapSource("engine work between passes", rank, engine, predicted_overhead))
    return sorted(found.values(), key=lambda g: -g.excess_ms)
