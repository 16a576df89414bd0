"""The building-block space of the controllable-memory paper (§3).

A block says, for microbatch 0, in which unit slot each F and B of each stage
starts; microbatch j starts `j * period` later. Along a microbatch's path the
block is fixed by offsets: between the F of consecutive stages (`f_offset[k]`
inside chunk k, `f_turn` where the path turns to the next chunk), from the last
F to the last B (`gap`), between the B of consecutive stages (`b_offset[k]`,
`b_turn`), and the period. Each device's F/B order is its block slots sorted by
start time, so the warm-up and cool-down are the truncated repetitions, as in
the language; W fills the free slots, oldest pending first, the rest at the end
(the paper's placement of W, before the squeeze re-times the order).

V-Min and V-Half (the paper's Appendix patterns) are points of this space:
`v_min` and `v_half` give their offsets. V-ZB's block (ZB-V's steady state,
examples/v_zb.pp) has wider offsets than the sweep tries; `v_zb` gives it and
`named_blocks` adds the hand-made points to the sweep.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numba
import numpy as np

from ppdsl.ir.schedule import Placement
from ppdsl.semantics import PassKind

_F, _B, _W = PassKind.F.code, PassKind.B.code, PassKind.W.code

__all__ = [
    "BlockShape",
    "block_starts",
    "block_fb_orders",
    "block_orders",
    "enumerate_blocks",
    "named_blocks",
    "v_min",
    "v_half",
    "v_zb",
]


@dataclass(frozen=True)
class BlockShape:
    """Offsets (in unit slots) that fix one building block."""

    f_offset: tuple[int, ...]
    """F(s) -> F(s+1) inside chunk k."""
    f_turn: int
    """F(s) -> F(s+1) where the path crosses into the next chunk."""
    gap: int
    """F(S-1) -> B(S-1)."""
    b_offset: tuple[int, ...]
    """B(s+1) -> B(s) inside chunk k."""
    b_turn: int
    """B(s+1) -> B(s) where the path crosses back into the previous chunk."""
    period: int
    """T: microbatch j starts j·T after microbatch 0."""
    head: int = 0
    """V-shape only: between devices i and i+1 for i < head, chunk 0's F and
    chunk 1's B (the passes that go down the devices) step by `head_offset`
    instead (the authors' adaptive V scheduler's two offsets, their Appendix A)."""
    head_offset: int = 1
    """The step of those first `head` device transitions."""


def v_min(d: int) -> BlockShape:
    """V-Min's block (controllable-memory paper, Appendix)."""
    interval = 2 if d % 3 == 0 else 0
    return BlockShape((1, 1), 1, 1 + interval, (1, 1), 1, 6)


def v_half(d: int) -> BlockShape:
    """V-Half's block (controllable-memory paper, Appendix)."""
    interval = 3 if d % 2 == 0 else 0
    return BlockShape((2, 1), 1, 1 + interval, (1, 2), 2, 6)


def v_zb(d: int) -> BlockShape:
    """V-ZB's block (controllable-memory paper; the slots of examples/v_zb.pp)."""
    return BlockShape((4, 2), 3, 1, (2, 4), 3, 6)


def named_blocks(placement: Placement) -> dict[str, BlockShape]:
    """The hand-made blocks of this placement, by name (V-shape only)."""
    d, S = placement.num_devices, placement.num_stages
    if S != 2 * d or placement.kind != "vshape":
        return {}
    return {"V-Min": v_min(d), "V-Half": v_half(d), "V-ZB": v_zb(d)}


