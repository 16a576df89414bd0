"""Elaborate the AST into the schedule IR: the driver of the front end's second
half. Top-level statements run in order (`declarations`: params with `-D`
overrides, lets, placement, backward form, costs, memory, recompute); then the order form
(`order_form`, run once per device) or the block form (`block_form`, repeated
by `blocks`), then the expectations. Every error is located at the source that
caused it (`expressions.ElaborationError` becomes one CompileError).
"""

from __future__ import annotations

from dataclasses import replace

from ppdsl import limits
from ppdsl.diagnostics import CompileError, Diagnostic, Span
from ppdsl.frontend import ast
from ppdsl.frontend.block_form import elaborate_block
from ppdsl.frontend.declarations import (
    Declarations,
    declare_cost,
    declare_memory,
    declare_param,
    declare_placement,
    declare_recompute,
    ensure_placement,
    expectation,
    require,
)
from ppdsl.frontend.expressions import ElaborationError, did_you_mean, norm
from ppdsl.frontend.order_form import elaborate_order
from ppdsl.ir.schedule import Schedule
from ppdsl.semantics import pass_kinds

__all__ = ["elaborate"]


def elaborate(module: ast.Module, overrides: dict[str, str]) -> Schedule:
    """The schedule IR of a parsed file, with `-D name=value` overrides applied."""
    try:
        return _elaborate(module, overrides)
    except ElaborationError as exc:
        raise CompileError([_with_declaration(exc, module)]) from None
    except RecursionError:
        message = (
            "the file nests expressions or blocks too deeply for ppdsl; split long "
            "expressions with `let`"
        )
        raise CompileError([Diagnostic("error", message, module.span)]) from None


_DECLARATION_NOTES = {
    "place": (ast.Place, "the placement is declared here"),
    "backward": (ast.Backward, "the backward form is declared here"),
}


def _with_declaration(exc: ElaborationError, module: ast.Module) -> Diagnostic:
    """The error with a note at the declaration it involves (none when the file
    leaves it to its default)."""
    if exc.involves not in _DECLARATION_NOTES:
        return exc.diagnostic
    kind, note = _DECLARATION_NOTES[exc.involves]
    stmt = next((s for s in module.stmts if isinstance(s, kind)), None)
    if stmt is None:
        return exc.diagnostic
    d = exc.diagnostic
    return replace(d, notes=(*d.notes, (stmt.span, note)))


def _elaborate(module: ast.Module, overrides: dict[str, str]) -> Schedule:
    state = Declarations(module.file)
    param_names = [s.name for s in module.stmts if isinstance(s, ast.Param)]
    let_names = {s.name for s in module.stmts if isinstance(s, ast.Let)}
    for name, text in overrides.items():
        if name not in param_names:
            what = (
                f"'{name}' is a let, not a param"
                if name in let_names
                else (f"no param '{name}' in this schedule")
            )
            hint = did_you_mean(name, param_names)
            known = ", ".join(param_names) if param_names else "none"
            raise ElaborationError(f"-D {name}={text}: {what}{hint} (params: {known})", None)
    for required, meaning in (("d", "the number of devices"), ("m", "the number of microbatches")):
        if required not in param_names:
            raise ElaborationError(
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
                raise ElaborationError(
                    f"{what} is given twice (also at {other.line}:{other.column}); keep one",
                    stmt.span,
                )
            seen[kind] = stmt.span
        if isinstance(stmt, (ast.Place, ast.Cost, ast.Memory, ast.Recompute)) and "d" not in state.env:
            d_span = next(s.span for s in module.stmts if isinstance(s, ast.Param) and s.name == "d")
            what = {
                ast.Place: "'place'",
                ast.Cost: "'cost'",
                ast.Memory: "'memory'",
                ast.Recompute: "'recompute'",
            }[type(stmt)]
            raise ElaborationError(
                f"{what} depends on the number of devices, but 'param d' comes later "
                f"(at {d_span.line}:{d_span.column}); move 'param d' above it",
                stmt.span,
            )
        if isinstance(stmt, ast.Param):
            declare_param(stmt, state, overrides)
        elif isinstance(stmt, ast.Let):
            value = state.evaluate(stmt.value)
            state.define(stmt.name, value, stmt.span)
            state.params.append((stmt.name, value))
        elif isinstance(stmt, ast.Require):
            require(stmt, state)
        elif isinstance(stmt, ast.Place):
            declare_placement(stmt, state)
        elif isinstance(stmt, ast.Backward):
            if stmt.mode not in ("split", "fused"):
                hint = did_you_mean(stmt.mode, ("split", "fused")) or "; write split or fused"
                raise ElaborationError(f"unknown backward '{stmt.mode}'{hint}", stmt.mode_span)
            state.split_backward = stmt.mode == "split"
        elif isinstance(stmt, ast.Cost):
            declare_cost(stmt, state)
        elif isinstance(stmt, ast.Memory):
            declare_memory(stmt, state)
        elif isinstance(stmt, ast.Recompute):
            declare_recompute(stmt, state)
        else:
            deferred.append(stmt)
    placement = ensure_placement(state)
    m = state.env["m"]
    assert type(m) is int
    _check_size(module, state, placement.num_stages * m, overrides)
    costs = state.cost_model()
    memory = state.memory_model()
    orders = None
    block = None
    expects = []
    for stmt in deferred:
        if isinstance(stmt, ast.OrderDecl):
            orders = elaborate_order(stmt, state, placement, m)
        elif isinstance(stmt, ast.BlockDecl):
            if placement.lanes > 1:
                raise ElaborationError(
                    f"a block runs every microbatch through all {placement.num_stages} stages, "
                    f"but '{placement.kind}' runs {placement.lanes} pipelines of "
                    f"{placement.num_model_stages} stages; write its order with 'order {{ ... }}'",
                    stmt.span,
                )
            block, orders = elaborate_block(stmt, state, placement, m, costs)
        else:
            expects.append(expectation(stmt, state, placement.num_devices))
    if orders is None:
        raise ElaborationError(
            f"schedule '{module.name}' has no 'order {{ ... }}' or 'block period T {{ ... }}'",
            module.span,
        )
    params = tuple(
        (name, norm(value) if not isinstance(value, bool) else int(value))
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


def _check_size(
    module: ast.Module, state: Declarations, stage_microbatches: int, overrides: dict[str, str]
) -> None:
    """The passes the schedule expands to (every stage runs each pass kind once per
    microbatch, a recomputed one R besides) within `limits`, refused at `param m`
    before any expansion."""
    kinds = len(pass_kinds(state.split_backward))
    where = next(s for s in module.stmts if isinstance(s, ast.Param) and s.name == "m")
    m = state.env["m"]
    given = f" (-D m={overrides['m']})" if "m" in overrides else ""
    what = f"{stage_microbatches // m} stages x m = {m}{given} microbatches x {kinds} pass kinds"
    recomputed = sum(1 for marked in state.recompute or () if marked)
    if recomputed:
        what += f" + R on {recomputed} recomputed stage{'s' if recomputed != 1 else ''}"
    limits.check_passes(stage_microbatches * kinds + m * recomputed, where.span, what)
