"""Every rank's whole-device memory in bytes, over the step's time line.

The compiler's memory check proves each device's *activation* peak in units of
M_B. A GPU holds much more: the parameters, their gradients, the optimizer's
state, autocast's low-precision weight copies, the output gradients a W stash
keeps, the buffers of posted receives and of sends not yet done, the step's
input batch, each pass's working memory, and what the caching allocator keeps
in reserve. This module adds them up per rank as the rank's program runs (the
lowered rank program: its compute passes and its exchanges, in order) and
reports the peak of the sum, not the sum of each part's peak.

The time line of one rank, op by op (`device_bytes`):

- resident all step: parameters (per dtype), optimizer state (`OPTIMIZER_STATE`;
  divided by the replicas under `--dp-mode shard`, not under replicate; under
  shard a stage's whole parameters are gathered from its first pass to its
  reduction point, and its gradients are whole until then), and on
  the rank of the model's first stage the step's input batch (token ids of every
  microbatch) and on the last stage's rank the targets;
- a stage's gradients appear at its first W or fused backward (the runtime
  zeroes them with `set_to_none` before each step) and stay to the step's end;
  with `dp > 1` its fp32 reduction buffer joins them at its reduction point
  (the stage's last W or BW, `semantics.reduction_points`);
- autocast (`--precision bf16|fp16` over fp32 parameters): a stage's
  low-precision weight copy is made at its first F and kept all step (the
  runtime keeps autocast's cast cache for the step);
- activations: each pass's `semantics.memory_delta` in bytes (the schedule's
  memory model times `unit_bytes`);
- a W stash's output gradients: from its B to its W;
- a receive's buffer: from the exchange that posts it (early receives post some
  long before their pass) until its consuming pass ends;
- a send's buffer: from the end of the pass that made the tensor until the
  exchange that posts it completes (the lowered exchanges are blocking);
- during a pass, its working memory on top of the larger of the levels before
  and after it (`runtime.execution.memory.predicted_device_peak`'s rule);
- the allocator's reserve: `ALLOCATOR_RESERVE` of the peak of everything else
  (the caching allocator rounds blocks up and keeps freed ones; stated, not
  measured here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from ppdsl.ir.rank import RankArrays
from ppdsl.ir.schedule import PassKind, Schedule
from ppdsl.semantics import TransferKind, reduction_points

__all__ = [
    "ALLOCATOR_RESERVE",
    "COMPONENTS",
    "DTYPE_BYTES",
    "OPTIMIZER_STATE",
    "DeviceOptions",
    "ModelBytes",
    "RankBytes",
    "StageBytes",
    "device_bytes",
    "format_bytes",
]

ALLOCATOR_RESERVE = 0.05
"""The allocator's reserve as a fraction of the peak of everything else: the
caching allocator rounds each block up (to 512 bytes, large ones to 2 MiB) and
keeps segments it cannot split; 5% is a stated allowance, not a measurement."""

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the parameter dtypes and autocast precisions."""

OPTIMIZER_STATE = {"sgd": 0, "adam": 2, "adamw": 2}
"""fp32 values per parameter the optimizer keeps (Adam's two moments; plain SGD
none). Over bf16 parameters an fp32 master copy is one more."""

COMPONENTS = (
    "parameters",
    "gradients",
    "reduction_buffers",
    "optimizer",
    "autocast_copies",
    "activations",
    "stash_gradients",
    "receive_buffers",
    "send_buffers",
    "input_batch",
    "working",
    "reserve",
)
"""The named rows, in the order `ppdsl stats --bytes` and `ppdsl plan` print them."""


@dataclass(frozen=True)
class StageBytes:
    """One model stage at the run's sequence length and microbatch size."""

    parameters: int
    """Parameter count (elements)."""
    boundary: int = 0
    """Bytes of the tensor the stage sends on (its output activation; the
    gradient coming back is the same size)."""
    stash_gradients: int = 0
    """Bytes of output gradients a W stash keeps per microbatch, B to W."""
    working: Mapping[PassKind, int] = field(default_factory=dict)
    """Per pass kind, the bytes a pass allocates and frees within itself."""


@dataclass(frozen=True)
class ModelBytes:
    """What the byte model needs of a model, besides the schedule."""

    stages: tuple[StageBytes, ...]
    """Per model stage (a schedule stage's model stage: `Placement.model_stage`)."""
    unit_bytes: float
    """Bytes of one unit of the schedule's memory model (its M_B are in units)."""
    input_batch: int = 0
    """Bytes of the step's input token ids (every microbatch), on the first stage."""
    targets: int = 0
    """Bytes of the step's targets, on the last stage."""


