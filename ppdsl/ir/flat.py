"""The schedule IR as flat arrays, built once per schedule and shared by the
checks, the simulator and the search's metrics.

Every pass of every device gets one flat index: device 0's order first, then
device 1's, ... (`offsets[dev]` is where device `dev` starts). Kinds are
`PassKind.code`s, so every array indexed by kind (`semantics.NEED_KIND`,
`semantics.delta_table`, `Costs.durations`) applies to `kind` directly. Work on
these arrays is what keeps the checks fast at d=64, m=1024, v=2 (about 400k
passes).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from ppdsl.ir.schedule import Pass, PassOrder, Schedule
from ppdsl.semantics import KINDS, NUM_KINDS

__all__ = ["FlatSchedule", "flatten", "flat_arrays"]


@dataclass(frozen=True, eq=False)
class FlatSchedule:
    """All passes of a schedule, flattened device by device."""

    offsets: np.ndarray
    """int64[d + 1]: device dev's passes are offsets[dev]:offsets[dev+1]."""
    kind: np.ndarray
    """int64 `PassKind.code` of each pass."""
    microbatch: np.ndarray
    """int64."""
    stage: np.ndarray
    """int64."""
    device: np.ndarray
    """int64: the device whose order holds the pass."""
    passes: PassOrder
    """The passes (made as read), for spans and messages."""
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
    """What passes compute from these arrays once (the needs, the index table)."""

    @property
    def size(self) -> int:
        """How many passes."""
        return len(self.passes)

    @property
    def num_devices(self) -> int:
        """How many devices (orders)."""
        return len(self.offsets) - 1

    def index_table(self) -> np.ndarray:
        """`table[kind code, microbatch, stage]`: the flat index of that pass (-1:
        absent; the last occurrence where one repeats). Needs every microbatch and
        stage in range (the passes check runs first)."""
        table = self.derived.get("index_table")
        if table is None:
            table = np.full((NUM_KINDS, self.num_microbatches, self.num_stages), -1, dtype=np.int64)
            table[self.kind, self.microbatch, self.stage] = np.arange(self.size, dtype=np.int64)
            self.derived["index_table"] = table
        return table


_flat_cache: list[tuple[weakref.ref, FlatSchedule]] = []


def flat_arrays(orders) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, kind, microbatch, stage) of per-device orders of Pass objects."""
    return _arrays([p for order in orders for p in order], [len(o) for o in orders])


_KIND_CODE = {k: k.code for k in KINDS}


def _arrays(passes: list[Pass], lengths: list[int]):
    n = len(passes)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # map/attrgetter loop in C: a generator per field costs 3x more at 400k passes
    codes = map(_KIND_CODE.__getitem__, map(attrgetter("kind"), passes))
    kind = np.fromiter(codes, dtype=np.int64, count=n)
    microbatch = np.fromiter(map(attrgetter("microbatch"), passes), dtype=np.int64, count=n)
    stage = np.fromiter(map(attrgetter("stage"), passes), dtype=np.int64, count=n)
    return offsets, kind, microbatch, stage


def flatten(schedule: Schedule) -> FlatSchedule:
    """Flat arrays of `schedule`'s passes (the last result is reused for the
    same schedule object, so the passes after elaboration flatten once)."""
    for ref, flat in _flat_cache:
        if ref() is schedule:
            return flat
    # the columns of every order (an elaborated one has them already: `PassOrder`)
    passes = PassOrder.join(schedule.orders)
    offsets = np.zeros(len(schedule.orders) + 1, dtype=np.int64)
    np.cumsum([len(o) for o in schedule.orders], out=offsets[1:])
    device = np.repeat(np.arange(len(schedule.orders), dtype=np.int64), np.diff(offsets))
    flat = FlatSchedule(
        offsets,
        passes.kind.astype(np.int64),
        passes.microbatch.astype(np.int64),
        passes.stage.astype(np.int64),
        device,
        passes,
        schedule.num_microbatches,
        schedule.num_stages,
        np.asarray(schedule.placement.stage_device, dtype=np.int64),
        schedule.placement.lanes,
        passes.overlapped,
    )
    _flat_cache[:] = [(weakref.ref(schedule), flat)]
    return flat
