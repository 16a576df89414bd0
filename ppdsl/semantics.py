"""The rules of the domain, each written once: what every other module asks.

- Pass kinds (`PassKind`): F forward, B input-gradient backward, W
  weight-gradient backward, BW fused backward (the zero-bubble paper's split),
  R recompute (activation checkpointing: a stage marked `recompute` keeps only
  its input after F and re-runs its forward in R before its backward); their
  letters in torch.distributed.pipelining's action strings (`0F1`), written by
  `format_torch_actions` and read by `parse_torch_action` only.
- The dependency relation (`NEEDS`): which pass of the same microbatch each pass
  waits for, at which stage offset, and which tensor (if any) travels along that
  edge. Its array form (`NEED_KIND`, `NEED_STAGE_OFFSET`, `NEED_TRANSFER`, made
  once at import) is what every numba kernel takes.
- The transfer rule: a need with a tensor (an activation forward, an input
  gradient backward) between stages on two devices is a transfer; it costs
  `comm` after the sender's pass, and at least `recv` (`DEFAULT_RECV`) after
  the receiver is free; the lowering sends and receives it (`receives`, `sends`).
- Memory deltas (`MEMORY_COEFFICIENTS`, `RECOMPUTE_MEMORY_COEFFICIENTS`):
  each pass changes its device's activation memory by a combination of M_B and
  M_W (§2 of the zero-bubble paper), and on a recomputed stage of M_I (the
  input its F keeps); `delta_table` scales them to exact integers for the kernels,
  and `memory_peak` is a device's peak: their largest prefix sum over its order.
- Placements (`PLACEMENTS`): stage -> device maps by name, and the spelling
  that gives a map back. A bidirectional placement (`LANES`: DualPipe) runs
  its stages as several pipelines ("lanes") of equal length: microbatch j
  goes through lane `microbatch_lane(j, m, lanes)` only, a need never
  crosses from one lane into another, and stage s is a copy of model stage
  `model_stage(s, S, lanes)` (the copies' gradients are summed).
- Default costs and memory (`DEFAULT_DURATION`): unit pass costs, BW = B + W,
  R = F, no transfer cost, M_B = 1, M_W = M_B / 2, M_I = 0.
- Data-parallel collectives (`COLLECTIVES`: reduce, gather): when a stage's
  gradient reduction may start (after its last pass that writes weight
  gradients, `reduction_point`) and when its gathered weights are first needed
  (`gather_point`); they cost `cost reduce[s]` / `cost gather[s]`, 0 unless given.
- The whole training step (`STEP_COSTS`, `step_time`): per-pass engine
  overhead, each stage's optimizer step and the gradient-norm all-reduce, 0
  unless given (then the step is the makespan).
- Number formatting for every message, table and printed file.

Adding a pass kind means adding it here: `PassKind` (and `_TORCH_LETTER`),
`NEEDS`, `MEMORY_COEFFICIENTS`, `DEFAULT_DURATION` and the form that runs it
(`backward_kinds`, or `pass_kinds`' `recompute` for R); the kernels, checks, lowering, simulator and
elaboration follow (docs/architecture.md lists what the runtime adds to run it).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = [
    "PassKind",
    "KINDS",
    "NUM_KINDS",
    "format_torch_actions",
    "parse_torch_action",
    "MAX_ACTION_INDEX_DIGITS",
    "pass_kinds",
    "backward_kinds",
    "need_arrays",
    "NEED_OPTIONAL",
    "TransferKind",
    "Need",
    "NEEDS",
    "MAX_NEEDS",
    "NEED_KIND",
    "NEED_STAGE_OFFSET",
    "NEED_TRANSFER",
    "needs",
    "same_lane",
    "microbatch_lane",
    "lane_stages",
    "model_stage",
    "receives",
    "sends",
    "transfer_pass",
    "transfer_passes",
    "MEMORY_COEFFICIENTS",
    "RECOMPUTE_MEMORY_COEFFICIENTS",
    "memory_delta",
    "allocates_at_start",
    "delta_table",
    "memory_peak",
    "PLACEMENTS",
    "LANES",
    "placement_lanes",
    "takes_chunks",
    "placement_devices",
    "identify_placement",
    "placement_spelling",
    "read_placement",
    "DEFAULT_DURATION",
    "DEFAULT_COMM",
    "DEFAULT_RECV",
    "DEFAULT_TOKENS",
    "COLLECTIVES",
    "DP_MODES",
    "DEFAULT_COLLECTIVE",
    "STEP_COSTS",
    "JITTER_DRAWS",
    "DEFAULT_STEP_COST",
    "pass_cost",
    "pass_jitter",
    "cost_decimal",
    "per_stage_text",
    "step_time",
    "WRITES_WEIGHT_GRADIENTS",
    "reduction_point",
    "reduction_points",
    "gather_point",
    "DEFAULT_OVERLAP",
    "DEFAULT_ACTIVATION",
    "DEFAULT_WEIGHT_FRACTION",
    "DEFAULT_KEPT_INPUT",
    "with_default_durations",
    "format_number",
    "format_exact",
    "format_decimal",
    "format_short",
    "format_ratio",
    "format_literal",
]


# --- pass kinds -----------------------------------------------------------------


class PassKind(str, Enum):
    """F: forward. B: input-gradient backward. W: weight-gradient backward.
    BW: fused backward (input and weight gradients in one pass). R: recompute,
    the forward run again on a recomputed stage's kept input, restoring its
    activations before its backward."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    R = "R"

    @property
    def code(self) -> int:
        """The kind's index in every kind-indexed array (`KINDS[code] is kind`)."""
        return _CODE[self]

    @property
    def torch_letter(self) -> str:
        """torch.distributed.pipelining's action letter: I is its input-gradient
        pass and B its full (fused) backward; R (recompute) is ppdsl's own, torch
        has no such action."""
        return _TORCH_LETTER[self]


