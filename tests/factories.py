"""Builders and hypothesis strategies for schedule IR, for tests of the checks,
the simulator and the interchange formats.

Plain builders: `placement(...)`, `make_schedule(...)`, `one_f_one_b_orders`,
`random_valid_orders`. Strategies: `schedules()` draws a valid schedule (random
placement incl. vshape/looped/wave, a random topological interleaving of all
passes, random costs); `corruptions()` breaks exactly one guarantee and says
which check must catch it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from fractions import Fraction

from hypothesis import strategies as st

from ppdsl.diagnostics import Span
from ppdsl.ir.rank import Compute, Exchange, RankProgram, Transfer
from ppdsl.ir.schedule import (
    Block,
    BlockSlot,
    Costs,
    Expect,
    MemoryModel,
    Pass,
    PassKind,
    Placement,
    Schedule,
)

F, B, W, BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW
FILE = "orders.pp"


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


def placement(kind: str, num_devices: int, v: int = 2) -> Placement:
    """parallel, looped (v chunks), vshape, wave (v chunks), dualpipe (DualPipe's
    two pipelines: stage s on device s, its copy d+s on device d-1-s)."""
    d = num_devices
    if kind == "dualpipe":
        down = tuple(range(d))
        return Placement("dualpipe", d, down + tuple(d - 1 - k for k in range(d)), lanes=2)
    if kind == "parallel":
        return Placement("parallel", d, tuple(range(d)))
    if kind == "looped":
        return Placement("looped", d, tuple(s % d for s in range(v * d)))
    if kind == "vshape":
        kind, v = "wave", 2
    if kind == "wave":
        devs = []
        for s in range(v * d):
            chunk, k = divmod(s, d)
            devs.append(k if chunk % 2 == 0 else d - 1 - k)
        return Placement("vshape" if v == 2 else "wave", d, tuple(devs))
    raise ValueError(kind)


def pass_span(device: int, index: int) -> Span:
    """A distinct, sortable span per pass: line = device + 2, column = index + 1."""
    return Span(FILE, device + 2, index + 1, device + 2, index + 1)


def with_spans(orders: list[list[tuple]]) -> tuple[tuple[Pass, ...], ...]:
    """Pass objects of (kind, mb, stage) tuples, or (kind, mb, stage, overlapped)
    where a backward runs overlapped with the forward before it."""
    return tuple(
        tuple(Pass(*t[:3], pass_span(dev, i), *t[3:]) for i, t in enumerate(order))
        for dev, order in enumerate(orders)
    )


def make_schedule(
    place: Placement,
    num_microbatches: int,
    orders,
    *,
    split_backward: bool = True,
    costs: Costs | None = None,
    memory: MemoryModel | None = None,
    expects: tuple[Expect, ...] = (),
    block: Block | None = None,
    name: str = "test",
) -> Schedule:
    """A Schedule from orders given as Pass tuples or (kind, mb, stage) lists."""
    S = place.num_stages
    if orders and orders[0] and not isinstance(orders[0][0], Pass):
        orders = with_spans(orders)
    orders = tuple(tuple(o) for o in orders)
    return Schedule(
        name=name,
        file=FILE,
        params=(("d", place.num_devices), ("m", num_microbatches)),
        num_microbatches=num_microbatches,
        placement=place,
        split_backward=split_backward,
        costs=costs or Costs.unit(S),
        memory=memory or MemoryModel((Fraction(1),) * S, (Fraction(1, 2),) * S),
        orders=orders,
        expects=expects,
        block=block,
        span=Span(FILE, 1, 1, 1, 8),
    )


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


def _needs(
    kind: PassKind, j: int, s: int, S: int, split: bool, lanes: int = 1
) -> list[tuple[PassKind, int, int]]:
    """The zero-bubble paper's dependencies within one pipeline; with two lanes
    (DualPipe) each half of the stages is a pipeline of its own."""
    bk = B if split else BW
    first = s - s % (S // lanes)  # the first and last stage of s's pipeline
    last = first + S // lanes - 1
    if kind is F:
        return [(F, j, s - 1)] if s > first else []
    if kind in (B, BW):
        return [(F, j, s)] + ([(bk, j, s + 1)] if s < last else [])
    return [(B, j, s)]


def _stages_of(j: int, m: int, S: int, lanes: int) -> range:
    """The stages microbatch j goes through: all of them, or under DualPipe the
    first half (down) for the first half of the microbatches, else the second."""
    if lanes == 1:
        return range(S)
    return range(S // 2) if 2 * j < m else range(S // 2, S)


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
                    q for x in unit for q in _needs(x.kind, x.microbatch, x.stage, s.num_stages,
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


def random_valid_orders(
    place: Placement, m: int, split: bool, rng: random.Random, overlap: bool = False
):
    """A random topological interleaving of all passes, split into devices: every
    device order is consistent with one global order, so the schedule is valid.
    `overlap`: some F directly followed on its device by a backward whose inputs
    all come earlier in the global order run overlapped with it (a 4th element)."""
    S = place.num_stages
    kinds = (F, B, W) if split else (F, BW)
    lanes = place.lanes
    all_passes = [(k, j, s) for k in kinds for j in range(m) for s in _stages_of(j, m, S, lanes)]
    needers: dict[tuple, list[tuple]] = {}
    waiting = {}
    for p in all_passes:
        n = _needs(*p, S, split, lanes)
        waiting[p] = len(n)
        for q in n:
            needers.setdefault(q, []).append(p)
    ready = [p for p in all_passes if waiting[p] == 0]
    orders: list[list[tuple]] = [[] for _ in range(place.num_devices)]
    position: dict[tuple, int] = {}
    while ready:
        p = ready.pop(rng.randrange(len(ready)))
        position[p] = len(position)
        orders[place.stage_device[p[2]]].append(p)
        for q in needers.get(p, []):
            waiting[q] -= 1
            if waiting[q] == 0:
                ready.append(q)
    if not overlap:
        return orders
    paired = []
    for order in orders:
        out: list[tuple] = []
        for p in order:
            prev = out[-1] if out else None
            if (prev is not None and prev[0] is F and len(prev) == 3 and p[0] in (B, BW)
                    and all(position[q] < position[prev] for q in _needs(*p, S, split, lanes))
                    and rng.random() < 0.5):
                out.append((*p, True))
            else:
                out.append(p)
        paired.append(out)
    return paired


def random_costs(S: int, rng: random.Random, comm: float) -> Costs:
    f = tuple(float(rng.randint(1, 4)) for _ in range(S))
    b = tuple(float(rng.randint(1, 4)) for _ in range(S))
    w = tuple(float(rng.randint(1, 4)) for _ in range(S))
    costs = Costs.of(f, b, w, tuple(x + y for x, y in zip(b, w, strict=True)), comm)
    return replace(costs, overlap=rng.choice([1.0, 0.75, 0.5]))


@st.composite
def schedules(
    draw, max_devices: int = 4, max_microbatches: int = 6, overlap: bool = True
) -> Schedule:
    """A valid schedule: random placement, random valid orders (some with
    overlapped F&B pairs, unless `overlap` is False), random costs."""
    d = draw(st.integers(1, max_devices))
    kind = draw(st.sampled_from(["parallel", "looped", "vshape", "wave", "dualpipe"]))
    v = draw(st.integers(1, 3)) if kind in ("looped", "wave") else 2
    place = placement(kind, d, v)
    m = draw(st.integers(1, max_microbatches))
    split = draw(st.booleans())
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    comm = draw(st.sampled_from([0.0, 0.5, 1.0]))
    recv = draw(st.sampled_from([0.0, 0.25, 1.5]))  # `cost recv`: the receiver's part
    orders = random_valid_orders(place, m, split, rng, overlap=overlap and draw(st.booleans()))
    costs = random_costs(place.num_stages, rng, comm).with_receive_cost(recv)
    return make_schedule(place, m, orders, split_backward=split, costs=costs)


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


@st.composite
def block_sources(draw) -> str:
    """A schedule in block form: placement, backward, costs, one slot per pass
    kind and chunk as `a*i + b`, a period, W placed or filled, a memory bound.
    Half the blocks have free coefficients (mostly rejected: collisions, orders
    that cannot run); half follow one microbatch's path in slot time (F along the
    stages, B back, W after its B), so the period and costs decide."""
    d = draw(st.integers(1, 4))
    m = draw(st.integers(1, 6))
    vshape = draw(st.booleans())
    split = draw(st.booleans())
    fill = split and draw(st.booleans())
    kinds = ["F", "B"] if fill else (["F", "B", "W"] if split else ["F", "BW"])
    S = 2 * d if vshape else d
    # recomputation: none, every stage, or a condition on s; R written or left to
    # its default (ending as the backward starts)
    recompute = draw(st.sampled_from(["", "recompute", "recompute[s] = s % 2 == 0",
                                      "recompute[s] = s < d"]))
    write_r = bool(recompute) and draw(st.booleans())
    if draw(st.booleans()):
        period = draw(st.integers(1, 14))

        def slot(kind: str, chunk: int) -> str:
            a = draw(st.integers(-3, 4))
            b = draw(st.integers(0, 6 * d + 4))
            return f"{kind} at {a}*i + {b}"

        def r_slot(chunk: int) -> str:
            return slot("R", chunk)
    else:
        x, y = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        gap, wait = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        b0 = x * (S - 1) + 1 + gap + y * (S - 1)  # B of stage 0
        period = draw(st.integers(3 * S // d, b0 + 2 * S + 8))

        def slot(kind: str, chunk: int) -> str:
            # stage s = i (chunk 0) or 2d-1-i (chunk 1): F at x*s, B at b0 - y*s
            sign, base = (1, 0) if chunk == 0 else (-1, 2 * d - 1)
            if kind == "F":
                return f"{kind} at {x * base} + {sign * x}*i"
            b = f"{b0 - y * base} + {-sign * y}*i"
            return f"{kind} at {b}" if kind in ("B", "BW") else f"{kind} at {b} + {1 + wait}"

        def r_slot(chunk: int) -> str:  # R just before the backward, or a slot earlier
            sign, base = (1, 0) if chunk == 0 else (-1, 2 * d - 1)
            return f"R at {b0 - y * base} + {-sign * y}*i - {draw(st.integers(1, 2))}"

    lines = []
    for chunk in range(2 if vshape else 1):
        slots = ", ".join(slot(k, chunk) for k in kinds)
        if write_r and (recompute != "recompute[s] = s < d" or chunk == 0):
            slots += ", " + r_slot(chunk)
        lines.append(f"chunk {chunk}: {slots}" if vshape else slots)
    if fill:
        lines.append("W fill")
    costs = []
    if draw(st.booleans()):
        for kind in ("F", "B", "W") if split else ("F", "BW"):
            costs.append(f"cost {kind} = {draw(st.integers(1, 4))}")
        costs.append(f"cost comm = {draw(st.sampled_from(['0', '1/2', '1']))}")
    bound = draw(st.integers(1, 2 * m + 1))
    life = draw(st.one_of(st.none(), st.integers(1, 12 * d + 12)))
    body = "\n".join(
        [
            f"    param d = {d}",
            f"    param m = {m}",
            f"    place {'vshape' if vshape else 'parallel'}",
            f"    backward {'split' if split else 'fused'}",
            *(f"    {c}" for c in costs),
            *([f"    {recompute}", f"    memory M_I = {draw(st.sampled_from(['0', '1/4']))}"]
              if recompute else []),
            f"    block period {period} {{",
            *(f"        {line}" for line in lines),
            "    }",
            f"    expect peak_memory <= {bound} * M_B",
            *([f"    expect lifespan <= {life}"] if life is not None else []),
        ]
    )
    return f"schedule random_block {{\n{body}\n}}\n"


@st.composite
def grouped_block_sources(draw) -> str:
    """A grouped block (`group G every U`) on a looped placement, shaped like
    Megatron's interleaved 1F1B and the zero-bubble repository's grouped block:
    forward k of a group (chunk c, microbatch r, k = G c + r) at U k + x i, its
    backward passes a drawn number of forwards later, chunks reversed; the
    group size, spacing, period, warm-up and costs are drawn, so some blocks
    collide or cannot run (located errors) and the rest must keep every
    guarantee."""
    d = draw(st.integers(1, 4))
    v = draw(st.integers(1, 3))
    group = draw(st.integers(1, 4))
    m = group * draw(st.integers(1, 3))
    split = draw(st.booleans())
    spacing = draw(st.sampled_from([2, 3, 3, 4]))
    x = draw(st.integers(0, 1))
    period = spacing * group * v + draw(st.sampled_from([0, 0, 0, -1, 1, spacing]))
    warm = draw(st.integers(0, 2 * d + v * group))
    slope = draw(st.integers(0, 2))  # more warm-up forwards on earlier devices
    back = f"{spacing} * ({warm} + {slope} * ({d - 1} - i) + {group} * ({v - 1} - c))"
    lines = [f"F at {x}*i + {spacing * group}*c"]
    if split:
        lines.append(f"B at {x}*i + 1 + {back}")
        lines.append(f"W at {x}*i + 2 + {back}" if draw(st.booleans()) else "W fill")
    else:
        lines.append(f"BW at {x}*i + 1 + {back}")
    costs = []
    if draw(st.booleans()):
        costs.append(f"cost comm = {draw(st.sampled_from(['0', '1/2', '1']))}")
    bound = draw(st.integers(m * v // 2 + 1, 2 * m * v + 1))
    body = "\n".join(
        [
            f"    param d = {d}",
            f"    param m = {m}",
            f"    place looped({v})",
            f"    backward {'split' if split else 'fused'}",
            *(f"    {c}" for c in costs),
            f"    block period {period} group {group} every {spacing} {{",
            *(f"        {line}" for line in lines),
            "    }",
            f"    expect peak_memory <= {bound} * M_B",
        ]
    )
    return f"schedule random_block {{\n{body}\n}}\n"
