"""Property tests for schedule authors: hypothesis strategies for schedules,
placements, orders, building blocks and a `.pp` file's parameters, and
`check_orders` / `assert_valid`, which prove per-rank action lists (torch's
notation, `0F1`) or `.pp` files valid, deadlock-free and within a memory bound,
with located diagnostics (docs/testing.md).

The strategies are the ones ppdsl's own tests use. Valid orders are drawn as
random topological interleavings of every pass under the dependencies as the
zero-bubble paper states them (`paper_needs`, written apart from
`ppdsl.semantics`), so a property test built on them checks the compiler
against the paper. This module needs hypothesis (`pip install ppdsl[testing]`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from ppdsl.analysis import comm_rules
from ppdsl.analysis.checks.deadlock import verdict_diagnostics
from ppdsl.compiler import compile_file, compile_schedule
from ppdsl.diagnostics import CompileError, Diagnostic, Span, register_source, render_all
from ppdsl.families import parse_ranges
from ppdsl.interchange import from_torch_csv, torch_comm_items
from ppdsl.ir.schedule import (
    Block,
    Costs,
    Expect,
    MemoryModel,
    Pass,
    PassKind,
    Placement,
    Schedule,
)

__all__ = [
    "OrdersCheck",
    "check_orders",
    "check_file",
    "assert_valid",
    "param_values",
    "placements",
    "valid_orders",
    "schedules",
    "block_sources",
    "grouped_block_sources",
    "placement",
    "make_schedule",
    "with_spans",
    "pass_span",
    "paper_needs",
    "random_valid_orders",
    "random_costs",
    "FILE",
]

F, B, W, BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW
FILE = "orders.pp"
"""The file name the spans of `make_schedule`'s passes carry."""


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
        tuple(Pass(t[0], t[1], t[2], pass_span(dev, i), len(t) > 3 and bool(t[3]))
              for i, t in enumerate(order))
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



def paper_needs(
    kind: PassKind, j: int, s: int, S: int, split: bool, lanes: int = 1
) -> list[tuple[PassKind, int, int]]:
    """The passes `(kind, j, s)` waits for, as the zero-bubble paper states the
    dependencies within one pipeline of S stages (written apart from
    `ppdsl.semantics`, so that tests built on it check the compiler against the
    paper); with two lanes (DualPipe) each half of the stages is a pipeline of
    its own."""
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
        n = paper_needs(*p, S, split, lanes)
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
                    and all(position[q] < position[prev] for q in paper_needs(*p, S, split, lanes))
                    and rng.random() < 0.5):
                out.append((*p, True))
            else:
                out.append(p)
        paired.append(out)
    return paired


def random_costs(S: int, rng: random.Random, comm: float) -> Costs:
    """Pass costs from 1 to 4 per kind and stage, the given transfer cost, and a
    drawn F&B overlap factor."""
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


# --- strategies for authors --------------------------------------------------------


def param_values(*ranges: str) -> st.SearchStrategy[dict[str, int]]:
    """A `.pp` file's parameters drawn from ranges written as `ppdsl check --for`
    takes them (`"d=2..16"`, `"m=d..4*d"`, both ends included; `"v=1,2,4"`),
    each range over the names before it; they shrink toward each range's low end."""
    parsed = parse_ranges(ranges)

    @st.composite
    def draw_params(draw) -> dict[str, int]:
        params: dict[str, int] = {}
        for r in parsed:
            values = r.values(params)
            if isinstance(values, range):
                params[r.name] = draw(st.integers(values.start, values.stop - 1))
            else:
                params[r.name] = draw(st.sampled_from(values))
        return params

    return draw_params()


PLACEMENT_KINDS = ("parallel", "looped", "vshape", "wave", "dualpipe")


@st.composite
def placements(draw, max_devices: int = 4, kinds: Sequence[str] = PLACEMENT_KINDS) -> Placement:
    """A placement of `kinds` (parallel, looped(v), vshape, wave(v), dualpipe) on 1
    to `max_devices` devices, v from 1 to 3."""
    d = draw(st.integers(1, max_devices))
    kind = draw(st.sampled_from(list(kinds)))
    v = draw(st.integers(1, 3)) if kind in ("looped", "wave") else 2
    return placement(kind, d, v)


@st.composite
def valid_orders(
    draw, place: Placement, num_microbatches: int, split: bool = True
) -> list[list[str]]:
    """Per-rank action lists in torch's notation (`0F1`, `0I1`, `0W1`, `0B1`) of a
    random valid order of every pass on `place`: input for `check_orders`."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    orders = random_valid_orders(place, num_microbatches, split, rng)
    return [[f"{s}{kind.torch_letter}{j}" for kind, j, s, *_ in order] for order in orders]


# --- checking orders and files -----------------------------------------------------


@dataclass(frozen=True)
class OrdersCheck:
    """What `check_orders` or `check_file` found."""

    diagnostics: tuple[Diagnostic, ...]
    """Every finding, errors and warnings, located (`file:line:col`)."""
    schedule: Schedule | None
    """The checked schedule (None when it could not be built)."""
    peak_memory: tuple[Fraction, ...] = ()
    """Per rank, the peak activation memory in units of M_B (valid schedules only)."""
    makespan: float | None = None
    """The simulated step under unit costs, or the file's (valid schedules only)."""
    bubble: float | None = None
    """The zero-bubble paper's bubble ratio (valid schedules only)."""

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        """The findings that make the schedule invalid."""
        return tuple(d for d in self.diagnostics if d.severity == "error")

    @property
    def valid(self) -> bool:
        """True when there is no error."""
        return not self.errors

    def report(self) -> str:
        """The errors as `ppdsl check` prints them (source line and caret)."""
        return render_all(self.errors)


