"""The order form: `order { ... }` runs once per device and lists its passes.

The body is compiled once into closures; each runs with the environment of
names (`i`, `chunks`, loop variables, lets) and a `DeviceOrder`, the explicit
context of the device being written: its stages, how many passes a valid order
has, the limit past which a loop is surely runaway, and the passes so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ppdsl.diagnostics import Span
from ppdsl.frontend import ast
from ppdsl.frontend.declarations import MAX_PASSES, Declarations, pass_kind
from ppdsl.frontend.expressions import (
    BUILTINS,
    ElaborationError,
    Env,
    Scope,
    compile_expr,
    compile_range,
    integer,
    number,
)
from ppdsl.ir.schedule import Pass, Placement
from ppdsl.semantics import pass_kinds

__all__ = ["DeviceOrder", "elaborate_order"]


@dataclass(frozen=True)
class _Rules:
    """What pass calls check against, the same for every device."""

    split_backward: bool
    num_microbatches: int
    recompute: bool = False
    """Whether some stage is marked `recompute` (R is then a pass of the file)."""


@dataclass
class DeviceOrder:
    """The device whose order the body is writing, and what it has written."""

    device: int
    """`i`."""
    stages: tuple[int, ...]
    """The device's stages in model order: chunk c is stages[c]."""
    needed: int
    """How many passes a valid order of this device has (each pass once)."""
    limit: int
    """Past this many passes the order is surely a runaway loop: an error."""
    passes: list[Pass] = field(default_factory=list)

    def sub(self) -> DeviceOrder:
        """The same device with no passes yet (an `interleave` arm)."""
        return DeviceOrder(self.device, self.stages, self.needed, self.limit)

    def check_size(self, span: Span) -> None:
        """A located error once the order has grown past its limit."""
        if len(self.passes) > self.limit:
            raise ElaborationError(
                f"device {self.device}'s order grows past {self.limit} passes here, but its "
                f"stages need {self.needed} (each pass once)",
                span,
            )


_Run = Callable[[Env, DeviceOrder], None]


def _compile_body(body: tuple[ast.OrderStmt, ...], scope: Scope, rules: _Rules) -> _Run:
    inner = Scope((), scope)
    steps = [_compile_stmt(stmt, inner, rules) for stmt in body]
    if len(steps) == 1:
        return steps[0]

    def run(env: Env, order: DeviceOrder) -> None:
        for step in steps:
            step(env, order)

    return run


def _bind(name: str, scope: Scope, span: Span) -> None:
    if name in scope:
        raise ElaborationError(f"'{name}' is already defined here; choose another name", span)
    if name in BUILTINS and name not in ("c", "s"):
        raise ElaborationError(f"'{name}' is a name the compiler binds; choose another name", span)
    scope.names.add(name)


def _compile_stmt(stmt: ast.OrderStmt, scope: Scope, rules: _Rules) -> _Run:
    if isinstance(stmt, ast.PassCall):
        return _compile_pass(stmt, scope, rules)
    if isinstance(stmt, ast.Let):
        value = compile_expr(stmt.value, scope)
        _bind(stmt.name, scope, stmt.span)
        name = stmt.name

        def let(env: Env, order: DeviceOrder) -> None:
            env[name] = value(env)

        return let
    if isinstance(stmt, ast.For):
        rng = compile_range(stmt.range, scope)
        loop_scope = Scope((), scope)
        _bind(stmt.var, loop_scope, stmt.span)
        body = _compile_body(stmt.body, loop_scope, rules)
        var = stmt.var
        span = stmt.range.span

        def for_(env: Env, order: DeviceOrder) -> None:
            values = rng(env)
            if len(values) > MAX_PASSES:
                raise ElaborationError(
                    f"a loop over {len(values)} values; at most {MAX_PASSES}", span
                )
            for x in values:
                env[var] = x
                body(env, order)
                order.check_size(span)

        return for_
    if isinstance(stmt, ast.Repeat):
        count = compile_expr(stmt.count, scope)
        cspan = stmt.count.span
        body = _compile_body(stmt.body, scope, rules)

        def repeat(env: Env, order: DeviceOrder) -> None:
            n = integer(count(env), cspan, "a repeat count")
            if not 0 <= n <= MAX_PASSES:
                raise ElaborationError(
                    f"a repeat count must be in 0..{MAX_PASSES}, got {n}", cspan
                )
            for _ in range(n):
                body(env, order)
                order.check_size(cspan)

        return repeat
    if isinstance(stmt, ast.If):
        cond = compile_expr(stmt.cond, scope)
        cspan = stmt.cond.span
        then = _compile_body(stmt.then, scope, rules)
        else_ = _compile_body(stmt.else_, scope, rules) if stmt.else_ else None

        def if_(env: Env, order: DeviceOrder) -> None:
            if number(cond(env), cspan, "a condition"):
                then(env, order)
            elif else_ is not None:
                else_(env, order)

        return if_
    assert isinstance(stmt, ast.Interleave)
    first = _compile_body(stmt.first, scope, rules)
    second = _compile_body(stmt.second, scope, rules)

    def interleave(env: Env, order: DeviceOrder) -> None:
        a, b = order.sub(), order.sub()
        first(env, a)
        second(env, b)
        n = min(len(a.passes), len(b.passes))
        out = order.passes
        for x, y in zip(a.passes, b.passes, strict=False):
            out.append(x)
            out.append(y)
        out.extend(a.passes[n:])
        out.extend(b.passes[n:])

    return interleave


