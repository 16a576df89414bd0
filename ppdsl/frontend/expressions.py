"""Expressions of the language: values, static name resolution, and compiling
an expression into a closure over an environment.

Arithmetic is exact: values are ints, `Fraction`s (never one with denominator 1),
bools (from comparisons) or ranges. Names are resolved when an expression is
compiled, so an undefined name is an error at its use even in a branch never
taken. An expression whose values are ints all the way through runs as compiled
Python (the fast path: order-form loops evaluate millions of them); anything
else is evaluated exactly, with a located error for every mistake.
"""

from __future__ import annotations

import difflib
import math
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from ppdsl.diagnostics import Diagnostic, Span
from ppdsl.frontend import ast

__all__ = [
    "Num",
    "Value",
    "Env",
    "Eval",
    "ElaborationError",
    "FUNCTIONS",
    "BUILTINS",
    "did_you_mean",
    "norm",
    "show",
    "number",
    "integer",
    "Scope",
    "compile_expr",
    "compile_exact",
    "compile_range",
    "VectorEval",
    "compile_vector",
    "VectorFallback",
]

Num = int | Fraction  # bool is an int
Value = Num | range
Env = dict[str, Any]  # the names in scope and their Values
Eval = Callable[[Env], Value]

FUNCTIONS = ("min", "max", "ceil", "floor")
# Names the compiler binds; a param or let may not take them (v may be a param).
BUILTINS = frozenset(
    ["S", "T_F", "T_B", "T_W", "T_BW", "T_R", "T_comm", "T_overlap", "M_B", "M_W", "M_I"]
    + ["s", "i", "c", "chunks"]
    + list(FUNCTIONS)
)
_WHERE_BOUND = {
    "s": "the stage index 's' is bound only in per-stage `cost`/`memory` and in `block` lines",
    "i": "the device index 'i' is bound only in `block` and `order`",
    "c": "the chunk index 'c' is bound only in `chunk c:` lines (or by `for c in chunks`)",
    "chunks": "'chunks' is bound only in `order`",
    "tokens": "a microbatch's length 'tokens' is bound only in `cost` and `memory` "
              "(declare `param tokens = N` to use its nominal value elsewhere)",
}


class ElaborationError(Exception):
    """One located finding; `elaborate` turns it into a CompileError. `involves`
    names what else takes part: "place" or "backward" (`elaborate`, which knows
    where they are, adds a note at their line) or "loop" (each enclosing loop adds
    a note with its variable's value)."""

    def __init__(self, message: str, span: Span | None, notes=(), involves: str | None = None):
        super().__init__(message)
        self.diagnostic = Diagnostic("error", message, span, tuple(notes))
        self.involves = involves

    def add_located_note(self, span: Span | None, note: str) -> None:
        """Add a note at another line that takes part."""
        d = self.diagnostic
        self.diagnostic = Diagnostic(d.severity, d.message, d.span, (*d.notes, (span, note)))


def did_you_mean(word: str, candidates) -> str:
    """`; did you mean 'x'?` for the closest candidate, or nothing."""
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def norm(x):
    """A Fraction with denominator 1 becomes an int, so integer tests are `type is int`."""
    if type(x) is Fraction and x.denominator == 1:
        return int(x)
    return x


def show(x: Value) -> str:
    """A value as the language writes it (`true`, `0..4`, `3/2`)."""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, range):
        if x.step == -1:
            return f"reversed({x.stop + 1}..{x.start + 1})"
        return f"{x.start}..{x.stop}"
    return str(x)


# --- expressions ------------------------------------------------------------------


def number(value: Value, span: Span, what: str = "this") -> Num:
    """`value` if it is a number; a range is a located error."""
    if isinstance(value, range):
        raise ElaborationError(f"{what} is a range ({show(value)}), not a number", span)
    return value


def integer(value: Value, span: Span, what: str) -> int:
    """`value` as an int (a bool counts); anything else is a located error."""
    if isinstance(value, bool):
        return int(value)
    if type(value) is int:
        return value
    if isinstance(value, range):
        raise ElaborationError(f"{what} must be an integer, got the range {show(value)}", span)
    raise ElaborationError(f"{what} must be an integer, got {value}", span)


class Scope:
    """The names visible at a point of the program, for static resolution."""

    def __init__(self, names, parent: Scope | None = None):
        self.names = set(names)
        self.parent = parent

    def __contains__(self, name: str) -> bool:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.names:
                return True
            scope = scope.parent
        return False

    def all(self) -> set[str]:
        """Every name visible here (for "did you mean")."""
        out: set[str] = set()
        scope: Scope | None = self
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
    if expr.op == "^":
        raise _Slow  # the exponent's checks are the exact path's
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


def compile_expr(expr: ast.Expr, scope: Scope) -> Eval:
    """Turn an expression into a closure over the environment. Names resolve (or
    fail) now. Values that are ints all the way through take a compiled Python
    fast path; anything else (rationals, ranges, errors) is evaluated exactly."""
    exact = compile_exact(expr, scope)
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