KINDS: tuple[PassKind, ...] = tuple(PassKind)
"""Every pass kind, in code order."""
NUM_KINDS = len(KINDS)
_CODE = {kind: code for code, kind in enumerate(KINDS)}
_TORCH_LETTER = {
    PassKind.F: "F",
    PassKind.B: "I",
    PassKind.W: "W",
    PassKind.BW: "B",
    PassKind.R: "R",
}


MAX_ACTION_INDEX_DIGITS = 7
"""The most digits a stage or microbatch index of an action string may have
(ppdsl handles at most a million of each)."""
_TORCH_ACTION = re.compile(r"(\d+)([" + "".join(_TORCH_LETTER.values()) + r"])(\d+)")
_LETTER_KIND = {letter: kind for kind, letter in _TORCH_LETTER.items()}


def format_torch_actions(
    kinds: Iterable[int], microbatches: Iterable[int], stages: Iterable[int]
) -> list[str]:
    """torch.distributed.pipelining's action strings (stage, letter, microbatch:
    ``0F1``, ``0I1``, ``0W1``, ``0B1``) of passes given as columns: kind codes,
    microbatches, stages. The one formatter of action strings."""
    letters = [_TORCH_LETTER[k] for k in KINDS]  # by code
    return [f"{s}{letters[k]}{j}" for k, j, s in zip(kinds, microbatches, stages, strict=True)]


def parse_torch_action(text: str) -> tuple[PassKind, int, int] | None:
    """(kind, microbatch, stage) of a compute action string such as ``0F1``;
    None for text that is not one. Raises ValueError for an index of more than
    `MAX_ACTION_INDEX_DIGITS` digits. The one parser of action strings."""
    found = _TORCH_ACTION.fullmatch(text)
    if found is None:
        return None
    stage, letter, microbatch = found.groups()
    if max(len(stage), len(microbatch)) > MAX_ACTION_INDEX_DIGITS:
        raise ValueError(
            f"a stage or microbatch index of more than {MAX_ACTION_INDEX_DIGITS} digits; "
            "ppdsl handles at most a million of each"
        )
    return _LETTER_KIND[letter], int(microbatch), int(stage)


def backward_kinds(split_backward: bool) -> tuple[PassKind, ...]:
    """The backward passes of a schedule: B and W when split, BW when fused."""
    return (PassKind.B, PassKind.W) if split_backward else (PassKind.BW,)


def pass_kinds(split_backward: bool, recompute: bool = False) -> tuple[PassKind, ...]:
    """Every pass kind a schedule runs for each (microbatch, stage): F, R on a
    stage marked `recompute`, then the backward passes."""
    return (PassKind.F, *((PassKind.R,) if recompute else ()), *backward_kinds(split_backward))


# --- the dependency relation and the transfer rule --------------------------------


class TransferKind(str, Enum):
    """ACT: a forward activation from stage s to s+1. GRAD: the gradient of a
    stage's input from stage s+1 back to s."""

    ACT = "act"
    GRAD = "grad"

    @property
    def code(self) -> int:
        """The transfer kind's index in `NEED_TRANSFER` (-1 there: no tensor)."""
        return _TRANSFER_CODE[self]


_TRANSFER_CODE = {kind: code for code, kind in enumerate(TransferKind)}


