"""A corpus of one- and two-edit changes to the examples, as a new user makes them
(issue 40): an offset moved, a period changed, a line dropped or two swapped, a
loop bound changed, the placement or the backward form changed. Each mutant keeps
the lines it edited, so a measurement can ask whether an error points near them.

`python -m tests.mutations` compiles every mutant and prints, over the rejected
ones, how many have an error or note within 2 lines of an edited line, how many
one-edit mutants get a fix that `ppdsl check` then accepts, whether any offered
fix gives an invalid file, and how many errors repeat per device.
"""

from __future__ import annotations

import random
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ppdsl.diagnostics import CompileError, Diagnostic
from ppdsl.frontend import ast
from ppdsl.frontend.parse import parse
from tests.paths import EXAMPLES

__all__ = ["Mutant", "Measure", "corpus", "measure", "is_near", "repeated_errors", "main"]

_PLACEMENTS = ("parallel", "looped(2)", "vshape")
_TWO_EDIT_PER_EXAMPLE = 12
_SEED = 40


@dataclass(frozen=True)
class _Change:
    """One change to a file's lines: line `index` (0-based) becomes `lines`."""

    index: int
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Mutant:
    """An example with one or two changes: its text and the (1-based) lines the
    changes touch in that text (for a dropped line, the lines either side)."""

    example: str
    description: str
    text: str
    edited_lines: frozenset[int]
    num_edits: int


def _replace(line: str, column: int, end_column: int, text: str) -> str:
    """`line` with columns [column, end_column] (1-based, inclusive) replaced."""
    return line[: column - 1] + text + line[end_column:]


def _expr_changes(lines: list[str], span, what: str, texts: list[str]) -> Iterator[tuple[str, _Change]]:
    if span.line != span.end_line:
        return
    old = lines[span.line - 1][span.column - 1 : span.end_column]
    for text in texts:
        new = text.format(old=old)
        yield f"{what} {old!r} -> {new!r}", _Change(
            span.line - 1, (_replace(lines[span.line - 1], span.column, span.end_column, new),)
        )


def _number_or_shift(old_value: ast.Expr, deltas: tuple[int, ...]) -> list[str]:
    if isinstance(old_value, ast.Number) and old_value.value.denominator == 1:
        return [str(int(old_value.value) + k) for k in deltas if int(old_value.value) + k > 0]
    return [f"{{old}} {'+' if k > 0 else '-'} {abs(k)}" for k in deltas]


def _walk_order(stmts) -> Iterator[ast.For]:
    for stmt in stmts:
        if isinstance(stmt, ast.For):
            yield stmt
            yield from _walk_order(stmt.body)
        elif isinstance(stmt, ast.If):
            yield from _walk_order(stmt.then)
            yield from _walk_order(stmt.else_)
        elif isinstance(stmt, ast.Repeat):
            yield from _walk_order(stmt.body)


def _body_lines(lines: list[str], span) -> list[int]:
    """0-based indices of the code lines strictly inside a block or order whose
    braces balance (dropping or swapping them keeps the file parseable)."""
    found = []
    for index in range(span.line, span.end_line - 1):
        code = lines[index].split("#", 1)[0].strip()
        if code and code.count("{") == code.count("}") and code not in ("}",):
            found.append(index)
    return found