def compile_exact(expr: ast.Expr, scope: Scope) -> Eval:
    """Turn an expression into a closure over the environment, with exact semantics
    and located errors for every mistake."""
    if isinstance(expr, ast.Number):
        value = norm(expr.value)
        return lambda env: value
    if isinstance(expr, ast.Name):
        name = expr.id
        if name not in scope:
            if name in _WHERE_BOUND and name not in scope:
                raise ElaborationError(f"undefined name '{name}': {_WHERE_BOUND[name]}", expr.span)
            hint = did_you_mean(name, scope.all())
            raise ElaborationError(f"undefined name '{name}'{hint}", expr.span)
        return lambda env: env[name]
    if isinstance(expr, ast.Unary):
        operand = compile_exact(expr.operand, scope)
        span = expr.operand.span
        if expr.op == "-":
            return lambda env: -number(operand(env), span)
        return lambda env: not number(operand(env), span)
    if isinstance(expr, ast.Cond):
        cond, then, else_ = (compile_exact(e, scope) for e in (expr.cond, expr.then, expr.else_))
        cspan = expr.cond.span
        return lambda env: then(env) if number(cond(env), cspan) else else_(env)
    if isinstance(expr, ast.Call):
        return _compile_call(expr, scope)
    assert isinstance(expr, ast.Binary)
    return _compile_binary(expr, scope)


def _compile_call(expr: ast.Call, scope: Scope) -> Eval:
    if expr.func not in FUNCTIONS:
        hint = did_you_mean(expr.func, FUNCTIONS)
        if not hint:
            hint = "; functions are " + ", ".join(FUNCTIONS)
        raise ElaborationError(f"unknown function '{expr.func}'{hint}", expr.span)
    args = [compile_exact(a, scope) for a in expr.args]
    spans = [a.span for a in expr.args]
    if expr.func in ("ceil", "floor"):
        if len(args) != 1:
            raise ElaborationError(f"{expr.func}() takes one argument, got {len(args)}", expr.span)
        fn = math.ceil if expr.func == "ceil" else math.floor
        (arg,), (aspan,) = args, spans
        return lambda env: fn(number(arg(env), aspan))
    pick = min if expr.func == "min" else max
    if not args:
        raise ElaborationError(f"{expr.func}() needs at least one argument", expr.span)

    def call(env: Env) -> Value:
        return pick(number(a(env), s) for a, s in zip(args, spans, strict=True))

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


def _compile_binary(expr: ast.Binary, scope: Scope) -> Eval:
    left, right = compile_exact(expr.left, scope), compile_exact(expr.right, scope)
    lspan, rspan, op = expr.left.span, expr.right.span, expr.op
    if op == "and":
        return lambda env: bool(number(left(env), lspan)) and bool(number(right(env), rspan))
    if op == "or":
        return lambda env: bool(number(left(env), lspan)) or bool(number(right(env), rspan))
    if op == "^":
        return _compile_power(left, right, expr)
    divides = op in ("/", "//", "%")

    def slow(a: Value, b: Value) -> Value:
        # rationals, bools, ranges (an error) and division by zero
        a, b = number(a, lspan), number(b, rspan)
        if divides and b == 0:
            raise ElaborationError(f"division by zero: '{op}' by a value that is 0", expr.span)
        if op == "/":
            return norm(Fraction(a) / Fraction(b))
        if op == "//":
            return math.floor(Fraction(a) / Fraction(b))
        result = _OPS[op](a, b)
        return result if isinstance(result, bool) else norm(result)

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


MAX_EXPONENT = 64
"""The largest exponent `x ^ n` takes (a whole number from 0)."""


def _compile_power(left: Eval, right: Eval, expr: ast.Binary) -> Eval:
    lspan, rspan = expr.left.span, expr.right.span

    def power(env: Env) -> Value:
        base, exponent = number(left(env), lspan), number(right(env), rspan)
        if exponent != int(exponent) or not 0 <= exponent <= MAX_EXPONENT:
            raise ElaborationError(
                f"an exponent is a whole number from 0 to {MAX_EXPONENT}, got {show(exponent)}",
                rspan)
        return norm(Fraction(base) ** int(exponent))

    return power


class VectorFallback(Exception):
    """A vector evaluation does not apply here (a name not an int, a possible
    overflow, a zero divisor, an inexact `/`); run the loop one value at a time."""


_LOGICAL = ("==", "!=", "<", "<=", ">", ">=", "and", "or")
_LIMIT = 1 << 62  # every intermediate stays below this, so int64 is exact


