"""Write found orders as an ordinary `.pp` file in the order form.

The file is built as an AST and printed by the front end's one printer
(`ppdsl.frontend.ast.format_module`). Each device's order becomes one branch of
an `if i == k { ... } else if ...` chain. Runs that repeat with the microbatch
index going up by one become loops, so a steady state reads as
`for j in 4..20 { F(j + 4); B(j); W(j) }`; the other passes are listed as they
come. The file states its costs, memory model and the metrics the search
measured as `expect` clauses (rounded up, so `ppdsl check` passes), and opens
with the command that produced it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from ppdsl.frontend import ast
from ppdsl.ir.schedule import Costs, Pass
from ppdsl.search.problem import SearchProblem
from ppdsl.semantics import PassKind, format_number

__all__ = ["emit_pp", "compress", "cost_statements", "memory_statements"]

_MAX_GROUP = 8

# (kind letter, microbatch, chunk)
Item = tuple[str, int, int]


def _call(item: Item, offset_from: int | None, v: int) -> ast.PassCall:
    """`F(3)`, or `F(j + 2)` inside a loop over j; the chunk too when v > 1."""
    kind, mb, chunk = item
    index: ast.Expr
    if offset_from is None:
        index = ast.number(mb)
    else:
        delta = mb - offset_from
        index = ast.name("j")
        if delta:
            index = ast.binary("+" if delta > 0 else "-", index, ast.number(abs(delta)))
    args = (index,) if v == 1 else (index, ast.number(chunk))
    return ast.PassCall(kind, args, ast.GENERATED)


def compress(items: Sequence[Item]) -> list[tuple[int, int, int]]:
    """Cover `items` with (start, group, repeats): items[start:start+group]
    repeated `repeats` times, each repetition the previous one with every
    microbatch + 1. Singles have group 1, repeats 1."""
    out = []
    p, n = 0, len(items)
    while p < n:
        best = (1, 1)
        for g in range(1, min(_MAX_GROUP, n - p) + 1):
            r = 1
            while p + (r + 1) * g <= n and all(
                items[p + r * g + k][0] == items[p + k][0]
                and items[p + r * g + k][2] == items[p + k][2]
                and items[p + r * g + k][1] == items[p + k][1] + r
                for k in range(g)
            ):
                r += 1
            if r >= 3 and g * r > best[0] * best[1]:
                best = (g, r)
        out.append((p, best[0], best[1]))
        p += best[0] * best[1]
    return out


def _device_order(items: Sequence[Item], v: int) -> tuple[ast.OrderStmt, ...]:
    """A device's passes, repeated runs as loops over j."""
    body: list[ast.OrderStmt] = []
    for start, group, repeats in compress(items):
        if repeats == 1:
            body.append(_call(items[start], None, v))
            continue
        head = items[start : start + group]
        base = min(mb for _, mb, _ in head)
        span = ast.SpanRange(ast.number(base), ast.number(base + repeats), ast.GENERATED)
        loop = tuple(_call(x, base, v) for x in head)
        body.append(ast.For("j", span, loop, ast.GENERATED))
    return tuple(body)


def _branches(bodies: list[tuple[ast.OrderStmt, ...]]) -> tuple[ast.OrderStmt, ...]:
    """`if i == 0 { ... } else if i == 1 { ... } else { ... }`."""
    if len(bodies) == 1:
        test = ast.binary("==", ast.name("i"), ast.number(0))
        return (ast.If(test, bodies[0], (), ast.GENERATED),)
    rest: tuple[ast.OrderStmt, ...] = bodies[-1]
    for dev in range(len(bodies) - 2, -1, -1):
        test = ast.binary("==", ast.name("i"), ast.number(dev))
        rest = (ast.If(test, bodies[dev], rest, ast.GENERATED),)
    return rest


def cost_statements(costs: Costs) -> list[ast.Stmt]:
    """`cost F`, `cost B`, `cost W` (per stage where the stages differ), `cost comm`
    (a line in `bytes` where it has a time per byte, with `memory bytes[s]` and
    `memory grad_bytes[s]` where stated), `cost overhead` when declared, and the data-parallel collectives declared
    (`cost reduce`)."""
    stmts: list[ast.Stmt] = []
    for kind in (PassKind.F, PassKind.B, PassKind.W):
        values = costs.per_stage(kind)
        index = "s" if len(set(values)) > 1 else None
        value = ast.per_stage(values)
        stmts.append(ast.Cost(kind.value, index, value, ast.GENERATED, ast.GENERATED))
    comm: ast.Expr = ast.number(costs.comm)
    if costs.comm_per_byte:  # latency + bytes / bandwidth (docs/language.md, "Transfers")
        comm = ast.binary("+", comm, ast.binary("*", ast.number(costs.comm_per_byte),
                                                ast.name("bytes")))
    stmts.append(ast.Cost("comm", None, comm, ast.GENERATED, ast.GENERATED))
    for name, sizes in (("bytes", costs.transfer_bytes), ("grad_bytes", costs.grad_bytes)):
        if sizes:
            index = "s" if len(set(sizes)) > 1 else None
            stmts.append(ast.Memory(name, index, ast.per_stage(sizes), ast.GENERATED,
                                    ast.GENERATED))
    if any(costs.overhead):  # part of every pass's time, as the search timed it
        values = tuple(costs.overhead)
        index = "s" if len(set(values)) > 1 else None
        stmts.append(ast.Cost("overhead", index, ast.per_stage(values), ast.GENERATED,
                              ast.GENERATED))
    for name, values in costs.declared_collectives().items():
        index = "s" if len(set(values)) > 1 else None
        stmts.append(ast.Cost(name, index, ast.per_stage(values), ast.GENERATED, ast.GENERATED))
    return stmts


