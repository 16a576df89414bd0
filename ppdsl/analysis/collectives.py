"""The data-parallel communication lane of each device: when each stage's
gradient reduction (and, with sharded data parallelism, its weight gather) runs
beside the compute timeline, and how much of it is exposed.

The model follows what the runtime does (`ppdsl.runtime.execution.data_parallel`):

- reduce: issued when the stage's last W or BW ends (`semantics.reduction_point`);
  its cost is `cost reduce[s]` (an all-reduce under `replicate`, a
  reduce-scatter under `shard`);
- gather (shard only): the device's first stage (in the order of first forwards)
  is gathered from the start of its first pass, each later stage from the start
  of the previous stage's first F (one gather ahead); it is needed by the
  stage's first pass (`semantics.gather_point`);
- one collective at a time per device, in the order they are issued (the ranks
  of a DP group issue the same collectives in the same order).

Exposed communication per device: the time a gather is still running when its
stage's first pass is due, plus the time reductions still run after the
device's last pass (the optimizer step waits for them). Communication that runs
while the device computes is hidden. The compute timeline itself is not moved:
`step_end` adds the exposed time to the device's last pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppdsl.analysis.simulate import Timeline
from ppdsl.ir.schedule import PassKind, Schedule
from ppdsl.semantics import DP_MODES, reduction_points

__all__ = ["MODES", "Collective", "CommLanes", "StateBytes", "comm_lanes", "state_bytes"]

MODES = DP_MODES
"""Data-parallel modes: `replicate` reduces only; `shard` gathers too."""


@dataclass(frozen=True)
class Collective:
    """One collective on a device's communication lane."""

    kind: str
    """"reduce" or "gather"."""
    stage: int
    issued: float
    """When the runtime issues it (a pass's start or end in the timeline)."""
    start: float
    """When it runs (after the lane's previous collective)."""
    end: float
    after_pass: int
    """reduce: the index in the device's order of the pass it follows (the
    stage's last W/BW); gather: the index of the pass that needs it (the stage's
    first pass)."""
    needed_by: float | None
    """gather: the start of the stage's first pass; reduce: None (the step's end)."""

    @property
    def exposed(self) -> float:
        """gather: how long its stage's first pass would wait for it."""
        return max(0.0, self.end - self.needed_by) if self.needed_by is not None else 0.0


@dataclass(frozen=True)
class CommLanes:
    """Every device's communication lane under one data-parallel mode."""

    mode: str
    lanes: tuple[tuple[Collective, ...], ...]
    """Per device, its collectives in the order they run."""
    exposed: tuple[float, ...]
    """Per device: gather waits + reductions running past its last pass."""
    step_end: tuple[float, ...]
    """Per device: its last pass's end plus its exposed communication."""
    total: tuple[float, ...]
    """Per device: the summed cost of its collectives."""

    @property
    def makespan(self) -> float:
        """The step's end with communication: the latest device's `step_end`."""
        return max(self.step_end, default=0.0)


