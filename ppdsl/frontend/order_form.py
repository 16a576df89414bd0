"""The order form: `order { ... }` runs once per device and lists its passes.

The body is compiled once into closures; each runs with the environment of
names (`i`, `chunks`, loop variables, lets) and a `DeviceOrder`, the explicit
context of the device being written: its stages, how many passes a valid order
has, the limit past which a loop is surely runaway, and the passes so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

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
    """What pass calls check against, the same for every device and every m."""

    split_backward: bool
    recompute: bool = False
    """Whether some stage is marked `recompute` (R is then a pass of the file)."""


@dataclass
class DeviceOrder:
    """The device whose order the body is writing, and what it has written."""

    device: int
    """`i`."""
    stages: tuple[int, ...]
    """The device's stages in model order: chunk c is stages[c]."""
    num_microbatches: int
    """m."""
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
        return DeviceOrder(self.device, self.stages, self.num_microbatches, self.needed,
                           self.limit)

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

    def columns(
        self, env: Env, x: np.ndarray, bound: int, stage_of: Callable[[np.ndarray], np.ndarray],
        num_chunks: int, num_microbatches: int, arrays: Env | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Per value of `x` (|value| <= `bound`) and call: whether it runs,
        its microbatch and its stage (`stage_of` an array of chunks, those of
        the calls that do not run 0); None where a value-by-value run could
        differ. `arrays`: `env` with names bound to arrays beside `x`
        (`VectorEval`)."""
        n = len(x)
        try:
            masks, micro, stage = [], [], []
            for call in self.calls:
                mask = np.ones(n, dtype=bool)
                for cond, wanted in call.guards:
                    mask &= np.broadcast_to(cond(env, x, bound, arrays) != 0, (n,)) == wanted
                j = np.broadcast_to(call.microbatch(env, x, bound, arrays), (n,))
                c = np.broadcast_to(call.chunk(env, x, bound, arrays) if call.chunk else 0, (n,))
                chosen_j, chosen_c = j[mask], c[mask]
                if np.any((chosen_j < 0) | (chosen_j >= num_microbatches)):
                    return None
                if np.any((chosen_c < 0) | (chosen_c >= num_chunks)):
                    return None
                masks.append(mask)
                micro.append(j)
                stage.append(stage_of(np.where(mask, c, 0)))
        except VectorFallback:
            return None
        # iteration-major: value, then call
        return np.stack(masks, axis=1), np.stack(micro, axis=1), np.stack(stage, axis=1)

    def run(self, env: Env, values: range, order: DeviceOrder) -> bool:
        x = np.arange(values.start, values.stop, values.step, dtype=np.int64)
        bound = max(abs(values.start), abs(values.stop))
        stages = np.asarray(order.stages, dtype=np.int64)
        found = self.columns(env, x, bound, stages.__getitem__, len(stages),
                             order.num_microbatches)
        if found is None:
            return False
        taken, micro, stage = found
        if order.size() + int(taken.sum()) > order.limit:
            return False  # value by value, to stop at the pass past the limit
        it, k = np.nonzero(taken)
        small = _index_type(order.num_microbatches, order.stages)
        order.lay(PassOrder(
            self.codes()[k],
            micro[it, k].astype(small),
            stage[it, k].astype(small),
            k.astype(np.int32),
            tuple(c.span for c in self.calls),
        ))
        return True

    def codes(self) -> np.ndarray:
        """The calls' `PassKind.code`s."""
        return np.array([c.kind.code for c in self.calls], dtype=np.int8)


def _index_type(num_microbatches: int, stages: tuple[int, ...]) -> type:
    # in range (checked by the caller): int32 holds them unless m or the stages are huge
    return np.int32 if max(num_microbatches, max(stages, default=0)) < 2**31 else np.int64


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
    return _VectorLoop(tuple(calls))


@dataclass(frozen=True)
class _DeviceLoops:
    """An order body of `for` loops only, each a `_VectorLoop`, run for every
    device at once: the loop variable and `i` are both arrays over the
    (device, value) pairs of all devices' ranges, so a schedule costs a few
    numpy calls per loop rather than per loop and device (issue 41: checking
    ZB-V for d = 2..32 spent most of its time in d x 8 small loops). Where a
    device-by-device run could differ (an error, a limit, an expression that
    falls back), `run` gives None and the devices run one by one."""

    loops: tuple[tuple[Callable[[Env], range], Span, _VectorLoop], ...]
    """Each loop's range, its span (for the iteration limit) and its body."""

    def run(
        self, envs: list[Env], chunk_stages: list[tuple[int, ...]], num_microbatches: int,
        limit: list[int],
    ) -> tuple[PassOrder, ...] | None:
        """Every device's order (`envs[device]` binds `i` and `chunks`; past
        `limit[device]` passes an order is a runaway), or None."""
        num_devices = len(envs)
        if num_devices == 0 or len({len(stages) for stages in chunk_stages}) != 1:
            return None
        table = np.array(chunk_stages, dtype=np.int64)  # [device, chunk] -> stage
        num_chunks = table.shape[1]
        # every name but `i` is the same on all devices; |i| is at most the last one
        arrays = dict(envs[-1])
        parts, calls = [], 0
        counted: list[tuple[int, Span]] = []
        try:
            ranges = [[rng(env) for env in envs] for rng, _, _ in self.loops]
        except ElaborationError:
            return None
        for (_, span, loop), per_device in zip(self.loops, ranges, strict=True):
            counts = np.array([limits.iteration_count(r) for r in per_device], dtype=np.int64)
            counted.append((int(counts.sum()), span))
            if not counts.sum():
                calls += len(loop.calls)
                continue
            x = np.concatenate([np.arange(r.start, r.stop, r.step, dtype=np.int64)
                                for r in per_device])
            device = np.repeat(np.arange(num_devices, dtype=np.int64), counts)
            bound = max(max(abs(r.start), abs(r.stop)) for r in per_device)
            arrays["i"] = device
            def stage_of(c: Any, d: np.ndarray = device) -> Any:
                return table[d, c]

            found = loop.columns(envs[-1], x, bound, stage_of, num_chunks,
                                 num_microbatches, arrays)
            if found is None:
                return None
            taken, micro, stage = found
            it, k = np.nonzero(taken)  # device-major: (device, value) rows, then call
            parts.append((device[it], loop.codes()[k], micro[it, k], stage[it, k], k + calls))
            calls += len(loop.calls)
        if not parts:
            return None
        device, kind, micro, stage, span_index = (np.concatenate(c) for c in zip(*parts, strict=True))
        sizes = np.bincount(device, minlength=num_devices)
        if any(size > most for size, most in zip(sizes.tolist(), limit, strict=True)):
            return None  # device by device, to stop at the pass past the limit
        if sum(total for total, _ in counted) > limits.iterations_left():
            return None  # device by device, to stop at the loop past the limit
        for total, span in counted:
            limits.count_iterations(total, span)
        order = np.argsort(device, kind="stable")  # each device's loops in order
        small = _index_type(num_microbatches, tuple(table.ravel().tolist()))
        kind, micro, stage = kind[order], micro[order].astype(small), stage[order].astype(small)
        span_index = span_index[order].astype(np.int32)
        spans = tuple(call.span for _, _, loop in self.loops for call in loop.calls)
        ends = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        return tuple(
            PassOrder(kind[a:b], micro[a:b], stage[a:b], span_index[a:b], spans)
            for a, b in zip(ends, ends[1:], strict=False)
        )


def _device_loops(body: tuple[ast.OrderStmt, ...], scope: Scope, rules: _Rules) -> _DeviceLoops | None:
    """The all-devices form of an order body (None unless every statement is a
    `for` loop with a vector form)."""
    inner = Scope((), scope)
    loops = []
    for stmt in body:
        if not isinstance(stmt, ast.For):
            return None
        vector = _vector_loop(stmt, rules)
        if vector is None:
            return None
        loops.append((compile_range(stmt.range, inner), stmt.range.span, vector))
    return _DeviceLoops(tuple(loops)) if loops else None


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
    span = stmt.span

    def microbatch(env: Env, num_microbatches: int) -> int:
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
            order.passes.append(Pass(kind, microbatch(env, order.num_microbatches),
                                     order.stages[0], span))

        return run_first_chunk

    def run(env: Env, order: DeviceOrder) -> None:
        j = microbatch(env, order.num_microbatches)
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


_COMPILED: dict[tuple, tuple[ast.OrderDecl, _Run, _DeviceLoops | None]] = {}
_COMPILED_KEPT = 8


def _compiled(decl: ast.OrderDecl, names: frozenset[str], rules: _Rules) -> tuple[_Run, _DeviceLoops | None]:
    """The body compiled (and its all-devices form), once per order block, the
    names it sees and the backward form: nothing in it depends on the values of
    params, so a family's instances (`ppdsl check --for`) share it."""
    key = (id(decl), names, rules)
    found = _COMPILED.get(key)
    if found is not None and found[0] is decl:
        return found[1], found[2]
    scope = Scope(["i", "chunks"], Scope(names))
    body = _compile_body(decl.body, scope, rules)
    at_once = _device_loops(decl.body, scope, rules)
    if len(_COMPILED) >= _COMPILED_KEPT:
        _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[key] = (decl, body, at_once)
    return body, at_once


def elaborate_order(
    decl: ast.OrderDecl, state: Declarations, placement: Placement, m: int
) -> tuple[PassOrder, ...]:
    """Every device's order: the body run once per device with `i` and
    `chunks` bound."""
    rules = _Rules(state.split_backward, state.recomputes)
    body, at_once = _compiled(decl, frozenset(state.env), rules)
    kinds_per_stage = len(pass_kinds(state.split_backward, state.recomputes))
    chunk_stages = [placement.chunks(device) for device in range(placement.num_devices)]
    envs = [{**state.env, "i": device, "chunks": range(len(stages))}
            for device, stages in enumerate(chunk_stages)]
    # a valid order has exactly `needed` passes; far more is a runaway loop
    needed = [len(stages) * m * kinds_per_stage for stages in chunk_stages]
    limit = [4 * n + 1000 for n in needed]
    if at_once is not None:
        laid = at_once.run(envs, chunk_stages, m, limit)
        if laid is not None:
            return laid
    orders = []
    for device, stages in enumerate(chunk_stages):
        order = DeviceOrder(device, stages, m, needed[device], limit[device])
        body(envs[device], order)
        order.check_size(decl.span)
        orders.append(order.finish())
    return tuple(orders)
