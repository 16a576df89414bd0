"""The timed simulation in plain Python, written from the definition
(ppdsl/analysis/simulate.py's module docstring), kept as the oracle of the numba
executor's `simulate` (tests/analysis/test_simulate.py, tests/system/test_properties.py, the
simulate bench)."""

from __future__ import annotations

import math

from ppdsl import semantics
from ppdsl.analysis.simulate import SimulationError, Timeline, _exact_profile, _timeline
from ppdsl.ir.schedule import Pass, PassKind, Schedule

__all__ = ["simulate_reference"]


def simulate_reference(schedule: Schedule, *, memory_over_time: bool = False) -> Timeline:
    """The same simulation in plain Python, from the definition: a pass starts
    at the max of (end of the previous pass on its device), (end of each
    pass it depends on + transfer cost) and, when one of those ran on another
    device, (end of the previous pass on its device + `cost recv`). Evaluated depth-first with an explicit
    stack; a cycle raises SimulationError."""
    placement = schedule.placement
    orders = [tuple(order) for order in schedule.orders]  # Pass objects, read once
    where: dict[tuple[PassKind, int, int], tuple[int, int]] = {}
    for dev, order in enumerate(orders):
        for k, p in enumerate(order):
            where[p.key] = (dev, k)

    received_by: dict[tuple[int, int], bool] = {}

    def needs(dev: int, k: int) -> list[tuple[tuple[int, int], float]]:
        order = orders[dev]
        p: Pass = order[k]
        keys = [(key, p.stage) for key in semantics.needs(
            p.kind, p.microbatch, p.stage, schedule.num_stages,
            lanes=placement.lanes, recompute=schedule.recompute,
        )]
        if k + 1 < len(order) and order[k + 1].overlapped:
            # an overlapped pair starts as one unit: when its backward's inputs are in too
            q = order[k + 1]
            keys += [(key, q.stage) for key in semantics.needs(
                q.kind, q.microbatch, q.stage, schedule.num_stages,
                lanes=placement.lanes, recompute=schedule.recompute,
            )]
        found_keys = keys
        found: list[tuple[tuple[int, int], float]] = []
        if k > 0:
            found.append(((dev, k - 1), 0.0))
        received = False
        for key, consumer in found_keys:
            if key not in where:
                raise SimulationError(
                    f"cannot simulate: {key[0].value}{key[1]}:s{key[2]} is missing"
                )
            other = where[key]
            remote = placement.stage_device[key[2]] != dev
            received = received or remote
            # the transfer over the edge between the two stages (`Costs.transfer_cost`)
            lag = float(schedule.costs.transfer_cost(key[2], consumer)) if remote else 0.0
            found.append((other, lag))
        received_by[(dev, k)] = received
        if received and k > 0:
            found.append(((dev, k - 1), float(schedule.costs.recv)))
        return found

    def floor(dev: int, k: int) -> float:
        """A device's first pass that receives starts no earlier than `cost recv`."""
        return float(schedule.costs.recv) if k == 0 and received_by[(dev, k)] else 0.0

    def duration_of(dev: int, k: int) -> float:
        order = orders[dev]
        joined = k + 1 < len(order) and order[k + 1].overlapped
        return schedule.costs.pass_duration(order[k], joined)

    ends: dict[tuple[int, int], float] = {}
    starts: dict[tuple[int, int], float] = {}
    on_stack: set[tuple[int, int]] = set()
    for dev, order in enumerate(orders):
        for k in range(len(order)):
            if (dev, k) in ends:
                continue
            stack = [(dev, k)]
            on_stack.add((dev, k))
            while stack:
                node = stack[-1]
                pending = [n for n, _ in needs(*node) if n not in ends]
                if pending:
                    # one child at a time, so the stack is exactly the chain of waits
                    if pending[0] in on_stack:
                        raise SimulationError(
                            "cannot simulate: the orders wait on each other in a cycle"
                        )
                    stack.append(pending[0])
                    on_stack.add(pending[0])
                    continue
                stack.pop()
                on_stack.discard(node)
                if node in ends:
                    continue
                begin = max([ends[n] + c for n, c in needs(*node)], default=0.0)
                begin = max(begin, floor(*node))
                starts[node] = begin
                ends[node] = begin + duration_of(*node)
    start = tuple(
        tuple(starts[(d, k)] for k in range(len(o))) for d, o in enumerate(orders)
    )
    end = tuple(tuple(ends[(d, k)] for k in range(len(o))) for d, o in enumerate(orders))
    busy = [
        math.fsum(duration_of(d, k) for k in range(len(o))) for d, o in enumerate(orders)
    ]
    return _timeline(schedule, start, end, busy, memory_over_time, _memory_over_time_exact)


def _memory_over_time_exact(
    schedule: Schedule, start: tuple[tuple[float, ...], ...], end: tuple[tuple[float, ...], ...]
) -> tuple[tuple[tuple[float, float], ...], ...]:
    """`_memory_over_time` summed in Fractions pass by pass (the reference's)."""
    return tuple(_exact_profile(schedule, dev, start[dev], end[dev])
                 for dev in range(schedule.num_devices))