def _compile_pass(stmt: ast.PassCall, scope: Scope, rules: _Rules) -> _Run:
    kind = pass_kind(stmt.kind, stmt.span, rules.split_backward, rules.recompute)
    if len(stmt.args) not in (1, 2):
        raise ElaborationError(
            f"{stmt.kind}(j) or {stmt.kind}(j, c) takes a microbatch and optionally a chunk, "
            f"got {len(stmt.args)} arguments",
            stmt.span,
        )
    micro = compile_expr(stmt.args[0], scope)
    mspan = stmt.args[0].span
    chunk = compile_expr(stmt.args[1], scope) if len(stmt.args) == 2 else None
    cspan = stmt.args[1].span if len(stmt.args) == 2 else stmt.span
    num_microbatches = rules.num_microbatches
    span = stmt.span

    def microbatch(env: Env) -> int:
        j = micro(env)
        if type(j) is not int:
            j = integer(j, mspan, "a microbatch index")
        if not 0 <= j < num_microbatches:
            raise ElaborationError(
                f"microbatch {j} out of range: m = {num_microbatches}, so 0..{num_microbatches}",
                mspan,
            )
        return j

    if chunk is None:

        def run_first_chunk(env: Env, order: DeviceOrder) -> None:
            order.passes.append(Pass(kind, microbatch(env), order.stages[0], span))

        return run_first_chunk

    def run(env: Env, order: DeviceOrder) -> None:
        j = microbatch(env)
        stages = order.stages
        c = chunk(env)
        if type(c) is not int:
            c = integer(c, cspan, "a chunk index")
        if not 0 <= c < len(stages):
            raise ElaborationError(
                f"chunk {c} out of range: device {order.device} holds {len(stages)} chunk(s), "
                f"so 0..{len(stages)}",
                cspan,
            )
        order.passes.append(Pass(kind, j, stages[c], span))

    return run


def elaborate_order(
    decl: ast.OrderDecl, state: Declarations, placement: Placement, m: int
) -> tuple[tuple[Pass, ...], ...]:
    """Every device's order: the body run once per device with `i` and
    `chunks` bound."""
    rules = _Rules(state.split_backward, m, state.recomputes)
    scope = Scope(["i", "chunks"], state.scope())
    body = _compile_body(decl.body, scope, rules)
    kinds_per_stage = len(pass_kinds(state.split_backward, state.recomputes))
    orders = []
    for device in range(placement.num_devices):
        stages = placement.chunks(device)
        env = dict(state.env)
        env["i"] = device
        env["chunks"] = range(len(stages))
        # a valid order has exactly `needed` passes; far more is a runaway loop
        needed = len(stages) * m * kinds_per_stage
        order = DeviceOrder(device, stages, needed, 4 * needed + 1000)
        body(env, order)
        order.check_size(decl.span)
        orders.append(tuple(order.passes))
    return tuple(orders)
