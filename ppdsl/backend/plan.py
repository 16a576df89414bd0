"""What a rank needs to know about the compiled schedule besides its own ops: the
placement, the microbatch count, the memory model and the compiler's predictions.
It is the manifest's content (`manifest.json` beside the generated programs),
written by codegen and read by the runtime; plain Python, no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any

import numpy as np

from ppdsl import __version__, json_text, semantics
from ppdsl.ir.rank import RankArrays, RankProgram, rank_program_texts
from ppdsl.ir.schedule import (
    MEMORY_NAMES,
    Costs,
    MemoryModel,
    Pass,
    PassOrder,
    Placement,
    Schedule,
    format_schedule,
    torch_actions,
)
from ppdsl.semantics import KINDS, PassKind, memory_peak, parse_torch_action

__all__ = ["Plan", "PassKeys", "plan_from_schedule", "fingerprint", "predicted_peak"]


def predicted_peak(
    order: PassOrder,
    memory: MemoryModel,
    table: tuple[np.ndarray, int] | None = None,
) -> Fraction:
    """The memory model's peak for one device's order (`semantics.memory_peak`;
    `table`: its `delta_table`, made once for every device of a plan, with
    `longest_order` their longest order)."""
    deltas, scale = table if table is not None else memory.delta_table(longest_order=len(order))
    return memory_peak(deltas, scale, order.kind, order.stage)[0]


class PassKeys(Sequence[tuple[PassKind, int, int]]):
    """A device's order as the plan holds it, (kind, microbatch, stage) per pass,
    read from its columns when asked (a tuple per pass would be ~80 bytes each
    at a million passes). Equal to the tuple of those triples."""

    __slots__ = ("passes",)

    def __init__(self, passes: PassOrder):
        self.passes = passes
        """The device's passes."""

    def __len__(self) -> int:
        return len(self.passes)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        if isinstance(index, slice):
            return tuple(self)[index]
        p = self.passes[index]
        return (p.kind, p.microbatch, p.stage)

    def __iter__(self) -> Iterator[tuple[PassKind, int, int]]:
        passes = self.passes
        return zip(map(KINDS.__getitem__, passes.kind.tolist()), passes.microbatch.tolist(),
                   passes.stage.tolist(), strict=True)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PassKeys | tuple | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


