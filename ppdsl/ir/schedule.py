"""The schedule IR: per device, the ordered compute passes, with placement,
costs, memory model and the expectations the file declared.

This is what elaboration produces and what every check, the simulator, the
lowering and the interchange formats consume. `format_schedule` is its one
canonical text form; golden tests compare that text.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

from ppdsl.diagnostics import Span

__all__ = [
    "PassKind",
    "Pass",
    "Placement",
    "Costs",
    "MemoryModel",
    "Expect",
    "BlockSlot",
    "Block",
    "Schedule",
    "format_pass",
    "format_schedule",
    "torch_action",
]


class PassKind(str, Enum):
    """F: forward. B: input-gradient backward. W: weight-gradient backward.
    BW: fused backward (input and weight gradients in one pass)."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"

    @property
    def torch_letter(self) -> str:
        """torch.distributed.pipelining's action letter: I is its input-gradient
        pass and B its full (fused) backward."""
        return _TORCH_LETTER[self]


_TORCH_LETTER = {PassKind.F: "F", PassKind.B: "I", PassKind.W: "W", PassKind.BW: "B"}


@dataclass(frozen=True, slots=True)
class Pass:
    """One compute pass of one microbatch through one stage."""

    kind: PassKind
    microbatch: int
    stage: int
    span: Span | None = None

    @property
    def key(self) -> tuple[PassKind, int, int]:
        return (self.kind, self.microbatch, self.stage)


@dataclass(frozen=True)
class Placement:
    """Which device holds each stage. `kind` is how the file asked for it
    (parallel, looped, vshape, wave, list); `stage_device[s]` is the device."""

    kind: str
    num_devices: int
    stage_device: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_device)

    def chunks(self, device: int) -> tuple[int, ...]:
        """Stages on `device` in model order: chunk c of the device is the c-th."""
        return tuple(s for s, dev in enumerate(self.stage_device) if dev == device)


@dataclass(frozen=True)
class Costs:
    """Duration of each pass kind per stage, and of one cross-device transfer.
    `fused_backward[s]` is the BW pass (defaults to B + W)."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    fused_backward: tuple[float, ...]
    comm: float

    def duration(self, kind: PassKind, stage: int) -> float:
        if kind is PassKind.F:
            return self.forward[stage]
        if kind is PassKind.B:
            return self.backward_input[stage]
        if kind is PassKind.W:
            return self.backward_weight[stage]
        return self.fused_backward[stage]

    @staticmethod
    def unit(num_stages: int) -> Costs:
        one = (1.0,) * num_stages
        return Costs(one, one, one, (2.0,) * num_stages, 0.0)


@dataclass(frozen=True)
class MemoryModel:
    """Activation memory, §2 of the zero-bubble paper: an F leaves
    `activation[s]` (M_B) on its device; B frees M_B - M_W; W frees the last
    `weight_retained[s]` (M_W); a fused backward frees all of M_B."""

    activation: tuple[Fraction, ...]
    weight_retained: tuple[Fraction, ...]

    def delta(self, kind: PassKind, stage: int) -> Fraction:
        if kind is PassKind.F:
            return self.activation[stage]
        if kind is PassKind.B:
            return self.weight_retained[stage] - self.activation[stage]
        if kind is PassKind.W:
            return -self.weight_retained[stage]
        return -self.activation[stage]


@dataclass(frozen=True)
class Expect:
    """`expect METRIC[device] OP bound`. metric: peak_memory, bubble (the
    zero-bubble paper's ratio), idle (whole-pipeline idle fraction), makespan.
    device None means "every device" for peak_memory and the schedule-wide value
    for the others."""

    metric: str
    op: str
    bound: Fraction
    device: int | None
    span: Span
    text: str  # the bound as written, for messages


@dataclass(frozen=True)
class BlockSlot:
    """In a building block: the pass `kind` of `stage` for microbatch 0 starts at
    `start` and lasts `duration` (in the block's time unit)."""

    kind: PassKind
    stage: int
    device: int
    start: Fraction
    duration: Fraction
    span: Span | None


@dataclass(frozen=True)
class Block:
    """A building block (controllable-memory paper §3): microbatch j's passes
    start at slot.start + j * period."""

    period: Fraction
    slots: tuple[BlockSlot, ...]
    span: Span | None


@dataclass(frozen=True)
class Schedule:
    """A fully elaborated schedule. `orders[device]` is the device's compute
    passes in execution order."""

    name: str
    file: str
    params: tuple[tuple[str, object], ...]
    num_microbatches: int
    placement: Placement
    split_backward: bool
    costs: Costs
    memory: MemoryModel
    orders: tuple[tuple[Pass, ...], ...]
    expects: tuple[Expect, ...] = ()
    block: Block | None = None
    span: Span | None = None

    @property
    def num_devices(self) -> int:
        return self.placement.num_devices

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def backward_kinds(self) -> tuple[PassKind, ...]:
        return (PassKind.B, PassKind.W) if self.split_backward else (PassKind.BW,)


def torch_action(p: Pass) -> str:
    """torch.distributed.pipelining's action string: stage, letter, microbatch
    (``0F1``, ``0I1``, ``0W1``, ``0B1``)."""
    return f"{p.stage}{p.kind.torch_letter}{p.microbatch}"


def format_pass(p: Pass, show_stage: bool) -> str:
    """`F3` on a device with one stage; `F3:s5` where the stage must be named."""
    text = f"{p.kind.value}{p.microbatch}"
    return f"{text}:s{p.stage}" if show_stage else text


def _fmt_num(x: object) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x)


def _fmt_per_stage(values: tuple) -> str:
    if len(set(values)) == 1:
        return _fmt_num(values[0])
    return "[" + " ".join(_fmt_num(v) for v in values) + "]"


def format_schedule(schedule: Schedule) -> str:
    """The canonical text form of a schedule (what golden tests compare)."""
    s = schedule
    params = " ".join(f"{k}={_fmt_num(v)}" for k, v in s.params)
    c, mem = s.costs, s.memory
    backward = "split" if s.split_backward else "fused"
    lines = [
        f"schedule {s.name}",
        f"  params {params}" if params else "  params",
        f"  devices {s.num_devices} stages {s.num_stages} microbatches {s.num_microbatches}",
        f"  placement {s.placement.kind} [{' '.join(map(str, s.placement.stage_device))}]",
        f"  backward {backward}",
        f"  costs F={_fmt_per_stage(c.forward)} B={_fmt_per_stage(c.backward_input)}"
        f" W={_fmt_per_stage(c.backward_weight)} BW={_fmt_per_stage(c.fused_backward)}"
        f" comm={_fmt_num(c.comm)}",
        f"  memory M_B={_fmt_per_stage(mem.activation)} M_W={_fmt_per_stage(mem.weight_retained)}",
    ]
    for device, order in enumerate(s.orders):
        show_stage = len(s.placement.chunks(device)) > 1
        lines.append(f"  rank {device}: " + " ".join(format_pass(p, show_stage) for p in order))
    return "\n".join(lines) + "\n"
