"""The schedule IR: per device, the ordered compute passes, with placement,
costs, memory model and the expectations the file declared.

This is what elaboration produces and what every check, the simulator, the
lowering and the interchange formats consume. An order has one form, the
columns of a `PassOrder`; a `Pass` is what reading one pass gives. One printer
each: `pass_texts` for passes (`format_pass`, `format_order`),
`format_schedule` the canonical text form (golden tests compare that text),
`torch_actions` for torch's action strings (`semantics.format_torch_actions`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from itertools import repeat
from operator import attrgetter
from typing import Any, overload

import numpy as np

from ppdsl import semantics
from ppdsl.diagnostics import Span
from ppdsl.semantics import KINDS, PassKind, format_number

__all__ = [
    "PassKind",
    "Pass",
    "PassOrder",
    "Placement",
    "Costs",
    "MemoryModel",
    "Expect",
    "MEMORY_NAMES",
    "Polynomial",
    "tokens_duration",
    "BlockSlot",
    "Block",
    "Schedule",
    "pass_texts",
    "format_pass",
    "format_order",
    "format_schedule",
    "torch_action",
    "torch_actions",
]


Polynomial = tuple[float, float, float]
"""(a, b, c): a + b*tokens + c*tokens^2, a cost in the tokens of its microbatch."""

MEMORY_NAMES = ("M_B", "M_W", "M_I")
"""The memory model's amounts, in the order `MemoryModel.tokens` holds them."""


@dataclass(frozen=True, slots=True)
class Pass:
    """One compute pass of one microbatch through one stage. `overlapped`: it
    runs together with the pass before it in its device's order as one
    combined pass (a forward, then this backward: DualPipe's overlapped F&B)."""

    kind: PassKind
    microbatch: int
    stage: int
    span: Span | None = None
    overlapped: bool = False

    @property
    def key(self) -> tuple[PassKind, int, int]:
        return (self.kind, self.microbatch, self.stage)


_CODE = {k: k.code for k in KINDS}


