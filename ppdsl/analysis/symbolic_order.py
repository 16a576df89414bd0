"""An order-form file proven for a whole range of d and m at once, by integer
linear reasoning (Fourier-Motzkin, CP-SAT for witnesses), without enumerating
instances (docs/testing.md).

The fragment decided: a parallel or V-shape placement, and an `order` whose
statements are pass calls, `if`s and `for` loops over `a..b`, with a and b
affine in d, i and m, each loop's body pass calls under `if`s (no nested
loop); a condition is a comparison of affine forms (the loop variable's
coefficient 1 or -1), or an `and` of them; a call's microbatch is affine in the
loop variable, d, i and m, its chunk a constant. ZB-V's order
(`examples/zb_v.pp`) is one.

In that fragment a call runs on an interval of its loop's iterations,
[max(a, lower bounds), min(b, upper bounds)), when its conditions free of the
loop variable hold; so how many passes precede the call's pass in iteration x
is a sum of max(0, min(x, hi) - lo) over the calls: the per-device sequences
are piecewise affine in d, i, m and x. Each min and max is split into its
linear cases (`Pieces`), the cases that cannot occur dropped, and each property
becomes finitely many questions "is there an integer point (d, device i, m,
iterations) that breaks it?". Fourier-Motzkin elimination in exact rationals,
each inequality tightened to integers, answers most: an empty result proves
there is none, for every d in [d_low, d_high] and every m the file's
`require`s and the m range allow, with no bound on m. Where it leaves a point,
CP-SAT looks for an integer witness with m <= `M_CAP` (finding none, the proof
is stated up to `M_CAP`). The properties:

- each pass once: for each pass kind and chunk, every call's microbatches lie
  in [0, m), no two iterations give one microbatch, and the calls' iteration
  counts sum to m;
- dependencies: a potential a * position + b * device (a, b small integers
  read off one instance) strictly increases along every dependency of
  `semantics.NEEDS`; it also increases along each device's order, so sorting
  every pass by it is one global order that every device follows (ZB-V's is
  position + i);
- each `expect peak_memory <= E` on every device, E affine in d and m: the
  memory after each pass that allocates (a prefix sum of
  `semantics.MEMORY_COEFFICIENTS`' deltas, itself piecewise affine) is at most E.

A witness that breaks the first or the last, or a dependency between two
passes of one device, is a counterexample: the instance (d, m) is invalid. A
dependency across devices that the potential does not order is not proven
(the potential is a sufficient condition): the witness's instance is checked
concretely by the caller. Not decided here, as for blocks: deadlock-freedom of
the lowered programs, and `expect`s other than `peak_memory <=` on every device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction
from math import gcd, lcm
from typing import Any

from ppdsl.analysis.symbolic import Affine, Outside, SymbolicResult, affine, need_cases
from ppdsl.frontend import ast
from ppdsl.ir.schedule import Schedule
from ppdsl.semantics import MEMORY_COEFFICIENTS, NEEDS, PassKind, needs, pass_kinds

__all__ = ["M_CAP", "prove_order"]

M_CAP = 2**40
"""The largest m proven: CP-SAT works on bounded integers; an instance past it
would hold more than 10^13 passes."""

_BIG = 2**48  # the bound of every derived integer (positions reach about 6 * M_CAP)

_POTENTIALS = ((1, 1), (2, 1), (1, 0), (2, -1), (1, -1), (1, 2), (3, 1), (3, 2), (3, -1))
"""Candidate potentials (a, b): a * position + b * device, tried in turn."""


@dataclass(frozen=True)
class _Call:
    """One pass call of the order, with the conditions around it."""

    kind: PassKind
    chunk: int
    microbatch: Affine
    """Over "t" (the loop variable), "d", "i", "m" and "1"."""
    lows: tuple[Affine, ...]
    """t >= each."""
    highs: tuple[Affine, ...]
    """t < each."""
    flags: tuple[Affine, ...]
    """Each >= 0: the conditions free of t."""
    text: str


@dataclass(frozen=True)
class _Segment:
    """A loop over t in [start, stop) (a call outside loops: [0, 1))."""

    start: Affine
    stop: Affine
    calls: tuple[_Call, ...]


@dataclass(frozen=True)
class _Program:
    segments: tuple[_Segment, ...]
    chunks: int
    placement: str
    m_rules: tuple[Affine, ...]
    """Each >= 0 over d and m: the requires and the m range."""
    m_text: str


@dataclass
class _Env:
    """What expressions of the file may name, as affine forms."""

    names: dict[str, Affine]
    lets: dict[str, ast.Expr]

    def form(self, expr: ast.Expr, **extra: Affine) -> Affine:
        found = affine(expr, {**self.names, **extra}, self.lets)
        if any(v.denominator != 1 for v in found.values()):
            raise Outside(f"{_where(expr)}: '{ast.format_expr(expr)}' has a fractional "
                          "coefficient")
        return {k: v for k, v in found.items() if v}


def _where(node: Any) -> str:
    span = getattr(node, "span", None)
    return f"{span.line}:{span.column}" if span is not None else "?"


def _call_text(call: ast.PassCall) -> str:
    """`line:col: F(k, 0)`, how a finding names a call."""
    args = ", ".join(ast.format_expr(a) for a in call.args)
    return f"{call.span.line}:{call.span.column}: {call.kind}({args})"


def _sub(a: Affine, b: Affine) -> Affine:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, Fraction(0)) - v
    return {k: v for k, v in out.items() if v}


_ONE = {"1": Fraction(1)}


def _comparisons(cond: ast.Expr, env: _Env, wanted: bool, **extra: Affine) -> list[Affine]:
    """`cond` (or its negation, `wanted` False) as a conjunction of forms >= 0."""
    if isinstance(cond, ast.Unary) and cond.op == "not":
        return _comparisons(cond.operand, env, not wanted, **extra)
    if isinstance(cond, ast.Binary) and cond.op in ("and", "or"):
        if (cond.op == "and") == wanted:
            return (_comparisons(cond.left, env, wanted, **extra)
                    + _comparisons(cond.right, env, wanted, **extra))
        raise Outside(f"{_where(cond)}: a condition that is a disjunction "
                      f"('{ast.format_expr(cond)}'{'' if wanted else ' false'}) is not decided")
    if isinstance(cond, ast.Binary) and cond.op in ("<", "<=", ">", ">=", "==", "!="):
        left, right = env.form(cond.left, **extra), env.form(cond.right, **extra)
        op = cond.op if wanted else {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=",
                                     "!=": "=="}[cond.op]
        if op == "<":
            return [_sub(_sub(right, left), _ONE)]
        if op == "<=":
            return [_sub(right, left)]
        if op == ">":
            return [_sub(_sub(left, right), _ONE)]
        if op == ">=":
            return [_sub(left, right)]
        if op == "==":
            return [_sub(left, right), _sub(right, left)]
        raise Outside(f"{_where(cond)}: '{ast.format_expr(cond)}'{'' if wanted else ' false'} "
                      "is a disjunction, not decided")
    raise Outside(f"{_where(cond)}: the condition '{ast.format_expr(cond)}' is not a "
                  "comparison of affine forms")


def _calls(body: tuple[ast.OrderStmt, ...], env: _Env, var: str | None, guards: list[Affine],
           schedule: Schedule, chunks: int) -> list[_Call]:
    t_form = {var: {"t": Fraction(1)}} if var else {}
    out: list[_Call] = []
    kinds = pass_kinds(schedule.split_backward)
    for stmt in body:
        if isinstance(stmt, ast.If):
            cond_then = _comparisons(stmt.cond, env, True, **t_form)
            out += _calls(stmt.then, env, var, guards + cond_then, schedule, chunks)
            if stmt.else_:
                cond_else = _comparisons(stmt.cond, env, False, **t_form)
                out += _calls(stmt.else_, env, var, guards + cond_else, schedule, chunks)
            continue
        if not isinstance(stmt, ast.PassCall):
            what = {ast.For: "a loop inside a loop", ast.Repeat: "`repeat`",
                    ast.Interleave: "`interleave`", ast.Overlap: "an overlapped F&B",
                    ast.Let: "a `let` inside the order"}.get(type(stmt), type(stmt).__name__)
            raise Outside(f"{_where(stmt)}: {what} is not decided")
        kind = next((k for k in kinds if k.value == stmt.kind), None)
        if kind is None:
            raise Outside(f"{_where(stmt)}: {stmt.kind} is not a pass of this schedule")
        chunk = 0
        if len(stmt.args) == 2:
            value = env.form(stmt.args[1], **t_form)
            if set(value) - {"1"}:
                raise Outside(f"{_where(stmt)}: a chunk that is not a constant is not decided")
            chunk = int(value.get("1", 0))
        if not 0 <= chunk < chunks:
            raise Outside(f"{_where(stmt)}: chunk {chunk} is not one of this device's")
        lows, highs, flags = [], [], []
        for g in guards:
            coef = g.get("t", Fraction(0))
            rest = {k: v for k, v in g.items() if k != "t"}
            if coef == 0:
                flags.append(g)
            elif coef == 1:  # t + rest >= 0
                lows.append(_sub({}, rest))
            elif coef == -1:  # rest - t >= 0: t < rest + 1
                highs.append({**rest, "1": rest.get("1", Fraction(0)) + 1})
            else:
                raise Outside(f"{_where(stmt)}: a condition with the loop variable's "
                              f"coefficient {coef} is not decided")
        out.append(_Call(kind, chunk, env.form(stmt.args[0], **t_form), tuple(lows),
                         tuple(highs), tuple(flags),
                         _call_text(stmt)))
    return out


def _program(module: ast.Module, schedule: Schedule,
             m_range: tuple[ast.Expr, ast.Expr] | None) -> _Program:
    """The order as segments of guarded calls, or Outside naming what is not decided."""
    orders = [s for s in module.stmts if isinstance(s, ast.OrderDecl)]
    if not orders:
        raise Outside("it has no order form")
    place = schedule.placement.kind
    if place not in ("parallel", "vshape"):
        raise Outside(f"placement {place}: only parallel and vshape are decided")
    if schedule.memory.kept_input and any(x is not None for x in schedule.memory.kept_input):
        raise Outside("recomputed stages are not decided")
    if schedule.memory.follows_tokens:
        raise Outside("memory that follows the microbatch's tokens is not decided")
    lets = {s.name: s.value for s in module.stmts if isinstance(s, ast.Let)}
    names: dict[str, Affine] = {"d": {"d": Fraction(1)}, "i": {"i": Fraction(1)},
                                "m": {"m": Fraction(1)}}
    # a param other than d and m is a constant only where its default is one
    # (`param v = 2`): one that follows d (`param v = d / 2`) is left unbound
    literal = {s.name for s in module.stmts if isinstance(s, ast.Param)
               and isinstance(s.default, ast.Number)}
    for name, value in schedule.params:
        if (name in literal and name not in ("d", "m", *lets)
                and isinstance(value, (int, Fraction))):
            names[name] = {"1": Fraction(value)}
    env = _Env(names, lets)
    chunks = 2 if place == "vshape" else 1
    segments = []
    for line in orders[0].body:
        if isinstance(line, ast.For):
            if not isinstance(line.range, ast.SpanRange):
                raise Outside(f"{_where(line)}: a loop over `reversed(..)` or `chunks` is not "
                              "decided (only a..b)")
            start, stop = env.form(line.range.start), env.form(line.range.stop)
            calls = _calls(line.body, env, line.var, [], schedule, chunks)
            segments.append(_Segment(start, stop, tuple(calls)))
        else:
            calls = _calls((line,), env, None, [], schedule, chunks)
            segments.append(_Segment({}, _ONE, tuple(calls)))
    rules: list[Affine] = []
    texts: list[str] = []
    for stmt in module.stmts:
        if isinstance(stmt, ast.Require):
            rules += _comparisons(stmt.cond, env, True)
            texts.append(ast.format_expr(stmt.cond))
    if m_range is not None:
        low, high = env.form(m_range[0]), env.form(m_range[1])
        rules += [_sub({"m": Fraction(1)}, low), _sub(high, {"m": Fraction(1)})]
        texts.append(f"{ast.format_expr(m_range[0])} <= m <= {ast.format_expr(m_range[1])}")
    for rule in rules:
        if set(rule) - {"1", "d", "m"}:
            raise Outside("a require or m range that names more than d and m is not decided")
    return _Program(tuple(segments), chunks, place, tuple(rules), ", ".join(texts) or "m >= 1")


_VARS = ("d", "i", "m", "t", "u")
Form = tuple[int, ...]
"""A normalized integer form: its coefficients of `_VARS`, then its constant; read as >= 0."""


def _normal(a: Affine) -> Form | None:
    """`a >= 0` over the integers, scaled to coprime integer coefficients with
    the constant rounded down (a valid tightening for integer points); None
    when it holds trivially; (0, ..., -1) when it is false."""
    scale = lcm(*(v.denominator for v in a.values())) if a else 1
    coef = [int(a.get(k, 0) * scale) for k in _VARS]
    const = a.get("1", Fraction(0)) * scale
    g = gcd(*coef)
    if g == 0:
        return None if const >= 0 else (0,) * len(_VARS) + (-1,)
    return (*(c // g for c in coef), int(const // g))


def _shadow_infeasible(forms: list[Form]) -> bool:
    """True when no rational point (after each step's integer tightening)
    meets every form: Fourier-Motzkin elimination, exact, with no bound on any
    variable. False when some point may (or the system grows past 4000 forms)."""
    width = len(_VARS)
    current: dict[tuple[int, ...], int] = {}

    def put(coef: tuple[int, ...], const: int, into: dict[tuple[int, ...], int]) -> bool:
        g = gcd(*coef)
        if g == 0:
            return const >= 0
        coef = tuple(c // g for c in coef)
        const = const // g
        if coef not in into or const < into[coef]:
            into[coef] = const
        return True

    for f in forms:
        if not put(f[:width], f[width], current):
            return True
    alive = set(range(width))
    while alive:
        best, cost = -1, -1
        for v in alive:
            p = sum(1 for c in current if c[v] > 0)
            n = sum(1 for c in current if c[v] < 0)
            if best < 0 or p * n < cost:
                best, cost = v, p * n
        alive.discard(best)
        v = best
        upper = [(c, k) for c, k in current.items() if c[v] < 0]
        lower = [(c, k) for c, k in current.items() if c[v] > 0]
        nxt: dict[tuple[int, ...], int] = {}
        for c, k in current.items():
            if c[v] == 0:
                put(c, k, nxt)
        for cl, kl in lower:
            for cu, ku in upper:
                a, b = -cu[v], cl[v]
                coef = tuple(a * x + b * y for x, y in zip(cl, cu, strict=True))
                if not put(coef, a * kl + b * ku, nxt):
                    return True
        if len(nxt) > 4000:
            return False
        current = nxt
    return False


Pieces = list[tuple[tuple[Form, ...], Affine]]
"""A piecewise-affine value: (conditions, value) pairs that cover the context."""


class _Solver:
    """The questions' one place: exact infeasibility by Fourier-Motzkin, then
    CP-SAT for an integer witness (m up to `M_CAP`)."""

    def __init__(self, program: _Program, low: int, high: int):
        self.program = program
        self.low, self.high = low, high
        self.base: list[Form] = [f for f in map(_normal, (
            {"d": Fraction(1), "1": Fraction(-low)}, {"d": Fraction(-1), "1": Fraction(high)},
            {"i": Fraction(1)}, {"d": Fraction(1), "i": Fraction(-1), "1": Fraction(-1)},
            {"m": Fraction(1), "1": Fraction(-1)}, *program.m_rules)) if f is not None]
        self.questions = 0
        self.capped = False
        self._cache: dict[frozenset[Form], bool] = {}
        self.earlier: dict[tuple[int, int, tuple], Pieces] = {}
        """`_View.earlier`'s, per (shift, loop, weights)."""

    def possible(self, forms: list[Form]) -> bool:
        """False when the forms have no point (proven); True when they may."""
        key = frozenset(forms)
        if key not in self._cache:
            self._cache[key] = not _shadow_infeasible(list(key))
        return self._cache[key]

    def prune(self, pieces: Pieces, context: list[Form]) -> Pieces:
        return [(cond, value) for cond, value in pieces if self.possible(context + list(cond))]

    def witness(self, forms: list[Form]) -> dict[str, int] | None:
        """An integer point of `forms` (the smallest d, then m, found), or None:
        none with m <= M_CAP (proven by Fourier-Motzkin for every m when it can)."""
        self.questions += 1
        if not self.possible(forms):
            return None
        from ortools.sat.python import cp_model

        model = cp_model.CpModel()
        v = {"d": model.new_int_var(self.low, self.high, "d"),
             "i": model.new_int_var(0, self.high, "i"),
             "m": model.new_int_var(1, M_CAP, "m"),
             "t": model.new_int_var(-_BIG, _BIG, "t"), "u": model.new_int_var(-_BIG, _BIG, "u")}
        for f in forms:
            model.add(sum(c * v[k] for c, k in zip(f, _VARS, strict=False) if c) + f[-1] >= 0)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.max_time_in_seconds = 10.0
        status = solver.solve(model)
        if status == cp_model.INFEASIBLE:
            self.capped = True
            return None
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise Outside("CP-SAT could not decide a question within 10 s")
        found = {k: solver.value(x) for k, x in v.items()}
        model.minimize(v["d"] * (M_CAP + 1) + v["m"])
        solver.parameters.max_time_in_seconds = 5.0
        if solver.solve(model) in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            found = {k: solver.value(x) for k, x in v.items()}
        return found


def _at(a: Affine, shift: int, var: str) -> Affine:
    """A form of the program at device i + shift, its loop variable named `var`."""
    out = {k: v for k, v in a.items() if k != "t"}
    if shift and a.get("i"):
        out["1"] = out.get("1", Fraction(0)) + shift * a["i"]
    if a.get("t"):
        out[var] = a["t"]
    return out


def _add(a: Affine, b: Affine, factor: int = 1) -> Affine:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, Fraction(0)) + factor * v
    return {k: v for k, v in out.items() if v}