@dataclass(frozen=True)
class DeviceOptions:
    """How the run holds its model state."""

    param_dtype: str = "fp32"
    """fp32 or bf16 (`--param-dtype`)."""
    optimizer: str = "adam"
    """sgd, adam or adamw (`--optimizer`)."""
    precision: str = "fp32"
    """Autocast: fp32 (none), bf16 or fp16 (`--precision`)."""
    dp: int = 1
    """Data-parallel replicas."""
    dp_mode: str = "replicate"
    """replicate or shard: shard divides parameters, gradients and optimizer
    state by `dp`."""
    reserve: float = ALLOCATOR_RESERVE
    """The allocator's reserve, a fraction of the peak of the rest."""

    def __post_init__(self) -> None:
        if self.param_dtype not in ("fp32", "bf16"):
            raise ValueError(f"param dtype must be fp32 or bf16, not {self.param_dtype!r}")
        if self.optimizer not in OPTIMIZER_STATE:
            raise ValueError(f"optimizer must be sgd, adam or adamw, not {self.optimizer!r}")
        if self.precision not in DTYPE_BYTES:
            raise ValueError(f"precision must be fp32, bf16 or fp16, not {self.precision!r}")
        if self.dp < 1 or self.dp_mode not in ("replicate", "shard"):
            raise ValueError(f"need dp >= 1 and replicate or shard, not {self.dp}, {self.dp_mode}")

    def optimizer_bytes(self) -> int:
        """Optimizer bytes per parameter (its fp32 state, and a master copy over
        bf16 parameters)."""
        master = 1 if self.param_dtype == "bf16" else 0
        return 4 * (OPTIMIZER_STATE[self.optimizer] + master)


@dataclass(frozen=True)
class RankBytes:
    """One rank's bytes."""

    rank: int
    peak_bytes: int
    """The peak over the step of the whole-device sum, reserve included."""
    bytes: dict[str, int]
    """Per component (`COMPONENTS`), its own peak over the step."""
    at_peak: dict[str, int]
    """Per component, what it holds at the moment of `peak_bytes`."""
    peak_op: int
    """The op of the rank's program at which the peak is reached."""


