"""What a rank needs to know about the compiled schedule besides its own ops: the
placement, the microbatch count, the memory model and the compiler's predictions.
It is the manifest's content (`manifest.json` beside the generated programs),
written by codegen and read by the runtime; plain Python, no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from typing import Any

import numpy as np

from ppdsl import __version__, json_text, semantics
from ppdsl.ir.rank import RankArrays, RankProgram, rank_program_texts
from ppdsl.ir.schedule import (
    Costs,
    MemoryModel,
    Pass,
    PassOrder,
    Placement,
    Schedule,
    format_schedule,
    torch_actions,
)
from ppdsl.semantics import KINDS, PassKind, peak_of_deltas

__all__ = ["Plan", "PassKeys", "plan_from_schedule", "fingerprint", "predicted_peak"]


def predicted_peak(
    order: Iterable[tuple[PassKind, int]],
    memory: MemoryModel,
    table: tuple[np.ndarray, int] | None = None,
) -> Fraction:
    """The memory model's peak for one device: the largest prefix sum of the
    deltas of its passes (kind, stage) in order (exact: integer deltas over their
    common denominator, `semantics.delta_table`; `table`: that table, made once
    for every device of a plan, with `longest_order` their longest order)."""
    order = list(order)
    deltas, scale = table if table is not None else memory.delta_table(longest_order=len(order))
    if deltas.dtype != np.int64 or not order:
        return peak_of_deltas(memory.delta(kind, stage) for kind, stage in order)
    codes = np.fromiter((k.code for k, _ in order), dtype=np.int64, count=len(order))
    stages = np.fromiter((s for _, s in order), dtype=np.int64, count=len(order))
    top = int(np.cumsum(deltas[codes, stages]).max())
    return Fraction(max(top, 0), scale)


class PassKeys(Sequence[tuple[PassKind, int, int]]):
    """A device's order as the plan holds it, (kind, microbatch, stage) per pass,
    read from the schedule's passes when asked (a tuple per pass would be ~80
    bytes each at a million passes). Equal to the tuple of those triples."""

    __slots__ = ("passes",)

    def __init__(self, passes: Sequence[Pass]):
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
        if isinstance(passes, PassOrder):  # from the columns: no Pass made per pass
            return zip(map(KINDS.__getitem__, passes.kind.tolist()), passes.microbatch.tolist(),
                       passes.stage.tolist(), strict=True)
        return ((p.kind, p.microbatch, p.stage) for p in passes)

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
    orders: tuple[Sequence[tuple[PassKind, int, int]], ...]
    """Per rank: (kind, microbatch, stage) of each compute pass, in order (tuples
    read from a manifest; `PassKeys` over the passes of a compiled schedule)."""
    fingerprint: str
    predicted_busy_share: tuple[float, ...] | None = None
    """Per rank: simulated busy time / makespan (None without a timeline)."""
    costs: dict[str, Any] | None = None
    predicted_makespan: float | None = None
    """The simulated makespan under `costs` (None without a timeline)."""
    costs_from: str | None = None
    """The `--costs-from` file the costs came from (milliseconds, as `ppdsl profile`
    writes them), or None for the schedule's own costs (its units)."""
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
            orders=tuple(tuple(Pass(PassKind(k), j, s) for k, j, s in order if PassKind(k) is PassKind.F)
                         for order in self.orders),
        )

    def predicted_peak(self, rank: int, memory: MemoryModel | None = None) -> Fraction:
        """The memory model's peak on `rank` (prefix sum of deltas over its order)."""
        return predicted_peak(((k, s) for k, _, s in self.orders[rank]), memory or self.memory)

    def predicted_peaks(self) -> list[Fraction]:
        """`predicted_peak` of every rank (one delta table for all)."""
        table = self.memory.delta_table(longest_order=max(map(len, self.orders), default=0))
        deltas, scale = table
        peaks = []
        for order in self.orders:
            passes = order.passes if isinstance(order, PassKeys) else None
            if isinstance(passes, PassOrder) and deltas.dtype == np.int64 and len(passes):
                # from the columns: no (kind, stage) pair made per pass
                top = int(np.cumsum(deltas[passes.kind, passes.stage]).max())
                peaks.append(Fraction(max(top, 0), scale))
            else:
                peaks.append(predicted_peak(((k, s) for k, _, s in order), self.memory, table))
        return peaks

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
            },
            "costs": self.costs,
            "predicted_makespan": self.predicted_makespan,
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
        letters = {k.torch_letter: k for k in KINDS}
        orders = []
        for actions in data["actions"]:
            order = []
            for a in actions:
                i = next(j for j, c in enumerate(a) if not c.isdigit())
                order.append((letters[a[i]], int(a[i + 1 :]), int(a[:i])))
            orders.append(tuple(order))
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
            ),
            orders=tuple(orders),
            fingerprint=data["fingerprint"],
            predicted_busy_share=tuple(busy) if busy is not None else None,
            costs=data.get("costs"),
            predicted_makespan=data.get("predicted_makespan"),
            costs_from=data.get("costs_from"),
            lanes=int(data.get("lanes", 1)),
        )


def _actions(order: Sequence[tuple[PassKind, int, int]]) -> list[str]:
    """A rank's order as torch.distributed.pipelining action strings."""
    if isinstance(order, PassKeys) and isinstance(order.passes, PassOrder):
        return torch_actions(order.passes)
    return [f"{s}{k.torch_letter}{mb}" for k, mb, s in order]


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
               **{n: list(row) for n, row in c.declared_collectives().items()}},
        predicted_makespan=float(timeline.makespan) if timeline is not None else None,
        costs_from=costs_from,
        lanes=schedule.placement.lanes,
    )


def dumps(plan: Plan) -> str:
    return json_text.dumps(plan.to_json(), 1)
