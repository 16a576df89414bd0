"""Hand-made schedules the search is compared with, built the way the papers
define them and measured by the search's own evaluator.

- parallel: 1F1B with B and W split (B W right after each other), ZB-H1 (the
  zero-bubble paper's block: F at s, B at 3d-2-2s, W at 3d-1+s, period 3);
- vshape: V-Min and V-Half (the controllable-memory paper's blocks, W in the
  free slots). For V-ZB the bench's reference is the paper's claim (zero
  bubble at 1F1B's memory when T_F = T_B = T_W); its block is also among the
  search's own starting points (`blockspace.named_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ppdsl.search.blockspace import BlockShape, block_orders, v_half, v_min
from ppdsl.search.driver import Arrays, arrays_for
from ppdsl.search.evaluate import Metrics, evaluate_orders
from ppdsl.search.problem import SearchProblem

__all__ = ["Reference", "references"]


@dataclass(frozen=True)
class Reference:
    """A hand-made schedule under the search's costs and memory model."""

    name: str
    bubble: float
    makespan: float
    peak: Fraction
    """Highest per-device peak, in M_B."""


def _explicit(problem: SearchProblem, a: Arrays, orders) -> Metrics:
    flat = [x for o in orders for x in o]
    offsets = np.cumsum([0] + [len(o) for o in orders]).astype(np.int64)
    kind, mb, st = (np.array(col, dtype=np.int64) for col in zip(*flat, strict=True))
    return evaluate_orders(
        offsets, kind, mb, st, a.stage_device, a.dur, a.comm, a.mem, problem.num_microbatches
    )


def _one_f_one_b(d: int, m: int) -> list[list[tuple[int, int, int]]]:
    orders = []
    for i in range(d):
        warm = min(d - i - 1, m)
        order = [(0, j, i) for j in range(warm)]
        f = warm
        for b in range(m):
            if f < m:
                order.append((0, f, i))
                f += 1
            order += [(1, b, i), (2, b, i)]
        orders.append(order)
    return orders


def _zb_h1(d: int, m: int) -> list[list[tuple[int, int, int]]]:
    orders = []
    for s in range(d):
        slots = []
        for j in range(m):
            slots += [
                (s + 3 * j, 0, j),
                (3 * d - 2 - 2 * s + 3 * j, 1, j),
                (3 * d - 1 + s + 3 * j, 2, j),
            ]
        slots.sort()
        orders.append([(k, j, s) for _, k, j in slots])
    return orders


def references(problem: SearchProblem) -> list[Reference]:
    """The hand-made schedules that fit `problem`'s placement (any budget)."""
    a = arrays_for(problem)
    d, m = problem.num_devices, problem.num_microbatches
    found: list[tuple[str, Metrics]] = []
    kind = problem.placement.kind
    if kind == "parallel":
        found.append(("1F1B", _explicit(problem, a, _one_f_one_b(d, m))))
        found.append(("ZB-H1", _explicit(problem, a, _zb_h1(d, m))))
    elif kind == "vshape":
        shapes: list[tuple[str, BlockShape]] = [("V-Min", v_min(d)), ("V-Half", v_half(d))]
        for name, shape in shapes:
            orders = block_orders(problem.placement, shape, m)
            if orders is not None:
                found.append(
                    (name, evaluate_orders(*orders, a.stage_device, a.dur, a.comm, a.mem, m))
                )
    return [
        Reference(name, x.bubble, x.makespan, Fraction(int(x.peak.max()), a.scale))
        for name, x in found
        if x.ok
    ]
