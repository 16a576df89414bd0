"""The AST of a `.pp` file: frozen dataclasses, each with the `span` of its source.

`ppdsl.frontend.parse` builds it from the lark tree; `ppdsl.frontend.elaborate` turns it into the
schedule IR. Expressions are kept unevaluated: their values depend on `-D`
overrides and on the loop variables of the order form.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ppdsl.diagnostics import Span
from ppdsl.semantics import format_literal, identify_placement, takes_chunks

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
    "Require",
    "Place",
    "Backward",
    "Cost",
    "Memory",
    "Recompute",
    "Slot",
    "SlotLine",
    "Fill",
    "Group",
    "BlockDecl",
    "For",
    "Repeat",
    "If",
    "Interleave",
    "PassCall",
    "Overlap",
    "OrderDecl",
    "ExpectDecl",
    "Stmt",
    "OrderStmt",
    "Module",
    "format_expr",
    "format_range",
    "format_module",
    "GENERATED",
    "number",
    "name",
    "binary",
    "per_stage",
    "place",
    "expect",
    "peak_bound",
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
    """`a OP b` for arithmetic (`+ - * / // % ^`), comparisons and `and`/`or`."""

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
class Require:
    """`require COND, "message"`: the schedule's valid range (an error at this
    line, quoting the message, when COND is false)."""

    cond: Expr
    message: str | None
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
class Recompute:
    """`recompute` (every stage), `recompute = cond` or `recompute[s] = cond(s)`:
    the stages whose F keeps only its input and whose R restores the rest."""

    index: str | None
    value: Expr | None
    span: Span


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
class Group:
    """`group G every U` in a block's header: G microbatches a group, U apart."""

    size: Expr
    spacing: Expr
    span: Span


@dataclass(frozen=True, slots=True)
class BlockDecl:
    """`block period T { lines }`: the building block of the controllable-memory paper;
    `block period T group G every U { lines }` repeats it for groups of G
    microbatches, one every U, a group every T (Megatron's interleaved 1F1B)."""

    period: Expr
    lines: tuple[SlotLine | Fill, ...]
    span: Span
    group: Group | None = None


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


@dataclass(frozen=True, slots=True)
class Overlap:
    """`F(j, c) & B(k, c2)`: a forward and a backward (B or BW) of another
    microbatch run as one combined pass (DualPipe's overlapped F&B)."""

    forward: PassCall
    backward: PassCall
    span: Span


OrderStmt = Let | For | Repeat | If | Interleave | PassCall | Overlap


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


Stmt = (
    Param
    | Let
    | Require
    | Place
    | Backward
    | Cost
    | Memory
    | Recompute
    | BlockDecl
    | OrderDecl
    | ExpectDecl
)


@dataclass(frozen=True, slots=True)
class Module:
    """One `.pp` file: `schedule NAME { statements }`."""

    name: str
    stmts: tuple[Stmt, ...]
    file: str
    span: Span


# --- the canonical text form ------------------------------------------------------

# Binding strength of each operator, loosest first, as in grammar/ppdsl.lark.
_PREC = {
    "?": 0,
    "or": 1,
    "and": 2,
    "not": 3,
    "==": 4,
    "!=": 4,
    "<": 4,
    "<=": 4,
    ">": 4,
    ">=": 4,
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
    "//": 6,
    "%": 6,
    "neg": 7,
    "^": 8,
}
_ATOM = 9
_INDENT = "    "
_WIDTH = 100
"""Consecutive pass calls share a line up to this many columns."""


def _prec(expr: Expr) -> int:
    if isinstance(expr, Number):
        return _ATOM if expr.value >= 0 else _PREC["neg"]
    if isinstance(expr, (Name, Call)):
        return _ATOM
    if isinstance(expr, Cond):
        return _PREC["?"]
    if isinstance(expr, Unary):
        return _PREC["neg"] if expr.op == "-" else _PREC["not"]
    return _PREC[expr.op]


def _wrap(expr: Expr, at_least: int) -> str:
    text = format_expr(expr)
    return f"({text})" if _prec(expr) < at_least else text


def format_expr(expr: Expr) -> str:
    """An expression as source text, with only the parentheses it needs."""
    if isinstance(expr, Number):
        text = format_literal(expr.value)
        return text if "/" not in text else f"({text})"
    if isinstance(expr, Name):
        return expr.id
    if isinstance(expr, Call):
        return f"{expr.func}({', '.join(format_expr(a) for a in expr.args)})"
    if isinstance(expr, Cond):
        cond = _wrap(expr.cond, _PREC["or"])
        return f"{cond} ? {format_expr(expr.then)} : {format_expr(expr.else_)}"
    if isinstance(expr, Unary):
        if expr.op == "-":
            return f"-{_wrap(expr.operand, _PREC['neg'])}"
        return f"not {_wrap(expr.operand, _PREC['not'])}"
    prec = _PREC[expr.op]
    if expr.op == "^":  # binds tighter than unary minus on its left, takes one on its right
        return f"{_wrap(expr.left, _ATOM)}^{_wrap(expr.right, _PREC['neg'])}"
    if prec == _PREC["=="]:  # comparisons do not chain
        return f"{_wrap(expr.left, prec + 1)} {expr.op} {_wrap(expr.right, prec + 1)}"
    return f"{_wrap(expr.left, prec)} {expr.op} {_wrap(expr.right, prec + 1)}"


