"""Builders, oracles and hypothesis strategies for schedule IR, for tests of
the checks, the simulator and the interchange formats.

The generators of valid schedules, placements, orders and blocks are public in
`ppdsl.testing` (docs/testing.md) and re-exported here: `placement(...)`,
`make_schedule(...)`, `random_valid_orders`, `schedules()`, `block_sources()`,
`grouped_block_sources()`. Here: `one_f_one_b_orders`, the oracles
(`oracle_peaks`, `oracle_timeline`), `corruptions()`, which breaks exactly one
guarantee and says which check must catch it, and `brute_force_finishes`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from fractions import Fraction

from hypothesis import strategies as st

from ppdsl.diagnostics import Span
from ppdsl.ir.rank import Compute, Exchange, RankProgram, Transfer
from ppdsl.ir.schedule import BlockSlot, Expect, Pass, PassKind, Placement, Schedule
from ppdsl.testing import (
    FILE,
    block_sources,
    grouped_block_sources,
    make_schedule,
    paper_needs,
    pass_span,
    placement,
    random_costs,
    random_valid_orders,
    schedules,
    with_spans,
)

__all__ = [
    "FILE", "block_sources", "grouped_block_sources", "make_schedule", "paper_needs", "pass_span",
    "placement", "random_costs", "random_valid_orders", "schedules", "with_spans",
    "ZB_H1", "parse_rows", "one_f_one_b_orders", "oracle_peaks", "oracle_timeline",
    "Corruption", "corrupt", "CORRUPTIONS", "corruptions", "block_slot", "breadth_first_orders",
    "brute_force_finishes", "F", "B", "W", "BW",
]

F, B, W, BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW


# ZB-H1, p=4, m=8 (docs/papers.md's reference order)
ZB_H1 = """\
F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7
"""


def parse_rows(text: str) -> list[list[tuple]]:
    """`F0 B0 W0 ...` per line (one device per line, stage = line index) -> orders."""
    kinds = {"F": F, "B": B, "W": W}
    return [
        [(kinds[tok[0]], int(tok[1:]), dev) for tok in line.split()]
        for dev, line in enumerate(text.splitlines())
    ]


def one_f_one_b_orders(
    d: int, m: int, split: bool = False
) -> list[list[tuple[PassKind, int, int]]]:
    """1F1B (PipeDream-flush) on a parallel placement: device i warms up with
    min(d - i, m) forwards... then alternates; with `split`, each BW becomes B W."""
    orders = []
    for i in range(d):
        warm = min(d - i - 1, m)
        order: list[tuple[PassKind, int, int]] = [(F, j, i) for j in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                order.append((F, f, i))
                f += 1
            if split:
                order += [(B, b, i), (W, b, i)]
            else:
                order.append((BW, b, i))
            b += 1
        orders.append(order)
    return orders


def oracle_peaks(s: Schedule) -> tuple[Fraction, ...]:
    """Per device, the peak activation memory written from the zero-bubble
    paper's model, independently of ppdsl's semantics module: F leaves M_B, B
    frees M_B - M_W, W the last M_W, a fused BW all of M_B; the peak is the
    largest prefix sum over the device's order (0 when it never rises)."""
    peaks = []
    for order in s.orders:
        level = peak = Fraction(0)
        for p in order:
            a, w = s.memory.activation[p.stage], s.memory.weight_retained[p.stage]
            level += {F: a, B: w - a, W: -w, BW: -a}[p.kind]
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)