class _View:
    """Device i + shift's order, its loop variable named `var`."""

    def __init__(self, solver: _Solver, shift: int, var: str):
        self.solver = solver
        self.shift, self.var = shift, var
        self.segments = solver.program.segments
        self.context: list[Form] = []
        if shift:
            self.context = [f for f in (_normal({"i": Fraction(1), "1": Fraction(shift)}),
                                        _normal({"d": Fraction(1), "i": Fraction(-1),
                                                 "1": Fraction(-1 - shift)})) if f is not None]

    def form(self, a: Affine) -> Affine:
        return _at(a, self.shift, self.var)

    def ends(self, key: tuple[int, int]) -> tuple[list[Affine], list[Affine], list[Affine]]:
        """The call's interval's lower and upper ends (it runs for max(lows) <= x <
        min(highs)), and its conditions free of x."""
        segment = self.segments[key[0]]
        call = segment.calls[key[1]]
        lows = [self.form(segment.start), *map(self.form, call.lows)]
        highs = [self.form(segment.stop), *map(self.form, call.highs)]
        return lows, highs, [self.form(f) for f in call.flags]

    def runs(self, key: tuple[int, int]) -> list[Form]:
        """That the call runs in iteration `var`."""
        lows, highs, flags = self.ends(key)
        x = {self.var: Fraction(1)}
        forms = [_add(x, lo, -1) for lo in lows]
        forms += [_add(_add(h, x, -1), _ONE, -1) for h in highs]
        return [f for f in map(_normal, forms + flags) if f is not None]

    def count(self, key: tuple[int, int], upto: Affine | None, context: list[Form]) -> Pieces:
        """How many iterations before `upto` (None: all) the call runs in, as pieces."""
        lows, highs, flags = self.ends(key)
        if upto is not None:
            highs = [*highs, upto]
        pieces: Pieces = []
        for n, high in enumerate(highs):
            least = [_normal(_add(h, high, -1)) for k, h in enumerate(highs) if k != n]
            for k, low in enumerate(lows):
                most = [_normal(_add(low, lo, -1)) for j, lo in enumerate(lows) if j != k]
                span = _add(high, low, -1)
                cond = tuple(f for f in (*least, *most) if f is not None)
                pieces.append((cond + tuple(_some(_normal(span))), span))
                pieces.append((cond + tuple(_some(_normal(_add({}, _add(span, _ONE), -1)))), {}))
        if flags:
            on = tuple(f for f in map(_normal, flags) if f is not None)
            pieces = [(cond + on, value) for cond, value in pieces]
            for n, flag in enumerate(flags):
                off = _normal(_add({}, _add(flag, _ONE), -1))
                pieces.append((tuple(f for f in (*map(_normal, flags[:n]), off)
                                     if f is not None), {}))
        return self.solver.prune(pieces, context)

    def before(self, key: tuple[int, int], weight: dict[PassKind, int],
               context: list[Form]) -> Pieces:
        """The passes before the call's in iteration `var` (each weighted by its
        kind's `weight`), as pieces."""
        n, k = key
        total = self.earlier(n, weight)
        x = {self.var: Fraction(1)}
        for c, call in enumerate(self.segments[n].calls):
            if weight[call.kind]:
                upto = x if c >= k else _add(x, _ONE)
                part = self.count((n, c), upto, context)
                total = _sum(self.solver, total, part, weight[call.kind], context)
        return total

    def earlier(self, n: int, weight: dict[PassKind, int]) -> Pieces:
        """The passes of the loops before loop n, weighted (free of the loop
        variable: worked out once per device shift, under the view's context)."""
        cache = self.solver.earlier
        key = (self.shift, n, tuple(sorted(weight.items())))
        if key not in cache:
            context = self.solver.base + self.context
            total: Pieces = [((), {})] if n == 0 else self.earlier(n - 1, weight)
            if n > 0:
                for c, call in enumerate(self.segments[n - 1].calls):
                    if weight[call.kind]:
                        part = self.count((n - 1, c), None, context)
                        total = _sum(self.solver, total, part, weight[call.kind], context)
            cache[key] = total
        return cache[key]