def format_range(rng: Range) -> str:
    """A loop range as source text."""
    if isinstance(rng, SpanRange):
        return f"{_wrap(rng.start, _PREC['?'] + 1)}..{_wrap(rng.stop, _PREC['?'] + 1)}"
    if isinstance(rng, ReversedRange):
        return f"reversed({format_range(rng.inner)})"
    return format_expr(rng.expr)


def _format_call(call: PassCall | Overlap) -> str:
    if isinstance(call, Overlap):
        return f"{_format_call(call.forward)} & {_format_call(call.backward)}"
    return f"{call.kind}({', '.join(format_expr(a) for a in call.args)})"


def _format_body(body: tuple[OrderStmt, ...], depth: int) -> list[str]:
    """Statements one a line, except that consecutive pass calls share lines
    (`F(0); F(1); B(0)`) up to the width."""
    pad = _INDENT * depth
    lines: list[str] = []
    calls: list[str] = []

    def flush() -> None:
        line = ""
        for text in calls:
            if line and len(pad) + len(line) + 2 + len(text) > _WIDTH:
                lines.append(pad + line)
                line = ""
            line = f"{line}; {text}" if line else text
        if line:
            lines.append(pad + line)
        calls.clear()

    for stmt in body:
        if isinstance(stmt, (PassCall, Overlap)):
            calls.append(_format_call(stmt))
            continue
        flush()
        lines += _format_order_stmt(stmt, depth)
    flush()
    return lines


def _format_order_stmt(stmt: OrderStmt, depth: int) -> list[str]:
    pad = _INDENT * depth
    if isinstance(stmt, (PassCall, Overlap)):
        return [pad + _format_call(stmt)]
    if isinstance(stmt, Let):
        return [f"{pad}let {stmt.name} = {format_expr(stmt.value)}"]
    if isinstance(stmt, For):
        head = f"{pad}for {stmt.var} in {format_range(stmt.range)} {{"
        if stmt.body and all(isinstance(x, (PassCall, Overlap)) for x in stmt.body):
            # a loop of passes (a steady state) reads best on one line
            inline = f"{head} {'; '.join(_format_call(x) for x in stmt.body)} }}"  # type: ignore[arg-type]
            if len(inline) <= _WIDTH:
                return [inline]
        return [head, *_format_body(stmt.body, depth + 1), f"{pad}}}"]
    if isinstance(stmt, Repeat):
        head = f"{pad}repeat {format_expr(stmt.count)} {{"
        return [head, *_format_body(stmt.body, depth + 1), f"{pad}}}"]
    if isinstance(stmt, Interleave):
        return [
            f"{pad}interleave {{",
            *_format_body(stmt.first, depth + 1),
            f"{pad}}} with {{",
            *_format_body(stmt.second, depth + 1),
            f"{pad}}}",
        ]
    assert isinstance(stmt, If)
    lines = [f"{pad}if {format_expr(stmt.cond)} {{", *_format_body(stmt.then, depth + 1)]
    rest = stmt.else_
    while len(rest) == 1 and isinstance(rest[0], If):  # else if ...
        chained = rest[0]
        lines += [f"{pad}}} else if {format_expr(chained.cond)} {{"]
        lines += _format_body(chained.then, depth + 1)
        rest = chained.else_
    if rest:
        lines += [f"{pad}}} else {{", *_format_body(rest, depth + 1)]
    return lines + [f"{pad}}}"]