def memory_statements(activation: Sequence[Fraction], retained: Sequence[Fraction]) -> list[ast.Stmt]:
    """`memory M_B` and `memory M_W`, per stage where the stages differ."""
    stmts: list[ast.Stmt] = []
    for name, values in (("M_B", activation), ("M_W", retained)):
        index = "s" if len(set(values)) > 1 else None
        stmts.append(ast.Memory(name, index, ast.per_stage(tuple(values)), ast.GENERATED, ast.GENERATED))
    return stmts


def _recompute_statements(problem: SearchProblem) -> list[ast.Stmt]:
    """`recompute[s] = s == 0 ? 1 : ...` for the recomputed stages (none: nothing)."""
    stages = problem.memory.recompute
    if not stages:
        return []
    if len(stages) == problem.num_stages:
        return [ast.Recompute(None, None, ast.GENERATED)]
    marks = tuple(int(s in stages) for s in range(problem.num_stages))
    return [ast.Recompute("s", ast.per_stage(marks), ast.GENERATED)]


def _kept_input_statements(problem: SearchProblem) -> list[ast.Stmt]:
    """`memory M_I`: what a recomputed stage's F keeps (stages that do not
    recompute take the recomputed ones' first value; the language reads it only
    where `recompute` holds)."""
    kept = problem.memory.kept_input
    if not problem.memory.recompute:
        return []
    first = next(k for k in kept if k is not None)
    values = tuple(first if k is None else k for k in kept)
    index = "s" if len(set(values)) > 1 else None
    return [ast.Memory("M_I", index, ast.per_stage(values), ast.GENERATED, ast.GENERATED)]


def _round_up(x: float, digits: int) -> str:
    scale = 10**digits
    value = math.ceil(x * scale - 1e-9) / scale
    if value < x:
        value += 1 / scale
    return f"{value:.{digits}f}"


def emit_pp(
    problem: SearchProblem,
    orders: Sequence[Sequence[Pass]],
    *,
    name: str,
    command: str,
    method: str,
    bubble: float,
    makespan: float,
    peak: Fraction,
    beats: str | None = None,
    memory_note: str | None = None,
    notes: tuple[str, ...] = (),
) -> str:
    """The `.pp` text of `orders` (per device, in execution order). `memory_note`
    replaces the header's line on memory units; `notes` are more comment lines
    for the header (the exact engine's bound)."""
    pl = problem.placement
    v = problem.chunks_per_device
    chunk_of = {}
    for dev in range(pl.num_devices):
        for c, s in enumerate(pl.chunks(dev)):
            chunk_of[s] = c
    head = [
        f"# Found by: {command}",
        f"# Method: {method}.",
        f"# Measured: bubble {bubble:.4f}, makespan {makespan:g}, peak memory "
        f"{format_number(peak)} M_B per device (budget {format_number(problem.budget)}).",
        "# " + (memory_note or "Memory is in units of one 1F1B stage's activation "
                "(M_B = 1/v for v model stages per device; DualPipe holds two copies of its d)."),
    ]
    if beats:
        head.append(f"# {beats}")
    head += list(notes)
    bodies = [
        _device_order([(p.kind.value, p.microbatch, chunk_of[p.stage]) for p in order], v)
        for order in orders
    ]
    g = ast.GENERATED
    stmts: list[ast.Stmt] = [
        ast.Param("d", ast.number(pl.num_devices), g),
        ast.Param("m", ast.number(problem.num_microbatches), g),
        ast.place(pl.stage_device, pl.num_devices, pl.lanes),
        ast.Backward("split", g, g),
        *_recompute_statements(problem),
        *cost_statements(problem.costs),
        *memory_statements(problem.memory.activation, problem.memory.weight_retained),
        *_kept_input_statements(problem),
        ast.OrderDecl(_branches(bodies), g),
        ast.expect("peak_memory", "<=", ast.number(problem.budget)),
        ast.expect("bubble", "<=", ast.number(Fraction(_round_up(bubble, 4)))),
        ast.expect("makespan", "<=", ast.number(Fraction(_round_up(makespan, 3)))),
    ]
    module = ast.Module(name, tuple(stmts), "", g)
    return "\n".join(head) + "\n" + ast.format_module(module)
