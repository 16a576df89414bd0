"""Source spans, diagnostics, and how they are shown to a person.

Every AST node and every IR node that came from source carries a `Span`; every
finding of the compiler is a `Diagnostic`. A pass that finds errors collects them
all and raises one `CompileError`; the CLI renders them as
``file:line:col: error: message`` followed by the source line and a caret.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, TextIO

__all__ = [
    "Span",
    "Diagnostic",
    "CompileError",
    "Severity",
    "register_source",
    "source_text",
    "render",
    "render_all",
    "sorted_diagnostics",
]

Severity = Literal["error", "warning", "note"]


@dataclass(frozen=True, slots=True)
class Span:
    """A range of source text. Lines and columns count from 1; end is inclusive of
    the last character's column (end_column points at it)."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"

    def sort_key(self) -> tuple[str, int, int]:
        return (self.file, self.line, self.column)


@dataclass(frozen=True)
class Diagnostic:
    """One finding. `notes` are follow-up lines (each optionally located), used for
    deadlock cycles and "did you mean" hints."""

    severity: Severity
    message: str
    span: Span | None = None
    notes: tuple[tuple[Span | None, str], ...] = field(default_factory=tuple)

    def sort_key(self) -> tuple[int, str, int, int, str]:
        if self.span is None:
            return (1, "", 0, 0, self.message)
        return (0, *self.span.sort_key(), self.message)


class CompileError(Exception):
    """Raised by a compiler pass that found errors in the user's input."""

    def __init__(self, diagnostics: Iterable[Diagnostic]):
        self.diagnostics: list[Diagnostic] = sorted_diagnostics(diagnostics)
        super().__init__("\n".join(d.message for d in self.diagnostics))


def sorted_diagnostics(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Diagnostics ordered by location, unlocated ones last."""
    return sorted(diagnostics, key=Diagnostic.sort_key)


_SOURCES: dict[str, str] = {}


def register_source(file: str, text: str) -> None:
    """Remember a file's text so diagnostics can quote its lines."""
    _SOURCES[file] = text


def source_text(file: str) -> str | None:
    """The registered text of `file`, if any."""
    return _SOURCES.get(file)


_COLORS = {"error": "\x1b[1;31m", "warning": "\x1b[1;35m", "note": "\x1b[1;36m"}


def _use_color(stream: TextIO) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    return hasattr(stream, "isatty") and stream.isatty()


_QUOTE_WIDTH = 120
"""The most characters of a source line quoted under a message."""


def _quote(span: Span) -> list[str]:
    text = _SOURCES.get(span.file)
    if text is None:
        return []
    lines = text.splitlines()
    if not 1 <= span.line <= len(lines):
        return []
    line = lines[span.line - 1].rstrip("\n")
    width = 1
    if span.end_line == span.line and span.end_column >= span.column:
        width = span.end_column - span.column + 1
    column = span.column
    if len(line) > _QUOTE_WIDTH:
        # a long line (generated, or hostile) is quoted as a window around the caret
        start = max(0, min(column - 1 - _QUOTE_WIDTH // 2, len(line) - _QUOTE_WIDTH))
        end = start + _QUOTE_WIDTH
        window = line[start:end]
        prefix = "..." if start > 0 else ""
        line = prefix + window + ("..." if end < len(line) else "")
        column = column - start + len(prefix)
        width = max(1, min(width, _QUOTE_WIDTH - (column - 1 - len(prefix))))
    caret = " " * (column - 1) + "^" + "~" * (width - 1)
    return [f"    {line}", f"    {caret}"]


def render(diagnostic: Diagnostic, color: bool = False) -> str:
    """`file:line:col: severity: message`, the quoted line with a caret, then notes."""
    sev = diagnostic.severity
    label = f"{_COLORS[sev]}{sev}\x1b[0m" if color else sev
    where = f"{diagnostic.span}: " if diagnostic.span else "ppdsl: "
    out = [f"{where}{label}: {diagnostic.message}"]
    if diagnostic.span:
        out += _quote(diagnostic.span)
    for span, note in diagnostic.notes:
        out.append(f"  {span.file}:{span.line}: {note}" if span else f"  {note}")
    return "\n".join(out)


def render_all(diagnostics: Iterable[Diagnostic], stream: TextIO | None = None) -> str:
    """Render sorted diagnostics; colour only on a terminal and without NO_COLOR."""
    stream = stream if stream is not None else sys.stderr
    color = _use_color(stream)
    return "\n".join(render(d, color) for d in sorted_diagnostics(diagnostics))