def comm_lanes(schedule: Schedule, timeline: Timeline, mode: str = "replicate") -> CommLanes:
    """The lanes of `schedule` under `mode` (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"data-parallel mode must be one of {', '.join(MODES)}, not {mode!r}")
    costs = schedule.costs
    lanes, exposed, step_end, total = [], [], [], []
    for dev, order in enumerate(schedule.orders):
        first_pass: dict[int, int] = {}
        first_forward: dict[int, int] = {}
        for i, p in enumerate(order):
            first_pass.setdefault(p.stage, i)
            if p.kind is PassKind.F:
                first_forward.setdefault(p.stage, i)
        wanted: list[tuple[float, int, Collective]] = []
        if mode == "shard":
            by_forward = sorted(first_forward, key=first_forward.__getitem__)
            for k, s in enumerate(by_forward):
                need = first_pass[s]  # semantics.gather_point
                issue_at = need if k == 0 else first_forward[by_forward[k - 1]]
                issued = float(timeline.start[dev][issue_at])
                wanted.append((issued, 0, Collective("gather", s, issued, 0.0, 0.0, need,
                                                     float(timeline.start[dev][need]))))
        for s, at in sorted(reduction_points(order).items()):
            issued = float(timeline.end[dev][at])
            wanted.append((issued, 1, Collective("reduce", s, issued, 0.0, 0.0, at, None)))
        wanted.sort(key=lambda x: (x[0], x[1], x[2].after_pass))
        free = 0.0
        lane = []
        for issued, _, c in wanted:
            start = max(issued, free)
            end = start + costs.collective(c.kind, c.stage)
            free = end
            lane.append(Collective(c.kind, c.stage, issued, start, end, c.after_pass, c.needed_by))
        last = float(timeline.span_end[dev])
        tail = max((c.end for c in lane if c.kind == "reduce"), default=last)
        waits = sum(c.exposed for c in lane)
        lanes.append(tuple(lane))
        exposed.append(waits + max(0.0, tail - last))
        step_end.append(last + exposed[-1])
        total.append(sum(c.end - c.start for c in lane))
    return CommLanes(mode, tuple(lanes), tuple(exposed), tuple(step_end), tuple(total))


@dataclass(frozen=True)
class StateBytes:
    """Per device, the bytes of model state a data-parallel replica holds (beside
    activations) for a given parameter count."""

    params: tuple[float, ...]
    """Parameters resident all step: whole (replicate) or the shard (shard)."""
    gathered: tuple[float, ...]
    """shard: the most whole parameters held at once during the step (a stage is
    whole from its gather until its reduction is issued); replicate: 0."""
    grads: tuple[float, ...]
    """Gradients resident after the step: whole (replicate) or the shard (shard)."""
    grad_buffers: tuple[float, ...]
    """The most gradient bytes in flight at once: replicate, each reduced stage's
    bucket until the step's end; shard, whole gradients from the stage's first
    backward until its reduce-scatter ends."""
    optimizer: tuple[float, ...]
    """Optimizer state (whole or the shard)."""

    def total(self, dev: int) -> float:
        """An upper bound of the device's model-state bytes (each peak added)."""
        return (self.params[dev] + self.gathered[dev] + self.grads[dev] + self.grad_buffers[dev]
                + self.optimizer[dev])


def _peak(intervals: list[tuple[float, float, float]]) -> float:
    """The largest sum of sizes of intervals [start, end] that overlap."""
    events = sorted([(a, 0, size) for a, _, size in intervals] + [(b, 1, -size) for _, b, size in intervals])
    level = best = 0.0
    for _, _, change in events:  # at equal times, starts before ends: both are held
        level += change
        best = max(best, level)
    return best


def state_bytes(
    schedule: Schedule,
    timeline: Timeline,
    lanes: CommLanes,
    num_params: float,
    dp: int,
    *,
    param_bytes: float = 4.0,
    optimizer_bytes: float = 8.0,
) -> StateBytes:
    """Model-state bytes per device for `num_params` parameters split evenly over
    the stages, `dp` replicas in `lanes.mode`; `param_bytes` per parameter and per
    gradient (fp32: 4), `optimizer_bytes` per parameter (Adam's two moments in
    fp32: 8)."""
    per_stage = num_params / schedule.num_stages
    shard = lanes.mode == "shard"
    out: dict[str, list[float]] = {k: [] for k in ("params", "gathered", "grads", "buffers", "optimizer")}
    for dev, order in enumerate(schedule.orders):
        stages = sorted({p.stage for p in order})
        whole = per_stage * len(stages)
        mine = whole / dp if shard else whole
        out["params"].append(mine * param_bytes)
        out["grads"].append(mine * param_bytes)
        out["optimizer"].append(mine * optimizer_bytes)
        lane = lanes.lanes[dev]
        reduce = {c.stage: c for c in lane if c.kind == "reduce"}
        if shard:
            gather = {c.stage: c for c in lane if c.kind == "gather"}
            held = [(gather[s].start, reduce[s].issued, per_stage * param_bytes)
                    for s in stages if s in gather and s in reduce]
            out["gathered"].append(_peak(held))
            firsts = {s: min(float(t) for t, p in zip(timeline.start[dev], order, strict=True)
                             if p.stage == s and p.kind is not PassKind.F) for s in reduce}
            out["buffers"].append(_peak([(firsts[s], reduce[s].end, per_stage * param_bytes)
                                         for s in reduce]))
        else:
            out["gathered"].append(0.0)
            out["buffers"].append(_peak([(reduce[s].issued, lanes.step_end[dev], per_stage * param_bytes)
                                         for s in reduce]))
    return StateBytes(tuple(out["params"]), tuple(out["gathered"]), tuple(out["grads"]),
                      tuple(out["buffers"]), tuple(out["optimizer"]))

