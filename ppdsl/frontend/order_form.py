"""The order form: `order { ... }` runs once per device and lists its passes.

The body is compiled once into closures; each runs with the environment of
names (`i`, `chunks`, loop variables, lets) and a `DeviceOrder`, the explicit
context of the device being written: its stages, how many passes a valid order
has, the limit past which a loop is surely runaway, and the passes so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from ppdsl import limits
from ppdsl.diagnostics import Span
from ppdsl.frontend import ast
from ppdsl.frontend.declarations import Declarations, pass_kind
from ppdsl.frontend.expressions import (
    BUILTINS,
    ElaborationError,
    Env,
    Scope,
    VectorEval,
    VectorFallback,
    compile_expr,
    compile_range,
    compile_vector,
    integer,
    number,
)
from ppdsl.ir.schedule import Pass, PassOrder, Placement
from ppdsl.semantics import PassKind, backward_kinds, pass_kinds

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
    """The passes written one at a time since the last vector loop's."""
    laid: list[list[Pass] | PassOrder] = field(default_factory=list)
    """The order before `passes`: runs of single passes and vector loops' columns."""
    laid_count: int = 0

    def size(self) -> int:
        """How many passes the order has so far."""
        return self.laid_count + len(self.passes)

    def lay(self, columns: PassOrder) -> None:
        """Append a vector loop's passes."""
        if self.passes:
            self.laid.append(self.passes)
            self.laid_count += len(self.passes)
            self.passes = []
        self.laid.append(columns)
        self.laid_count += len(columns)

    def all_passes(self) -> list[Pass]:
        """The order so far as Pass objects."""
        return [q for run in self.laid for q in run] + self.passes

    def finish(self) -> PassOrder:
        """The written order, as one `PassOrder` of its runs."""
        return PassOrder.join([*self.laid, self.passes])

    def sub(self) -> DeviceOrder:
        """The same device with no passes yet (an `interleave` arm)."""
        return DeviceOrder(self.device, self.stages, self.needed, self.limit)

    def check_size(self, span: Span) -> None:
        """A located error once the order has grown past its limit."""
        if self.size() > self.limit:
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
    if isinstance(stmt, ast.Overlap):
        return _compile_overlap(stmt, scope, rules)
    if isinstance(stmt, ast.Let):
        value = compile_expr(stmt.value, scope)
        _bind(stmt.name, scope, stmt.span)
        name = stmt.name
        span = stmt.value.span

        def let(env: Env, order: DeviceOrder) -> None:
            env[name] = got = value(env)
            if type(got) is not int or got.bit_length() > 62:
                limits.check_integer(got, span, "this value")

        return let
    if isinstance(stmt, ast.For):
        rng = compile_range(stmt.range, scope)
        loop_scope = Scope((), scope)
        _bind(stmt.var, loop_scope, stmt.span)
        body = _compile_body(stmt.body, loop_scope, rules)
        var = stmt.var
        span = stmt.range.span
        vector = _vector_loop(stmt, rules)

        def for_(env: Env, order: DeviceOrder) -> None:
            values = rng(env)
            limits.count_iterations(limits.iteration_count(values), span)
            if vector is not None and len(values) >= _VECTOR_MIN and vector.run(env, values, order):
                return
            for x in values:
                env[var] = x
                try:
                    body(env, order)
                except ElaborationError as exc:
                    if exc.involves == "loop":  # the loops that made the index take part
                        exc.add_located_note(span, f"where {var} = {x}, in this loop")
                    raise
                order.check_size(span)

        return for_
    if isinstance(stmt, ast.Repeat):
        count = compile_expr(stmt.count, scope)
        cspan = stmt.count.span
        body = _compile_body(stmt.body, scope, rules)

        def repeat(env: Env, order: DeviceOrder) -> None:
            n = integer(count(env), cspan, "a repeat count")
            if n < 0:
                raise ElaborationError(f"a repeat count must be >= 0, got {n}", cspan)
            limits.count_iterations(n, cspan)
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
        units_a, units_b = _units(a.all_passes()), _units(b.all_passes())
        n = min(len(units_a), len(units_b))
        out = order.passes
        for x, y in zip(units_a, units_b, strict=False):
            out.extend(x)
            out.extend(y)
        for unit in units_a[n:] + units_b[n:]:
            out.extend(unit)

    return interleave


def _units(passes: list[Pass]) -> list[list[Pass]]:
    """Passes as the units a device runs: an overlapped pair is one."""
    units: list[list[Pass]] = []
    for p in passes:
        if p.overlapped and units:
            units[-1].append(p)
        else:
            units.append([p])
    return units


