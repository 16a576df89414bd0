"""The schedule IR as flat arrays, built once per schedule and shared by the
checks, the simulator and the search's metrics.

Every pass of every device gets one flat index: device 0's order first, then
device 1's, ... (`offsets[dev]` is where device `dev` starts). Kinds are
`PassKind.code`s, so every array indexed by kind (`semantics.NEED_KIND`,
`semantics.delta_table`, `Costs.durations`) applies to `kind` directly. Work on
these arrays is what keeps the checks fast at d=64, m=1024, v=2 (about 400k
passes).

The per-pass columns are as narrow as their values allow (int8 kinds, int32
indices: the pass limit keeps flat indices far below 2**31), because at d=128,
m=2048 (1.6M passes) every byte per pass is 1.6 MB of the check's peak memory.
Arithmetic that could leave int32 (a linear index over kind, microbatch and
stage) widens first.
"""

from __future__ import annotations

import operator
import weakref
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from ppdsl.ir.schedule import Pass, PassOrder, Schedule
from ppdsl.semantics import NUM_KINDS

__all__ = ["FlatSchedule", "INDEX", "flatten", "flat_arrays"]


INDEX = np.int32
"""The dtype of flat indices and of the per-pass index columns."""

CHUNK = 1 << 18
"""Passes per slice of `FlatSchedule.chunks`."""


@dataclass(frozen=True, eq=False)
class FlatSchedule:
    """All passes of a schedule, flattened device by device."""

    offsets: np.ndarray
    """int64[d + 1]: device dev's passes are offsets[dev]:offsets[dev+1]."""
    kind: np.ndarray
    """int8 `PassKind.code` of each pass."""
    microbatch: np.ndarray
    """int32."""
    stage: np.ndarray
    """int32."""
    device: np.ndarray
    """int32: the device whose order holds the pass."""
    passes: Sequence[Pass]
    """The Pass objects by flat index, for spans and messages (a view of the
    schedule's orders, not a copy)."""
    num_microbatches: int
    num_stages: int
    stage_device: np.ndarray
    """int64[S]: the placement."""
    lanes: int = 1
    """The placement's pipelines (`Placement.lanes`)."""
    joined: np.ndarray | None = None
    """bool per pass: it runs as one unit with the pass before it (an
    overlapped F&B's backward); None when no pass is."""
    derived: dict[str, Any] = field(default_factory=dict, repr=False)
    """What passes compute from these arrays once (the index table)."""

    @property
    def size(self) -> int:
        """How many passes."""
        return len(self.passes)

    @property
    def num_devices(self) -> int:
        """How many devices (orders)."""
        return len(self.offsets) - 1

    def index_table(self) -> np.ndarray:
        """`table[kind code, microbatch, stage]`: the int32 flat index of that
        pass (-1: absent; the last occurrence where one repeats). Needs every
        microbatch and stage in range (the passes check runs first)."""
        table = self.derived.get("index_table")
        if table is None:
            table = np.full((NUM_KINDS, self.num_microbatches, self.num_stages), -1, dtype=INDEX)
            for part in self.chunks():
                table[self.kind[part], self.microbatch[part], self.stage[part]] = np.arange(
                    part.start, part.stop, dtype=INDEX
                )
            self.derived["index_table"] = table
        return table

    def chunks(self) -> Iterator[slice]:
        """The flat indices in slices of `CHUNK`: numpy's fancy indexing copies
        each index column to int64, so whole-column lookups would cost 8 bytes
        a pass per column at once."""
        for a in range(0, self.size, CHUNK):
            yield slice(a, min(a + CHUNK, self.size))


class _Passes(Sequence[Pass]):
    """The passes of per-device orders by flat index, read from the orders
    themselves (a tuple of every pass would cost 8 bytes a pass)."""

    def __init__(self, orders: Sequence[Sequence[Pass]], offsets: np.ndarray):
        self._orders = orders
        self._starts = offsets[:-1].tolist()
        self._size = int(offsets[-1])

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, k: Any) -> Any:
        if k.__class__ is not int or not 0 <= k < self._size:
            return self._other(k)
        # the last device starting at or before k (one with no pass starts where the next does)
        dev = bisect_right(self._starts, k) - 1
        return self._orders[dev][k - self._starts[dev]]

    def _other(self, k: Any) -> Any:
        """A slice, a negative index, a numpy integer, or one out of range."""
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._size))]
        k = operator.index(k)
        if k < 0:
            k += self._size
        if not 0 <= k < self._size:
            raise IndexError("flat pass index out of range")
        return self[k]

    def __iter__(self) -> Iterator[Pass]:
        return chain.from_iterable(self._orders)

    def columns(self) -> PassOrder:
        """The passes as one `PassOrder` (the orders' own columns where they
        are `PassOrder`s: no Pass made per pass)."""
        return PassOrder.join(self._orders)


_flat_cache: list[tuple[weakref.ref, FlatSchedule]] = []


def flat_arrays(orders: Sequence[Sequence[Pass]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, kind, microbatch, stage) of per-device orders (`PassOrder`s, or
    Pass sequences, made columns first), all int64 (the search's candidates)."""
    return _arrays([PassOrder.of(o) for o in orders], np.int64, np.int64)


def _arrays(
    orders: Sequence[PassOrder], kind_dtype: type[np.integer], index_dtype: type[np.integer]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The orders' columns joined (no Pass read)."""
    offsets = np.zeros(len(orders) + 1, dtype=np.int64)
    np.cumsum([len(o) for o in orders], out=offsets[1:])

    def joined(field: str, dtype: type[np.integer]) -> np.ndarray:
        values = np.concatenate([getattr(o, field) for o in orders]) if orders else np.zeros(0, dtype)
        fits = np.iinfo(dtype)
        if len(values) and (values.min() < fits.min or values.max() > fits.max):
            return values.astype(np.int64)  # far out of range: the passes check reports it
        return values.astype(dtype, copy=False)

    return offsets, joined("kind", kind_dtype), joined("microbatch", index_dtype), joined(
        "stage", index_dtype)


def _joined(orders: Sequence[PassOrder]) -> np.ndarray | None:
    if all(o.overlapped is None for o in orders):
        return None
    return np.concatenate([o.overlapped if o.overlapped is not None
                           else np.zeros(len(o), dtype=np.bool_) for o in orders])


def flatten(schedule: Schedule) -> FlatSchedule:
    """Flat arrays of `schedule`'s passes (the last result is reused for the
    same schedule object, so the passes after elaboration flatten once)."""
    for ref, flat in _flat_cache:
        if ref() is schedule:
            return flat
    orders = schedule.orders
    offsets, kind, microbatch, stage = _arrays(orders, np.int8, INDEX)
    device = np.repeat(np.arange(len(orders), dtype=INDEX), np.diff(offsets))
    flat = FlatSchedule(
        offsets,
        kind,
        microbatch,
        stage,
        device,
        _Passes(orders, offsets),
        schedule.num_microbatches,
        schedule.num_stages,
        np.asarray(schedule.placement.stage_device, dtype=np.int64),
        schedule.placement.lanes,
        _joined(orders),
    )
    _flat_cache[:] = [(weakref.ref(schedule), flat)]
    return flat