def oracle_timeline(s: Schedule) -> tuple[list[list[float]], list[list[float]]]:
    """(start, end) per device and pass, from the definition and independently
    of ppdsl's code: a pass starts at the latest of the end of the previous pass
    on its device and the end of each pass it needs (`_needs`, written here from
    the zero-bubble paper) plus `comm` when that pass ran on another device,
    and then at least `recv` after the end of its device's previous pass.
    Assumes a valid schedule; iterates until nothing changes."""
    where = {p.key: (dev, k) for dev, order in enumerate(s.orders) for k, p in enumerate(order)}
    start: list[list[float | None]] = [[None] * len(o) for o in s.orders]
    end: list[list[float | None]] = [[None] * len(o) for o in s.orders]
    todo = sum(len(o) for o in s.orders)
    while todo:
        progressed = False
        for dev, order in enumerate(s.orders):
            for k, p in enumerate(order):
                if end[dev][k] is not None:
                    continue
                ready = [end[dev][k - 1]] if k else [0.0]
                unit = [p]  # an overlapped pair starts once both passes' inputs are in
                joined = k + 1 < len(order) and order[k + 1].overlapped
                if joined:
                    unit.append(order[k + 1])
                needed = [
                    q for x in unit for q in paper_needs(x.kind, x.microbatch, x.stage, s.num_stages,
                                                     s.split_backward, s.placement.lanes)
                ]
                for q in needed:
                    qd, qk = where[q]
                    comm = s.costs.comm if qd != dev else 0.0
                    ready.append(None if end[qd][qk] is None else end[qd][qk] + comm)
                if any(where[q][0] != dev for q in needed):
                    free = ready[0]
                    ready.append(None if free is None else free + s.costs.recv)
                if any(r is None for r in ready):
                    continue
                begin = max(ready)  # type: ignore[type-var]
                start[dev][k] = begin
                # each pass of an overlapped pair takes `overlap` of its own cost
                share = s.costs.overlap if (joined or p.overlapped) else 1.0
                end[dev][k] = begin + s.costs.durations[p.kind.code][p.stage] * share
                todo -= 1
                progressed = True
        assert progressed, "the orders wait on each other in a cycle"
    return start, end  # type: ignore[return-value]


@dataclass(frozen=True)
class Corruption:
    """A schedule that breaks exactly one guarantee; `check` is the module name
    that must report it and `span` where (None: the schedule's own span)."""

    schedule: Schedule
    check: str
    what: str
    span: Span | None


def _rebuild(s: Schedule, orders: list[list[Pass]]) -> Schedule:
    return replace(s, orders=tuple(tuple(o) for o in orders))


def corrupt(s: Schedule, how: str, rng: random.Random) -> Corruption:
    """Break one guarantee of a valid schedule `s` (moving passes undoes its
    overlapped pairs first: a pair broken apart is a guarantee of its own)."""
    if how in ("duplicate", "wrong_device", "dependency", "drop"):
        s = replace(s, orders=tuple(tuple(replace(p, overlapped=False) for p in o)
                                    for o in s.orders))
    orders = [list(o) for o in s.orders]
    devices = [dev for dev, o in enumerate(orders) if o]
    dev = rng.choice(devices)
    k = rng.randrange(len(orders[dev]))
    p = orders[dev][k]
    if how == "drop":
        del orders[dev][k]
        return Corruption(_rebuild(s, orders), "passes", f"drop {p}", s.span)
    if how == "duplicate":
        orders[dev].insert(rng.randrange(len(orders[dev]) + 1), p)
        # the error sits at the later occurrence; both carry the same span here
        return Corruption(_rebuild(s, orders), "passes", f"duplicate {p}", p.span)
    if how == "out_of_range":
        bad = replace(p, microbatch=s.num_microbatches + rng.randrange(3))
        orders[dev][k] = bad
        return Corruption(_rebuild(s, orders), "passes", f"microbatch out of range {p}", p.span)
    if how == "wrong_lane":
        # DualPipe: a microbatch of the other direction on this stage
        others = [j for j in range(s.num_microbatches) if (2 * j < s.num_microbatches)
                  != (2 * p.microbatch < s.num_microbatches)]
        if s.placement.lanes == 1 or not others:
            return corrupt(s, "drop", rng)
        orders[dev][k] = replace(p, microbatch=rng.choice(others))
        return Corruption(_rebuild(s, orders), "passes", f"other lane's microbatch {p}", p.span)
    if how == "wrong_device":
        if s.num_devices < 2:
            return corrupt(s, "drop", rng)
        other = rng.choice([x for x in range(s.num_devices) if x != dev])
        del orders[dev][k]
        orders[other].insert(rng.randrange(len(orders[other]) + 1), p)
        return Corruption(_rebuild(s, orders), "passes", f"move {p} to device {other}", p.span)
    if how == "dependency":
        # move a backward pass before the F of its own (microbatch, stage): same device
        backs = [
            (d2, i, q) for d2, o in enumerate(orders) for i, q in enumerate(o) if q.kind is not F
        ]
        d2, i, q = rng.choice(backs)
        f_index = next(x for x, r in enumerate(orders[d2]) if r.key == (F, q.microbatch, q.stage))
        del orders[d2][i]
        orders[d2].insert(f_index, q)
        return Corruption(_rebuild(s, orders), "dependencies", f"{q} before its F", None)
    if how == "memory":
        peaks = oracle_peaks(s)
        target = rng.randrange(s.num_devices)
        span = Span(FILE, 90, 5, 90, 30)
        bound = peaks[target] - Fraction(1, 2)
        e = Expect("peak_memory", "<=", bound, target, span, str(bound))
        return Corruption(replace(s, expects=(e,)), "memory", f"bound {bound} on {target}", span)
    raise ValueError(how)


