"""Source spans, diagnostics, and how they are shown to a person.

Every AST node and every IR node that came from source carries a `Span`; every
finding of the compiler is a `Diagnostic`. A pass that finds errors collects them
all and raises one `CompileError`; the CLI renders them as
``file:line:col: error: message`` followed by the source line and a caret.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, TextIO

__all__ = [
    "Span",
    "Edit",
    "Fix",
    "Diagnostic",
    "CompileError",
    "Severity",
    "register_source",
    "source_text",
    "render",
    "render_all",
    "sorted_diagnostics",
    "group_repeats",
    "apply_edits",
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


@dataclass(frozen=True, slots=True)
class Edit:
    """Replace the text from (line, column) up to, not including, (end_line,
    end_column) with `text`; 1-based, as an LSP text edit (an insertion has
    end == start)."""

    line: int
    column: int
    end_line: int
    end_column: int
    text: str


@dataclass(frozen=True, slots=True)
class Fix:
    """An edit of the file that the compiler has proven makes it valid (rustc's
    machine-applicable suggestion): its edits do not overlap, and their
    positions refer to the file before the fix."""

    description: str
    edits: tuple[Edit, ...]


@dataclass(frozen=True)
class Diagnostic:
    """One finding. `notes` are follow-up lines (each optionally located): every
    other line that takes part (the other pass of a collision, each wait of a
    cycle, the loop that should have made a missing pass) and "did you mean"
    hints. `fixes` are proven edits, smallest first (`ppdsl.fixes`)."""

    severity: Severity
    message: str
    span: Span | None = None
    notes: tuple[tuple[Span | None, str], ...] = field(default_factory=tuple)
    fixes: tuple[Fix, ...] = field(default_factory=tuple)

    def sort_key(self) -> tuple[int, str, int, int, str]:
        if self.span is None:
            return (1, "", 0, 0, self.message)
        return (0, *self.span.sort_key(), self.message)


class CompileError(Exception):
    """Raised by a compiler pass that found errors in the user's input; one cause
    found on several devices is one diagnostic (`group_repeats`)."""

    def __init__(self, diagnostics: Iterable[Diagnostic]):
        self.diagnostics: list[Diagnostic] = sorted_diagnostics(group_repeats(diagnostics))
        super().__init__("\n".join(d.message for d in self.diagnostics))


def sorted_diagnostics(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Diagnostics ordered by location, unlocated ones last."""
    return sorted(diagnostics, key=Diagnostic.sort_key)


_NUMBER = re.compile(r"\d+")
_DEVICE = re.compile(r"\bdevice (\d+)")
_SHOWN_INSTANCES = 3
"""How many instances of a grouped diagnostic its notes show."""


def _cause(d: Diagnostic) -> tuple:
    """What makes two diagnostics one cause: the same severity and line, and the
    same message but for its numbers (a device, a stage, a microbatch, a time)."""
    return (d.severity, d.span, _NUMBER.sub("#", d.message))


def _ranges(numbers: list[int]) -> str:
    """`0-3, 5`: sorted numbers with consecutive runs joined."""
    parts: list[tuple[int, int]] = []
    for n in sorted(set(numbers)):
        if parts and n == parts[-1][1] + 1:
            parts[-1] = (parts[-1][0], n)
        else:
            parts.append((n, n))
    return ", ".join(f"{a}" if a == b else f"{a}\u2013{b}" for a, b in parts)


def _grouped(group: list[Diagnostic]) -> Diagnostic:
    first = group[0]
    devices = [int(m.group(1)) for d in group for m in [_DEVICE.search(d.message)] if m]
    if len(devices) == len(group) and len(set(devices)) == len(group):
        where = f"devices {_ranges(devices)}"
        if first.message.startswith(f"on device {devices[0]},"):
            message = first.message.replace(
                f"on device {devices[0]},", f"on {where} (device {devices[0]} shown),", 1
            )
        else:
            message = f"on {where}: {first.message}"
    else:
        message = f"{first.message} (and {len(group) - 1} more like it)"
    notes: list[tuple[Span | None, str]] = []
    for d in group[:_SHOWN_INSTANCES]:
        if d is not first:
            notes.append((d.span, f"also: {d.message}"))
        notes += [n for n in d.notes if n not in notes]
    return Diagnostic(first.severity, message, first.span, tuple(notes), first.fixes)


def group_repeats(diagnostics: Iterable[Diagnostic]) -> list[Diagnostic]:
    """One diagnostic per cause: those that differ only in their numbers at one
    line (one wrong offset seen on every device) become one, "on devices 0-3
    (device 0 shown), ...", its notes showing the first instances."""
    groups: dict[tuple, list[Diagnostic]] = {}
    for d in diagnostics:
        groups.setdefault(_cause(d), []).append(d)
    return [group[0] if len(group) == 1 else _grouped(group) for group in groups.values()]


def apply_edits(text: str, edits: Iterable[Edit]) -> str:
    """`text` with non-overlapping `edits` (positions in `text`) made."""
    starts = [0]
    for line in text.split("\n"):
        starts.append(starts[-1] + len(line) + 1)

    def offset(line: int, column: int) -> int:
        return min(starts[line - 1] + column - 1, len(text)) if line <= len(starts) - 1 else len(text)

    out = text
    for edit in sorted(edits, key=lambda e: (e.line, e.column), reverse=True):
        lo, hi = offset(edit.line, edit.column), offset(edit.end_line, edit.end_column)
        out = out[:lo] + edit.text + out[hi:]
    return out


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
    for fix in diagnostic.fixes:
        out += _help(diagnostic, fix)
    return "\n".join(out)


def _help(diagnostic: Diagnostic, fix: Fix) -> list[str]:
    """`help: DESCRIPTION`, then each edited line as it reads after the fix."""
    file = diagnostic.span.file if diagnostic.span else None
    text = _SOURCES.get(file) if file else None
    out = [f"  help: {fix.description}"]
    if text is None:
        return out
    fixed = apply_edits(text, fix.edits).split("\n")
    shift = 0
    for edit in sorted(fix.edits, key=lambda e: (e.line, e.column)):
        first = edit.line + shift
        count = edit.text.count("\n") + 1
        for n in range(first, first + count):
            if 1 <= n <= len(fixed):
                out.append(f"    {file}:{n}: {fixed[n - 1].strip()}")
        shift += count - (edit.end_line - edit.line + 1)
    return out


def render_all(diagnostics: Iterable[Diagnostic], stream: TextIO | None = None) -> str:
    """Render sorted diagnostics; colour only on a terminal and without NO_COLOR."""
    stream = stream if stream is not None else sys.stderr
    color = _use_color(stream)
    return "\n".join(render(d, color) for d in sorted_diagnostics(diagnostics))
