"""Proven fixes for a rejected file: the smallest edits that make it valid.

A schedule's validity is decided by the compiler, so a fix can be proven rather
than guessed (rustc's machine-applicable suggestions): `find_fixes` lists
candidate edits at the lines the errors involve, and at the declarations every
schedule has, recompiles the edited text with the same `-D` overrides and
costs (the file's own expectations included), and attaches each edit that
compiles to the error it touches, smallest first. The candidates are:

- a block slot's offset +-1, +-2, +-d, or swapped with another slot's;
- the block's period +-1;
- a loop's bound +-1;
- the placement word (parallel, looped(v), vshape);
- `backward split|fused`;
- a failing expectation's bound set to the measured value.

The search is bounded by a time budget (`BUDGET_SECONDS`, 1 s: what it may add
to `ppdsl check`) and a count of candidates; it stops once `MAX_FIXES` are proven.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from ppdsl import jit
from ppdsl.costs_file import CostsFile
from ppdsl.diagnostics import (
    CompileError,
    Diagnostic,
    Edit,
    Fix,
    Span,
    apply_edits,
    register_source,
    source_text,
)
from ppdsl.frontend import ast
from ppdsl.frontend.parse import parse, parse_expression

__all__ = ["BUDGET_SECONDS", "MAX_FIXES", "find_fixes", "apply_fix", "candidate_fixes"]

BUDGET_SECONDS = 1.0
"""What looking for fixes may add to one `ppdsl check` (issue 40)."""
MAX_FIXES = 3
"""How many proven fixes the search collects before it stops."""
MAX_CANDIDATES = 40
"""How many candidate edits it compiles at most."""

_PLACEMENTS = ("parallel", "looped(v)", "looped(2)", "vshape")


@dataclass(frozen=True)
class _Candidate:
    """A candidate fix, its tier (0: at a line an error involves, 1: a
    declaration, 2: an expectation's bound), its size in characters, and the
    same edit on the AST: (the span of the node replaced, what it becomes: "expr"
    text, or a "place" or "backward" word)."""

    fix: Fix
    tier: int
    size: int
    lines: frozenset[int]
    nodes: tuple[tuple[Span, str, str], ...]


def apply_fix(text: str, fix: Fix) -> str:
    """`text` with the fix's edits made."""
    return apply_edits(text, fix.edits)


def _size(old: str, new: str) -> int:
    """Characters changed: the longer of the two middles once the common prefix
    and suffix are set aside."""
    start = 0
    while start < min(len(old), len(new)) and old[start] == new[start]:
        start += 1
    end = 0
    while end < min(len(old), len(new)) - start and old[-1 - end] == new[-1 - end]:
        end += 1
    return max(len(old) - start - end, len(new) - start - end)


def _text_of(lines: list[str], span: Span) -> str | None:
    if span.line != span.end_line or not 1 <= span.line <= len(lines):
        return None
    return lines[span.line - 1][span.column - 1 : span.end_column]


def _edit(span: Span, text: str) -> Edit:
    """Replace the span's text (its end column inclusive) with `text`."""
    return Edit(span.line, span.column, span.end_line, span.end_column + 1, text)


_TERM = re.compile(r"([+-])\s*(\d+)(?![\w.(])")


def _constant(old: str) -> re.Match[str] | None:
    """The last `+ k` / `- k` term of `old` at the top level: outside brackets,
    not multiplied or divided (`3*d - 2 - 2*s`: the `- 2`)."""
    found = None
    for match in _TERM.finditer(old):
        before = old[: match.start()]
        after = old[match.end() :].lstrip()
        if before.count("(") != before.count(")") or not before.strip():
            continue
        if before.rstrip()[-1] in "*/%+-(" or after[:1] in ("*", "/", "%"):
            continue
        found = match
    return found


def _shifted(old: str, delta: str) -> str:
    """`old` moved by `delta` ("+1", "-d"): its top-level integer term is adjusted
    in place (`3*d - 1 - 2*s` - 1 -> `3*d - 2 - 2*s`; `s + 1` - 1 -> `s`), a
    literal changes value, and anything else gets the term appended."""
    sign, amount = delta[0], delta[1:]
    step = (1 if sign == "+" else -1) * int(amount) if amount.isdigit() else None
    if step is not None and old.strip().isdigit():
        value = int(old) + step
        return str(value) if value >= 0 else f"{old} {sign} {amount}"
    match = _constant(old) if step is not None else None
    if match is None or step is None:
        return f"{old} {sign} {amount}"
    value = int(match.group(2)) * (1 if match.group(1) == "+" else -1) + step
    head, tail = old[: match.start()].rstrip(), old[match.end() :]
    if value == 0:
        return f"{head}{tail}"
    return f"{head} {'+' if value > 0 else '-'} {abs(value)}{tail}"


def _replacement(
    span: Span, old: str, new: str, description: str, tier: int, node: str = "expr",
    node_span: Span | None = None,
) -> _Candidate:
    return _Candidate(
        Fix(description, (_edit(span, new),)), tier, _size(old, new), frozenset({span.line}),
        ((node_span or span, node, new),),
    )


def _walk_loops(stmts: Sequence[ast.OrderStmt]) -> Iterator[ast.For]:
    for stmt in stmts:
        if isinstance(stmt, ast.For):
            yield stmt
            yield from _walk_loops(stmt.body)
        elif isinstance(stmt, ast.If):
            yield from _walk_loops(stmt.then)
            yield from _walk_loops(stmt.else_)
        elif isinstance(stmt, ast.Repeat):
            yield from _walk_loops(stmt.body)
        elif isinstance(stmt, ast.Interleave):
            yield from _walk_loops(stmt.first)
            yield from _walk_loops(stmt.second)


def _slot_candidates(
    block: ast.BlockDecl, lines: list[str], involved: set[int]
) -> Iterator[_Candidate]:
    slots = [
        slot for line in block.lines if isinstance(line, ast.SlotLine) for slot in line.slots
    ]
    for slot in slots:
        span = slot.start.span
        old = _text_of(lines, span)
        if old is None or span.line not in involved:
            continue
        for delta in ("+1", "-1", "+2", "-2", "+d", "-d"):
            new = _shifted(old, delta)
            yield _replacement(
                span, old, new, f"start {slot.kind} at {new} (was {old})", 0
            )
        for other in slots:
            other_old = _text_of(lines, other.start.span)
            if other is slot or other_old is None or other_old == old:
                continue
            if (other.start.span.line, other.start.span.column) < (span.line, span.column):
                continue  # each pair once
            fix = Fix(
                f"swap the offsets of {slot.kind} ({old}) and {other.kind} ({other_old})",
                (_edit(span, other_old), _edit(other.start.span, old)),
            )
            yield _Candidate(
                fix, 0, len(old) + len(other_old),
                frozenset({span.line, other.start.span.line}),
                ((span, "expr", other_old), (other.start.span, "expr", old)),
            )


def _period_candidates(block: ast.BlockDecl, lines: list[str]) -> Iterator[_Candidate]:
    span = block.period.span
    old = _text_of(lines, span)
    if old is None:
        return
    for delta in ("+1", "-1"):
        new = _shifted(old, delta)
        if new.strip() in ("0", ""):
            continue
        yield _replacement(span, old, new, f"make the period {new} (was {old})", 1)


def _loop_candidates(
    order: ast.OrderDecl, lines: list[str], involved: set[int]
) -> Iterator[_Candidate]:
    for loop in _walk_loops(order.body):
        inner = loop.range.inner if isinstance(loop.range, ast.ReversedRange) else loop.range
        if not isinstance(inner, ast.SpanRange):
            continue
        if not involved & set(range(loop.span.line, loop.span.end_line + 1)):
            continue
        span = inner.stop.span
        old = _text_of(lines, span)
        if old is None:
            continue
        for delta in ("+1", "-1"):
            new = _shifted(old, delta)
            yield _replacement(
                span, old, new, f"run `for {loop.var}` to {new} (was {old})", 0
            )


def _declaration_candidates(
    module: ast.Module, lines: list[str]
) -> Iterator[_Candidate]:
    params = {s.name for s in module.stmts if isinstance(s, ast.Param)}
    for stmt in module.stmts:
        if isinstance(stmt, ast.Place) and stmt.span.line == stmt.span.end_line:
            span = Span(
                stmt.span.file, stmt.span.line, stmt.kind_span.column, stmt.span.line,
                stmt.span.end_column,
            )
            old = _text_of(lines, span)
            if old is None:
                continue
            for new in _PLACEMENTS:
                if new == old or ("(v)" in new and "v" not in params):
                    continue
                yield _replacement(
                    span, old, new, f"place {new} (was {old})", 1, "place", stmt.span
                )
        if isinstance(stmt, ast.Backward) and stmt.mode in ("split", "fused"):
            new = "fused" if stmt.mode == "split" else "split"
            yield _replacement(
                stmt.mode_span, stmt.mode, new, f"make the backward {new} (was {stmt.mode})", 1,
                "backward", stmt.span,
            )


_MEASURED = re.compile(
    r"(?:peak activation memory on device \d+|the makespan|lifespan[^,]*?) is "
    r"(?P<value>-?\d+(?:/\d+)?),"
)


def _expect_candidates(
    module: ast.Module, lines: list[str], errors: Sequence[Diagnostic]
) -> Iterator[_Candidate]:
    """A failing expectation's bound set to the exact measured value (memory,
    makespan and lifespans are exact; a bubble ratio is printed rounded, so it
    is not offered)."""
    expects = {s.span.line: s for s in module.stmts if isinstance(s, ast.ExpectDecl)}
    for error in errors:
        if error.span is None or error.span.line not in expects:
            continue
        match = _MEASURED.search(error.message)
        if match is None:
            continue
        decl = expects[error.span.line]
        old = _text_of(lines, decl.bound.span)
        if old is None:
            continue
        new = match.group("value")
        yield _replacement(
            decl.bound.span, old, new, f"expect {decl.metric} {decl.op} {new} (was {old})", 2
        )


def candidate_fixes(
    module: ast.Module, text: str, errors: Sequence[Diagnostic]
) -> list[_Candidate]:
    """The candidate edits for `errors` in `text` (parsed as `module`), in the
    order they are tried: those at a line an error involves first, then the
    declarations, then the expectations' bounds; smallest first within each."""
    file = module.file
    lines = text.split("\n")
    involved = {
        span.line
        for error in errors
        for span in (error.span, *(s for s, _ in error.notes))
        if span is not None and span.file == file
    }
    found: list[_Candidate] = []
    for stmt in module.stmts:
        if isinstance(stmt, ast.BlockDecl):
            found += _slot_candidates(stmt, lines, involved)
            found += _period_candidates(stmt, lines)
        if isinstance(stmt, ast.OrderDecl):
            found += _loop_candidates(stmt, lines, involved)
    found += _declaration_candidates(module, lines)
    found += _expect_candidates(module, lines, errors)
    unique: dict[tuple[Edit, ...], _Candidate] = {}
    for candidate in found:
        unique.setdefault(candidate.fix.edits, candidate)
    return sorted(unique.values(), key=lambda c: (c.tier, c.size))


def _node(span: Span, what: str, text: str, within: Any) -> Any:
    """The AST node that `text` makes in place of `within` (an expression, or
    the `place` / `backward` statement)."""
    if what == "expr":
        return parse_expression(text, span.file)
    if what == "backward":
        return replace(within, mode=text)
    placed = parse(f"schedule fix {{\n    place {text}\n}}\n", span.file).stmts[0]
    return replace(placed, span=within.span, kind_span=within.kind_span)


def _rebuilt(node: Any, target: Span, what: str, text: str) -> Any:
    """`node` with its descendant at `target` replaced (a statement's span may
    be its header only, so every statement is visited; an expression is entered
    only when it holds the target)."""
    if isinstance(node, tuple):
        items = tuple(_rebuilt(item, target, what, text) for item in node)
        return node if all(a is b for a, b in zip(items, node, strict=True)) else items
    span = getattr(node, "span", None)
    if not isinstance(span, Span):
        return node
    if span == target and (what != "expr" or isinstance(node, _EXPRESSIONS)):
        return _node(target, what, text, node)
    if isinstance(node, _EXPRESSIONS) and not _holds(span, target):
        return node
    changes = {}
    for f in fields(node):
        value = getattr(node, f.name)
        if isinstance(value, tuple) or is_dataclass(value):
            new = _rebuilt(value, target, what, text)
            if new is not value:
                changes[f.name] = new
    return replace(node, **changes) if changes else node


_EXPRESSIONS = (ast.Number, ast.Name, ast.Unary, ast.Binary, ast.Cond, ast.Call)


def _holds(outer: Span, inner: Span) -> bool:
    return (outer.line, outer.column) <= (inner.line, inner.column) and (
        outer.end_line, outer.end_column
    ) >= (inner.end_line, inner.end_column)


def _screened(
    module: ast.Module, candidate: _Candidate, overrides: dict[str, str], options: dict[str, Any]
) -> bool:
    """Whether the candidate's edit, made on the AST, compiles (no parse: the
    cheap test before the proof on the text)."""
    from ppdsl.compiler import compile_module

    try:
        for target, what, text in candidate.nodes:
            module = _rebuilt(module, target, what, text)
        compile_module(module, overrides, **options)
    except CompileError:
        return False
    return True


def _valid(text: str, file: str, overrides: dict[str, str], options: dict[str, Any]) -> bool:
    """Whether the edited text compiles (every check and expectation)."""
    from ppdsl.compiler import compile_source

    try:
        compile_source(text, file, overrides, **options)
    except CompileError:
        return False
    return True


def find_fixes(
    diagnostics: Sequence[Diagnostic],
    text: str,
    file: str,
    overrides: dict[str, str] | None = None,
    *,
    costs: CostsFile | None = None,
    early_receives: bool = True,
    comm_model: str = "rendezvous",
    budget_seconds: float = BUDGET_SECONDS,
    max_candidates: int = MAX_CANDIDATES,
    compile_seconds: float = 0.0,
) -> list[Diagnostic]:
    """`diagnostics` with the proven fixes attached: each to the first error whose
    lines it edits (or to the first error), smallest edit first. Every fix is
    proven by compiling the edited text under the same overrides, costs, early
    receives and communication model as the file was checked under.
    `compile_seconds`, what compiling the file took, is the first guess of what a
    candidate takes: no candidate starts that could end past the budget."""
    errors = [d for d in diagnostics if d.severity == "error"]
    if not errors:
        return list(diagnostics)
    options: dict[str, Any] = {
        "costs": costs, "early_receives": early_receives, "comm_model": comm_model
    }
    started = time.perf_counter()
    proven: list[_Candidate] = []
    original = source_text(file)
    try:
        module = parse(text, file)
    except CompileError:
        return list(diagnostics)
    # the longest a screen took, and a proof (a compile with its parse): the next
    # may take as long, so none starts that would end past the budget
    slowest_screen, proof = compile_seconds / 2, compile_seconds

    def left() -> float:
        return budget_seconds - (time.perf_counter() - started)

    # the candidates are the file's size: where its own compile ran the kernels as
    # plain Python, so do theirs, or the kernels' running count (`jit.SMALL`) would
    # start numba mid-search, which alone costs about the whole budget
    small = jit.active() == "auto" and "numba" not in sys.modules
    kernels = jit.mode("python") if small else contextlib.nullcontext()
    try:
        with kernels:
            for count, candidate in enumerate(candidate_fixes(module, text, errors)):
                if count >= max_candidates or len(proven) >= MAX_FIXES:
                    break
                if left() < slowest_screen:
                    break
                begun = time.perf_counter()
                screened = _screened(module, candidate, overrides or {}, options)
                slowest_screen = max(slowest_screen, time.perf_counter() - begun)
                if not screened:
                    continue
                if left() < proof:
                    break
                begun = time.perf_counter()
                if _valid(apply_fix(text, candidate.fix), file, overrides or {}, options):
                    proven.append(candidate)
                proof = max(proof, time.perf_counter() - begun)
    finally:
        if original is not None:  # the candidates' compiles registered their text
            register_source(file, original)
    by_error: dict[int, list[_Candidate]] = {}
    for candidate in sorted(proven, key=lambda c: c.size):
        owner = next(
            (
                k for k, error in enumerate(errors)
                if candidate.lines & {
                    s.line for s in (error.span, *(n for n, _ in error.notes)) if s is not None
                }
            ),
            0,
        )
        by_error.setdefault(owner, []).append(candidate)
    out: list[Diagnostic] = []
    k = 0
    for d in diagnostics:
        if d.severity == "error":
            fixes = tuple(c.fix for c in by_error.get(k, ()))
            out.append(replace(d, fixes=d.fixes + fixes) if fixes else d)
            k += 1
        else:
            out.append(d)
    return out
