"""Elaborate the AST into the schedule IR: evaluate params (with `-D` overrides),
the placement, costs and memory model, then the order form (run once per device)
or the block form (slots per stage, repeated by `ppdsl.blocks.repeat_block`).

Arithmetic is exact: values are ints, `Fraction`s (never one with denominator 1),
bools (from comparisons) or ranges. Names are resolved statically, so an undefined
name is an error at its use even in a branch never taken. Every error is located
at the source that caused it.
"""

from __future__ import annotations

import difflib
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ppdsl import ast
from ppdsl.diagnostics import CompileError, Diagnostic, Span
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

__all__ = ["elaborate", "PLACEMENTS", "METRICS"]

Num = int | Fraction  # bool is an int
Value = Num | range
Env = dict[str, Any]  # Values, plus the device's stages and limits in the order form
Eval = Callable[[Env], Value]

PLACEMENTS = ("parallel", "looped", "vshape", "wave")
METRICS = ("peak_memory", "bubble", "idle", "makespan")
_EXPECT_OPS = ("<=", "<", "==", ">=", ">")
_COST_NAMES = {"F": "F", "B": "B", "W": "W", "BW": "BW", "comm": "comm"}
_MEMORY_NAMES = ("M_B", "M_W")
_FUNCTIONS = ("min", "max", "ceil", "floor")
# Names the compiler binds; a param or let may not take them (v may be a param).
_BUILTINS = frozenset(
    ["S", "T_F", "T_B", "T_W", "T_BW", "T_comm", "M_B", "M_W", "s", "i", "c", "chunks"]
    + list(_FUNCTIONS)
)
# Sizes beyond which a schedule is surely a mistake (and would only exhaust memory).
_MAX_DEVICES = 1 << 16
_MAX_MICROBATCHES = 1 << 20
_MAX_STAGES = 1 << 20
_MAX_PASSES = 20_000_000
_WHERE_BOUND = {
    "s": "the stage index 's' is bound only in per-stage `cost`/`memory` and in `block` lines",
    "i": "the device index 'i' is bound only in `block` and `order`",
    "c": "the chunk index 'c' is bound only in `chunk c:` lines (or by `for c in chunks`)",
    "chunks": "'chunks' is bound only in `order`",
}


class _Error(Exception):
    """One located finding; `elaborate` turns it into a CompileError."""

    def __init__(self, message: str, span: Span | None, notes=()):
        super().__init__(message)
        self.diagnostic = Diagnostic("error", message, span, tuple(notes))


def _did_you_mean(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _norm(x):
    """A Fraction with denominator 1 becomes an int, so integer tests are `type is int`."""
    if type(x) is Fraction and x.denominator == 1:
        return int(x)
    return x


def _show(x: Value) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, range):
        if x.step == -1:
            return f"reversed({x.stop + 1}..{x.start + 1})"
        return f"{x.start}..{x.stop}"
    return str(x)


# --- expressions ------------------------------------------------------------------


def _number(value: Value, span: Span, what: str = "this") -> Num:
    if isinstance(value, range):
        raise _Error(f"{what} is a range ({_show(value)}), not a number", span)
    return value


def _integer(value: Value, span: Span, what: str) -> int:
    if isinstance(value, bool):
        return int(value)
    if type(value) is int:
        return value
    if isinstance(value, range):
        raise _Error(f"{what} must be an integer, got the range {_show(value)}", span)
    raise _Error(f"{what} must be an integer, got {value}", span)


class _Scope:
    """The names visible at a point of the program, for static resolution."""

    def __init__(self, names, parent: _Scope | None = None):
        self.names = set(names)
        self.parent = parent

    def __contains__(self, name: str) -> bool:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.names:
                return True
            scope = scope.parent
        return False

    def all(self) -> set[str]:
        out: set[str] = set()
        scope: _Scope | None = self
        while scope is not None:
            out |= scope.names
            scope = scope.parent
        return out


class _Slow(Exception):
    """The integer fast path does not apply; evaluate exactly."""


def _fast_div(a, b):
    if type(a) is int and type(b) is int and b and a % b == 0:
        return a // b
    raise _Slow


def _fast_bool(x) -> bool:
    if type(x) is range:
        raise _Slow
    return bool(x)


def _fast_eq(a, b) -> bool:
    if type(a) is range or type(b) is range:
        raise _Slow
    return a == b


def _fast_ne(a, b) -> bool:
    if type(a) is range or type(b) is range:
        raise _Slow
    return a != b


def _fast_number(x):
    if type(x) is range:
        raise _Slow
    return x


_FAST_GLOBALS = {
    "__builtins__": {},
    "_div": _fast_div,
    "_b": _fast_bool,
    "_eq": _fast_eq,
    "_ne": _fast_ne,
    "_n": _fast_number,
    "_ceil": math.ceil,
    "_floor": math.floor,
    "min": min,
    "max": max,
}
_FAST_OPS = ("+", "-", "*", "//", "%", "<", "<=", ">", ">=")