def block_starts(
    shape: BlockShape, num_devices: int, num_stages: int
) -> tuple[list[int], list[int]]:
    """Start slot of F(s) and B(s) for microbatch 0."""
    d = num_devices
    f = [0] * num_stages
    for s in range(1, num_stages):
        same_chunk = s // d == (s - 1) // d
        step = shape.f_offset[(s - 1) // d] if same_chunk else shape.f_turn
        if same_chunk and s < d and s - 1 < shape.head:  # chunk 0, device s-1 -> s
            step = shape.head_offset
        f[s] = f[s - 1] + step
    b = [0] * num_stages
    b[-1] = f[-1] + shape.gap
    for s in range(num_stages - 2, -1, -1):
        same_chunk = s // d == (s + 1) // d
        step = shape.b_offset[s // d] if same_chunk else shape.b_turn
        # chunk 1 (V-shape): stage s+1 sits on device 2d-2-s, stage s on the next one down
        if same_chunk and s // d == 1 and 2 * d - 2 - s < shape.head:
            step = shape.head_offset
        b[s] = b[s + 1] + step
    return f, b


def _collision_free(placement: Placement, f: list[int], b: list[int], period: int) -> bool:
    v = placement.num_stages // placement.num_devices
    if period < 3 * v:
        return False  # room for the device's v W passes in every period
    for dev in range(placement.num_devices):
        slots = set()
        for s in placement.chunks(dev):
            for x in (f[s] % period, b[s] % period):
                if x in slots:
                    return False
                slots.add(x)
    return True


def block_orders(
    placement: Placement, shape: BlockShape, num_microbatches: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Per-device orders of the repeated block with W filled in, as flat
    (offsets, kind, microbatch, stage); None when the block collides."""
    fb = block_fb_orders(placement, shape, num_microbatches)
    if fb is None:
        return None
    return _fill_w(*fb)


@numba.njit(cache=True)
def _fill_w(slot, kind, stage, mb):  # pragma: no cover - numba
    d, length = kind.shape
    total = length + length // 2
    offsets = np.zeros(d + 1, dtype=np.int64)
    out_kind = np.zeros(d * total, dtype=np.int64)
    out_stage = np.zeros(d * total, dtype=np.int64)
    out_mb = np.zeros(d * total, dtype=np.int64)
    pend_stage = np.zeros(length, dtype=np.int64)
    pend_mb = np.zeros(length, dtype=np.int64)
    n = 0
    for dev in range(d):
        head = 0
        tail = 0
        k = 0
        t = slot[dev, 0]
        while k < length:
            if slot[dev, k] == t:
                out_kind[n] = kind[dev, k]
                out_stage[n] = stage[dev, k]
                out_mb[n] = mb[dev, k]
                n += 1
                if kind[dev, k] == _B:
                    pend_stage[tail] = stage[dev, k]
                    pend_mb[tail] = mb[dev, k]
                    tail += 1
                k += 1
            elif head < tail:
                out_kind[n] = _W
                out_stage[n] = pend_stage[head]
                out_mb[n] = pend_mb[head]
                n += 1
                head += 1
            t += 1
        while head < tail:
            out_kind[n] = _W
            out_stage[n] = pend_stage[head]
            out_mb[n] = pend_mb[head]
            n += 1
            head += 1
        offsets[dev + 1] = n
    return offsets, out_kind[:n], out_mb[:n], out_stage[:n]


def block_fb_orders(
    placement: Placement, shape: BlockShape, num_microbatches: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Per-device F/B passes of the repeated block in start order, as
    (slot[d, L], kind, stage, microbatch); None when the block collides."""
    d, S, m = placement.num_devices, placement.num_stages, num_microbatches
    f, b = block_starts(shape, d, S)
    if not _collision_free(placement, f, b, shape.period):
        return None
    v = S // d
    length = 2 * v * m
    slot = np.zeros((d, length), dtype=np.int64)
    kind = np.zeros((d, length), dtype=np.int64)
    stage = np.zeros((d, length), dtype=np.int64)
    mb = np.zeros((d, length), dtype=np.int64)
    j = np.arange(m)
    for dev in range(d):
        times, kinds, stages, mbs = [], [], [], []
        for s in placement.chunks(dev):
            for k, start in ((_F, f[s]), (_B, b[s])):
                times.append(start + j * shape.period)
                kinds.append(np.full(m, k))
                stages.append(np.full(m, s))
                mbs.append(j)
        t = np.concatenate(times)
        order = np.argsort(t, kind="stable")
        slot[dev] = t[order]
        kind[dev] = np.concatenate(kinds)[order]
        stage[dev] = np.concatenate(stages)[order]
        mb[dev] = np.concatenate(mbs)[order]
    return slot, kind, stage, mb


def enumerate_blocks(placement: Placement) -> list[BlockShape]:
    """The space searched: offsets 1-2 per chunk and turn, gap 1-4, period 3v
    to 3v+2 (uniform offsets for v > 2, where the full space is too big). On a
    V-shape also the two-offset blocks of the authors' adaptive scheduler: unit
    offsets, and a step of 2 to 5 for chunk 0's F and chunk 1's B across the
    first 1 to d-1 devices (how V-Min's memory gets its best bubble)."""
    d, S = placement.num_devices, placement.num_stages
    v = S // d
    shapes = []
    offsets = (1, 2)
    if v <= 2:
        per_chunk = list(itertools.product(offsets, repeat=v))
    else:
        per_chunk = [(o,) * v for o in offsets]
    turns = offsets if v > 1 else (1,)
    for fo, bo, ft, bt, gap, extra in itertools.product(
        per_chunk, per_chunk, turns, turns, (1, 2, 3, 4), (0, 1, 2)
    ):
        shapes.append(BlockShape(fo, ft, gap, bo, bt, 3 * v + extra))
    if placement.kind == "vshape" and v == 2:
        for ft, bt, gap, extra, head, step in itertools.product(
            turns, turns, (1, 2, 3, 4), (0, 1, 2), range(1, d), (2, 3, 4, 5)
        ):
            shapes.append(BlockShape((1, 1), ft, gap, (1, 1), bt, 3 * v + extra, head, step))
    return shapes