def _some(f: Form | None) -> list[Form]:
    return [] if f is None else [f]


def _sum(solver: _Solver, a: Pieces, b: Pieces, factor: int, context: list[Form]) -> Pieces:
    """a + factor * b, piece by piece, the impossible combinations dropped."""
    out: Pieces = []
    for cond_a, value_a in a:
        for cond_b, value_b in b:
            cond = tuple(dict.fromkeys(cond_a + cond_b))
            if (len(a) > 1 or len(b) > 1) and not solver.possible(context + list(cond)):
                continue
            out.append((cond, _add(value_a, value_b, factor)))
    return out


def _memory_forms(schedule: Schedule, bound: Affine) -> tuple[dict[PassKind, int], Affine]:
    """Each kind's memory delta and the bound, scaled to integers."""
    activation, retained = set(schedule.memory.activation), set(schedule.memory.weight_retained)
    if len(activation) != 1 or len(retained) != 1:
        raise Outside("M_B or M_W differs between stages")
    m_b, m_w = Fraction(activation.pop()), Fraction(retained.pop())
    deltas = {k: a * m_b + w * m_w for k, (a, w, _) in MEMORY_COEFFICIENTS.items()}
    scale = lcm(*(v.denominator for v in (*deltas.values(), *bound.values())))
    return ({k: int(v * scale) for k, v in deltas.items()},
            {k: v * scale for k, v in bound.items()})