@dataclass(frozen=True)
class Need:
    """A pass of microbatch j at stage s waits for the pass `kind` of microbatch
    j at stage s + `stage_offset`; `carries` is the tensor that pass hands over
    (None: nothing crosses, the two passes share a stage and its device).
    `optional`: the need exists only where the schedule runs that pass (R, on a
    stage marked `recompute`)."""

    kind: PassKind
    stage_offset: int
    carries: TransferKind | None
    optional: bool = False


NEEDS: dict[PassKind, tuple[Need, ...]] = {
    # F(j, s) takes the activation of F(j, s-1)
    PassKind.F: (Need(PassKind.F, -1, TransferKind.ACT),),
    # B(j, s) needs its own F's saved activations (restored by R on a recomputed
    # stage) and the input gradient of B(j, s+1)
    PassKind.B: (
        Need(PassKind.F, 0, None),
        Need(PassKind.R, 0, None, optional=True),
        Need(PassKind.B, +1, TransferKind.GRAD),
    ),
    # W(j, s) needs what B(j, s) kept (its input and output gradients)
    PassKind.W: (Need(PassKind.B, 0, None),),
    # the fused backward: B's needs, with the next stage's fused backward
    PassKind.BW: (
        Need(PassKind.F, 0, None),
        Need(PassKind.R, 0, None, optional=True),
        Need(PassKind.BW, +1, TransferKind.GRAD),
    ),
    # R(j, s) re-runs F(j, s) on the input F kept
    PassKind.R: (Need(PassKind.F, 0, None),),
}
"""The dependency relation (§2 of the zero-bubble paper). A need whose stage is
outside 0..S-1 does not exist: the first stage's F reads the batch, the last
stage's backward starts from the loss. An optional need exists only where its
pass does (R on a recomputed stage)."""

MAX_NEEDS = max(len(n) for n in NEEDS.values())