def _one_edit_changes(text: str, file: str) -> list[tuple[str, tuple[_Change, ...]]]:
    lines = text.split("\n")
    module = parse(text, file)
    found: list[tuple[str, tuple[_Change, ...]]] = []
    for stmt in module.stmts:
        if isinstance(stmt, ast.BlockDecl):
            for description, change in _expr_changes(
                lines, stmt.period.span, "period", _number_or_shift(stmt.period, (1, -1))
            ):
                found.append((description, (change,)))
            for line in stmt.lines:
                if isinstance(line, ast.SlotLine):
                    for slot in line.slots:
                        for description, change in _expr_changes(
                            lines, slot.start.span, f"offset of {slot.kind}",
                            ["{old} + 1", "{old} - 1", "{old} + 2"],
                        ):
                            found.append((description, (change,)))
        if isinstance(stmt, ast.OrderDecl):
            for loop in _walk_order(stmt.body):
                inner = loop.range.inner if isinstance(loop.range, ast.ReversedRange) else loop.range
                if isinstance(inner, ast.SpanRange):
                    for description, change in _expr_changes(
                        lines, inner.stop.span, "loop bound", ["{old} - 1", "{old} + 1"]
                    ):
                        found.append((description, (change,)))
        if isinstance(stmt, ast.BlockDecl | ast.OrderDecl):
            body = _body_lines(lines, stmt.span)
            for index in body:
                found.append((f"line {index + 1} dropped", (_Change(index, ()),)))
            for first, second in zip(body, body[1:], strict=False):
                if second == first + 1:
                    found.append((
                        f"lines {first + 1} and {second + 1} swapped",
                        (_Change(first, (lines[second],)), _Change(second, (lines[first],))),
                    ))
        if isinstance(stmt, ast.Place) and stmt.span.line == stmt.span.end_line:
            line = lines[stmt.span.line - 1]
            start = stmt.kind_span.column
            end = stmt.span.end_column
            old = line[start - 1 : end]
            for new in _PLACEMENTS:
                if new != old:
                    found.append((
                        f"placement {old!r} -> {new!r}",
                        (_Change(stmt.span.line - 1, (_replace(line, start, end, new),)),),
                    ))
        if isinstance(stmt, ast.Backward):
            new = {"split": "fused", "fused": "split"}.get(stmt.mode)
            if new:
                span = stmt.mode_span
                found.append((
                    f"backward {stmt.mode} -> {new}",
                    (_Change(span.line - 1, (_replace(lines[span.line - 1], span.column, span.end_column, new),)),),
                ))
    return found


def _apply(text: str, changes: tuple[_Change, ...]) -> tuple[str, frozenset[int]]:
    """The changed text and its edited lines (1-based, in the changed text)."""
    lines = text.split("\n")
    by_index = {c.index: c.lines for c in changes}
    out: list[str] = []
    edited: set[int] = set()
    for index, line in enumerate(lines):
        if index not in by_index:
            out.append(line)
            continue
        new = by_index[index]
        if not new:  # a dropped line: the lines either side of the gap
            edited.update({len(out), len(out) + 1})
        for piece in new:
            out.append(piece)
            edited.add(len(out))
    return "\n".join(out), frozenset(n for n in edited if n >= 1)


def corpus(examples: Path = EXAMPLES) -> list[Mutant]:
    """Every one-edit mutant of every example, and a seeded sample of two-edit ones
    (two changes on different lines)."""
    rng = random.Random(_SEED)
    mutants: list[Mutant] = []
    for path in sorted(examples.glob("*.pp")):
        text = path.read_text(encoding="utf-8")
        file = f"examples/{path.name}"
        changes = _one_edit_changes(text, file)
        for description, change in changes:
            new, edited = _apply(text, change)
            mutants.append(Mutant(path.stem, description, new, edited, 1))
        pairs = [
            (a, b) for k, a in enumerate(changes) for b in changes[k + 1 :]
            if not {c.index for c in a[1]} & {c.index for c in b[1]}
        ]
        for a, b in rng.sample(pairs, min(_TWO_EDIT_PER_EXAMPLE, len(pairs))):
            new, edited = _apply(text, a[1] + b[1])
            mutants.append(Mutant(path.stem, f"{a[0]}; {b[0]}", new, edited, 2))
    return mutants


def is_near(diagnostics: list[Diagnostic], edited: frozenset[int], within: int = 2) -> bool:
    """Some error, or a note of an error, lies within `within` lines of an edited line."""
    for d in diagnostics:
        if d.severity != "error":
            continue
        spans = [d.span, *(span for span, _ in d.notes)]
        for span in spans:
            if span is not None and any(abs(span.line - n) <= within for n in edited):
                return True
    return False


_NUMBER = re.compile(r"\d+")


