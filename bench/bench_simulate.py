"""Simulator and checks at scale: the numba simulator against the plain-Python
reference, numba's compile time on its own, and every check of the compiler on a
V-shape order with d=64, m=1024 (393,216 passes)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numba
import numpy as np

from ppdsl.analysis.checks import check_schedule, deadlock, expectations
from ppdsl.analysis.executor import run_orders
from ppdsl.analysis.simulate import simulate
from ppdsl.diagnostics import Span
from ppdsl.ir import flat as flat_ir
from ppdsl.ir.flat import flatten
from ppdsl.ir.schedule import Costs, MemoryModel, Pass, PassKind, Placement, Schedule
from ppdsl.lowering.lower import lower_arrays
from ppdsl.semantics import NEED_KIND, NEED_OPTIONAL, NEED_STAGE_OFFSET, NUM_KINDS
from tests.oracles.simulate import simulate_reference

_F, _B, _W = PassKind.F, PassKind.B, PassKind.W
_SPAN = Span("bench.pp", 1, 1, 1, 1)


def _schedule(placement: Placement, m: int, orders: list[list[Pass]]) -> Schedule:
    S = placement.num_stages
    return Schedule(
        name="bench",
        file="bench.pp",
        params=(("d", placement.num_devices), ("m", m)),
        num_microbatches=m,
        placement=placement,
        split_backward=True,
        costs=Costs.of((1.0,) * S, (1.0,) * S, (1.0,) * S, (2.0,) * S, 0.1),
        memory=MemoryModel.default(S),
        orders=tuple(tuple(o) for o in orders),
        span=_SPAN,
    )


def zb_h1_like(d: int, m: int) -> Schedule:
    """1F1B with B and W split (B then W at once), parallel placement."""
    orders = []
    for i in range(d):
        warm = min(d - i - 1, m)
        order = [Pass(_F, j, i, _SPAN) for j in range(warm)]
        f = warm
        for b in range(m):
            if f < m:
                order.append(Pass(_F, f, i, _SPAN))
                f += 1
            order += [Pass(_B, b, i, _SPAN), Pass(_W, b, i, _SPAN)]
        orders.append(order)
    return _schedule(Placement("parallel", d, tuple(range(d))), m, orders)


def vshape_breadth_first(d: int, m: int) -> Schedule:
    """V-shape placement, every device breadth-first: all F chunk by chunk, then all
    B W in reverse chunk order."""
    stage_device = tuple(s if s < d else 2 * d - 1 - s for s in range(2 * d))
    placement = Placement("vshape", d, stage_device)
    orders = []
    for dev in range(d):
        chunks = placement.chunks(dev)
        order = [Pass(_F, j, s, _SPAN) for s in chunks for j in range(m)]
        for s in reversed(chunks):
            for j in range(m):
                order += [Pass(_B, j, s, _SPAN), Pass(_W, j, s, _SPAN)]
        orders.append(order)
    return _schedule(placement, m, orders)


def _time(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _numba_compile_seconds() -> float:
    """Compile the simulator kernel afresh (no cache) and time only that."""
    fresh = numba.njit(run_orders.fn)  # run_orders is a jit.Kernel: its plain function
    small = zb_h1_like(2, 2)
    flat = flatten(small)
    table = flat.index_table()
    t0 = time.perf_counter()
    no_time = np.zeros((NUM_KINDS, flat.num_stages))
    fresh(
        flat.offsets, flat.kind, flat.microbatch, flat.stage, flat.device, table,
        flat.num_stages // flat.lanes, NEED_KIND, NEED_STAGE_OFFSET, NEED_OPTIONAL,
        np.zeros(0, dtype=np.bool_), no_time, 0.0, np.zeros(flat.offsets.shape[0] - 1), 0.0,
        np.zeros(0),
    )
    return time.perf_counter() - t0


def main() -> None:
    rows: list[tuple[str, str, str]] = []
    rows.append(("numba compile of the simulator kernel", "-", f"{_numba_compile_seconds():.3f} s"))

    s = zb_h1_like(32, 256)
    n = sum(len(o) for o in s.orders)
    simulate(s)  # warm: load the cached kernel

    def cold() -> object:
        flat_ir._flat_cache.clear()  # include flattening the IR into arrays
        return simulate(s)

    fast = _time(cold)
    ref = _time(lambda: simulate_reference(s), repeat=1)
    assert simulate(s) == simulate_reference(s)
    rows.append((f"simulate numba, 1F1B split, d=32 m=256 ({n} passes)", "", f"{fast:.3f} s"))
    rows.append((f"simulate reference, d=32 m=256 ({n} passes)", "", f"{ref:.3f} s"))
    rows.append(("  speed-up", "", f"{ref / fast:.0f}x"))

    big = vshape_breadth_first(64, 1024)
    n = sum(len(o) for o in big.orders)
    timings: dict[str, float] = {}

    def stage(name: str, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        out = fn()
        timings[name] = time.perf_counter() - t0
        return out

    found = stage(
        "check_schedule (passes, dependencies, collisions, memory)", lambda: check_schedule(big)
    )
    assert found == [], found
    programs = stage("lower (the arrays the deadlock check and codegen read)",
                     lambda: lower_arrays(big))
    assert stage("deadlock", lambda: deadlock.check(big, programs)) == []
    timeline = stage("simulate numba", lambda: simulate(big))
    stage("expectations", lambda: expectations.check(big, timeline))
    label = f"vshape breadth-first d=64 m=1024 ({n} passes)"
    for name, seconds in timings.items():
        rows.append((name, label, f"{seconds:.3f} s"))
    rows.append(("all of the above", label, f"{sum(timings.values()):.3f} s"))
    rows.append(
        (
            "simulate numba again (flat arrays cached)",
            label,
            f"{_time(lambda: simulate(big)):.3f} s",
        )
    )

    width = max(len(r[0]) for r in rows)
    wlabel = max(len(r[1]) for r in rows)
    print(f"{'what':<{width}}  {'schedule':<{wlabel}}  time")
    for what, label, seconds in rows:
        print(f"{what:<{width}}  {label:<{wlabel}}  {seconds}")


if __name__ == "__main__":
    main()
