"""A run's measured pass times beside the simulator: the mean measured costs
(`mean_costs`), the simulation of the run's orders under them
(`simulated_timeline`), and where the measured step's time went against the
prediction (`gap_sources`), for `ppdsl run`'s closing summary.

The durations are a `ppdsl.runtime.execution.trace.Tracer`'s: in ms, keyed by
(pass kind letter, stage), and the slices outside passes by (their category,
-1) ("exchange", "optimizer", "data"). Plain Python: the compiler's analysis,
no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ppdsl.ir.schedule import Costs, MemoryModel, Pass, PassKind, Placement, Schedule
from ppdsl.semantics import pass_cost

if TYPE_CHECKING:
    from ppdsl.analysis.simulate import Timeline

__all__ = ["GapSource", "gap_sources", "mean_costs", "simulated_timeline"]


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
                      ).with_receive_cost(fallback.recv).with_transfers_of(fallback)


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
    # imported here: the simulator loads numba, which a worker pays for only
    # when its run is traced
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