def format_bytes(n: float) -> str:
    """`1.50 GiB`, `12.0 MiB`, `512 B`."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class _Level:
    """The components' running levels on one rank, their own peaks, and the
    peak of their sum with what each held then."""

    def __init__(self) -> None:
        self.now = dict.fromkeys(COMPONENTS, 0.0)
        self.total = 0.0
        self.own = dict.fromkeys(COMPONENTS, 0.0)
        self.best = -1.0
        self.at_best: dict[str, float] = dict(self.now)
        self.best_op = 0

    def add(self, part: str, amount: float) -> None:
        if amount:
            level = self.now[part] = self.now[part] + amount
            self.total += amount
            self.own[part] = max(self.own[part], level)

    def seen(self, op: int, levels: dict[str, float] | None = None,
             total: float | None = None) -> None:
        """A moment of the time line: the present levels, or `levels` summing
        to `total` (a pass's moment)."""
        total = self.total if total is None else total
        if total > self.best:
            self.best, self.at_best, self.best_op = total, dict(levels or self.now), op


def _transfer_bytes(model: ModelBytes, schedule: Schedule, kind: TransferKind,
                    src_stage: int, dst_stage: int) -> int:
    """A transfer's tensor: the sending stage's output going forward, the
    receiving stage's output's gradient coming back."""
    producer = src_stage if kind is TransferKind.ACT else dst_stage
    return model.stages[schedule.placement.model_stage(producer)].boundary


def device_bytes(schedule: Schedule, lowered: RankArrays, model: ModelBytes,
                 options: DeviceOptions = DeviceOptions()) -> tuple[RankBytes, ...]:
    """Each rank's whole-device bytes over its program (module docstring)."""
    placement = schedule.placement
    if len(model.stages) != placement.num_model_stages:
        raise ValueError(f"the model has {len(model.stages)} stages, the schedule "
                         f"{placement.num_model_stages}")
    param_bytes = DTYPE_BYTES[options.param_dtype]
    share = options.dp if options.dp_mode == "shard" else 1
    autocast = options.precision != "fp32" and options.param_dtype == "fp32"
    memory = schedule.memory
    unit = Fraction(model.unit_bytes)
    last = placement.num_model_stages - 1
    passes = lowered.passes
    activation = {(kind, s): float(memory.delta(kind, s) * unit) for kind in PassKind
                  for s in range(placement.num_stages)}
    send_of: dict[int, float] = {}  # producing pass -> bytes it leaves to send
    sends_at: dict[int, float] = {}  # exchange op -> bytes of the sends it completes
    recvs_at: dict[int, float] = {}  # exchange op -> bytes of the receives it posts
    recv_of: dict[int, float] = {}  # consuming pass -> bytes of its received tensors
    for e in range(len(lowered.where)):
        size = _transfer_bytes(model, schedule, TransferKind.ACT if int(lowered.transfer[e]) ==
                               TransferKind.ACT.code else TransferKind.GRAD,
                               int(lowered.src_stage[e]), int(lowered.dst_stage[e]))
        g, p = int(lowered.where[e]), int(lowered.entry_pass[e])
        if lowered.sending[e]:
            sends_at[g] = sends_at.get(g, 0) + size
            if p >= 0:
                send_of[p] = send_of.get(p, 0) + size
        else:
            recvs_at[g] = recvs_at.get(g, 0) + size
            if p >= 0:
                recv_of[p] = recv_of.get(p, 0) + size
    out = []
    for rank in range(lowered.num_ranks):
        order = schedule.orders[rank]
        stages = sorted({p.stage for p in order})
        level = _Level()
        count = {s: model.stages[placement.model_stage(s)].parameters for s in stages}
        whole = sum(count.values())
        level.add("parameters", whole * param_bytes / share)
        level.add("optimizer", whole * options.optimizer_bytes() / share)
        for s in stages:  # each lane's first stage takes its inputs, its last its targets
            if placement.model_stage(s) == 0:
                level.add("input_batch", model.input_batch / placement.lanes)
            if placement.model_stage(s) == last:
                level.add("input_batch", model.targets / placement.lanes)
        reduced = {order[i].key for i in reduction_points(order).values()}
        has_grads: set[int] = set()
        has_copy: set[int] = set()
        gathered: set[int] = set()
        lo, hi = int(lowered.offsets[rank]), int(lowered.offsets[rank + 1])
        level.seen(lo)
        for g in range(lo, hi):
            p = int(lowered.op_pass[g])
            if p < 0:  # an exchange: its receives are posted, its sends complete
                level.add("receive_buffers", recvs_at.get(g, 0))
                level.seen(g)
                level.add("send_buffers", -sends_at.get(g, 0))
                continue
            pass_ = passes[p]
            kind, s = pass_.kind, pass_.stage
            stage = model.stages[placement.model_stage(s)]
            before, before_total = dict(level.now), level.total
            level.add("activations", activation[kind, s])
            if kind is PassKind.F and autocast and s not in has_copy:
                has_copy.add(s)
                level.add("autocast_copies", count[s] * DTYPE_BYTES[options.precision])
            if kind is PassKind.B:
                level.add("stash_gradients", stage.stash_gradients)
            elif kind is PassKind.W:
                level.add("stash_gradients", -stage.stash_gradients)
            if s not in gathered:  # shard: the stage's whole parameters from its first pass
                gathered.add(s)
                level.add("parameters", count[s] * param_bytes * (1 - 1 / share))
            if kind in (PassKind.W, PassKind.BW) and s not in has_grads:
                has_grads.add(s)  # whole until the reduction (shard: a reduce-scatter)
                level.add("gradients", count[s] * param_bytes)
            if pass_.key in reduced:
                if options.dp > 1:
                    level.add("reduction_buffers", count[s] * 4 / share)
                level.add("parameters", -count[s] * param_bytes * (1 - 1 / share))
                level.add("gradients", -count[s] * param_bytes * (1 - 1 / share))
            level.add("send_buffers", send_of.get(p, 0))
            # during the pass: its working memory over the larger of the levels
            # before and after it (its received inputs still held)
            working = stage.working.get(kind, 0)
            level.own["working"] = max(level.own["working"], working)
            larger = before if before_total > level.total else level.now
            moment = max(before_total, level.total) + working
            if moment > level.best:
                level.seen(g, {**larger, "working": larger["working"] + working}, moment)
            level.add("receive_buffers", -recv_of.get(p, 0))
        reserve = options.reserve
        at = {k: int(math.ceil(v)) for k, v in level.at_best.items()}
        at["reserve"] = int(math.ceil(sum(at.values()) * reserve))
        own = {k: int(math.ceil(v)) for k, v in level.own.items()}
        own["reserve"] = at["reserve"]
        out.append(RankBytes(rank, sum(at.values()), own, at, level.best_op - lo))
    return tuple(out)
