"""Hand-made schedules the search is compared with, built the way the papers
define them and measured by the search's own evaluator.

- parallel: 1F1B with B and W split (B W right after each other), ZB-H1 and
  ZB-H2 (the zero-bubble paper's blocks, period 3: F at s; B at 3d-2-2s, W at
  3d-1+s; B at 6d-5s-5, W at 6d+s-4);
- vshape: V-Min, V-Half and V-ZB (the controllable-memory paper's blocks, W in
  the free slots, then its warm-up/cool-down step where that helps: as
  examples/v_*.pp compile).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ppdsl.frontend.blocks import tighten_warm_up_and_cool_down
from ppdsl.search.blockspace import block_orders, named_blocks
from ppdsl.search.driver import Arrays, Candidate, arrays_for, evaluate_passes
from ppdsl.search.evaluate import Metrics, evaluate_orders
from ppdsl.search.problem import SearchProblem
from ppdsl.semantics import PassKind

__all__ = ["Reference", "references"]

_F, _B, _W = PassKind.F.code, PassKind.B.code, PassKind.W.code


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
        order = [(_F, j, i) for j in range(warm)]
        f = warm
        for b in range(m):
            if f < m:
                order.append((_F, f, i))
                f += 1
            order += [(_B, b, i), (_W, b, i)]
        orders.append(order)
    return orders


def _zb_block(d: int, m: int, b_at, w_at) -> list[list[tuple[int, int, int]]]:
    """A period-3 block of the zero-bubble paper (F at s), repeated: each stage's
    passes in the order of their start slots."""
    orders = []
    for s in range(d):
        slots = []
        for j in range(m):
            slots += [(s + 3 * j, _F, j), (b_at(s) + 3 * j, _B, j), (w_at(s) + 3 * j, _W, j)]
        slots.sort()
        orders.append([(k, j, s) for _, k, j in slots])
    return orders


def _zb_h1(d: int, m: int) -> list[list[tuple[int, int, int]]]:
    return _zb_block(d, m, lambda s: 3 * d - 2 - 2 * s, lambda s: 3 * d - 1 + s)


def _zb_h2(d: int, m: int) -> list[list[tuple[int, int, int]]]:
    return _zb_block(d, m, lambda s: 6 * d - 5 * s - 5, lambda s: 6 * d + s - 4)


def references(problem: SearchProblem) -> list[Reference]:
    """The hand-made schedules that fit `problem`'s placement (any budget)."""
    a = arrays_for(problem)
    d, m = problem.num_devices, problem.num_microbatches
    found: list[tuple[str, Metrics]] = []
    kind = problem.placement.kind
    if kind == "parallel":
        found.append(("1F1B", _explicit(problem, a, _one_f_one_b(d, m))))
        found.append(("ZB-H1", _explicit(problem, a, _zb_h1(d, m))))
        found.append(("ZB-H2", _explicit(problem, a, _zb_h2(d, m))))
    elif kind == "vshape":
        for name, shape in named_blocks(problem.placement).items():
            orders = block_orders(problem.placement, shape, m)
            if orders is None:
                continue
            # as the examples compile: repeated, W in the free slots, then the
            # paper's warm-up/cool-down step where it helps
            plain = Candidate(*orders, None, name).orders()  # type: ignore[arg-type]
            tight = tighten_warm_up_and_cool_down(plain, problem.placement, problem.costs)
            found.append((name, evaluate_passes(problem, a, tight)))
    return [
        Reference(name, x.bubble, x.makespan, Fraction(int(x.peak.max()), a.scale))
        for name, x in found
        if x.ok
    ]