class VectorEval:
    """An int expression evaluated for every value of one loop variable at once
    (numpy int64), with the same results as `compile_expr` gives value by value
    wherever it applies: before evaluating, `__call__` bounds every
    intermediate from the names' values (no int64 overflow) and raises
    `VectorFallback` where the exact path could differ (a name that is not an
    int, a zero divisor, a `/` that does not divide); the caller then runs the
    loop value by value, errors included."""

    def __init__(self, expr: ast.Expr, var: str):
        self.expr = expr
        self.var = var

    def __call__(self, env: Env, values: Any, bound: int, arrays: Env | None = None) -> Any:
        """`values`: int64 array of the loop variable, every |value| <= `bound`.
        `arrays`, where given, is the environment evaluated: `env` with some
        names bound to int64 arrays as long as `values`, each element at most
        that name's int in `env` in absolute value (which bounds it)."""
        self._bound(self.expr, env, bound)
        return self._eval(self.expr, env if arrays is None else arrays, values)

    def _bound(self, e: ast.Expr, env: Env, bound: int) -> int:
        if isinstance(e, ast.Number):
            b = abs(int(e.value))
        elif isinstance(e, ast.Name):
            if e.id == self.var:
                b = bound
            else:
                value = env[e.id]
                if type(value) is not int:
                    raise VectorFallback
                b = abs(value)
        elif isinstance(e, ast.Unary):
            b = self._bound(e.operand, env, bound) if e.op == "-" else 1
            if e.op != "-":
                self._bound(e.operand, env, bound)
        elif isinstance(e, ast.Cond):
            self._bound(e.cond, env, bound)
            b = max(self._bound(e.then, env, bound), self._bound(e.else_, env, bound))
        elif isinstance(e, ast.Call):
            b = max(self._bound(a, env, bound) for a in e.args)
        else:
            assert isinstance(e, ast.Binary)
            left, right = self._bound(e.left, env, bound), self._bound(e.right, env, bound)
            if e.op in _LOGICAL:
                b = 1
            elif e.op in ("+", "-"):
                b = left + right
            elif e.op == "*":
                b = left * right
            elif e.op == "%":
                b = right
            else:  # `/`, `//`: |a // b| <= |a| for a nonzero int b
                b = left
        if b >= _LIMIT:
            raise VectorFallback
        return b

    def _eval(self, e: ast.Expr, env: Env, x: Any) -> Any:
        import numpy as np

        if isinstance(e, ast.Number):
            return int(e.value)
        if isinstance(e, ast.Name):
            return x if e.id == self.var else env[e.id]
        if isinstance(e, ast.Unary):
            inner = self._eval(e.operand, env, x)
            return -inner if e.op == "-" else np.asarray(inner == 0, dtype=np.int64)
        if isinstance(e, ast.Cond):
            cond = self._eval(e.cond, env, x)
            return np.where(cond != 0, self._eval(e.then, env, x), self._eval(e.else_, env, x))
        if isinstance(e, ast.Call):
            args = [self._eval(a, env, x) for a in e.args]
            if e.func in ("ceil", "floor") or len(args) == 1:
                return args[0]
            pick = np.minimum if e.func == "min" else np.maximum
            out = args[0]
            for a in args[1:]:
                out = pick(out, a)
            return out
        assert isinstance(e, ast.Binary)
        a, b = self._eval(e.left, env, x), self._eval(e.right, env, x)
        op = e.op
        if op == "and":
            return np.asarray((a != 0) & (b != 0), dtype=np.int64)
        if op == "or":
            return np.asarray((a != 0) | (b != 0), dtype=np.int64)
        if op in ("/", "//", "%"):
            if np.any(np.asarray(b) == 0):
                raise VectorFallback
            if op == "/":
                if np.any(np.asarray(a % b) != 0):
                    raise VectorFallback
                return a // b
            return a // b if op == "//" else a % b
        result = _OPS[op](a, b)
        return np.asarray(result, dtype=np.int64) if op in _LOGICAL else result


def compile_vector(expr: ast.Expr, var: str, *, as_number: bool = True) -> VectorEval | None:
    """`expr` as a `VectorEval` over loop variable `var`, or None where the
    language's exact semantics need values one at a time (a rational literal;
    with `as_number`, a comparison whose bool result would be the value)."""
    if as_number and (
        (isinstance(expr, ast.Binary) and expr.op in _LOGICAL)
        or (isinstance(expr, ast.Unary) and expr.op != "-")
    ):
        return None
    try:
        _python(expr)  # the int fast path applies: no rational literal
    except _Slow:
        return None
    if isinstance(expr, ast.Call) and expr.func not in FUNCTIONS:
        return None
    return VectorEval(expr, var)


def compile_range(rng: ast.Range, scope: Scope) -> Callable[[Env], range]:
    """A loop range compiled to a closure: `a..b`, `reversed(...)`, or a name
    bound to a range (`chunks`)."""
    if isinstance(rng, ast.SpanRange):
        start, stop = compile_expr(rng.start, scope), compile_expr(rng.stop, scope)
        sspan, tspan = rng.start.span, rng.stop.span

        def span_range(env: Env) -> range:
            a = integer(start(env), sspan, "a range's start")
            b = integer(stop(env), tspan, "a range's end")
            return range(a, b)

        return span_range
    if isinstance(rng, ast.ReversedRange):
        inner = compile_range(rng.inner, scope)
        return lambda env: inner(env)[::-1]
    value = compile_expr(rng.expr, scope)
    span = rng.span

    def named(env: Env) -> range:
        got = value(env)
        if not isinstance(got, range):
            raise ElaborationError(f"a loop needs a range such as 0..m or chunks, got {show(got)}", span)
        return got

    return named