def _python(expr: ast.Expr) -> str:
    """Python source for `expr` assuming every value is an int; raises _Slow for
    anything the int path cannot express (rational literals)."""
    if isinstance(expr, ast.Number):
        if expr.value.denominator != 1:
            raise _Slow
        return repr(int(expr.value))
    if isinstance(expr, ast.Name):
        return f"env[{expr.id!r}]"
    if isinstance(expr, ast.Unary):
        inner = _python(expr.operand)
        return f"(-{inner})" if expr.op == "-" else f"(not _b({inner}))"
    if isinstance(expr, ast.Cond):
        cond, then, else_ = _python(expr.cond), _python(expr.then), _python(expr.else_)
        return f"({then} if _b({cond}) else {else_})"
    if isinstance(expr, ast.Call):
        args = [_python(a) for a in expr.args]
        if expr.func in ("ceil", "floor"):
            return f"_{expr.func}(_n({args[0]}))"
        if len(args) == 1:
            return f"_n({args[0]})"
        return f"{expr.func}({', '.join(args)})"
    left, right = _python(expr.left), _python(expr.right)
    if expr.op in ("and", "or"):
        return f"(_b({left}) {expr.op} _b({right}))"
    if expr.op == "/":
        return f"_div({left}, {right})"
    if expr.op == "==":
        return f"_eq({left}, {right})"
    if expr.op == "!=":
        return f"_ne({left}, {right})"
    assert expr.op in _FAST_OPS
    return f"({left} {expr.op} {right})"


def _compile(expr: ast.Expr, scope: _Scope) -> Eval:
    """Turn an expression into a closure over the environment. Names resolve (or
    fail) now. Values that are ints all the way through take a compiled Python
    fast path; anything else (rationals, ranges, errors) is evaluated exactly."""
    exact = _compile_exact(expr, scope)
    if isinstance(expr, (ast.Number, ast.Name)):
        return exact
    try:
        source = _python(expr)
        if len(source) > 4000:
            return exact
        fast = eval(f"lambda env: {source}", dict(_FAST_GLOBALS))  # noqa: S307 - built from the AST
    except (_Slow, SyntaxError, RecursionError, MemoryError):
        return exact

    def evaluate(env: Env) -> Value:
        try:
            result = fast(env)
        except Exception:
            return exact(env)
        if type(result) is int or type(result) is bool:
            return result
        return exact(env)

    return evaluate


def _compile_exact(expr: ast.Expr, scope: _Scope) -> Eval:
    """Turn an expression into a closure over the environment, with exact semantics
    and located errors for every mistake."""
    if isinstance(expr, ast.Number):
        value = _norm(expr.value)
        return lambda env: value
    if isinstance(expr, ast.Name):
        name = expr.id
        if name not in scope:
            if name in _WHERE_BOUND and name not in scope:
                raise _Error(f"undefined name '{name}': {_WHERE_BOUND[name]}", expr.span)
            hint = _did_you_mean(name, scope.all())
            raise _Error(f"undefined name '{name}'{hint}", expr.span)
        return lambda env: env[name]
    if isinstance(expr, ast.Unary):
        operand = _compile_exact(expr.operand, scope)
        span = expr.operand.span
        if expr.op == "-":
            return lambda env: -_number(operand(env), span)
        return lambda env: not _number(operand(env), span)
    if isinstance(expr, ast.Cond):
        cond, then, else_ = (_compile_exact(e, scope) for e in (expr.cond, expr.then, expr.else_))
        cspan = expr.cond.span
        return lambda env: then(env) if _number(cond(env), cspan) else else_(env)
    if isinstance(expr, ast.Call):
        return _compile_call(expr, scope)
    assert isinstance(expr, ast.Binary)
    return _compile_binary(expr, scope)


def _compile_call(expr: ast.Call, scope: _Scope) -> Eval:
    if expr.func not in _FUNCTIONS:
        hint = _did_you_mean(expr.func, _FUNCTIONS)
        if not hint:
            hint = "; functions are " + ", ".join(_FUNCTIONS)
        raise _Error(f"unknown function '{expr.func}'{hint}", expr.span)
    args = [_compile_exact(a, scope) for a in expr.args]
    spans = [a.span for a in expr.args]
    if expr.func in ("ceil", "floor"):
        if len(args) != 1:
            raise _Error(f"{expr.func}() takes one argument, got {len(args)}", expr.span)
        fn = math.ceil if expr.func == "ceil" else math.floor
        (arg,), (aspan,) = args, spans
        return lambda env: fn(_number(arg(env), aspan))
    pick = min if expr.func == "min" else max
    if not args:
        raise _Error(f"{expr.func}() needs at least one argument", expr.span)

    def call(env: Env) -> Value:
        return pick(_number(a(env), s) for a, s in zip(args, spans, strict=True))

    return call