def _actions(orders: Mapping[int, Iterable[Any]] | Sequence[Iterable[Any]]) -> list[list[str]]:
    """Rows of action strings: torch's `pipeline_order` (rank -> list of
    `_Action` or None) or lists of strings; None cells are idle steps."""
    if isinstance(orders, Mapping):
        ranks = sorted(orders)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"ranks must be 0..{len(ranks) - 1}, got {ranks}")
        rows = [orders[r] for r in ranks]
    else:
        rows = list(orders)
    return [[str(a).replace(",", ";") for a in row if a is not None] for row in rows]


def check_orders(
    orders: Mapping[int, Iterable[Any]] | Sequence[Iterable[Any]],
    *,
    num_microbatches: int | None = None,
    placement: str | None = None,
    max_peak_memory: int | Fraction | None = None,
    name: str = "orders",
    early_receives: bool = True,
    comm_model: str = "rendezvous",
) -> OrdersCheck:
    """Per-rank action lists in torch's notation (`0F1` forward, `0I1` input
    gradient, `0W1` weight gradient, `0B1` full backward, `(0F3;7B1)OVERLAP_F_B`)
    checked as `ppdsl check` checks a file: every pass
    exactly once, dependencies, deadlock-freedom of ppdsl's lowering under
    `comm_model` (rendezvous: blocking send/recv, the default; nccl; gloo; with
    ppdsl's early receives unless `early_receives=False`), and, with
    `max_peak_memory`, each rank's activation peak in units of M_B. Orders in
    torch's compute+comm form (`0SEND_F1`, `1RECV_F1`, ...) have their own
    transfers run first under `comm_model`'s rules (as `ppdsl import` does); a
    deadlock among them is reported as its cycle of waits. `orders` is a
    list of rows or torch's `pipeline_order` dict. Diagnostics are located in
    the orders' CSV form, file `name`, line = rank + 1, column = the action's."""
    rows = _actions(orders)
    text = "".join(",".join(row) + "\n" for row in rows)
    register_source(name, text)
    try:
        schedule = from_torch_csv(
            text, name, placement=placement, num_microbatches=num_microbatches,
            name="orders" if not name.isidentifier() else name,
        )
    except CompileError as err:
        return OrdersCheck(tuple(err.diagnostics), None)
    items = torch_comm_items(text, schedule)
    if items is not None:  # compute+comm actions: their own transfers, run under comm_model
        found = verdict_diagnostics(
            comm_rules.run(items, comm_model), items, comm_model,
            "post one of these operations earlier, or the pair as one BATCH_P2P group")
        if found:
            return OrdersCheck(tuple(found), schedule)
    if max_peak_memory is not None:
        bound = Fraction(max_peak_memory)
        span = Span(name, 1, 1, 1, 1)
        schedule = replace(schedule, expects=(
            Expect("peak_memory", "<=", bound, None, span, f"{bound} * M_B"),))
    return _compiled(schedule, early_receives=early_receives, comm_model=comm_model)


def _compiled(schedule: Schedule, *, early_receives: bool, comm_model: str) -> OrdersCheck:
    try:
        compiled = compile_schedule(schedule, early_receives=early_receives, warn_unbounded=False,
                                    comm_model=comm_model)
    except CompileError as err:
        return OrdersCheck(tuple(err.diagnostics), schedule)
    t = compiled.timeline
    return OrdersCheck(compiled.warnings, compiled.schedule, t.peak_memory, float(t.makespan),
                       float(t.bubble_ratio))


def check_file(path: str | Path, **params: int) -> OrdersCheck:
    """A `.pp` file compiled with `params` as its `-D` overrides (`d=8, m=32`)."""
    try:
        compiled = compile_file(path, {k: str(v) for k, v in params.items()})
    except CompileError as err:
        return OrdersCheck(tuple(err.diagnostics), None)
    t = compiled.timeline
    return OrdersCheck(compiled.warnings, compiled.schedule, t.peak_memory, float(t.makespan),
                       float(t.bubble_ratio))


def assert_valid(
    orders: Mapping[int, Iterable[Any]] | Sequence[Iterable[Any]] | str | Path,
    **options: Any,
) -> OrdersCheck:
    """`check_orders(orders, **options)`, or `check_file(path, **params)` for a
    `.pp` path, failing the test with the located diagnostics when invalid. Under
    hypothesis the failure is an AssertionError, so hypothesis shrinks the drawn
    input and prints the smallest counterexample beside them."""
    if isinstance(orders, (str, Path)):
        found = check_file(orders, **options)
        what = f"{orders} with {' '.join(f'{k}={v}' for k, v in options.items()) or 'its defaults'}"
    else:
        found = check_orders(orders, **options)
        what = options.get("name", "orders")
    if not found.valid:
        raise AssertionError(f"{what} is invalid:\n{found.report()}")
    return found