def _compile_overlap(stmt: ast.Overlap, scope: Scope, rules: _Rules) -> _Run:
    forward, backward = stmt.forward, stmt.backward
    backwards = tuple(k.value for k in backward_kinds(rules.split_backward))
    if forward.kind != "F" or backward.kind not in backwards:
        raise ElaborationError(
            f"an overlapped pass is a forward and a backward of this device: "
            f"F(j, c) & {backwards[0]}(k, c2), not {forward.kind}(...) & {backward.kind}(...)",
            stmt.span,
        )
    run_forward = _compile_pass(forward, scope, rules)
    run_backward = _compile_pass(backward, scope, rules)

    def overlap(env: Env, order: DeviceOrder) -> None:
        run_forward(env, order)
        run_backward(env, order)
        order.passes[-1] = replace(order.passes[-1], overlapped=True)

    return overlap


_VECTOR_MIN = 16  # shorter loops run value by value (numpy's per-call cost)


@dataclass(frozen=True)
class _GuardedPass:
    """A pass call of a loop body with the conditions (value, wanted truth) of
    the `if`s around it."""

    kind: PassKind
    span: Span
    guards: tuple[tuple[VectorEval, bool], ...]
    microbatch: VectorEval
    chunk: VectorEval | None


@dataclass(frozen=True)
class _VectorLoop:
    """A `for` loop whose body is pass calls and `if`s only, evaluated for all
    its values at once: each expression once per loop (numpy over the loop
    variable), the passes then laid out iteration by iteration. Where the
    value-by-value run could differ (an error, a name that is not an int, a
    possible overflow), `run` says no and the loop runs value by value."""

    calls: tuple[_GuardedPass, ...]
    num_microbatches: int

    def run(self, env: Env, values: range, order: DeviceOrder) -> bool:
        x = np.arange(values.start, values.stop, values.step, dtype=np.int64)
        bound = max(abs(values.start), abs(values.stop))
        n, stages = len(x), order.stages
        try:
            masks, micro, stage = [], [], []
            for call in self.calls:
                mask = np.ones(n, dtype=bool)
                for cond, wanted in call.guards:
                    mask &= np.broadcast_to(cond(env, x, bound) != 0, (n,)) == wanted
                j = np.broadcast_to(call.microbatch(env, x, bound), (n,))
                c = np.broadcast_to(call.chunk(env, x, bound), (n,)) if call.chunk else 0
                c = np.broadcast_to(c, (n,))
                chosen_j, chosen_c = j[mask], c[mask]
                if np.any((chosen_j < 0) | (chosen_j >= self.num_microbatches)):
                    return False
                if np.any((chosen_c < 0) | (chosen_c >= len(stages))):
                    return False
                masks.append(mask)
                micro.append(j)
                stage.append(np.asarray(stages, dtype=np.int64)[np.where(mask, c, 0)])
        except VectorFallback:
            return False
        taken = np.stack(masks, axis=1)  # iteration-major: value, then call
        if order.size() + int(taken.sum()) > order.limit:
            return False  # value by value, to stop at the pass past the limit
        it, k = np.nonzero(taken)
        codes = np.array([c.kind.code for c in self.calls], dtype=np.int8)
        # in range (checked above): int32 holds them unless m or the stages are huge
        small = np.int32 if max(self.num_microbatches, max(stages, default=0)) < 2**31 else np.int64
        order.lay(PassOrder(
            codes[k],
            np.stack(micro, axis=1)[it, k].astype(small),
            np.stack(stage, axis=1)[it, k].astype(small),
            k.astype(np.int32),
            tuple(c.span for c in self.calls),
        ))
        return True


def _vector_loop(stmt: ast.For, rules: _Rules) -> _VectorLoop | None:
    """The vector form of a loop (None where its body has more than pass calls
    and `if`s, or an expression that needs exact values)."""
    calls: list[_GuardedPass] = []

    def walk(body, guards) -> bool:
        for s in body:
            if isinstance(s, ast.PassCall):
                if len(s.args) not in (1, 2):
                    return False
                micro = compile_vector(s.args[0], stmt.var)
                chunk = compile_vector(s.args[1], stmt.var) if len(s.args) == 2 else None
                if micro is None or (len(s.args) == 2 and chunk is None):
                    return False
                kind = pass_kind(s.kind, s.span, rules.split_backward, rules.recompute)
                calls.append(_GuardedPass(kind, s.span, guards, micro, chunk))
            elif isinstance(s, ast.If):
                cond = compile_vector(s.cond, stmt.var, as_number=False)
                if cond is None:
                    return False
                if not walk(s.then, (*guards, (cond, True))):
                    return False
                if not walk(s.else_, (*guards, (cond, False))):
                    return False
            else:
                return False
        return True

    if not walk(stmt.body, ()) or not calls:
        return None
    return _VectorLoop(tuple(calls), rules.num_microbatches)


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
                involves="loop",
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
                involves="place",
            )
        order.passes.append(Pass(kind, j, stages[c], span))

    return run


def elaborate_order(
    decl: ast.OrderDecl, state: Declarations, placement: Placement, m: int
) -> tuple[PassOrder, ...]:
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
        orders.append(order.finish())
    return tuple(orders)