def _bounds(module: ast.Module, schedule: Schedule, env_names: dict[str, Affine],
            lets: dict[str, ast.Expr]) -> tuple[list[tuple[Affine, str]], list[str]]:
    """The `expect peak_memory <= E` on every device (E affine in d and m), and
    the expectations left undecided."""
    activation = set(schedule.memory.activation)
    weight = set(schedule.memory.weight_retained)
    names = {**env_names}
    if len(activation) == 1 and len(weight) == 1:
        names |= {"M_B": {"1": Fraction(activation.pop())},
                  "M_W": {"1": Fraction(weight.pop())}}
    bounds, left = [], []
    for stmt in module.stmts:
        if not isinstance(stmt, ast.ExpectDecl):
            continue
        text = f"peak_memory {stmt.op} {ast.format_expr(stmt.bound)}"
        if stmt.metric == "peak_memory" and stmt.device is None and stmt.op in ("<=", "<"):
            try:
                bound = {k: v for k, v in affine(stmt.bound, names, lets).items()
                         if k in ("1", "d", "m")}
            except Outside:
                left.append(f"expect {stmt.text}")
                continue
            if stmt.op == "<":
                bound = _sub(bound, {"1": Fraction(1, 10**6)})
            bounds.append((bound, text))
        else:
            where = "[..]" if stmt.device is not None else ""
            left.append(f"expect {stmt.metric}{where} {stmt.op} {ast.format_expr(stmt.bound)}")
    return bounds, left


