"""A block-form file proven for a whole range of d at once, by integer linear
reasoning (CP-SAT), without enumerating instances (docs/testing.md).

What it decides, for every d in [d_low, d_high] and every m:

- collision-freedom: no two slots of a device overlap modulo the period, for
  any pair of microbatches (a repetition offset q of any size);
- dependencies: every pass starts strictly after each pass it needs (the
  zero-bubble paper's relation, `semantics.needs`), so sorting every pass by
  its start time is one global order that each device's order follows;
- each `expect peak_memory <= E` that holds for every device: a stage holds at
  most ceil(lifespan / T) microbatches (the controllable-memory paper, §3), from
  the start of its F to the end of its last backward pass, summed per device.

Each property is a question "is there a (d, device i, offset q) that breaks
it?", linear in those integers when every slot start is affine in s, i and d
(lets of such expressions included), the period and pass durations are
constants and the memory bound is affine in d: CP-SAT answers it, and an
infeasible question is a proof. The warm-up and cool-down step of
`frontend/blocks.py` keeps the block's dependencies and never raises its peak,
so the proof covers the compiled orders. Not decided here: deadlock-freedom of
the lowered programs, and `expect` bubble, idle, makespan and lifespan, and
bounds on one device: the enumeration (`--for`) checks them. An order form
is `symbolic_order`'s. A file outside this (`W fill`, a grouped block,
recomputation, a start that is not affine, a per-stage cost, a placement other
than parallel or vshape) is named as such with the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from fractions import Fraction
from math import lcm

from ppdsl.frontend import ast
from ppdsl.ir.schedule import Schedule
from ppdsl.semantics import NEEDS, PassKind

__all__ = ["SymbolicResult", "prove_block"]

Affine = dict[str, Fraction]
"""Coefficients of "1", "d" and "i"."""


@dataclass(frozen=True)
class SymbolicResult:
    """The answer of `prove_block`."""

    status: str
    """"proven"; "counterexample" (a collision, real for every m past the
    witness's); "unproven" (a sufficient condition fails at the witness: the
    enumeration decides); or "outside"."""
    d_low: int
    d_high: int
    proven: tuple[str, ...] = ()
    """The properties proven for every d in the range and every m."""
    not_decided: tuple[str, ...] = ()
    """What this check leaves to the enumeration."""
    reason: str = ""
    """Why the file is outside, or what the counterexample breaks."""
    counterexample: dict[str, int] = field(default_factory=dict)
    """d and the device i that break a property."""
    seconds: float = 0.0
    m_range: str = ""
    """The m proven (an order form's: its requires, the m range, the cap);
    empty for a block, proven for every m."""


class Outside(Exception):
    """The file is outside what the symbolic check decides."""


def _const(value: Fraction) -> Affine:
    return {"1": Fraction(value)}


def _add(a: Affine, b: Affine, sign: int = 1) -> Affine:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, Fraction(0)) + sign * v
    return out


def _scale(a: Affine, factor: Fraction) -> Affine:
    return {k: v * factor for k, v in a.items()}


def _constant_of(a: Affine) -> Fraction | None:
    return a.get("1", Fraction(0)) if all(v == 0 for k, v in a.items() if k != "1") else None


def affine(expr: ast.Expr, env: dict[str, Affine], lets: dict[str, ast.Expr]) -> Affine:
    """`expr` as an affine form over d and i, or Outside naming what is not."""
    if isinstance(expr, ast.Number):
        return _const(Fraction(expr.value))
    if isinstance(expr, ast.Name):
        if expr.id in env:
            return env[expr.id]
        if expr.id in lets:
            return affine(lets[expr.id], env, lets)
        raise Outside(f"{expr.span.line}:{expr.span.column}: '{expr.id}' is not a constant, "
                       "d, s, i or an affine let")
    if isinstance(expr, ast.Unary) and expr.op == "-":
        return _scale(affine(expr.operand, env, lets), Fraction(-1))
    if isinstance(expr, ast.Unary) and expr.op == "+":
        return affine(expr.operand, env, lets)
    if isinstance(expr, ast.Binary) and expr.op in ("+", "-"):
        left, right = affine(expr.left, env, lets), affine(expr.right, env, lets)
        return _add(left, right, 1 if expr.op == "+" else -1)
    if isinstance(expr, ast.Binary) and expr.op in ("*", "/"):
        left, right = affine(expr.left, env, lets), affine(expr.right, env, lets)
        k_right, k_left = _constant_of(right), _constant_of(left)
        if expr.op == "*" and k_right is not None:
            return _scale(left, k_right)
        if expr.op == "*" and k_left is not None:
            return _scale(right, k_left)
        if expr.op == "/" and k_right:
            return _scale(left, 1 / k_right)
    where = f"{expr.span.line}:{expr.span.column}" if getattr(expr, "span", None) else "?"
    raise Outside(f"{where}: '{ast.format_expr(expr)}' is not affine in s, i and d")


@dataclass(frozen=True)
class _Slot:
    kind: PassKind
    chunk: int
    start: Affine
    duration: Fraction


def _stage(chunk: int) -> Affine:
    """Stage of chunk c on device i: i (chunk 0), 2d - 1 - i (the V's chunk 1)."""
    if chunk == 0:
        return {"i": Fraction(1)}
    return {"d": Fraction(2), "1": Fraction(-1), "i": Fraction(-1)}


_ORDER_FORM = (
    "it is an order form, not a block: a block's questions are about start times (a slot's, "
    "affine in s, i and d, plus j*T); an order form's are about each device's order, which "
    "`symbolic_order.prove_order` decides"
)
"""Why `prove_block` leaves an order-form file to `symbolic_order`."""


def _slots(module: ast.Module, schedule: Schedule) -> tuple[list[_Slot], Fraction]:
    """The block's slots as affine forms per chunk, and the period."""
    block_decls = [s for s in module.stmts if isinstance(s, ast.BlockDecl)]
    if not block_decls:
        raise Outside(_ORDER_FORM)
    decl = block_decls[0]
    place = schedule.placement.kind
    if place not in ("parallel", "vshape"):
        raise Outside(f"placement {place}: only parallel and vshape are decided")
    if decl.group is not None:
        raise Outside("a grouped block (`group G every U`) is not decided")
    if schedule.memory.kept_input and any(x is not None for x in schedule.memory.kept_input):
        raise Outside("recomputed stages are not decided")
    lets = {s.name: s.value for s in module.stmts if isinstance(s, ast.Let)}
    constants: dict[str, Affine] = {}
    for name, value in schedule.params:
        if name not in ("d", "m") and name not in lets and isinstance(value, (int, Fraction)):
            constants[name] = _const(Fraction(value))
    durations: dict[PassKind, Fraction] = {}
    for placed in (schedule.block.slots if schedule.block else ()):
        if durations.setdefault(placed.kind, placed.duration) != placed.duration:
            raise Outside(f"{placed.kind.value} lasts differently on different stages")
    for kind, value in durations.items():
        constants[f"T_{kind.value}"] = _const(value)
    chunks = 2 if place == "vshape" else 1
    period = _constant_of(affine(decl.period, constants, lets))
    if period is None:
        raise Outside("the period depends on d")
    found: dict[tuple[PassKind, int], _Slot] = {}
    for line in decl.lines:
        if isinstance(line, ast.Fill):
            raise Outside("`W fill` places W greedily, not by an affine slot")
        targets = [line.chunk] if isinstance(line.chunk, int) else list(range(chunks))
        for c in targets:
            env = {**constants, "d": {"d": Fraction(1)}, "i": {"i": Fraction(1)},
                   "s": _stage(c), "c": _const(Fraction(c))}
            if isinstance(line.chunk, str):
                env[line.chunk] = _const(Fraction(c))
            for slot in line.slots:
                kind = PassKind(slot.kind)
                key = (kind, c)
                if key in found and isinstance(line.chunk, int) is False:
                    continue  # a numbered chunk's own line wins over a general one
                found[key] = _Slot(kind, c, affine(slot.start, env, lets), durations[kind])
    return list(found.values()), period


def _bounds(module: ast.Module, schedule: Schedule) -> tuple[list[tuple[Affine, str]], list[str]]:
    """The `expect peak_memory <= E` bounds on every device (E affine in d, in
    units of M_B), and the expectations left undecided."""
    lets = {s.name: s.value for s in module.stmts if isinstance(s, ast.Let)}
    activation = set(schedule.memory.activation)
    if len(activation) != 1:
        raise Outside("M_B differs between stages")
    unit = activation.pop()
    env = {"M_B": _const(unit), "M_W": _const(schedule.memory.weight_retained[0]),
           "d": {"d": Fraction(1)}}
    bounds, left = [], []
    for stmt in module.stmts:
        if not isinstance(stmt, ast.ExpectDecl):
            continue
        if stmt.metric == "peak_memory" and stmt.device is None and stmt.op in ("<=", "<"):
            try:
                bound = _scale(affine(stmt.bound, env, lets), 1 / unit)
            except Outside:
                left.append(f"expect {stmt.text}")
                continue
            if stmt.op == "<":
                bound = _add(bound, _const(Fraction(-1, 10**6)))
            bounds.append((bound, f"peak_memory {stmt.op} {ast.format_expr(stmt.bound)}"))
        else:
            left.append(f"expect {stmt.metric}{'[..]' if stmt.device else ''} {stmt.op} "
                        f"{ast.format_expr(stmt.bound)}")
    return bounds, left


class _Model:
    """One CP-SAT question over d in [low, high], device i in [0, d - 1]."""

    def __init__(self, low: int, high: int, scale: int):
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.model = cp_model.CpModel()
        self.d = self.model.new_int_var(low, high, "d")
        self.i = self.model.new_int_var(0, high - 1, "i")
        self.model.add(self.i <= self.d - 1)
        self.scale = scale

    def expr(self, a: Affine, i_shift: int = 0):
        """`a` scaled to integers, at device i + i_shift."""
        coef = {k: v * self.scale for k, v in a.items()}
        for v in coef.values():
            assert v.denominator == 1
        return (int(coef.get("1", 0)) + int(coef.get("d", 0)) * self.d
                + int(coef.get("i", 0)) * (self.i + i_shift))

    def solve(self, extra: dict | None = None) -> dict[str, int] | None:
        """A witness (d, i and the `extra` variables) of the question, or None
        when there is none (a proof)."""
        solver = self.cp.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.max_time_in_seconds = 30.0
        status = solver.solve(self.model)
        if status in (self.cp.OPTIMAL, self.cp.FEASIBLE):
            found = {"d": solver.value(self.d), "i": solver.value(self.i)}
            return found | {k: solver.value(v) for k, v in (extra or {}).items()}
        if status != self.cp.INFEASIBLE:
            raise Outside("CP-SAT could not decide a question within 30 s")
        return None


def _scale_of(slots: list[_Slot], period: Fraction, bounds) -> int:
    denominators = [period.denominator]
    for s in slots:
        denominators += [v.denominator for v in s.start.values()] + [s.duration.denominator]
    for bound, _ in bounds:
        denominators += [v.denominator for v in bound.values()]
    return lcm(*denominators)


def _collision(slots, period, low, high, scale) -> tuple[dict, str] | None:
    for n, a in enumerate(slots):
        for b in slots[n:]:
            m = _Model(low, high, scale)
            spread = sum(abs(v) for v in _add(a.start, b.start, -1).values()) * (high + 1)
            reach = int(spread / period) + 2 + int((a.duration + b.duration) / period)
            q = m.model.new_int_var(-reach, reach, "q")
            if a is b:
                m.model.add(q != 0)
            t = int(period * scale)
            xa, xb = m.expr(a.start), m.expr(b.start)
            m.model.add(xa + t * q < xb + int(b.duration * scale))
            m.model.add(xb < xa + t * q + int(a.duration * scale))
            hit = m.solve(extra={"q": q})
            if hit is not None:
                hit["m"] = abs(hit.pop("q")) + 1
                return hit, (f"{a.kind.value} of chunk {a.chunk} and {b.kind.value} of chunk "
                             f"{b.chunk} collide on device i = {hit['i']}, microbatches "
                             f"{hit['m'] - 1} apart")
    return None


def need_cases(placement: str, chunk: int, offset: int) -> list[tuple[int, int, str]]:
    """Where the pass at stage s + offset sits, seen from chunk `chunk` on device
    i: (its chunk, its device minus i, "range" when it exists only for some i,
    "turn" when it is the V's other chunk on the last device)."""
    if offset == 0:
        return [(chunk, 0, "same")]
    if chunk == 0:
        cases = [(0, offset, "range")]
        if placement == "vshape" and offset == 1:  # stage d - 1 needs stage d (chunk 1)
            cases.append((1, 0, "turn"))
        return cases
    cases = [(1, -offset, "range")]
    if offset == -1:  # stage d (chunk 1 on device d - 1) needs stage d - 1 (chunk 0)
        cases.append((0, 0, "turn"))
    return cases


def _dependencies(slots, placement, low, high, scale) -> tuple[dict, str] | None:
    at = {(s.kind, s.chunk): s for s in slots}
    for (kind, chunk), slot in at.items():
        for need in NEEDS[kind]:
            for need_chunk, shift, how in need_cases(placement, chunk, need.stage_offset):
                other = at.get((need.kind, need_chunk))
                if other is None:
                    if need.optional:
                        continue
                    raise Outside(f"no slot for {need.kind.value} of chunk {need_chunk}")
                m = _Model(low, high, scale)
                if how == "turn":
                    m.model.add(m.i == m.d - 1)
                elif how == "range":
                    m.model.add(m.i + shift >= 0)
                    m.model.add(m.i + shift <= m.d - 1)
                m.model.add(m.expr(other.start, shift) >= m.expr(slot.start))
                hit = m.solve()
                if hit is not None:
                    return hit, (f"{kind.value} of chunk {chunk} does not start after the "
                                 f"{need.kind.value} it needs on device i = {hit['i']}")
    return None


def _memory(slots, bounds, period, low, high, scale) -> tuple[dict, str] | None:
    by_chunk: dict[int, list[_Slot]] = {}
    for s in slots:
        by_chunk.setdefault(s.chunk, []).append(s)
    t = int(period * scale)
    for bound, text in bounds:
        m = _Model(low, high, scale)
        held = []
        for chunk, chunk_slots in by_chunk.items():
            forward = next(s for s in chunk_slots if s.kind is PassKind.F)
            life = m.model.new_int_var(-10**12, 10**12, f"life{chunk}")
            ends = []
            for s in chunk_slots:
                if s.kind in (PassKind.W, PassKind.BW, PassKind.B):
                    ends.append(m.expr(s.start) + int(s.duration * scale) - m.expr(forward.start))
            m.model.add_max_equality(life, ends)
            n = m.model.new_int_var(0, 10**9, f"held{chunk}")
            m.model.add(n * t >= life)
            m.model.add(n * t <= life + t - 1)
            held.append(n)
        # sum held > bound  (bound in units of M_B, scaled)
        m.model.add(scale * sum(held) > m.expr(bound))
        hit = m.solve()
        if hit is not None:
            return hit, (f"{text}: the lifespans' bound (ceil(lifespan / T) per stage, "
                         f"summed per device) exceeds it at device i = {hit['i']}; the peak "
                         "itself may not")
    return None


def prove_block(module: ast.Module, schedule: Schedule, d_low: int, d_high: int) -> SymbolicResult:
    """Decide the block of `module` (elaborated once as `schedule`, at any d) for
    every d in [d_low, d_high] and every m: proven, a counterexample, a property
    it cannot prove (with its witness d and device i), or outside."""
    start = time.monotonic()
    undecided = ["deadlock-freedom of the lowered programs"]
    try:
        slots, period = _slots(module, schedule)
        bounds, left = _bounds(module, schedule)
        undecided += left
        scale = _scale_of(slots, period, bounds)
        checks = (
            ("collision-freedom", lambda: _collision(slots, period, d_low, d_high, scale)),
            ("dependencies", lambda: _dependencies(slots, schedule.placement.kind, d_low, d_high,
                                                   scale)),
            *((text, (lambda b=b, text=text: _memory(slots, [(b, text)], period, d_low, d_high,
                                                      scale))) for b, text in bounds),
        )
        proven: list[str] = []
        for name, check in checks:
            hit = check()
            if hit is not None:
                status = "counterexample" if name == "collision-freedom" else "unproven"
                return SymbolicResult(status, d_low, d_high, tuple(proven),
                                      tuple(undecided), hit[1], hit[0],
                                      time.monotonic() - start)
            proven.append(name)
    except Outside as why:
        return SymbolicResult("outside", d_low, d_high, reason=str(why),
                              seconds=time.monotonic() - start)
    return SymbolicResult("proven", d_low, d_high, tuple(proven), tuple(undecided),
                          seconds=time.monotonic() - start)