def _format_stmt(stmt: Stmt) -> list[str]:
    pad = _INDENT
    if isinstance(stmt, Param):
        value = "" if stmt.default is None else f" = {format_expr(stmt.default)}"
        return [f"{pad}param {stmt.name}{value}"]
    if isinstance(stmt, Let):
        return [f"{pad}let {stmt.name} = {format_expr(stmt.value)}"]
    if isinstance(stmt, Require):
        message = "" if stmt.message is None else f', "{stmt.message}"'
        return [f"{pad}require {format_expr(stmt.cond)}{message}"]
    if isinstance(stmt, Place):
        if stmt.kind == "list":
            return [f"{pad}place [{', '.join(format_expr(e) for e in stmt.devices)}]"]
        arg = "" if stmt.arg is None else f"({format_expr(stmt.arg)})"
        return [f"{pad}place {stmt.kind}{arg}"]
    if isinstance(stmt, Backward):
        return [f"{pad}backward {stmt.mode}"]
    if isinstance(stmt, (Cost, Memory)):
        word = "cost" if isinstance(stmt, Cost) else "memory"
        index = "" if stmt.index is None else f"[{stmt.index}]"
        return [f"{pad}{word} {stmt.name}{index} = {format_expr(stmt.value)}"]
    if isinstance(stmt, Recompute):
        index = "" if stmt.index is None else f"[{stmt.index}]"
        value = "" if stmt.value is None else f" = {format_expr(stmt.value)}"
        return [f"{pad}recompute{index}{value}"]
    if isinstance(stmt, BlockDecl):
        group = stmt.group
        grouping = (
            ""
            if group is None
            else f" group {format_expr(group.size)} every {format_expr(group.spacing)}"
        )
        lines = [f"{pad}block period {format_expr(stmt.period)}{grouping} {{"]
        for line in stmt.lines:
            if isinstance(line, Fill):
                lines.append(f"{pad}{_INDENT}{line.kind} fill")
                continue
            slots = ", ".join(f"{s.kind} at {format_expr(s.start)}" for s in line.slots)
            chunk = "" if line.chunk is None else f"chunk {line.chunk}: "
            lines.append(f"{pad}{_INDENT}{chunk}{slots}")
        return lines + [f"{pad}}}"]
    if isinstance(stmt, OrderDecl):
        return [f"{pad}order {{", *_format_body(stmt.body, 2), f"{pad}}}"]
    assert isinstance(stmt, ExpectDecl)
    device = "" if stmt.device is None else f"[{format_expr(stmt.device)}]"
    return [f"{pad}expect {stmt.metric}{device} {stmt.op} {format_expr(stmt.bound)}"]


def format_module(module: Module) -> str:
    """The canonical source text of a module: parsing it gives the same AST
    (spans aside). Search and tests use it to write `.pp` files."""
    lines = [f"schedule {module.name} {{"]
    for stmt in module.stmts:
        lines += _format_stmt(stmt)
    return "\n".join(lines + ["}"]) + "\n"


# --- building ASTs in code ----------------------------------------------------------
# ppdsl writes `.pp` files (`ppdsl search`, `ppdsl import`) by building an AST
# and printing it with `format_module`, so every file it writes is in the
# printer's one canonical layout.

GENERATED = Span("<generated>", 1, 1, 1, 1)
"""The span of nodes built in code rather than parsed."""


def number(value: int | float | Fraction) -> Number:
    """A literal; a float by its shortest decimal (18.522, not its binary value)."""
    exact = Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    return Number(exact, GENERATED)


def name(id: str) -> Name:
    """A use of a name."""
    return Name(id, GENERATED)


def binary(op: str, left: Expr, right: Expr) -> Binary:
    """`left op right`."""
    return Binary(op, left, right, GENERATED)


def per_stage(values: tuple, index: str = "s") -> Expr:
    """One value for every stage: the number when all are equal, else
    `s == 0 ? a : s == 1 ? b : ... : z`."""
    if len(set(values)) == 1:
        return number(values[0])
    expr: Expr = number(values[-1])
    for s in range(len(values) - 2, -1, -1):
        test = binary("==", name(index), number(s))
        expr = Cond(test, number(values[s]), expr, GENERATED)
    return expr


def place(stage_device: tuple[int, ...], num_devices: int, lanes: int = 1) -> Place:
    """The `place` statement that gives exactly this stage -> device map (with
    `lanes` pipelines: a named bidirectional placement)."""
    named = identify_placement(stage_device, num_devices, lanes)
    if named is None:
        if lanes != 1:
            raise ValueError(f"no named placement with {lanes} lanes gives {list(stage_device)}")
        devices = tuple(number(d) for d in stage_device)
        return Place("list", None, devices, GENERATED, GENERATED)
    kind, v = named
    arg = number(v) if takes_chunks(kind) else None
    return Place(kind, arg, (), GENERATED, GENERATED)


def expect(metric: str, op: str, bound: Expr) -> ExpectDecl:
    """`expect metric op bound` (schedule-wide)."""
    return ExpectDecl(metric, None, op, bound, format_expr(bound), GENERATED, GENERATED)


def peak_bound(peak: Fraction, activation: Fraction) -> Expr:
    """A peak of activation memory as an `expect peak_memory` bound: in
    multiples of M_B (`activation`, that of stage 0) when it is not 0."""
    if activation:
        return binary("*", number(peak / activation), name("M_B"))
    return number(peak)