def need_arrays(
    with_optional: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`NEEDS` as arrays [kind code, slot]: the needed kind's code (-1: no need
    in that slot), its stage offset, the transfer kind's code (-1: none) and
    whether the need is optional (1). `with_optional=False` leaves the optional
    needs out: for a scheduler that never places R (the search)."""
    kind = np.full((NUM_KINDS, MAX_NEEDS), -1, dtype=np.int64)
    offset = np.zeros((NUM_KINDS, MAX_NEEDS), dtype=np.int64)
    carries = np.full((NUM_KINDS, MAX_NEEDS), -1, dtype=np.int64)
    optional = np.zeros((NUM_KINDS, MAX_NEEDS), dtype=np.int64)
    for k in KINDS:
        kept = [n for n in NEEDS[k] if with_optional or not n.optional]
        for slot, need in enumerate(kept):
            kind[k.code, slot] = need.kind.code
            offset[k.code, slot] = need.stage_offset
            carries[k.code, slot] = -1 if need.carries is None else need.carries.code
            optional[k.code, slot] = int(need.optional)
    for array in (kind, offset, carries, optional):
        array.flags.writeable = False
    return kind, offset, carries, optional


NEED_KIND, NEED_STAGE_OFFSET, NEED_TRANSFER, NEED_OPTIONAL = need_arrays()
"""`NEEDS` as arrays [kind code, slot] (`need_arrays`): made once at import, for
every numba kernel."""


def needs(
    kind: PassKind,
    microbatch: int,
    stage: int,
    num_stages: int,
    lanes: int = 1,
    recompute: Container[int] = (),
) -> list[tuple[PassKind, int, int]]:
    """The (kind, microbatch, stage) of every pass that this one waits for
    (`lanes`: the placement's pipelines, a need never leaves its lane;
    `recompute`: the stages marked `recompute`, whose R is needed)."""
    return [
        (n.kind, microbatch, stage + n.stage_offset)
        for n in NEEDS[kind]
        if same_lane(stage, stage + n.stage_offset, num_stages, lanes)
        and (not n.optional or stage + n.stage_offset in recompute)
    ]


def same_lane(stage: int, other: int, num_stages: int, lanes: int = 1) -> bool:
    """Whether `other` is a stage (0..S-1) of the same lane as `stage`: the
    stages are cut into `lanes` pipelines of S / lanes consecutive stages."""
    length = num_stages // lanes
    return 0 <= other < num_stages and other // length == stage // length


def microbatch_lane(microbatch: int, num_microbatches: int, lanes: int = 1) -> int:
    """The lane microbatch j runs through: the first m / lanes microbatches
    the first lane, and so on (DualPipe: the first half from device 0
    downwards, the second half from the last device upwards)."""
    return microbatch * lanes // num_microbatches


def lane_stages(lane: int, num_stages: int, lanes: int = 1) -> range:
    """The stages of `lane`, in the order a microbatch goes through them."""
    length = num_stages // lanes
    return range(lane * length, (lane + 1) * length)


def model_stage(stage: int, num_stages: int, lanes: int = 1) -> int:
    """The model stage that `stage` is a copy of (itself with one lane)."""
    return stage % (num_stages // lanes)


def receives(kind: PassKind) -> tuple[tuple[TransferKind, int], ...]:
    """The tensors a pass of `kind` takes from another stage: (transfer kind,
    offset of the producing stage)."""
    return tuple((n.carries, n.stage_offset) for n in NEEDS[kind] if n.carries is not None)


def sends(kind: PassKind) -> tuple[tuple[TransferKind, int], ...]:
    """The tensors a pass of `kind` hands to another stage: (transfer kind,
    offset of the consuming stage); the inverse of `receives`."""
    found: list[tuple[TransferKind, int]] = []
    for consumer in KINDS:
        for n in NEEDS[consumer]:
            if n.kind is kind and n.carries is not None:
                item = (n.carries, -n.stage_offset)
                if item not in found:
                    found.append(item)
    return tuple(found)


def transfer_passes(transfer: TransferKind, sending: bool) -> tuple[PassKind, ...]:
    """Every pass kind that produces (`sending`) or consumes a tensor of kind
    `transfer`, fused and split backward alike (a trace's passes are matched
    to their transfers with it; `transfer_pass` picks a schedule's one)."""
    return tuple(k for k in KINDS
                 if any(t is transfer for t, _ in (sends(k) if sending else receives(k))))


def transfer_pass(transfer: TransferKind, sending: bool, split_backward: bool) -> PassKind:
    """The pass of a schedule that produces (`sending`) or consumes a tensor of
    kind `transfer`."""
    kinds = pass_kinds(split_backward)
    for kind in transfer_passes(transfer, sending):
        if kind in kinds:
            return kind
    raise ValueError(f"no pass {'sends' if sending else 'receives'} {transfer.value}")


# --- memory -----------------------------------------------------------------------

MEMORY_COEFFICIENTS: dict[PassKind, tuple[int, int, int]] = {
    PassKind.F: (1, 0, 0),  # leaves M_B of activations
    PassKind.B: (-1, 1, 0),  # frees M_B - M_W, keeping what W needs
    PassKind.W: (0, -1, 0),  # frees the last M_W
    PassKind.BW: (-1, 0, 0),  # frees all of M_B
    PassKind.R: (0, 0, 0),  # runs on recomputed stages only
}
"""A pass's memory delta on its device as (a, w, i): a·M_B + w·M_W + i·M_I of
its stage (§2 of the zero-bubble paper), on a stage that keeps its activations."""

RECOMPUTE_MEMORY_COEFFICIENTS: dict[PassKind, tuple[int, int, int]] = {
    **MEMORY_COEFFICIENTS,
    PassKind.F: (0, 0, 1),  # keeps only its input, M_I
    PassKind.R: (1, 0, -1),  # restores the activations: M_B in all, the input among them
}
"""The same on a stage marked `recompute` (activation checkpointing)."""


def memory_delta(
    kind: PassKind,
    activation: Fraction,
    weight_retained: Fraction,
    kept_input: Fraction | None = None,
) -> Fraction:
    """The change of its device's activation memory when a pass of `kind` runs,
    for a stage with M_B = `activation` and M_W = `weight_retained`;
    `kept_input` is M_I of a stage marked `recompute` (None: it keeps its
    activations)."""
    table = MEMORY_COEFFICIENTS if kept_input is None else RECOMPUTE_MEMORY_COEFFICIENTS
    a, w, i = table[kind]
    return a * Fraction(activation) + w * Fraction(weight_retained) + i * Fraction(kept_input or 0)


def allocates_at_start(kind: PassKind) -> bool:
    """A pass that leaves activations allocates them as it starts; one that
    frees them does so when it ends (what a timed memory profile shows)."""
    return any(x > 0 for t in (MEMORY_COEFFICIENTS, RECOMPUTE_MEMORY_COEFFICIENTS) for x in t[kind])


def delta_table(
    activation: Sequence[Fraction],
    weight_retained: Sequence[Fraction],
    also: Iterable[Fraction] = (),
    longest_order: int = 0,
    kept_input: Sequence[Fraction | None] = (),
) -> tuple[np.ndarray, int]:
    """Per (kind code, stage), the memory delta times `scale`, the least common
    denominator of M_B, M_W, M_I and the values `also` (a budget that must scale
    the same way). `kept_input[s]` is M_I of a recomputed stage, None for one
    that keeps its activations (empty: none recomputes). int64 unless
    `longest_order` passes could overflow it (then Python ints)."""
    kept = list(kept_input) or [None] * len(activation)
    # each distinct value object once: stages mostly share one (M_B, M_W, M_I), and
    # hashing a Fraction costs more than the arithmetic (a family checks thousands)
    distinct = {id(x): x for x in (*activation, *weight_retained, *also, *kept) if x is not None}
    exact = {key: Fraction(x) for key, x in distinct.items()}
    scale = math.lcm(*(v.denominator for v in exact.values())) if exact else 1
    scaled = {key: v.numerator * (scale // v.denominator) for key, v in exact.items()}
    stages = list(zip(activation, weight_retained, kept, strict=True))
    columns: dict[tuple[int, int, int], list[int]] = {}
    for a, w, i in stages:
        if (id(a), id(w), id(i)) not in columns:
            coefficients = MEMORY_COEFFICIENTS if i is None else RECOMPUTE_MEMORY_COEFFICIENTS
            sa, sw, si = scaled[id(a)], scaled[id(w)], scaled[id(i)] if i is not None else 0
            columns[id(a), id(w), id(i)] = [
                ca * sa + cw * sw + ci * si for ca, cw, ci in map(coefficients.__getitem__, KINDS)
            ]
    rows = [list(r) for r in zip(*(columns[id(a), id(w), id(i)] for a, w, i in stages), strict=True)]
    if not rows:
        rows = [[] for _ in KINDS]
    biggest = max((abs(x) for r in rows for x in r), default=0)
    dtype = np.int64 if biggest * max(longest_order, 1) < 2**62 else object
    return np.array(rows, dtype=dtype).reshape(NUM_KINDS, len(activation)), scale


def memory_peak(
    table: np.ndarray, scale: int, kind: np.ndarray, stage: np.ndarray
) -> tuple[Fraction, int | None]:
    """A device's peak activation memory: the largest prefix sum of its passes'
    deltas in order (`table[kind, stage]`, a `delta_table` over its `scale`;
    `kind` the passes' codes), and the index of the pass after which it is first
    reached; (0, None) when memory never rises above 0. The one peak every
    caller asks (the memory check, the simulator, the manifest's predictions)."""
    if not len(kind):
        return Fraction(0), None
    levels = np.cumsum(table[kind, stage])  # exact: int64, or Python ints where it could overflow
    k = int(np.argmax(levels))
    peak = int(levels[k])
    return (Fraction(peak, scale), k) if peak > 0 else (Fraction(0), None)


# --- placements -------------------------------------------------------------------


def _parallel(d: int, v: int) -> tuple[int, ...]:
    return tuple(range(d))


def _looped(d: int, v: int) -> tuple[int, ...]:
    # Megatron's interleaving, breadth-first's looping: stage s on device s mod d
    return tuple(s % d for s in range(v * d))


def _wave(d: int, v: int) -> tuple[int, ...]:
    # a zig-zag: even chunks go down the devices, odd chunks come back up
    return tuple(s % d if (s // d) % 2 == 0 else d - 1 - s % d for s in range(v * d))


def _vshape(d: int, v: int) -> tuple[int, ...]:
    # the controllable-memory paper's V: stage s on device s, then back (2 chunks)
    return _wave(d, 2)


def _dualpipe(d: int, v: int) -> tuple[int, ...]:
    # DeepSeek-V3's DualPipe (§3.2.1): a pipeline down the devices (stages 0..d-1
    # on devices 0..d-1) and a copy of it up them (stage d+k, model stage k, on
    # device d-1-k); the map is the V's, the lanes make it two pipelines
    return _wave(d, 2)


PLACEMENTS = {
    "parallel": _parallel,
    "looped": _looped,
    "vshape": _vshape,
    "wave": _wave,
    "dualpipe": _dualpipe,
}
"""Named placements: name -> (devices d, chunks per device v) -> stage_device."""
LANES = {"dualpipe": 2}
"""The bidirectional placements: name -> how many pipelines (lanes) its stages
form; every other placement is one pipeline through all its stages."""
_FIXED_CHUNKS = {"parallel": 1, "vshape": 2, "dualpipe": 2}
"""The placements whose chunk count is fixed; every other takes it as an
argument (`looped(v)`)."""


def placement_lanes(name: str) -> int:
    """How many pipelines the placement `name` runs (2 for `dualpipe`, else 1)."""
    return LANES.get(name, 1)


def takes_chunks(name: str) -> bool:
    """Whether the placement `name` takes its chunk count: `looped(v)`, `wave(v)`."""
    return name not in _FIXED_CHUNKS


def placement_devices(name: str, num_devices: int, chunks: int | None = None) -> tuple[int, ...]:
    """stage -> device of the placement `name` on `num_devices` devices with
    `chunks` stages per device (required for looped and wave)."""
    if name not in PLACEMENTS:
        raise ValueError(
            f"unknown placement {name!r}: use {', '.join(PLACEMENTS)} or a list of devices"
        )
    v = _FIXED_CHUNKS.get(name, chunks)
    if v is None:
        raise ValueError(f"{name} needs its chunk count: {name}(v)")
    return PLACEMENTS[name](num_devices, v)


def identify_placement(
    stage_device: Sequence[int], num_devices: int, lanes: int = 1
) -> tuple[str, int] | None:
    """(name, chunks per device) of the named placement with `lanes` pipelines
    that gives exactly this stage -> device map, the simplest name first; None
    for no named one."""
    stage_device = tuple(stage_device)
    d, S = num_devices, len(stage_device)
    if d > 0 and S % d == 0:
        v = S // d
        simplest = (*_FIXED_CHUNKS, *(n for n in PLACEMENTS if n not in _FIXED_CHUNKS))
        for name in simplest:
            if name in _FIXED_CHUNKS and _FIXED_CHUNKS[name] != v:
                continue
            if placement_lanes(name) != lanes:
                continue
            if placement_devices(name, d, v) == stage_device:
                return name, v
    return None


def placement_spelling(stage_device: Sequence[int], num_devices: int, lanes: int = 1) -> str:
    """The `place` argument that gives exactly this stage -> device map:
    `parallel`, `vshape`, `looped(v)`, `wave(v)`, `dualpipe`, or the list
    `[e0, e1, ...]` (one lane only: a list cannot say the lanes)."""
    named = identify_placement(stage_device, num_devices, lanes)
    if named is None:
        if lanes != 1:
            raise ValueError(f"no named placement with {lanes} lanes gives {list(stage_device)}")
        return "[" + ", ".join(map(str, stage_device)) + "]"
    name, v = named
    return f"{name}({v})" if takes_chunks(name) else name


def read_placement(text: str) -> tuple[str, int | None]:
    """A placement as a command line spells it: `parallel`, `vshape`,
    `looped(2)`, `wave(3)` (also `looped2`, any case) -> (name, chunks or None).
    Raises ValueError for an unknown name."""
    words = text.strip().lower()
    found = re.fullmatch(r"([a-z]+)\s*(?:\(?\s*(\d+)\s*\)?)?", words)
    if not found or found.group(1) not in PLACEMENTS:
        raise ValueError(
            f"unknown placement {text!r}: use parallel, looped(v), vshape, wave(v) or dualpipe"
        )
    chunks = found.group(2)
    return found.group(1), None if chunks is None else int(chunks)


# --- default costs and memory -----------------------------------------------------

DEFAULT_DURATION: dict[PassKind, int | tuple[PassKind, ...]] = {
    PassKind.F: 1,
    PassKind.B: 1,
    PassKind.W: 1,
    # a fused backward does B's and W's work
    PassKind.BW: (PassKind.B, PassKind.W),
    # a recompute runs the forward again
    PassKind.R: (PassKind.F,),
}
"""A pass kind's cost when the file gives none: unit costs, or the sum of the
costs of the kinds listed (of the same stage)."""
DEFAULT_COMM = 0
"""A transfer between devices costs nothing unless the file says `cost comm`."""
DEFAULT_RECV = 0
"""`cost recv`, the receiver's own part of a transfer: a pass that needs a pass
of another device starts no earlier than `recv` after its device is free, even
when the data was sent long before. A runtime whose receive is a handshake
(gloo's: the receiver posts, the sender's data then moves) pays it on every
receive; `ppdsl profile` measures it (a receive posted after its data was
sent). 0 unless the file says `cost recv`: a transfer costs only `comm` after
its sender's pass, the papers' rule."""
COLLECTIVES = ("reduce", "gather")
"""The data-parallel collectives of a stage, once per step each: `reduce` its
gradients over the DP group (an all-reduce, or a reduce-scatter when sharded),
`gather` its sharded weights (an all-gather; sharded data parallelism only).
Declared per stage like pass costs (`cost reduce[s] = ...`)."""
DP_MODES = ("replicate", "shard")
"""How the replicas of a pipeline combine (`--dp-mode`): `replicate` all-reduces
each stage's gradients after its last W; `shard` keeps each stage's weights
sharded over the DP group, gathered once per step, its gradients
reduce-scattered."""
DEFAULT_COLLECTIVE = 0
"""A collective costs nothing unless the file says `cost reduce` / `cost gather`."""
STEP_COSTS = ("overhead", "optimizer", "norm", "jitter")
"""What a training step spends besides passes and transfers, as `ppdsl profile`
measures it (milliseconds; 0 unless given): `overhead[s]`, the runtime's own
work around each pass of stage s (posting its exchanges, hooks, bookkeeping),
which holds the device like the pass itself; `optimizer[s]`, the optimizer
step of stage s's parameters (a device's sums its stages'); `norm`, the
gradient-norm all-reduce every pipeline rank joins after its last pass and
before its optimizer step (`step_time`); `jitter` (no unit), how much a pass's
duration varies from one run of it to the next: the spread (a log-normal's
sigma) of log(duration / its median). With jitter the step time is the median of
`JITTER_DRAWS` simulated steps, each pass's cost times a factor drawn from a
log-normal distribution of that spread and mean 1, a pass's cost being the
mean of its durations (`pass_cost`; seeded: the same file gives the same
prediction). A rank that runs late holds up the ranks that wait for it, so the
step's median exceeds the step of the mean passes."""
JITTER_DRAWS = 31
"""Simulated steps whose median is the step time under `cost jitter`."""
DEFAULT_STEP_COST = 0
"""A step cost (`STEP_COSTS`) is 0 unless the file gives it."""


def pass_cost(durations: Sequence[float]) -> float:
    """A pass's cost from its measured `durations` (a profile's, or a run's own):
    their mean. A step's passes add up, so the step follows their mean, with
    the rare pass a busy machine stalled; their median leaves those stalls out
    (on this project's 2-core machine a tiny_gpt forward's mean is 1.06-1.13x
    its median)."""
    return math.fsum(durations) / len(durations)


def pass_jitter(durations: Mapping[Any, Sequence[float]]) -> float:
    """The spread of repeated pass durations (`cost jitter`): of log(duration /
    the median of its pass kind and stage), pooled over every kind and stage,
    the interquartile range / 1.349 (a normal distribution's standard
    deviation from its quartiles: the bulk of the spread, not the rare pass a
    busy machine descheduled, whose heavy tail the standard deviation follows
    and a log-normal would then repeat on every pass); 0 with fewer than four
    durations."""
    logs = [math.log(x / statistics.median(values))
            for values in durations.values() for x in values if x > 0 and len(values) > 1]
    if len(logs) < 4:
        return 0.0
    first, _, third = statistics.quantiles(logs, n=4, method="inclusive")
    return (third - first) / 1.349


def step_time(last_end: Sequence[float], norm: float) -> float:
    """The whole training step in steady state: every rank waits in the norm
    all-reduce until the last device's passes end, then steps its optimizer,
    then starts the next step's passes; so a device's passes start after its
    own optimizer step, and the step runs from one all-reduce to the next.
    `last_end`: per device, when its last pass ends with each device's passes
    starting no earlier than its optimizer step (`cost optimizer` of its
    stages); with no step costs it is the makespan."""
    return max(last_end, default=0.0) + norm
WRITES_WEIGHT_GRADIENTS = frozenset({PassKind.B, PassKind.W, PassKind.BW})
"""The pass kinds that add to a stage's weight gradients: W and BW,
and B for the parameters a split does not defer to W."""


def reduction_points(order: Sequence[Any]) -> dict[int, int]:
    """In a device's `order` (passes with `.kind` and `.stage`), per stage the
    index of its last W or BW: its gradients are final after it, and its
    reduction is issued there (the breadth-first paper's and the zero-bubble
    runtime's overlap). One scan; a stage with no W/BW has no entry."""
    found: dict[int, int] = {}
    for index, p in enumerate(order):
        if p.kind is PassKind.W or p.kind is PassKind.BW:
            found[p.stage] = index
    return found


def reduction_point(order: Sequence[Any], stage: int) -> int | None:
    """`reduction_points` of one stage, or None."""
    return reduction_points(order).get(stage)


def gather_point(order: Sequence[Any], stage: int) -> int | None:
    """In a device's `order`, the index of `stage`'s first pass (its gathered
    weights must be there by then), or None."""
    return next((i for i, p in enumerate(order) if p.stage == stage), None)


DEFAULT_OVERLAP = 1
"""An overlapped F&B (a forward and a backward run as one pass) lasts this share
of the two passes' costs unless the file says `cost overlap`: 1, back to back."""
DEFAULT_ACTIVATION = 1
"""M_B: one unit of activation per microbatch and stage."""
DEFAULT_WEIGHT_FRACTION = Fraction(1, 2)
"""M_W = M_B / 2 unless given: the part of an F's activation W still needs."""
DEFAULT_TOKENS = 1024
"""A microbatch's length where a cost or memory amount follows `tokens` and
neither the file (`param tokens = N`) nor the command line (`--lengths`) says:
the length of every microbatch in the compile-time simulation and checks."""
DEFAULT_KEPT_INPUT = 0
"""M_I = 0 unless given: what a recomputed stage's F keeps (its input; for a
transformer layer s·b·h against M_B = s·b·(34h + 5a·s), small)."""


def with_default_durations(
    given: Mapping[PassKind, Sequence[Any]], num_stages: int
) -> dict[PassKind, list[Any]]:
    """Per-stage durations of every pass kind: those `given`, the others from
    `DEFAULT_DURATION` (a sum of given or defaulted kinds where it says so)."""
    out: dict[PassKind, list[Any]] = {}
    for kind in KINDS:  # a kind's default only sums kinds listed before it
        if kind in given:
            out[kind] = list(given[kind])
            continue
        default = DEFAULT_DURATION[kind]
        if isinstance(default, tuple):
            out[kind] = [sum(out[k][s] for k in default) for s in range(num_stages)]
        else:
            out[kind] = [default] * num_stages
    return out


# --- number formatting ------------------------------------------------------------


def format_number(x: object) -> str:
    """Exact and short: `3` for 3, 3.0 and Fraction(3); `3/2`; `1.5` for a
    float that is not whole (canonical IR text, messages, written files)."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    if isinstance(x, Fraction) and x.denominator == 1:
        return str(x.numerator)
    return str(x)


def format_exact(x: Fraction | int, digits: int = 4) -> str:
    """`3`, or `3/2 (1.5)`: the exact value with its decimal to `digits`
    significant digits (diagnostics and tables quoting a rational)."""
    x = Fraction(x)
    return str(x.numerator) if x.denominator == 1 else f"{x} ({float(x):.{digits}g})"


def format_decimal(x: float, digits: int = 6) -> str:
    """A measured or simulated float to `digits` significant digits."""
    return f"{float(x):.{digits}g}"


def cost_decimal(x: float, digits: int = 4) -> str:
    """A short exact decimal the language reads (`0.0123`), never 0 for x > 0."""
    if x <= 0:
        return "0"
    text = f"{x:.{digits}f}".rstrip("0").rstrip(".")
    if float(text) == 0:
        text = f"{x:.{digits}e}"
        mantissa, exp = text.split("e")
        return f"{float(mantissa)} / {10 ** -int(exp)}" if int(exp) < 0 else mantissa
    return text


def per_stage_text(values: Sequence[str]) -> str:
    """A per-stage value as the language writes it: one value when every stage
    has it, else `s == 0 ? a : s == 1 ? b : c`."""
    if len(set(values)) == 1:
        return values[0]
    text = values[-1]
    for s in range(len(values) - 2, -1, -1):
        text = f"s == {s} ? {values[s]} : {text}"
    return text


def format_short(x: Fraction | int | float, digits: int = 6) -> str:
    """A whole number as such, anything else as a decimal to `digits`
    significant digits (summaries where the exact rational would be noise)."""
    if Fraction(x).denominator == 1:
        return str(int(x))
    return f"{float(x):.{digits}g}"


def format_ratio(x: Fraction | int | str, max_denominator: int = 12, digits: int = 3) -> str:
    """A measured ratio: exact while its denominator is small (`3/4`), else a
    decimal with `digits` places (a ratio of byte counts)."""
    x = Fraction(x)
    return str(x) if x.denominator <= max_denominator else f"{float(x):.{digits}f}"


def format_literal(value: Fraction) -> str:
    """A number as `.pp` source: `3`, `-2`, `18.522` (a finite decimal, as
    literals are written), or `1/3` (the caller parenthesises it)."""
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value.denominator == 1:
        return f"{sign}{value.numerator}"
    places, scale = 0, 1
    while (scale * value).denominator != 1 and places < 40:
        places += 1
        scale *= 10
    if (scale * value).denominator == 1:
        digits = str((scale * value).numerator).rjust(places + 1, "0")
        return f"{sign}{digits[:-places]}.{digits[-places:]}"
    return f"{sign}{value.numerator}/{value.denominator}"