class PassOrder(Sequence[Pass]):
    """A device's order held as columns: per pass its kind's code, microbatch,
    stage, the index of its span in `spans` and whether it is overlapped. Reading
    a pass makes its `Pass` (equal to the one the order was written with, not
    the same object); the arrays are what the flat schedule concatenates. It is
    the one form of an order: `Schedule` holds every order as one (a `Pass`
    object per pass costs ~1 µs and ~85 bytes, these 10); it equals the tuple
    of its passes. Its microbatches and stages are ints (`of` checks)."""

    __slots__ = ("kind", "microbatch", "stage", "span_index", "spans", "overlapped")

    def __init__(self, kind: np.ndarray, microbatch: np.ndarray, stage: np.ndarray,
                 span_index: np.ndarray, spans: tuple[Span | None, ...],
                 overlapped: np.ndarray | None = None):
        self.kind = kind
        """int8 `PassKind.code`s."""
        self.microbatch = microbatch
        """int32 or int64."""
        self.stage = stage
        """int32 or int64."""
        self.span_index = span_index
        """int32 index into `spans`."""
        self.spans = spans
        self.overlapped = overlapped
        """bool per pass, or None where none is."""

    @staticmethod
    def of(passes: Sequence[Pass]) -> PassOrder:
        """The columns of Pass objects (their spans kept as the same objects);
        `passes` itself where it is already columns. TypeError for a microbatch
        or stage that is not an int."""
        if isinstance(passes, PassOrder):
            return passes
        columns = getattr(passes, "columns", None)  # a view with columns of its own
        if columns is not None:
            return columns()
        n = len(passes)
        # map/attrgetter loops run in C: a generator per column costs 3x more
        microbatch = list(map(attrgetter("microbatch"), passes))
        stage = list(map(attrgetter("stage"), passes))
        if not set(map(type, microbatch + stage)) <= {int}:
            bad = next(x for x in microbatch + stage if type(x) is not int)
            raise TypeError(f"a pass's microbatch and stage are ints, got {type(bad).__name__} {bad!r}")
        span_of = list(map(attrgetter("span"), passes))
        by_id = dict(zip(map(id, span_of), span_of, strict=True))  # each span object once
        index = {key: k for k, key in enumerate(by_id)}
        ids = np.fromiter(map(index.__getitem__, map(id, span_of)), dtype=np.int32, count=n)
        spans = tuple(by_id.values())
        overlapped = np.fromiter(map(attrgetter("overlapped"), passes), dtype=np.bool_, count=n)
        return PassOrder(
            np.fromiter(map(_CODE.__getitem__, map(attrgetter("kind"), passes)), dtype=np.int8,
                        count=n),
            np.array(microbatch, dtype=np.int64),
            np.array(stage, dtype=np.int64),
            ids,
            spans,
            overlapped if overlapped.any() else None,
        )

    @staticmethod
    def join(runs: Sequence[Sequence[Pass]]) -> PassOrder:
        """One order of `runs` one after another (Pass sequences or PassOrders)."""
        columns = [PassOrder.of(run) for run in runs if len(run)]
        if not columns:
            return PassOrder.of(())
        if len(columns) == 1:
            return columns[0]
        shift = np.cumsum([0] + [len(c.spans) for c in columns[:-1]]).tolist()
        overlapped = None
        if any(c.overlapped is not None for c in columns):
            overlapped = np.concatenate([
                c.overlapped if c.overlapped is not None else np.zeros(len(c), np.bool_)
                for c in columns])
        return PassOrder(
            np.concatenate([c.kind for c in columns]),
            np.concatenate([c.microbatch for c in columns]),
            np.concatenate([c.stage for c in columns]),
            np.concatenate([c.span_index + k for c, k in zip(columns, shift, strict=True)]),
            tuple(span for c in columns for span in c.spans),
            overlapped,
        )

    def __len__(self) -> int:
        return len(self.kind)

    @overload
    def __getitem__(self, index: int) -> Pass: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Pass, ...]: ...

    def __getitem__(self, index: int | slice) -> Pass | tuple[Pass, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        i = range(len(self.kind))[index]  # IndexError, negative indices
        return Pass(KINDS[self.kind[i]], int(self.microbatch[i]), int(self.stage[i]),
                    self.spans[self.span_index[i]],
                    bool(self.overlapped[i]) if self.overlapped is not None else False)

    def __iter__(self) -> Iterator[Pass]:
        overlapped: Any = (repeat(False) if self.overlapped is None
                           else self.overlapped.tolist())
        return map(Pass, map(KINDS.__getitem__, self.kind.tolist()), self.microbatch.tolist(),
                   self.stage.tolist(), map(self.spans.__getitem__, self.span_index.tolist()),
                   overlapped)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PassOrder | tuple | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PassOrder({tuple(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (PassOrder, (self.kind, self.microbatch, self.stage, self.span_index, self.spans,
                            self.overlapped))


@dataclass(frozen=True)
class Placement:
    """Which device holds each stage. `kind` is how the file asked for it
    (parallel, looped, vshape, wave, dualpipe, list); `stage_device[s]` is the
    device. `lanes`: how many pipelines the stages form (2 for DualPipe's two
    directions, `semantics.LANES`), each of S / lanes consecutive stages."""

    kind: str
    num_devices: int
    stage_device: tuple[int, ...]
    lanes: int = 1
    span: Span | None = field(default=None, compare=False, repr=False)
    """The `place` line (None for a default placement or one built in code)."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_device)

    @property
    def num_model_stages(self) -> int:
        """Stages of the model: S, or S / lanes where each lane holds a copy."""
        return len(self.stage_device) // self.lanes

    def lane_of_stage(self, stage: int) -> int:
        """The lane (pipeline) that `stage` belongs to."""
        return stage // self.num_model_stages

    def model_stage(self, stage: int) -> int:
        """The model stage that `stage` runs (a copy of, with several lanes)."""
        return semantics.model_stage(stage, self.num_stages, self.lanes)

    def microbatch_lane(self, microbatch: int, num_microbatches: int) -> int:
        """The lane microbatch j goes through (`semantics.microbatch_lane`)."""
        return semantics.microbatch_lane(microbatch, num_microbatches, self.lanes)

    def chunks(self, device: int) -> tuple[int, ...]:
        """Stages on `device` in model order: chunk c of the device is the c-th."""
        return tuple(s for s, dev in enumerate(self.stage_device) if dev == device)

    @staticmethod
    def named(name: str, num_devices: int, chunks: int | None = None) -> Placement:
        """The placement `name` (`semantics.PLACEMENTS`) with `chunks` stages per
        device where it takes a count; raises ValueError for an unknown name."""
        return Placement(
            name,
            num_devices,
            semantics.placement_devices(name, num_devices, chunks),
            semantics.placement_lanes(name),
        )

    def spelling(self) -> str:
        """The `place` argument that gives exactly this map (`looped(2)`, `[0, 1, 1]`)."""
        return semantics.placement_spelling(self.stage_device, self.num_devices, self.lanes)


def tokens_duration(a: np.ndarray, b: np.ndarray, c: np.ndarray, overhead: np.ndarray,
                    tokens: np.ndarray) -> np.ndarray:
    """a + b*tokens + c*tokens^2 + overhead, in this one order of float
    operations (the simulator and the reorder search agree to the bit)."""
    return a + b * tokens + c * tokens * tokens + overhead


@dataclass(frozen=True)
class Costs:
    """Duration of each pass kind per stage, and of one cross-device transfer.
    `durations[kind.code][stage]`; build one with `Costs.of`. `overlap`: an
    overlapped F&B pair lasts this share of its two passes' durations (each
    pass scaled by it; 1: back to back)."""

    durations: tuple[tuple[float, ...], ...]
    comm: float
    overlap: float = float(semantics.DEFAULT_OVERLAP)
    collectives: tuple[tuple[float, ...], ...] = ()
    """Per `semantics.COLLECTIVES` name (reduce, gather), its cost on each stage;
    empty: none declared (all 0)."""

    overhead: tuple[float, ...] = ()
    """Per stage, the runtime's own work around each of its passes (`cost
    overhead[s]`; empty: none declared, 0)."""
    optimizer: tuple[float, ...] = ()
    """Per stage, its optimizer step (`cost optimizer[s]`; empty: none declared, 0)."""
    norm: float = float(semantics.DEFAULT_STEP_COST)
    """The gradient-norm all-reduce of a step (`cost norm`)."""
    jitter: float = float(semantics.DEFAULT_STEP_COST)
    """How much a pass's duration varies run to run (`cost jitter`,
    `semantics.STEP_COSTS`): the step time is then the median of seeded draws."""
    recv: float = float(semantics.DEFAULT_RECV)
    """The receiver's own part of a transfer (`cost recv`): a pass that needs a
    pass of another device starts no earlier than this after its device is
    free, even when the data was sent long before (`semantics.receives`)."""
    tokens: tuple[tuple[Polynomial, ...], ...] = ()
    """Per kind code, per stage, the pass's cost as a function of its
    microbatch's tokens, (a, b, c): a + b*tokens + c*tokens^2 (`cost F[s] = ...
    tokens ...`, docs/language.md); empty: no cost depends on tokens, and
    `durations` hold for every microbatch. `durations` are these at the file's
    `tokens`."""
    comm_per_byte: float = 0.0
    """`cost comm = a + b * bytes`: b, a transfer's time per byte (one over the
    link's bandwidth); `comm` is then a, the latency every transfer pays. 0: a
    transfer costs `comm` whatever its size (a plain `cost comm = x`)."""
    transfer_bytes: tuple[float, ...] = ()
    """Per stage, the bytes of the tensor it sends on (`memory bytes[s]`: its
    output activation; the gradient coming back is the same size); empty: not
    stated (a transfer then pays `comm` alone)."""
    grad_bytes: tuple[float, ...] = ()
    """Per stage, the bytes of its parameter gradients, what its data-parallel
    reduction moves (`memory grad_bytes[s]`); empty: not stated."""
    edges: tuple[float, ...] = ()
    """Per stage b < S - 1, a transfer between stages b and b + 1 (either way)
    as a topology times it over the link between their devices
    (`ppdsl.topology`); empty: `comm + comm_per_byte * transfer_bytes[b]`."""

    def edge_costs(self, num_stages: int) -> np.ndarray:
        """Per stage b < num_stages - 1, the cost of a transfer between stages
        b and b + 1 (the tensor stage b sends on, or its gradient coming back):
        `edges` when a topology set them, else latency + bytes / bandwidth
        (`comm + comm_per_byte * transfer_bytes[b]`), else `comm`."""
        count = max(num_stages - 1, 0)
        if self.edges:
            return np.array(self.edges[:count], dtype=np.float64)
        if self.comm_per_byte and self.transfer_bytes:
            return np.array([self.comm + self.comm_per_byte * x
                             for x in self.transfer_bytes[:count]], dtype=np.float64)
        return np.full(count, self.comm, dtype=np.float64)

    def transfer_cost(self, sender: int, receiver: int) -> float:
        """The cost of one transfer between adjacent stages `sender` and
        `receiver` (`edge_costs` of the edge between them)."""
        b = min(sender, receiver)
        if self.edges:
            return self.edges[b]
        if self.comm_per_byte and self.transfer_bytes:
            return self.comm + self.comm_per_byte * self.transfer_bytes[b]
        return self.comm

    def with_bytes(self, comm_per_byte: float, transfer_bytes: Sequence[float] = (),
                   grad_bytes: Sequence[float] = ()) -> Costs:
        """These costs with a transfer's time per byte (`cost comm = a + b *
        bytes`) and the bytes each stage sends on and reduces (per stage; empty:
        not stated)."""
        return replace(self, comm_per_byte=float(comm_per_byte),
                       transfer_bytes=tuple(float(x) for x in transfer_bytes),
                       grad_bytes=tuple(float(x) for x in grad_bytes))

    def with_transfers_of(self, other: Costs) -> Costs:
        """These costs with `other`'s transfer model beyond `comm`: its time per
        byte, stated bytes and edges."""
        return replace(self, comm_per_byte=other.comm_per_byte,
                       transfer_bytes=other.transfer_bytes, grad_bytes=other.grad_bytes,
                       edges=other.edges)

    @property
    def per_edge(self) -> bool:
        """Whether transfers differ by edge (bytes over a bandwidth, or a topology)."""
        return bool(self.edges) or bool(self.comm_per_byte and self.transfer_bytes)

    @property
    def models_step(self) -> bool:
        """Whether any step cost (`semantics.STEP_COSTS`) is declared: then the
        simulated step is more than the makespan."""
        return any(self.overhead) or any(self.optimizer) or self.norm > 0 or self.jitter > 0

    def duration_table(self) -> list[list[float]]:
        """`durations` with each stage's `overhead` added to every kind: how
        long a pass holds its device."""
        if not any(self.overhead):
            return [list(row) for row in self.durations]
        return [[x + o for x, o in zip(row, self.overhead, strict=True)] for row in self.durations]

    def with_step_costs(
        self, overhead: Sequence[float] = (), optimizer: Sequence[float] = (), norm: float = 0.0,
        jitter: float = 0.0,
    ) -> Costs:
        """These costs with the step costs given (per stage; empty: none)."""
        return replace(self, overhead=tuple(float(x) for x in overhead),
                       optimizer=tuple(float(x) for x in optimizer), norm=float(norm),
                       jitter=float(jitter))

    @property
    def follows_tokens(self) -> bool:
        """Whether some pass's cost depends on its microbatch's tokens."""
        return any(b or c for row in self.tokens for _, b, c in row)

    def with_tokens(self, tokens: Sequence[Sequence[Polynomial]]) -> Costs:
        """These costs with per-token costs (per kind code, per stage, (a, b, c))."""
        return replace(self, tokens=tuple(tuple((float(a), float(b), float(c)) for a, b, c in row)
                                          for row in tokens))

    def coefficients(self) -> np.ndarray:
        """[term, kind code, stage]: a, b, c and the stage's `overhead`, so that
        a pass lasts a + b*tokens + c*tokens^2 + overhead (b = c = 0 and a its
        `durations` where no cost follows the tokens)."""
        num_stages = len(self.durations[0])
        overhead = np.array(self.overhead or [0.0] * num_stages, dtype=np.float64)
        if self.tokens:
            coef = np.moveaxis(np.array(self.tokens, dtype=np.float64), 2, 0)
        else:
            coef = np.zeros((3, len(self.durations), num_stages))
            coef[0] = np.array(self.duration_table(), dtype=np.float64)
            overhead = np.zeros(num_stages)
        return np.concatenate([coef, np.broadcast_to(overhead, coef.shape[1:])[None]])

    def duration_cube(self, lengths: Sequence[int]) -> np.ndarray:
        """[kind code, stage, microbatch]: how long a pass holds its device
        (with its stage's `overhead`) when microbatch j has `lengths[j]`
        tokens (`tokens_duration`)."""
        a, b, c, o = (x[:, :, None] for x in self.coefficients())
        return tokens_duration(a, b, c, o, np.asarray(lengths, dtype=np.float64))

    def with_receive_cost(self, recv: float) -> Costs:
        """These costs with `cost recv` (the receiver's part of a transfer)."""
        return replace(self, recv=float(recv))

    def collective(self, name: str, stage: int) -> float:
        """The cost of stage `stage`'s data-parallel collective `name` (reduce, gather)."""
        if not self.collectives:
            return float(semantics.DEFAULT_COLLECTIVE)
        return self.collectives[semantics.COLLECTIVES.index(name)][stage]

    def declared_collectives(self) -> dict[str, tuple[float, ...]]:
        """The collectives with a non-zero cost on some stage: name -> per stage."""
        return {n: row for n, row in zip(semantics.COLLECTIVES, self.collectives, strict=False)
                if any(row)}

    def with_collectives(self, given: Mapping[str, Sequence[float]]) -> Costs:
        """These costs with the collectives `given` (name -> per stage), the others 0."""
        if not given:
            return self
        num_stages = len(self.durations[0])
        rows = tuple(tuple(float(x) for x in given.get(n, [semantics.DEFAULT_COLLECTIVE] * num_stages))
                     for n in semantics.COLLECTIVES)
        return replace(self, collectives=rows)

    @staticmethod
    def of(
        forward: Sequence[float],
        backward_input: Sequence[float],
        backward_weight: Sequence[float],
        fused_backward: Sequence[float] | None = None,
        comm: float = semantics.DEFAULT_COMM,
    ) -> Costs:
        """F, B, W (and BW, by default B + W) per stage, and the transfer cost."""
        given = {PassKind.F: forward, PassKind.B: backward_input, PassKind.W: backward_weight}
        if fused_backward is not None:
            given[PassKind.BW] = fused_backward
        return Costs.by_kind(given, comm)

    @staticmethod
    def by_kind(
        durations: Mapping[PassKind, Sequence[float]],
        comm: float,
        num_stages: int | None = None,
        overlap: float = float(semantics.DEFAULT_OVERLAP),
    ) -> Costs:
        """Per-stage durations of the kinds given, the others by default
        (`semantics.DEFAULT_DURATION`), and the transfer cost. `num_stages` is
        needed only when no kind is given."""
        if num_stages is None:
            num_stages = len(next(iter(durations.values())))
        every = semantics.with_default_durations(durations, num_stages)
        return Costs(
            tuple(tuple(float(x) for x in every[k]) for k in KINDS), float(comm), float(overlap)
        )

    @staticmethod
    def unit(num_stages: int) -> Costs:
        """The default costs (`semantics.DEFAULT_DURATION`: unit passes, BW = B + W)
        and the default transfer cost (none)."""
        every = semantics.with_default_durations({}, num_stages)
        return Costs.by_kind(every, semantics.DEFAULT_COMM)

    def per_stage(self, kind: PassKind) -> tuple[float, ...]:
        """The duration of `kind` on every stage."""
        return self.durations[kind.code]

    def duration(self, kind: PassKind, stage: int, overlapped: bool = False) -> float:
        """How long a pass of `kind` on `stage` takes (`overlapped`: as part of an
        overlapped F&B pair), with its stage's `overhead`."""
        base = self.durations[kind.code][stage] + (self.overhead[stage] if self.overhead else 0.0)
        return base * self.overlap if overlapped else base

    def pass_duration(self, p: Pass, joined: bool) -> float:
        """How long pass `p` takes; `joined`: the pass after it is overlapped with it."""
        return self.duration(p.kind, p.stage, p.overlapped or joined)

    @property
    def forward(self) -> tuple[float, ...]:
        """F per stage."""
        return self.durations[PassKind.F.code]

    @property
    def backward_input(self) -> tuple[float, ...]:
        """B per stage."""
        return self.durations[PassKind.B.code]

    @property
    def backward_weight(self) -> tuple[float, ...]:
        """W per stage."""
        return self.durations[PassKind.W.code]

    @property
    def fused_backward(self) -> tuple[float, ...]:
        """BW per stage."""
        return self.durations[PassKind.BW.code]


@dataclass(frozen=True)
class MemoryModel:
    """Activation memory, §2 of the zero-bubble paper: M_B (`activation[s]`) and
    M_W (`weight_retained[s]`) per stage; what each pass kind allocates or frees
    is `semantics.MEMORY_COEFFICIENTS` (`RECOMPUTE_MEMORY_COEFFICIENTS` on a
    stage marked `recompute`)."""

    activation: tuple[Fraction, ...]
    weight_retained: tuple[Fraction, ...]
    kept_input: tuple[Fraction | None, ...] = ()
    """Per stage, M_I (the input its F keeps) of a stage marked `recompute`, None
    for a stage that keeps its activations; empty when no stage recomputes."""
    tokens: tuple[tuple[tuple[Fraction, Fraction, Fraction], ...], ...] = ()
    """Per name of `MEMORY_NAMES` (M_B, M_W, M_I), per stage, its amount as a
    function of the microbatch's tokens, (a, b, c): a + b*tokens +
    c*tokens^2 (`memory M_B = ... tokens ...`); empty: none depends on tokens,
    and the fields above hold for every microbatch (they are these at the
    file's `tokens`)."""

    @property
    def follows_tokens(self) -> bool:
        """Whether some amount depends on its microbatch's tokens."""
        return any(b or c for row in self.tokens for _, b, c in row)

    def at(self, tokens: int) -> MemoryModel:
        """The model for a microbatch of `tokens` tokens (itself where nothing
        depends on tokens)."""
        if not self.tokens:
            return self
        t = Fraction(tokens)
        b, w, i = ([a + b * t + c * t * t for a, b, c in row] for row in self.tokens)
        kept = tuple(None if k is None else x for k, x in zip(self.kept_input, i, strict=False))
        return replace(self, activation=tuple(b), weight_retained=tuple(w), kept_input=kept)

    @property
    def recompute(self) -> frozenset[int]:
        """The stages marked `recompute` (they run R before their backward)."""
        return frozenset(s for s, kept in enumerate(self.kept_input) if kept is not None)

    def kept(self, stage: int) -> Fraction | None:
        """M_I of `stage` if it recomputes, else None."""
        return self.kept_input[stage] if self.kept_input else None

    @staticmethod
    def default(num_stages: int) -> MemoryModel:
        """M_B = 1 and M_W = M_B / 2 on every stage (`semantics`' defaults)."""
        a = Fraction(semantics.DEFAULT_ACTIVATION)
        return MemoryModel((a,) * num_stages, (a * semantics.DEFAULT_WEIGHT_FRACTION,) * num_stages)

    def delta(self, kind: PassKind, stage: int) -> Fraction:
        """The memory a pass of `kind` on `stage` leaves (> 0) or frees (< 0)."""
        return semantics.memory_delta(
            kind, self.activation[stage], self.weight_retained[stage], self.kept(stage)
        )

    def delta_table(self, also=(), longest_order: int = 0):  # type: ignore[no-untyped-def]
        """`semantics.delta_table` of this model: (int deltas [kind code, stage], scale)."""
        return semantics.delta_table(
            self.activation, self.weight_retained, also, longest_order, self.kept_input
        )


@dataclass(frozen=True)
class Expect:
    """`expect METRIC[index] OP bound`. metric: peak_memory, bubble (the
    zero-bubble paper's ratio), idle (whole-pipeline idle fraction), makespan,
    lifespan (a block stage's, controllable-memory paper §3). `device` is the
    index: a device for peak_memory, a stage for lifespan; None means every
    device (stage) for those two and the schedule-wide value for the others."""

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
    start at slot.start + j * period. A grouped block (`group_size` G > 1,
    Megatron's microbatch groups) repeats it for groups of G microbatches, one
    every `group_spacing` U, a group every period: microbatch j's passes start
    at slot.start + (j // G) * period + (j % G) * U."""

    period: Fraction
    slots: tuple[BlockSlot, ...]
    span: Span | None
    group_size: int = 1
    group_spacing: Fraction = Fraction(0)

    def shift(self, microbatch: int) -> Fraction:
        """How much later than microbatch 0's each pass of `microbatch` starts."""
        group, position = divmod(microbatch, self.group_size)
        return group * Fraction(self.period) + position * Fraction(self.group_spacing)


@dataclass(frozen=True, init=False)
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
    orders: tuple[PassOrder, ...]
    """Per device, its passes in execution order as columns: an order given as
    Pass objects is made a `PassOrder` here, once (the one form every later
    pass reads)."""
    expects: tuple[Expect, ...] = ()
    block: Block | None = None
    span: Span | None = None

    def __init__(
        self,
        name: str,
        file: str,
        params: tuple[tuple[str, object], ...],
        num_microbatches: int,
        placement: Placement,
        split_backward: bool,
        costs: Costs,
        memory: MemoryModel,
        orders: Sequence[Sequence[Pass]],
        expects: tuple[Expect, ...] = (),
        block: Block | None = None,
        span: Span | None = None,
    ) -> None:
        # the dataclass's own __init__, but for `orders`, which it takes in any
        # form and keeps as columns (a frozen dataclass sets its fields so)
        fields = {
            "name": name, "file": file, "params": params, "num_microbatches": num_microbatches,
            "placement": placement, "split_backward": split_backward, "costs": costs,
            "memory": memory, "orders": tuple(map(PassOrder.of, orders)), "expects": expects,
            "block": block, "span": span,
        }
        for field_name, value in fields.items():
            object.__setattr__(self, field_name, value)

    @property
    def num_devices(self) -> int:
        return self.placement.num_devices

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def backward_kinds(self) -> tuple[PassKind, ...]:
        return semantics.backward_kinds(self.split_backward)

    @property
    def pass_kinds(self) -> tuple[PassKind, ...]:
        """The kinds of pass every (microbatch, stage) of a stage that keeps its
        activations runs once (a recomputed stage adds R: `stage_pass_kinds`)."""
        return semantics.pass_kinds(self.split_backward)

    @property
    def recompute(self) -> frozenset[int]:
        """The stages marked `recompute`."""
        return self.memory.recompute

    def stage_pass_kinds(self, stage: int) -> tuple[PassKind, ...]:
        """The kinds of pass each microbatch runs once on `stage`."""
        return semantics.pass_kinds(self.split_backward, stage in self.memory.recompute)


def torch_action(p: Pass) -> str:
    """torch.distributed.pipelining's action string of one pass (``0F1``;
    `semantics.format_torch_actions`)."""
    return semantics.format_torch_actions([p.kind.code], [p.microbatch], [p.stage])[0]


def torch_actions(order: PassOrder) -> list[str]:
    """The action string of every pass of a device's order, from its columns."""
    return semantics.format_torch_actions(
        order.kind.tolist(), order.microbatch.tolist(), order.stage.tolist()
    )


def pass_texts(
    kinds: Iterable[int], microbatches: Iterable[int], stages: Iterable[int], show_stage: bool
) -> list[str]:
    """The text of passes given as columns (kind codes, microbatches, stages):
    `F3` on a device with one stage, `F3:s5` where the stage must be named. The
    one pass printer (`format_pass`, `format_order` and the rank programs'
    printer call it)."""
    letters = [k.value for k in KINDS]  # by code
    if show_stage:
        return [f"{letters[k]}{j}:s{s}" for k, j, s in zip(kinds, microbatches, stages, strict=True)]
    return [f"{letters[k]}{j}" for k, j in zip(kinds, microbatches, strict=True)]


def format_pass(p: Pass, show_stage: bool) -> str:
    """`pass_texts` of one pass."""
    return pass_texts([p.kind.code], [p.microbatch], [p.stage], show_stage)[0]


def format_order(order: PassOrder, show_stage: bool) -> str:
    """A device's order as text: passes by spaces, an overlapped pair joined
    by `&` (`F3&B1`)."""
    texts = pass_texts(
        order.kind.tolist(), order.microbatch.tolist(), order.stage.tolist(), show_stage
    )
    if order.overlapped is None or not order.overlapped.any():
        return " ".join(texts)
    parts: list[str] = []
    for text, joined in zip(texts, order.overlapped.tolist(), strict=True):
        if joined and parts:
            parts[-1] += "&" + text
        else:
            parts.append(text)
    return " ".join(parts)


def _fmt_per_stage(values: tuple) -> str:
    if len(set(values)) == 1:
        return values[0] if isinstance(values[0], str) else format_number(values[0])
    return "[" + " ".join(v if isinstance(v, str) else format_number(v) for v in values) + "]"


def _fmt_polynomial(p: Polynomial | tuple[Fraction, Fraction, Fraction]) -> str:
    """a + b*tokens + c*tokens^2 as `a+b*t+c*t^2`, zero terms left out."""
    a, b, c = p
    terms = [format_number(a)] if a or not (b or c) else []
    terms += [f"{format_number(b)}*t"] if b else []
    terms += [f"{format_number(c)}*t^2"] if c else []
    return "+".join(terms)


def format_schedule(schedule: Schedule) -> str:
    """The canonical text form of a schedule (what golden tests compare)."""
    s = schedule
    params = " ".join(f"{k}={format_number(v)}" for k, v in s.params)
    c, mem = s.costs, s.memory
    backward = "split" if s.split_backward else "fused"
    lines = [
        f"schedule {s.name}",
        f"  params {params}" if params else "  params",
        f"  devices {s.num_devices} stages {s.num_stages} microbatches {s.num_microbatches}",
        f"  placement {s.placement.kind} [{' '.join(map(str, s.placement.stage_device))}]",
        f"  backward {backward}",
        "  costs "
        + " ".join(
            f"{k.value}={_fmt_per_stage(c.per_stage(k))}"
            for k in KINDS
            if k is not PassKind.R or mem.recompute  # R's cost only where it runs
        )
        + f" comm={format_number(c.comm)}"
        + (f"+{format_number(c.comm_per_byte)}*bytes" if c.comm_per_byte else "")
        + (f" bytes={_fmt_per_stage(c.transfer_bytes)}" if c.transfer_bytes else "")
        + (f" grad_bytes={_fmt_per_stage(c.grad_bytes)}" if c.grad_bytes else "")
        + (f" edges={_fmt_per_stage(c.edges)}" if c.edges else "")
        + (f" overlap={format_number(c.overlap)}" if c.overlap != 1 else "")
        + "".join(f" {n}={_fmt_per_stage(row)}" for n, row in c.declared_collectives().items())
        + (f" overhead={_fmt_per_stage(c.overhead)}" if any(c.overhead) else "")
        + (f" optimizer={_fmt_per_stage(c.optimizer)}" if any(c.optimizer) else "")
        + (f" norm={format_number(c.norm)}" if c.norm else "")
        + (f" jitter={format_number(c.jitter)}" if c.jitter else "")
        + (f" recv={format_number(c.recv)}" if c.recv else ""),
        f"  memory M_B={_fmt_per_stage(mem.activation)} M_W={_fmt_per_stage(mem.weight_retained)}"
        + (
            f" recompute [{' '.join(map(str, sorted(mem.recompute)))}]"
            f" M_I={_fmt_per_stage(tuple(x for x in mem.kept_input if x is not None))}"
            if mem.recompute
            else ""
        ),
    ]
    if c.follows_tokens:
        lines.append("  costs in tokens " + " ".join(
            f"{k.value}={_fmt_per_stage(tuple(_fmt_polynomial(p) for p in c.tokens[k.code]))}"
            for k in KINDS if k is not PassKind.R or mem.recompute))
    if mem.follows_tokens:
        lines.append("  memory in tokens " + " ".join(
            f"{name}={_fmt_per_stage(tuple(_fmt_polynomial(p) for p in row))}"
            for name, row in zip(MEMORY_NAMES, mem.tokens, strict=True)
            if name != "M_I" or mem.recompute))
    for device, order in enumerate(s.orders):
        show_stage = len(s.placement.chunks(device)) > 1
        lines.append(f"  rank {device}: " + format_order(order, show_stage))
    return "\n".join(lines) + "\n"