def repeated_errors(diagnostics: list[Diagnostic]) -> int:
    """Errors that repeat another at the same line with only numbers changed (one
    cause reported per device, stage or microbatch)."""
    seen: set[tuple[int, str]] = set()
    repeats = 0
    for d in diagnostics:
        if d.severity != "error":
            continue
        key = (d.span.line if d.span else 0, _NUMBER.sub("#", d.message))
        repeats += key in seen
        seen.add(key)
    return repeats


@dataclass
class Measure:
    """What `measure` counts over a corpus."""

    mutants: int = 0
    rejected: int = 0
    near: int = 0
    rejected_one_edit: int = 0
    fixed_one_edit: int = 0
    fixes_offered: int = 0
    fixes_invalid: int = 0
    repeated: int = 0
    seconds: float = 0.0

    def percentages(self) -> tuple[float, float]:
        """(near %, fixed one-edit %)."""
        return (
            100 * self.near / max(1, self.rejected),
            100 * self.fixed_one_edit / max(1, self.rejected_one_edit),
        )


def _errors_of(text: str, file: str) -> list[Diagnostic] | None:
    """The diagnostics `ppdsl check` reports on `text` (with their fixes where the
    compiler has them), or None when the text is valid."""
    from ppdsl.compiler import compile_source

    try:
        compile_source(text, file)
    except CompileError as err:
        return _with_fixes(err.diagnostics, text, file)
    return None


def _with_fixes(diagnostics: list[Diagnostic], text: str, file: str) -> list[Diagnostic]:
    try:
        from ppdsl.fixes import find_fixes  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return diagnostics
    return find_fixes(diagnostics, text, file)


def _applied(text: str, fix) -> str:
    from ppdsl.fixes import apply_fix  # type: ignore[import-not-found, unused-ignore]

    return apply_fix(text, fix)


def measure(mutants: list[Mutant]) -> Measure:
    """Compile every mutant; for the rejected ones count where the errors point,
    their fixes (each applied and compiled again), and repeated errors."""
    from ppdsl.compiler import compile_source

    result = Measure(mutants=len(mutants))
    started = time.perf_counter()
    for mutant in mutants:
        file = f"examples/{mutant.example}.pp"
        diagnostics = _errors_of(mutant.text, file)
        if diagnostics is None:
            continue
        result.rejected += 1
        result.near += is_near(diagnostics, mutant.edited_lines)
        result.repeated += repeated_errors(diagnostics)
        fixes = [f for d in diagnostics for f in getattr(d, "fixes", ())]
        first_valid = None
        for fix in fixes:
            result.fixes_offered += 1
            try:
                compile_source(_applied(mutant.text, fix), file)
            except CompileError:
                result.fixes_invalid += 1
                continue
            if first_valid is None:
                first_valid = fix
        if mutant.num_edits == 1:
            result.rejected_one_edit += 1
            result.fixed_one_edit += bool(fixes) and first_valid is fixes[0]
    result.seconds = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    """Print the corpus's numbers (`-v`: each rejected mutant that no error points near)."""
    verbose = "-v" in (argv if argv is not None else sys.argv[1:])
    mutants = corpus()
    result = measure(mutants)
    near, fixed = result.percentages()
    print(f"mutants {result.mutants}, rejected {result.rejected} "
          f"({result.rejected_one_edit} one-edit), {result.seconds:.1f} s")
    print(f"near an edited line (within 2 lines): {near:.1f}%")
    print(f"one-edit rejected with a fix that check accepts: {fixed:.1f}%")
    print(f"offered fixes {result.fixes_offered}, invalid after applying {result.fixes_invalid}; "
          f"errors repeated per device {result.repeated}")
    if verbose:
        for mutant in mutants:
            diagnostics = _errors_of(mutant.text, f"examples/{mutant.example}.pp")
            if diagnostics is not None and not is_near(diagnostics, mutant.edited_lines):
                first = diagnostics[0]
                print(f"FAR {mutant.example}: {mutant.description} (lines "
                      f"{sorted(mutant.edited_lines)}): {first.span}: {first.message[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
