"""Block compaction's first fit before issue 13 (a Python scan rebuilding the
prefix and suffix peaks per pass: quadratic in a device's passes), kept as the
oracle of the numpy version (tests/test_blocks_scale.py)."""

from __future__ import annotations

from ppdsl.frontend.blocks import _extreme_delta
from ppdsl.ir.schedule import Pass


def _first_fit(
    row: list[tuple[float, float, Pass]],
    ready: float,
    duration: float,
    delta: tuple[int, ...],
    limit: tuple[int, ...],
    recompute: frozenset[int] = frozenset(),
) -> tuple[int, float] | None:
    """(index, start) of the earliest place in `row` where a pass of
    `duration` fits from `ready` on without raising the peak over `limit`."""
    n = len(row)
    channels = range(len(delta))
    levels = [[0] * (n + 1) for _ in channels]  # level after the first i passes
    for i, (_, _, q) in enumerate(row):
        dq = _extreme_delta(q.kind, q.stage, recompute)
        for c in channels:
            levels[c][i + 1] = levels[c][i] + dq[c]
    prefix_max = [[0] * (n + 1) for _ in channels]
    suffix_max = [[0] * (n + 1) for _ in channels]
    for c in channels:
        top = 0
        for i in range(n + 1):
            top = max(top, levels[c][i])
            prefix_max[c][i] = top
        low = -(10**9)
        for i in range(n, -1, -1):
            suffix_max[c][i] = low
            if i > 0:
                low = max(low, levels[c][i])
    free = 0.0
    for index in range(n + 1):
        start = max(free, ready)
        following = row[index][0] if index < n else float("inf")
        if start + duration <= following + 1e-9 and all(
            max(prefix_max[c][index], levels[c][index] + delta[c], suffix_max[c][index] + delta[c])
            <= limit[c]
            for c in channels
        ):
            return index, start
        if index < n:
            free = row[index][1]
    return None