_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
    "%": operator.mod,
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _compile_binary(expr: ast.Binary, scope: _Scope) -> Eval:
    left, right = _compile_exact(expr.left, scope), _compile_exact(expr.right, scope)
    lspan, rspan, op = expr.left.span, expr.right.span, expr.op
    if op == "and":
        return lambda env: bool(_number(left(env), lspan)) and bool(_number(right(env), rspan))
    if op == "or":
        return lambda env: bool(_number(left(env), lspan)) or bool(_number(right(env), rspan))
    divides = op in ("/", "//", "%")

    def slow(a: Value, b: Value) -> Value:
        # rationals, bools, ranges (an error) and division by zero
        a, b = _number(a, lspan), _number(b, rspan)
        if divides and b == 0:
            raise _Error(f"division by zero: '{op}' by a value that is 0", expr.span)
        if op == "/":
            return _norm(Fraction(a) / Fraction(b))
        if op == "//":
            return math.floor(Fraction(a) / Fraction(b))
        result = _OPS[op](a, b)
        return result if isinstance(result, bool) else _norm(result)

    if op == "/":

        def divide(env: Env) -> Value:
            a, b = left(env), right(env)
            if type(a) is int and type(b) is int and b and a % b == 0:
                return a // b
            return slow(a, b)

        return divide
    fn = _OPS[op]
    if divides:

        def int_divide(env: Env) -> Value:
            a, b = left(env), right(env)
            if type(a) is int and type(b) is int and b:
                return fn(a, b)
            return slow(a, b)

        return int_divide

    def arithmetic(env: Env) -> Value:
        a, b = left(env), right(env)
        if type(a) is int and type(b) is int:
            return fn(a, b)
        return slow(a, b)

    return arithmetic


def _compile_range(rng: ast.Range, scope: _Scope) -> Callable[[Env], range]:
    if isinstance(rng, ast.SpanRange):
        start, stop = _compile(rng.start, scope), _compile(rng.stop, scope)
        sspan, tspan = rng.start.span, rng.stop.span

        def span_range(env: Env) -> range:
            a = _integer(start(env), sspan, "a range's start")
            b = _integer(stop(env), tspan, "a range's end")
            return range(a, b)

        return span_range
    if isinstance(rng, ast.ReversedRange):
        inner = _compile_range(rng.inner, scope)
        return lambda env: inner(env)[::-1]
    value = _compile(rng.expr, scope)
    span = rng.span

    def named(env: Env) -> range:
        got = value(env)
        if not isinstance(got, range):
            raise _Error(f"a loop needs a range such as 0..m or chunks, got {_show(got)}", span)
        return got

    return named


# --- the top-level environment ----------------------------------------------------


@dataclass
class _State:
    """What the top-level statements have established so far."""

    file: str
    env: Env = field(default_factory=dict)
    defined: dict[str, Span | None] = field(default_factory=dict)
    params: list[tuple[str, Value]] = field(default_factory=list)
    placement: Placement | None = None
    split_backward: bool = True
    backward_seen: Span | None = None
    costs: dict[str, list[Num]] = field(default_factory=dict)
    comm: Num = 0
    explicit: set[str] = field(default_factory=set)
    memory: dict[str, list[Num]] = field(default_factory=dict)

    def scope(self) -> _Scope:
        return _Scope(self.env)

    def define(self, name: str, value: Value, span: Span | None) -> None:
        if name in _BUILTINS:
            raise _Error(f"'{name}' is a name the compiler binds; choose another name", span)
        if name in self.defined:
            where = self.defined[name]
            at = f" at {where.line}:{where.column}" if where else ""
            raise _Error(f"'{name}' is already defined{at}", span)
        self.defined[name] = span
        self.env[name] = value


def _eval_top(state: _State, expr: ast.Expr) -> Value:
    return _compile(expr, state.scope())(state.env)


def _at_most(value: int, limit: int, span: Span | None, what: str, prefix: str = "") -> None:
    if value > limit:
        raise _Error(f"{prefix}{what} is {value}; ppdsl handles at most {limit}", span)


def _positive_int(value: Value, span: Span | None, what: str, prefix: str = "") -> int:
    if isinstance(value, bool) or type(value) is not int or value <= 0:
        raise _Error(f"{prefix}{what} must be a positive integer, got {_show(value)}", span)
    return value


def _parse_override(name: str, text: str, state: _State) -> Value:
    """Evaluate `-D name=text` as an expression over the params defined before it."""
    from ppdsl.parse import parse

    prefix = f"-D {name}={text}: "
    try:
        module = parse(f"schedule _ {{ param _ = {text}\n}}", "<command line>")
        (param,) = module.stmts
        assert isinstance(param, ast.Param) and param.default is not None
        if isinstance(param.default, ast.Name) and param.default.id not in state.env:
            raise _Error(
                f"{prefix}'{text}' is not a number (give an integer, a rational such as 3/2, "
                "or an expression over earlier params such as 2*d)",
                None,
            )
        return _eval_top(state, param.default)
    except CompileError:
        raise _Error(f"{prefix}not a number or an expression over earlier params", None) from None
    except _Error as exc:
        if exc.diagnostic.message.startswith(prefix):
            raise
        raise _Error(prefix + exc.diagnostic.message, None) from None


