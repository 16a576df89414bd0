"""The AST of a `.pp` file: frozen dataclasses, each with the `span` of its source.

`ppdsl.parse` builds it from the lark tree; `ppdsl.elaborate` turns it into the
schedule IR. Expressions are kept unevaluated: their values depend on `-D`
overrides and on the loop variables of the order form.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ppdsl.diagnostics import Span

__all__ = [
    "Expr",
    "Number",
    "Name",
    "Unary",
    "Binary",
    "Cond",
    "Call",
    "Range",
    "SpanRange",
    "ReversedRange",
    "NamedRange",
    "Param",
    "Let",
    "Place",
    "Backward",
    "Cost",
    "Memory",
    "Slot",
    "SlotLine",
    "Fill",
    "BlockDecl",
    "For",
    "Repeat",
    "If",
    "Interleave",
    "PassCall",
    "OrderDecl",
    "ExpectDecl",
    "Stmt",
    "OrderStmt",
    "Module",
]


# --- expressions -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Number:
    """A literal: `3`, `18.522` (kept exact)."""

    value: Fraction
    span: Span


@dataclass(frozen=True, slots=True)
class Name:
    """A use of a name: `d`, `s`, `T_F`."""

    id: str
    span: Span


@dataclass(frozen=True, slots=True)
class Unary:
    """`-x` (op "-") or `not x` (op "not")."""

    op: str
    operand: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Binary:
    """`a OP b` for arithmetic (`+ - * / // %`), comparisons and `and`/`or`."""

    op: str
    left: Expr
    right: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Cond:
    """`cond ? then : else_`."""

    cond: Expr
    then: Expr
    else_: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Call:
    """`min(a, b)`, `max(...)`, `ceil(x)`, `floor(x)`."""

    func: str
    args: tuple[Expr, ...]
    span: Span


Expr = Number | Name | Unary | Binary | Cond | Call


@dataclass(frozen=True, slots=True)
class SpanRange:
    """`start..stop`, half-open."""

    start: Expr
    stop: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class ReversedRange:
    """`reversed(range)`."""

    inner: Range
    span: Span


@dataclass(frozen=True, slots=True)
class NamedRange:
    """A name bound to a range, such as `chunks`."""

    expr: Expr
    span: Span


Range = SpanRange | ReversedRange | NamedRange


# --- top-level statements -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Param:
    """`param NAME = default`; `-D NAME=value` overrides it. default None: `-D` must."""

    name: str
    default: Expr | None
    span: Span


@dataclass(frozen=True, slots=True)
class Let:
    """`let NAME = value` (top level or in the order form)."""

    name: str
    value: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class Place:
    """`place KIND`, `place KIND(arg)` or `place [e0, e1, ...]` (kind "list")."""

    kind: str
    arg: Expr | None
    devices: tuple[Expr, ...]
    span: Span
    kind_span: Span


@dataclass(frozen=True, slots=True)
class Backward:
    """`backward split` or `backward fused` (mode as written; elaboration checks it)."""

    mode: str
    span: Span
    mode_span: Span


@dataclass(frozen=True, slots=True)
class Cost:
    """`cost NAME = value` or `cost NAME[s] = value` (per stage, `s` bound to index)."""

    name: str
    index: str | None
    value: Expr
    span: Span
    name_span: Span


@dataclass(frozen=True, slots=True)
class Memory:
    """`memory M_B = value` or `memory M_W[s] = value`."""

    name: str
    index: str | None
    value: Expr
    span: Span
    name_span: Span


@dataclass(frozen=True, slots=True)
class Slot:
    """`KIND at start` in a block line."""

    kind: str
    start: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class SlotLine:
    """A block line. chunk None: every chunk; int: that chunk; str: every chunk not
    given by number, the name bound to the chunk index."""

    chunk: int | str | None
    slots: tuple[Slot, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Fill:
    """`W fill`: the passes of `kind` are placed greedily."""

    kind: str
    span: Span


@dataclass(frozen=True, slots=True)
class BlockDecl:
    """`block period T { lines }`: the building block of the controllable-memory paper."""

    period: Expr
    lines: tuple[SlotLine | Fill, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class For:
    """`for var in range { body }`."""

    var: str
    range: Range
    body: tuple[OrderStmt, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Repeat:
    """`repeat count { body }`."""

    count: Expr
    body: tuple[OrderStmt, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class If:
    """`if cond { then } else { else_ }` (else_ empty when absent)."""

    cond: Expr
    then: tuple[OrderStmt, ...]
    else_: tuple[OrderStmt, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class Interleave:
    """`interleave { first } with { second }`: alternate one pass of each."""

    first: tuple[OrderStmt, ...]
    second: tuple[OrderStmt, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class PassCall:
    """`F(j)` or `F(j, c)`: the pass of microbatch j on chunk c of the device."""

    kind: str
    args: tuple[Expr, ...]
    span: Span


OrderStmt = Let | For | Repeat | If | Interleave | PassCall


@dataclass(frozen=True, slots=True)
class OrderDecl:
    """`order { body }`: run once per device with `i` bound."""

    body: tuple[OrderStmt, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class ExpectDecl:
    """`expect METRIC[device] OP bound`; `text` is the bound as written."""

    metric: str
    device: Expr | None
    op: str
    bound: Expr
    text: str
    span: Span
    metric_span: Span


Stmt = Param | Let | Place | Backward | Cost | Memory | BlockDecl | OrderDecl | ExpectDecl


@dataclass(frozen=True, slots=True)
class Module:
    """One `.pp` file: `schedule NAME { statements }`."""

    name: str
    stmts: tuple[Stmt, ...]
    file: str
    span: Span