@dataclass
class _Finding:
    exact: bool
    witness: dict[str, int]
    reason: str


class _Prover:
    """The properties' questions over one program."""

    def __init__(self, program: _Program, low: int, high: int):
        self.program = program
        self.solver = _Solver(program, low, high)

    def keys(self):
        for n, segment in enumerate(self.program.segments):
            for k, call in enumerate(segment.calls):
                yield (n, k), call

    def _any(self, context: list[Form], pieces: Pieces, violated) -> dict[str, int] | None:
        """A witness of some piece whose value breaks `violated(value)` (a form >= 0)."""
        for cond, value in pieces:
            forms = context + list(cond) + _some(_normal(violated(value)))
            found = self.solver.witness(list(forms))
            if found is not None:
                return found
        return None

    def each_pass_once(self, schedule: Schedule) -> _Finding | None:
        """Every call's microbatches in [0, m), none twice, m in all."""
        groups: dict[tuple[PassKind, int], list[tuple[tuple[int, int], _Call]]] = {}
        for key, call in self.keys():
            groups.setdefault((call.kind, call.chunk), []).append((key, call))
        for kind in pass_kinds(schedule.split_backward):
            for chunk in range(self.program.chunks):
                group = groups.get((kind, chunk), [])
                found = (self._outside_range(group) or self._twice(group)
                         or self._count(kind, chunk, group))
                if found is not None:
                    return found
        return None

    def _outside_range(self, group) -> _Finding | None:
        view = _View(self.solver, 0, "t")
        for key, call in group:
            j = view.form(call.microbatch)
            for wrong in (_add(_add({}, j, -1), _ONE, -1), _add(j, {"m": Fraction(1)}, -1)):
                forms = self.solver.base + view.runs(key) + _some(_normal(wrong))
                hit = self.solver.witness(list(forms))
                if hit is not None:
                    return _Finding(True, hit, f"{call.text} runs microbatch "
                                               f"{_value(j, hit)}, outside 0..m - 1, on "
                                               f"device i = {hit['i']}")
        return None

    def _twice(self, group) -> _Finding | None:
        first, second = _View(self.solver, 0, "t"), _View(self.solver, 0, "u")
        for a, (key_a, call_a) in enumerate(group):
            for key_b, call_b in group[a:]:
                if key_a == key_b and call_a.microbatch.get("t"):
                    continue  # an affine microbatch with t in it never repeats
                same = _add(first.form(call_a.microbatch), second.form(call_b.microbatch), -1)
                forms = [*self.solver.base, *first.runs(key_a), *second.runs(key_b),
                         *_some(_normal(same)), *_some(_normal(_add({}, same, -1)))]
                if key_a == key_b:
                    forms += _some(_normal({"u": Fraction(1), "t": Fraction(-1),
                                            "1": Fraction(-1)}))
                hit = self.solver.witness(forms)
                if hit is not None:
                    return _Finding(True, hit, f"{call_a.text} and {call_b.text} run microbatch "
                                               f"{_value(first.form(call_a.microbatch), hit)} "
                                               f"twice on device i = {hit['i']}")
        return None

    def _count(self, kind: PassKind, chunk: int, group) -> _Finding | None:
        view = _View(self.solver, 0, "t")
        context = list(self.solver.base)
        total: Pieces = [((), {})]
        for key, _ in group:
            total = _sum(self.solver, total, view.count(key, None, context), 1, context)
        m = {"m": Fraction(1)}
        for violated in (lambda v: _add(_add(v, m, -1), _ONE, -1),
                         lambda v: _add(_add(m, v, -1), _ONE, -1)):
            hit = self._any(context, total, violated)
            if hit is not None:
                return _Finding(True, hit, f"device i = {hit['i']} does not run {kind.value} "
                                           f"of chunk {chunk} for exactly m microbatches")
        return None

    def dependencies(self, potential: tuple[int, int],
                     same_device: bool) -> _Finding | None:
        """Every need within one device (`same_device`), or across devices,
        ordered by a * position + b * device."""
        a, b = potential
        for key, call in self.keys():
            for need in NEEDS[call.kind]:
                if need.optional:
                    continue
                for chunk, shift, how in need_cases(self.program.placement, call.chunk,
                                                    need.stage_offset):
                    if (shift == 0) != same_device:
                        continue
                    for other_key, other in self.keys():
                        if (other.kind, other.chunk) != (need.kind, chunk):
                            continue
                        found = self._ordered(key, call, other_key, other, shift, how,
                                              potential)
                        if found is not None:
                            what = (", later on the same device)" if shift == 0 else
                                    f", on device {found['i'] + shift}) by the potential "
                                    f"{a} * position + {b} * device")
                            return _Finding(shift == 0, found, (
                                f"{call.text} on device i = {found['i']} is not ordered after "
                                f"the {need.kind.value} it needs ({other.text}{what}"))
        return None

    def _ordered(self, key, call, other_key, other, shift, how, potential):
        a, b = potential
        here, there = _View(self.solver, 0, "t"), _View(self.solver, shift, "u")
        same = _add(here.form(call.microbatch), there.form(other.microbatch), -1)
        context = [*self.solver.base, *there.context, *here.runs(key), *there.runs(other_key),
                   *_some(_normal(same)), *_some(_normal(_add({}, same, -1)))]
        if how == "turn":
            last = {"i": Fraction(1), "d": Fraction(-1), "1": Fraction(1)}
            context += [*_some(_normal(last)), *_some(_normal(_add({}, last, -1)))]
        if not self.solver.possible(context):
            return None
        one = dict.fromkeys(PassKind, 1)
        gap = _sum(self.solver, [((), {"1": Fraction(b * shift)})],
                   there.before(other_key, one, context), a, context)
        gap = _sum(self.solver, gap, here.before(key, one, context), -a, context)
        return self._any(context, gap, lambda v: v)

    def memory(self, deltas: dict[PassKind, int], bound: Affine, text: str) -> _Finding | None:
        """After each pass that allocates, every device holds at most the bound."""
        hit = self.solver.witness(self.solver.base + list(_some(_normal(
            _add(_add({}, bound, -1), _ONE, -1)))))
        if hit is not None:  # before the first pass, every device holds nothing
            return _Finding(True, hit, f"{text} is below 0 at d = {hit['d']}")
        view = _View(self.solver, 0, "t")
        for key, call in self.keys():
            if deltas[call.kind] <= 0:
                continue
            context = [*self.solver.base, *view.runs(key)]
            held = view.before(key, deltas, context)
            hit = self._any(context, held, lambda v, d=deltas[call.kind]: _add(
                _add(v, {"1": Fraction(d - 1)}), bound, -1))
            if hit is not None:
                return _Finding(True, hit, f"{text}: device i = {hit['i']} holds more after "
                                           f"{call.text}")
        return None