def _param(stmt: ast.Param, state: _State, overrides: dict[str, str]) -> None:
    if stmt.name in overrides:
        value = _parse_override(stmt.name, overrides[stmt.name], state)
        where: Span | None = None
        prefix = f"-D {stmt.name}={overrides[stmt.name]}: "
    elif stmt.default is None:
        raise _Error(
            f"param '{stmt.name}' has no value; give it with -D {stmt.name}=...", stmt.span
        )
    else:
        value = _eval_top(state, stmt.default)
        where = stmt.default.span
        prefix = ""
    if isinstance(value, range):
        raise _Error(f"{prefix}a param must be a number, got the range {_show(value)}", where)
    if stmt.name == "d":
        value = _positive_int(value, where, "d (the number of devices)", prefix)
        _at_most(value, _MAX_DEVICES, where, "d (the number of devices)", prefix)
    elif stmt.name == "m":
        value = _positive_int(value, where, "m (the number of microbatches)", prefix)
        _at_most(value, _MAX_MICROBATCHES, where, "m (the number of microbatches)", prefix)
    state.define(stmt.name, value, stmt.span)
    state.params.append((stmt.name, value))


def _placement(stmt: ast.Place, state: _State) -> Placement:
    d = state.env["d"]
    assert type(d) is int
    if stmt.kind == "list":
        devices = []
        for expr in stmt.devices:
            dev = _integer(_eval_top(state, expr), expr.span, "a device index")
            if not 0 <= dev < d:
                raise _Error(
                    f"device {dev} out of range: d = {d}, so devices are 0..{d}", expr.span
                )
            devices.append(dev)
        unused = sorted(set(range(d)) - set(devices))
        if unused:
            raise _Error(
                f"device {unused[0]} holds no stage: the list must use every device 0..{d} "
                f"(d = {d})",
                stmt.span,
            )
        return Placement("list", d, tuple(devices))
    if stmt.kind not in PLACEMENTS:
        hint = (
            _did_you_mean(stmt.kind, PLACEMENTS)
            or "; expected one of " + ", ".join(PLACEMENTS) + " or a list [e0, e1, ...]"
        )
        raise _Error(f"unknown placement '{stmt.kind}'{hint}", stmt.kind_span)
    takes_arg = stmt.kind in ("looped", "wave")
    if takes_arg and stmt.arg is None:
        raise _Error(f"'{stmt.kind}' needs the number of chunks: {stmt.kind}(v)", stmt.span)
    if not takes_arg and stmt.arg is not None:
        raise _Error(f"'{stmt.kind}' takes no argument", stmt.arg.span)
    if stmt.kind == "parallel":
        return Placement("parallel", d, tuple(range(d)))
    if stmt.kind == "vshape":
        return Placement("vshape", d, tuple(s if s < d else 2 * d - 1 - s for s in range(2 * d)))
    assert stmt.arg is not None
    v = _positive_int(_eval_top(state, stmt.arg), stmt.arg.span, "the number of chunks")
    _at_most(v * d, _MAX_STAGES, stmt.arg.span, "the number of stages v*d")
    if stmt.kind == "looped":
        return Placement("looped", d, tuple(s % d for s in range(v * d)))
    stages = tuple(s % d if (s // d) % 2 == 0 else d - 1 - s % d for s in range(v * d))
    return Placement("wave", d, stages)


def _set_placement(state: _State, placement: Placement) -> None:
    state.placement = placement
    num_stages = placement.num_stages
    state.env["S"] = num_stages
    if "v" not in state.env:
        state.env["v"] = _norm(Fraction(num_stages, placement.num_devices))
    for kind in ("F", "B", "W"):
        state.costs[kind] = [1] * num_stages
    state.costs["BW"] = [2] * num_stages
    state.memory["M_B"] = [1] * num_stages
    state.memory["M_W"] = [Fraction(1, 2)] * num_stages
    _refresh_names(state)


def _refresh_names(state: _State) -> None:
    """Keep the derived defaults (BW = B + W, M_W = M_B / 2) and the T_*/M_* names."""
    if "BW" not in state.explicit:
        state.costs["BW"] = [
            _norm(b + w) for b, w in zip(state.costs["B"], state.costs["W"], strict=True)
        ]
    if "M_W" not in state.explicit:
        state.memory["M_W"] = [_norm(Fraction(x) / 2) for x in state.memory["M_B"]]
    for kind in ("F", "B", "W", "BW"):
        state.env[f"T_{kind}"] = state.costs[kind][0]
    state.env["T_comm"] = state.comm
    for name in _MEMORY_NAMES:
        state.env[name] = state.memory[name][0]


def _ensure_placement(state: _State) -> Placement:
    if state.placement is None:
        d = state.env["d"]
        assert type(d) is int
        _set_placement(state, Placement("parallel", d, tuple(range(d))))
    assert state.placement is not None
    return state.placement


def _per_stage_values(stmt: ast.Cost | ast.Memory, state: _State, what: str) -> list[Num]:
    num_stages = _ensure_placement(state).num_stages
    if stmt.index is None:
        value = _eval_top(state, stmt.value)
        values = [value] * num_stages
    else:
        if stmt.index in state.env:
            raise _Error(
                f"'{stmt.index}' is already defined; name the stage index something else",
                stmt.span,
            )
        fn = _compile(stmt.value, _Scope([stmt.index], state.scope()))
        env = dict(state.env)
        values = []
        for s in range(num_stages):
            env[stmt.index] = s
            values.append(fn(env))
    nums: list[Num] = []
    for value in values:
        if isinstance(value, range) or value < 0:
            raise _Error(f"{what} must be a number >= 0, got {_show(value)}", stmt.value.span)
        nums.append(int(value) if isinstance(value, bool) else value)
    return nums


def _cost(stmt: ast.Cost, state: _State) -> None:
    if stmt.name not in _COST_NAMES:
        hint = _did_you_mean(stmt.name, _COST_NAMES) or "; costs are F, B, W, BW and comm"
        raise _Error(f"unknown cost '{stmt.name}'{hint}", stmt.name_span)
    if stmt.name == "comm":
        if stmt.index is not None:
            raise _Error("the transfer cost 'comm' is one value, not per stage", stmt.span)
        state.comm = _per_stage_values(stmt, state, "a cost")[0]
    else:
        state.costs[stmt.name] = _per_stage_values(stmt, state, "a cost")
    state.explicit.add(stmt.name)
    _refresh_names(state)


def _memory(stmt: ast.Memory, state: _State) -> None:
    if stmt.name not in _MEMORY_NAMES:
        hint = _did_you_mean(stmt.name, _MEMORY_NAMES) or "; the memory model has M_B and M_W"
        raise _Error(f"unknown memory quantity '{stmt.name}'{hint}", stmt.name_span)
    state.memory[stmt.name] = _per_stage_values(stmt, state, "a memory amount")
    state.explicit.add(stmt.name)
    _refresh_names(state)


# --- the order form ---------------------------------------------------------------


@dataclass(frozen=True)
class _OrderContext:
    """What pass calls need: the device's stages and the schedule's rules."""

    split_backward: bool
    num_microbatches: int


_Run = Callable[[Env, list], None]


def _compile_body(body: tuple[ast.OrderStmt, ...], scope: _Scope, ctx: _OrderContext) -> _Run:
    inner = _Scope((), scope)
    steps = [_compile_stmt(stmt, inner, ctx) for stmt in body]
    if len(steps) == 1:
        return steps[0]

    def run(env: Env, out: list) -> None:
        for step in steps:
            step(env, out)

    return run


def _bind(name: str, scope: _Scope, span: Span) -> None:
    if name in scope:
        raise _Error(f"'{name}' is already defined here; choose another name", span)
    if name in _BUILTINS and name not in ("c", "s"):
        raise _Error(f"'{name}' is a name the compiler binds; choose another name", span)
    scope.names.add(name)


def _compile_stmt(stmt: ast.OrderStmt, scope: _Scope, ctx: _OrderContext) -> _Run:
    if isinstance(stmt, ast.PassCall):
        return _compile_pass(stmt, scope, ctx)
    if isinstance(stmt, ast.Let):
        value = _compile(stmt.value, scope)
        _bind(stmt.name, scope, stmt.span)
        name = stmt.name

        def let(env: Env, out: list) -> None:
            env[name] = value(env)

        return let
    if isinstance(stmt, ast.For):
        rng = _compile_range(stmt.range, scope)
        loop_scope = _Scope((), scope)
        _bind(stmt.var, loop_scope, stmt.span)
        body = _compile_body(stmt.body, loop_scope, ctx)
        var = stmt.var
        span = stmt.range.span

        def for_(env: Env, out: list) -> None:
            values = rng(env)
            if len(values) > _MAX_PASSES:
                raise _Error(f"a loop over {len(values)} values; at most {_MAX_PASSES}", span)
            for x in values:
                env[var] = x
                body(env, out)
                if len(out) > env["__limit__"]:
                    _too_many(env, span)

        return for_
    if isinstance(stmt, ast.Repeat):
        count = _compile(stmt.count, scope)
        cspan = stmt.count.span
        body = _compile_body(stmt.body, scope, ctx)

        def repeat(env: Env, out: list) -> None:
            n = _integer(count(env), cspan, "a repeat count")
            if not 0 <= n <= _MAX_PASSES:
                raise _Error(f"a repeat count must be in 0..{_MAX_PASSES}, got {n}", cspan)
            for _ in range(n):
                body(env, out)
                if len(out) > env["__limit__"]:
                    _too_many(env, cspan)

        return repeat
    if isinstance(stmt, ast.If):
        cond = _compile(stmt.cond, scope)
        cspan = stmt.cond.span
        then = _compile_body(stmt.then, scope, ctx)
        else_ = _compile_body(stmt.else_, scope, ctx) if stmt.else_ else None

        def if_(env: Env, out: list) -> None:
            if _number(cond(env), cspan, "a condition"):
                then(env, out)
            elif else_ is not None:
                else_(env, out)

        return if_
    assert isinstance(stmt, ast.Interleave)
    first = _compile_body(stmt.first, scope, ctx)
    second = _compile_body(stmt.second, scope, ctx)

    def interleave(env: Env, out: list) -> None:
        a: list = []
        b: list = []
        first(env, a)
        second(env, b)
        n = min(len(a), len(b))
        for x, y in zip(a, b, strict=False):
            out.append(x)
            out.append(y)
        out.extend(a[n:])
        out.extend(b[n:])

    return interleave


def _too_many(env: Env, span: Span) -> None:
    needed = env["__needed__"]
    raise _Error(
        f"device {env['i']}'s order grows past {env['__limit__']} passes here, but its stages "
        f"need {needed} (each pass once)",
        span,
    )


def _kind(name: str, span: Span, split_backward: bool) -> PassKind:
    kinds = ("F", "B", "W") if split_backward else ("F", "BW")
    if name not in ("F", "B", "W", "BW"):
        hint = _did_you_mean(name, kinds) or "; passes are " + ", ".join(kinds)
        raise _Error(f"unknown pass '{name}'{hint}", span)
    if not split_backward and name in ("B", "W"):
        raise _Error(f"this schedule's backward is fused: write BW, not {name}", span)
    if split_backward and name == "BW":
        raise _Error("this schedule's backward is split: write B and W (or `backward fused`)", span)
    return PassKind(name)


def _compile_pass(stmt: ast.PassCall, scope: _Scope, ctx: _OrderContext) -> _Run:
    kind = _kind(stmt.kind, stmt.span, ctx.split_backward)
    if len(stmt.args) not in (1, 2):
        raise _Error(
            f"{stmt.kind}(j) or {stmt.kind}(j, c) takes a microbatch and optionally a chunk, "
            f"got {len(stmt.args)} arguments",
            stmt.span,
        )
    micro = _compile(stmt.args[0], scope)
    mspan = stmt.args[0].span
    chunk = _compile(stmt.args[1], scope) if len(stmt.args) == 2 else None
    cspan = stmt.args[1].span if len(stmt.args) == 2 else stmt.span
    num_microbatches = ctx.num_microbatches
    span = stmt.span

    def microbatch(env: Env) -> int:
        j = micro(env)
        if type(j) is not int:
            j = _integer(j, mspan, "a microbatch index")
        if not 0 <= j < num_microbatches:
            raise _Error(
                f"microbatch {j} out of range: m = {num_microbatches}, so 0..{num_microbatches}",
                mspan,
            )
        return j

    if chunk is None:

        def run_first_chunk(env: Env, out: list) -> None:
            out.append(Pass(kind, microbatch(env), env["__stages__"][0], span))

        return run_first_chunk

    def run(env: Env, out: list) -> None:
        j = microbatch(env)
        stages = env["__stages__"]
        c = chunk(env)
        if type(c) is not int:
            c = _integer(c, cspan, "a chunk index")
        if not 0 <= c < len(stages):
            raise _Error(
                f"chunk {c} out of range: device {env['i']} holds {len(stages)} chunk(s), "
                f"so 0..{len(stages)}",
                cspan,
            )
        out.append(Pass(kind, j, stages[c], span))

    return run


def _elaborate_order(
    decl: ast.OrderDecl, state: _State, placement: Placement, m: int
) -> tuple[tuple[Pass, ...], ...]:
    ctx = _OrderContext(state.split_backward, m)
    scope = _Scope(["i", "chunks"], state.scope())
    body = _compile_body(decl.body, scope, ctx)
    orders = []
    for device in range(placement.num_devices):
        stages = placement.chunks(device)
        env = dict(state.env)
        env["i"] = device
        env["chunks"] = range(len(stages))
        env["__stages__"] = stages  # type: ignore[assignment]
        # a valid order has exactly `needed` passes; far more is a runaway loop
        needed = len(stages) * m * (3 if state.split_backward else 2)
        env["__needed__"] = needed
        env["__limit__"] = 4 * needed + 1000
        out: list[Pass] = []
        body(env, out)
        if len(out) > env["__limit__"]:
            _too_many(env, decl.span)
        orders.append(tuple(out))
    return tuple(orders)


# --- the block form ---------------------------------------------------------------


def _elaborate_block(
    decl: ast.BlockDecl, state: _State, placement: Placement, m: int, costs: Costs
) -> tuple[Block, tuple[tuple[Pass, ...], ...]]:
    period = _number(_eval_top(state, decl.period), decl.period.span, "the period")
    if period <= 0:
        raise _Error(f"the block's period must be > 0, got {_show(period)}", decl.period.span)
    split = state.split_backward
    w_fill = False
    max_chunks = max(len(placement.chunks(dev)) for dev in range(placement.num_devices))
    # (priority, chunk) -> kind -> (slot, compiled start, chunk var)
    numbered: dict[int, dict[str, tuple[ast.Slot, Eval]]] = {}
    named: dict[str, tuple[ast.Slot, Eval, str]] = {}
    general: dict[str, tuple[ast.Slot, Eval]] = {}
    base = _Scope(["s", "i", "c"], state.scope())
    for line in decl.lines:
        if isinstance(line, ast.Fill):
            _kind(line.kind, line.span, split)
            if line.kind != "W":
                raise _Error(f"only W passes can be filled, not {line.kind}", line.span)
            if w_fill:
                raise _Error("'W fill' is given twice", line.span)
            w_fill = True
            continue
        if isinstance(line.chunk, int):
            if not 0 <= line.chunk < max_chunks:
                raise _Error(
                    f"chunk {line.chunk} out of range: devices hold {max_chunks} chunk(s), "
                    f"so 0..{max_chunks}",
                    line.span,
                )
            table: dict = numbered.setdefault(line.chunk, {})
            scope = base
        elif isinstance(line.chunk, str):
            table = named
            scope = _Scope([line.chunk], base) if line.chunk not in base else base
        else:
            table = general
            scope = base
        for slot in line.slots:
            _kind(slot.kind, slot.span, split)
            if slot.kind in table:
                other = table[slot.kind][0].span
                raise _Error(
                    f"{slot.kind} is placed twice for the same chunks "
                    f"(also at {other.line}:{other.column})",
                    slot.span,
                )
            start = _compile(slot.start, scope)
            table[slot.kind] = (slot, start, line.chunk) if table is named else (slot, start)
    if w_fill and ("W" in general or "W" in named or any("W" in x for x in numbered.values())):
        raise _Error("W is placed explicitly and by 'W fill'; keep one", decl.span)
    kinds = ["F", "B"] + ([] if w_fill else ["W"]) if split else ["F", "BW"]
    slots = []
    env = dict(state.env)
    for device in range(placement.num_devices):
        for c, stage in enumerate(placement.chunks(device)):
            env["s"], env["i"], env["c"] = stage, device, c
            for kind in kinds:
                entry = numbered.get(c, {}).get(kind)
                if entry is None and kind in named:
                    slot, start, var = named[kind]
                    env[var] = c
                    entry = (slot, start)
                if entry is None:
                    entry = general.get(kind)
                if entry is None:
                    raise _Error(
                        f"the block places no {kind} for stage {stage} (chunk {c} of device "
                        f"{device}); add `{kind} at ...`" + (" or `W fill`" if kind == "W" else ""),
                        decl.span,
                    )
                slot, start = entry
                at = _number(start(env), slot.start.span, "a start time")
                pk = PassKind(kind)
                duration = _norm(Fraction(_stage_cost(state, kind, stage)))
                slots.append(
                    BlockSlot(pk, stage, device, Fraction(at), Fraction(duration), slot.span)
                )
    # repeat_block breaks ties by slot position: keep the order the file wrote the slots
    slots.sort(key=lambda slot: (slot.span.sort_key() if slot.span else ("", 0, 0), slot.stage))
    block = Block(Fraction(period), tuple(slots), decl.span)
    if len(slots) * m > _MAX_PASSES:
        raise _Error(
            f"the block repeated m = {m} times makes more than {_MAX_PASSES} passes", decl.span
        )
    from ppdsl.blocks import repeat_block

    orders = repeat_block(block, placement, m, split_backward=split, w_fill=w_fill, costs=costs)
    return block, orders


def _stage_cost(state: _State, kind: str, stage: int) -> Num:
    return state.costs[kind][stage]


# --- expectations -----------------------------------------------------------------


def _expect(decl: ast.ExpectDecl, state: _State, num_devices: int) -> Expect:
    if decl.metric not in METRICS:
        hint = _did_you_mean(decl.metric, METRICS) or "; metrics are " + ", ".join(METRICS)
        raise _Error(f"unknown metric '{decl.metric}'{hint}", decl.metric_span)
    if decl.op not in _EXPECT_OPS:
        raise _Error(f"expect takes one of {' '.join(_EXPECT_OPS)}, not '{decl.op}'", decl.span)
    device = None
    if decl.device is not None:
        if decl.metric != "peak_memory":
            raise _Error(
                f"'{decl.metric}' is one value for the schedule; only peak_memory takes "
                "a device [k]",
                decl.device.span,
            )
        device = _integer(_eval_top(state, decl.device), decl.device.span, "a device index")
        if not 0 <= device < num_devices:
            raise _Error(
                f"device {device} out of range: d = {num_devices}, so 0..{num_devices}",
                decl.device.span,
            )
    bound = _number(_eval_top(state, decl.bound), decl.bound.span, "the bound")
    return Expect(decl.metric, decl.op, Fraction(bound), device, decl.span, decl.text)


# --- the driver -------------------------------------------------------------------


def elaborate(module: ast.Module, overrides: dict[str, str]) -> Schedule:
    """The schedule IR of a parsed file, with `-D name=value` overrides applied."""
    try:
        return _elaborate(module, overrides)
    except _Error as exc:
        raise CompileError([exc.diagnostic]) from None
    except RecursionError:
        message = (
            "the file nests expressions or blocks too deeply for ppdsl; split long "
            "expressions with `let`"
        )
        raise CompileError([Diagnostic("error", message, module.span)]) from None


def _elaborate(module: ast.Module, overrides: dict[str, str]) -> Schedule:
    state = _State(module.file)
    param_names = [s.name for s in module.stmts if isinstance(s, ast.Param)]
    let_names = {s.name for s in module.stmts if isinstance(s, ast.Let)}
    for name, text in overrides.items():
        if name not in param_names:
            what = (
                f"'{name}' is a let, not a param"
                if name in let_names
                else (f"no param '{name}' in this schedule")
            )
            hint = _did_you_mean(name, param_names)
            known = ", ".join(param_names) if param_names else "none"
            raise _Error(f"-D {name}={text}: {what}{hint} (params: {known})", None)
    for required, meaning in (("d", "the number of devices"), ("m", "the number of microbatches")):
        if required not in param_names:
            raise _Error(
                f"schedule '{module.name}' declares no 'param {required}' ({meaning})",
                module.span,
            )
    deferred: list = []
    seen: dict[type, Span] = {}
    for stmt in module.stmts:
        if isinstance(stmt, (ast.Place, ast.Backward, ast.BlockDecl, ast.OrderDecl)):
            kind = ast.BlockDecl if isinstance(stmt, ast.OrderDecl) else type(stmt)
            if kind in seen:
                other = seen[kind]
                what = {
                    ast.Place: "'place'",
                    ast.Backward: "'backward'",
                    ast.BlockDecl: "a 'block' or 'order'",
                }[kind]
                raise _Error(
                    f"{what} is given twice (also at {other.line}:{other.column}); keep one",
                    stmt.span,
                )
            seen[kind] = stmt.span
        if isinstance(stmt, (ast.Place, ast.Cost, ast.Memory)) and "d" not in state.env:
            d_span = next(s.span for s in module.stmts if isinstance(s, ast.Param) and s.name == "d")
            what = {ast.Place: "'place'", ast.Cost: "'cost'", ast.Memory: "'memory'"}[type(stmt)]
            raise _Error(
                f"{what} depends on the number of devices, but 'param d' comes later "
                f"(at {d_span.line}:{d_span.column}); move 'param d' above it",
                stmt.span,
            )
        if isinstance(stmt, ast.Param):
            _param(stmt, state, overrides)
        elif isinstance(stmt, ast.Let):
            value = _eval_top(state, stmt.value)
            state.define(stmt.name, value, stmt.span)
            state.params.append((stmt.name, value))
        elif isinstance(stmt, ast.Place):
            if state.placement is not None:
                raise _Error(
                    "'place' must come before the costs and memory that depend on it", stmt.span
                )
            _set_placement(state, _placement(stmt, state))
        elif isinstance(stmt, ast.Backward):
            if stmt.mode not in ("split", "fused"):
                hint = _did_you_mean(stmt.mode, ("split", "fused")) or "; write split or fused"
                raise _Error(f"unknown backward '{stmt.mode}'{hint}", stmt.mode_span)
            state.split_backward = stmt.mode == "split"
        elif isinstance(stmt, ast.Cost):
            _cost(stmt, state)
        elif isinstance(stmt, ast.Memory):
            _memory(stmt, state)
        else:
            deferred.append(stmt)
    placement = _ensure_placement(state)
    m = state.env["m"]
    assert type(m) is int
    costs = Costs(
        tuple(float(x) for x in state.costs["F"]),
        tuple(float(x) for x in state.costs["B"]),
        tuple(float(x) for x in state.costs["W"]),
        tuple(float(x) for x in state.costs["BW"]),
        float(state.comm),
    )
    memory = MemoryModel(
        tuple(Fraction(x) for x in state.memory["M_B"]),
        tuple(Fraction(x) for x in state.memory["M_W"]),
    )
    orders = None
    block = None
    expects = []
    for stmt in deferred:
        if isinstance(stmt, ast.OrderDecl):
            orders = _elaborate_order(stmt, state, placement, m)
        elif isinstance(stmt, ast.BlockDecl):
            block, orders = _elaborate_block(stmt, state, placement, m, costs)
        else:
            expects.append(_expect(stmt, state, placement.num_devices))
    if orders is None:
        raise _Error(
            f"schedule '{module.name}' has no 'order {{ ... }}' or 'block period T {{ ... }}'",
            module.span,
        )
    params = tuple(
        (name, _norm(value) if not isinstance(value, bool) else int(value))
        for name, value in state.params
    )
    return Schedule(
        name=module.name,
        file=module.file,
        params=params,
        num_microbatches=m,
        placement=placement,
        split_backward=state.split_backward,
        costs=costs,
        memory=memory,
        orders=orders,
        expects=tuple(expects),
        block=block,
        span=module.span,
    )