def fingerprint(schedule: Schedule, programs: tuple[RankProgram, ...] | RankArrays) -> str:
    """sha256 of the schedule's canonical text, the rank programs and ppdsl's version."""
    # the text is "\n".join([version line, schedule, programs]), hashed piece by
    # piece: at scale the programs' text is tens of MB
    digest = hashlib.sha256(f"ppdsl {__version__}\n{format_schedule(schedule)}\n".encode())
    for text in rank_program_texts(programs):
        digest.update(text.encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Plan:
    """The schedule facts every rank shares."""

    name: str
    file: str
    params: dict[str, Any]
    stage_device: tuple[int, ...]
    num_microbatches: int
    split_backward: bool
    memory: MemoryModel
    orders: tuple[PassKeys, ...]
    """Per rank: (kind, microbatch, stage) of each compute pass, in order (over
    the columns of a compiled schedule, or of the actions a manifest holds)."""
    fingerprint: str
    predicted_busy_share: tuple[float, ...] | None = None
    """Per rank: simulated busy time / makespan (None without a timeline)."""
    costs: dict[str, Any] | None = None
    predicted_makespan: float | None = None
    """The simulated makespan under `costs` (None without a timeline)."""
    costs_from: str | None = None
    """The `--costs-from` file the costs came from (milliseconds, as `ppdsl profile`
    writes them), or None for the schedule's own costs (its units)."""
    predicted_step_time: float | None = None
    """The simulated whole step (`Timeline.step_time`) when the costs declare
    step costs (`semantics.STEP_COSTS`), else None (the step is the makespan)."""
    lanes: int = 1
    """The placement's pipelines (2 under DualPipe): stage s is a copy of model
    stage `model_stage(s)`; microbatch j goes through lane `microbatch_lane(j)`."""

    @property
    def num_devices(self) -> int:
        return len(self.orders)

    @property
    def num_stages(self) -> int:
        return len(self.stage_device)

    @property
    def num_model_stages(self) -> int:
        """The model's stages (the factory builds these): S / lanes."""
        return len(self.stage_device) // self.lanes

    def model_stage(self, stage: int) -> int:
        """The model stage that schedule stage `stage` holds a copy of."""
        return semantics.model_stage(stage, self.num_stages, self.lanes)

    def microbatch_lane(self, microbatch: int) -> int:
        """The lane microbatch j goes through."""
        return semantics.microbatch_lane(microbatch, self.num_microbatches, self.lanes)

    def is_lane_first(self, stage: int) -> bool:
        """Whether `stage` is the first of its lane (it reads the batch's inputs)."""
        return stage % self.num_model_stages == 0

    def is_lane_last(self, stage: int) -> bool:
        """Whether `stage` is the last of its lane (it computes the loss)."""
        return stage % self.num_model_stages == self.num_model_stages - 1

    def forward_schedule(self) -> Schedule:
        """The schedule of an evaluation step: each rank's F passes in their order,
        under the same placement (`ppdsl.compiler.compile_forward` lowers it and
        proves it deadlock-free)."""
        ones = [1.0] * self.num_stages
        return Schedule(
            name=f"{self.name} (forward only)", file=self.file, params=tuple(self.params.items()),
            num_microbatches=self.num_microbatches,
            placement=Placement("list", self.num_devices, self.stage_device, self.lanes),
            split_backward=self.split_backward, costs=Costs.of(ones, ones, ones), memory=self.memory,
            orders=tuple(PassOrder.of([Pass(PassKind(k), j, s) for k, j, s in order
                                       if PassKind(k) is PassKind.F])
                         for order in self.orders),
        )

    def cost_model(self) -> Costs:
        """The costs the plan was compiled under (`costs`), as the IR states them
        (unit costs where the plan has none)."""
        given = self.costs or {}
        durations = {k: given[k.value] for k in KINDS if k.value in given}
        costs = Costs.by_kind(durations, float(given.get("comm", semantics.DEFAULT_COMM)),
                              self.num_stages)
        costs = costs.with_collectives({n: given[n] for n in semantics.COLLECTIVES if n in given})
        costs = costs.with_step_costs(given.get("overhead", ()), given.get("optimizer", ()),
                                      float(given.get("norm", 0.0)),
                                      float(given.get("jitter", 0.0)))
        costs = costs.with_receive_cost(float(given.get("recv", semantics.DEFAULT_RECV)))
        if "tokens" in given:
            costs = costs.with_tokens([given["tokens"][k.value] for k in KINDS])
        return costs

    def schedule(self) -> Schedule:
        """The plan's orders as a schedule under its costs and memory model (what
        `ppdsl.analysis.reorder` simulates)."""
        return Schedule(
            name=self.name, file=self.file, params=tuple(self.params.items()),
            num_microbatches=self.num_microbatches,
            placement=Placement("list", self.num_devices, self.stage_device, self.lanes),
            split_backward=self.split_backward, costs=self.cost_model(), memory=self.memory,
            orders=tuple(order.passes for order in self.orders),
        )

    def predicted_peak(self, rank: int, memory: MemoryModel | None = None) -> Fraction:
        """The memory model's peak on `rank` (prefix sum of deltas over its order)."""
        return predicted_peak(self.orders[rank].passes, memory or self.memory)

    def predicted_peaks(self) -> list[Fraction]:
        """`predicted_peak` of every rank (one delta table for all)."""
        table = self.memory.delta_table(longest_order=max(map(len, self.orders), default=0))
        return [predicted_peak(order.passes, self.memory, table) for order in self.orders]

    def to_json(self, *, deferred: bool = False) -> dict[str, Any]:
        """The manifest's content. `deferred`: each rank's actions are a
        `json_text.Deferred`, made as `json_text` writes them (a million-pass
        plan's action strings are then never all held at once)."""
        return {
            "ppdsl_version": __version__,
            "schedule": self.name,
            "file": self.file,
            "params": self.params,
            "fingerprint": self.fingerprint,
            "num_devices": self.num_devices,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "placement": list(self.stage_device),
            "lanes": self.lanes,
            "split_backward": self.split_backward,
            "memory": {
                "M_B": [str(x) for x in self.memory.activation],
                "M_W": [str(x) for x in self.memory.weight_retained],
                # per stage M_I of a stage marked `recompute`, null for one that is not
                "M_I": [None if x is None else str(x) for x in self.memory.kept_input],
                # per name, per stage, [a, b, c]: a + b*tokens + c*tokens^2
                **({"tokens": {name: [[str(x) for x in p] for p in row]
                               for name, row in zip(MEMORY_NAMES, self.memory.tokens,
                                                    strict=True)}}
                   if self.memory.follows_tokens else {}),
            },
            "costs": self.costs,
            "predicted_makespan": self.predicted_makespan,
            **({"predicted_step_time": self.predicted_step_time}
               if self.predicted_step_time is not None else {}),
            "costs_from": self.costs_from,
            "predicted_peak_memory": [str(x) for x in self.predicted_peaks()],
            "predicted_busy_share": list(self.predicted_busy_share)
            if self.predicted_busy_share is not None
            else None,
            "actions": [json_text.Deferred(partial(_actions, order)) if deferred else _actions(order)
                        for order in self.orders],
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Plan:
        orders = tuple(PassKeys(_order_of_actions(actions)) for actions in data["actions"])
        busy = data.get("predicted_busy_share")
        return Plan(
            name=data["schedule"],
            file=data["file"],
            params=dict(data["params"]),
            stage_device=tuple(data["placement"]),
            num_microbatches=int(data["num_microbatches"]),
            split_backward=bool(data["split_backward"]),
            memory=MemoryModel(
                tuple(Fraction(x) for x in data["memory"]["M_B"]),
                tuple(Fraction(x) for x in data["memory"]["M_W"]),
                tuple(None if x is None else Fraction(x) for x in data["memory"].get("M_I", ())),
                tuple(tuple((Fraction(a), Fraction(b), Fraction(c))
                            for a, b, c in data["memory"]["tokens"][name])
                      for name in MEMORY_NAMES) if "tokens" in data["memory"] else (),
            ),
            orders=orders,
            fingerprint=data["fingerprint"],
            predicted_busy_share=tuple(busy) if busy is not None else None,
            costs=data.get("costs"),
            predicted_makespan=data.get("predicted_makespan"),
            predicted_step_time=data.get("predicted_step_time"),
            costs_from=data.get("costs_from"),
            lanes=int(data.get("lanes", 1)),
        )


def _order_of_actions(actions: Sequence[str]) -> PassOrder:
    """A rank's order read back from its action strings, as columns."""
    keys = list(map(parse_torch_action, actions))
    if None in keys:
        raise ValueError(f"manifest: {actions[keys.index(None)]!r} is not a compute action")
    return PassOrder(
        np.array([k.code for k, _, _ in keys], dtype=np.int8),  # type: ignore[misc]
        np.array([j for _, j, _ in keys], dtype=np.int64),  # type: ignore[misc]
        np.array([s for _, _, s in keys], dtype=np.int64),  # type: ignore[misc]
        np.zeros(len(keys), dtype=np.int32),
        (None,),
    )


def _actions(order: PassKeys) -> list[str]:
    """A rank's order as torch.distributed.pipelining action strings."""
    return torch_actions(order.passes)


def _json_value(v: object) -> Any:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


def plan_from_schedule(
    schedule: Schedule,
    programs: tuple[RankProgram, ...] | RankArrays,
    timeline: Any = None,
    costs_from: str | None = None,
) -> Plan:
    """The plan of a compiled schedule (timeline: `ppdsl.analysis.simulate.Timeline` or
    None; costs_from: the `--costs-from` file, if any)."""
    busy = None
    if timeline is not None:
        busy = tuple(float(b) / float(timeline.makespan) for b in timeline.busy)
    c = schedule.costs
    return Plan(
        name=schedule.name,
        file=schedule.file,
        params={str(k): _json_value(v) for k, v in schedule.params},
        stage_device=schedule.placement.stage_device,
        num_microbatches=schedule.num_microbatches,
        split_backward=schedule.split_backward,
        memory=schedule.memory,
        orders=tuple(PassKeys(order) for order in schedule.orders),
        fingerprint=fingerprint(schedule, programs),
        predicted_busy_share=busy,
        costs={**{k.value: list(c.per_stage(k)) for k in KINDS}, "comm": c.comm,
               **{n: list(row) for n, row in c.declared_collectives().items()},
               **({"overhead": list(c.overhead)} if any(c.overhead) else {}),
               **({"optimizer": list(c.optimizer)} if any(c.optimizer) else {}),
               **({"norm": c.norm} if c.norm else {}),
               **({"jitter": c.jitter} if c.jitter else {}),
               **({"recv": c.recv} if c.recv else {}),
               # per kind, per stage, [a, b, c]: a + b*tokens + c*tokens^2
               **({"tokens": {k.value: [list(p) for p in c.tokens[k.code]] for k in KINDS}}
                  if c.follows_tokens else {})},
        predicted_makespan=float(timeline.makespan) if timeline is not None else None,
        predicted_step_time=(float(timeline.step_time)
                             if timeline is not None and c.models_step else None),
        costs_from=costs_from,
        lanes=schedule.placement.lanes,
    )


def dumps(plan: Plan) -> str:
    return json_text.dumps(plan.to_json(), 1)