def _value(a: Affine, at: dict[str, int]) -> int:
    return int(sum(v * (1 if k == "1" else at[k]) for k, v in a.items()))


def _potentials(schedule: Schedule) -> list[tuple[int, int]]:
    """The candidate potentials that order every need of this one instance
    (all of them when none does: the symbolic question then finds the witness)."""
    where: dict[tuple[PassKind, int, int], tuple[int, int]] = {}
    for device, order in enumerate(schedule.orders):
        for position, p in enumerate(order):
            where[p.kind, p.microbatch, p.stage] = (device, position)
    stages = schedule.placement.num_stages
    fits = []
    for a, b in _POTENTIALS:
        if all(a * pq + b * dq < a * pp + b * dp
               for (kind, j, s), (dp, pp) in where.items()
               for need in needs(kind, j, s, stages)
               if need in where
               for dq, pq in (where[need],)):
            fits.append((a, b))
    return fits or list(_POTENTIALS[:1])


def prove_order(module: ast.Module, schedule: Schedule, d_low: int, d_high: int,
                m_range: tuple[ast.Expr, ast.Expr] | None = None) -> SymbolicResult:
    """Decide the order form of `module` (elaborated once as `schedule`, at any
    instance) for every d in [d_low, d_high] and every m its `require`s and
    `m_range` (LOW, HIGH over d, both included) allow, up to `M_CAP`: proven, a
    counterexample (d, device i, m), a dependency the potential does not order
    (with its witness), or outside."""
    start = time.monotonic()
    undecided = ["deadlock-freedom of the lowered programs"]
    try:
        program = _program(module, schedule, m_range)
        prover = _Prover(program, d_low, d_high)
        lets = {s.name: s.value for s in module.stmts if isinstance(s, ast.Let)}
        names = {"d": {"d": Fraction(1)}, "m": {"m": Fraction(1)}}
        bounds, left = _bounds(module, schedule, names, lets)
        undecided += left
        checks: list[tuple[str, Any]] = [
            ("each pass once", lambda: prover.each_pass_once(schedule)),
            ("dependencies", lambda: _dependencies(prover, schedule)),
        ]
        for bound, text in bounds:
            deltas, scaled = _memory_forms(schedule, bound)
            checks.append((text, lambda d=deltas, s=scaled, t=text: prover.memory(d, s, t)))
        proven: list[str] = []
        for name, check in checks:
            found = check()
            if found is not None:
                status = "counterexample" if found.exact else "unproven"
                return SymbolicResult(status, d_low, d_high, tuple(proven), tuple(undecided),
                                      found.reason, found.witness, time.monotonic() - start,
                                      m_range=_m_text(program, prover))
            proven.append(name)
    except Outside as why:
        return SymbolicResult("outside", d_low, d_high, reason=str(why),
                              seconds=time.monotonic() - start)
    return SymbolicResult("proven", d_low, d_high, tuple(proven), tuple(undecided),
                          seconds=time.monotonic() - start, m_range=_m_text(program, prover))


def _m_text(program: _Program, prover: _Prover) -> str:
    """The m proven: every m the rules allow, up to M_CAP where some question
    needed CP-SAT's bounded search."""
    if prover.solver.capped:
        return f"{program.m_text}, m <= 2^{M_CAP.bit_length() - 1}"
    return program.m_text


def _dependencies(prover: _Prover, schedule: Schedule) -> _Finding | None:
    """The needs within a device first (exact), then those across devices under
    the first candidate potential that orders them all."""
    found = prover.dependencies((1, 0), same_device=True)
    if found is not None:
        return found
    first = None
    for potential in _potentials(schedule):
        found = prover.dependencies(potential, same_device=False)
        if found is None:
            return None
        first = first or found
    return first