CORRUPTIONS = (
    "drop", "duplicate", "out_of_range", "wrong_device", "dependency", "memory", "wrong_lane"
)


@st.composite
def corruptions(draw) -> Corruption:
    """A valid schedule with exactly one guarantee broken."""
    s = draw(schedules())
    how = draw(st.sampled_from(CORRUPTIONS))
    return corrupt(s, how, random.Random(draw(st.integers(0, 2**32 - 1))))


def block_slot(kind: PassKind, stage: int, device: int, start, duration, line: int) -> BlockSlot:
    return BlockSlot(
        kind, stage, device, Fraction(start), Fraction(duration), Span(FILE, line, 5, line, 20)
    )


def breadth_first_orders(place: Placement, m: int, split: bool = True):
    """Looped breadth-first / GPipe-like orders for any placement: every device
    runs all forwards chunk by chunk, then all backwards in reverse chunk order
    (B W pairs with a split backward). Deadlock-free under blocking exchanges:
    every device sends and receives microbatches in the same order."""
    orders = []
    for dev in range(place.num_devices):
        chunks = place.chunks(dev)
        order: list[tuple[PassKind, int, int]] = [(F, j, s) for s in chunks for j in range(m)]
        for s in reversed(chunks):
            for j in range(m):
                order += [(B, j, s), (W, j, s)] if split else [(BW, j, s)]
        orders.append(order)
    return orders


def brute_force_finishes(
    programs: tuple[RankProgram, ...], rng: random.Random, sends_block: bool = True
) -> bool:
    """Run the programs op by op: an exchange first posts its sends and receives
    (into shared sets), then completes once every matching op of a peer has been
    posted (only the receives' when sends do not block). Step any rank that can,
    in random order; True when all finish."""
    pc = [0] * len(programs)
    posted_phase = [False] * len(programs)
    posted_sends: set[Transfer] = set()
    posted_recvs: set[Transfer] = set()
    while True:
        movable = []
        for r, prog in enumerate(programs):
            if pc[r] >= len(prog.ops):
                continue
            op = prog.ops[pc[r]]
            if isinstance(op, Compute) or not posted_phase[r]:
                movable.append(r)
            elif (not sends_block or all(t in posted_recvs for t in op.sends)) and all(
                t in posted_sends for t in op.recvs
            ):
                movable.append(r)
        if not movable:
            return all(pc[r] == len(p.ops) for r, p in enumerate(programs))
        r = rng.choice(movable)
        op = programs[r].ops[pc[r]]
        if isinstance(op, Exchange) and not posted_phase[r]:
            posted_sends.update(op.sends)
            posted_recvs.update(op.recvs)
            posted_phase[r] = True
        else:
            posted_phase[r] = False
            pc[r] += 1


