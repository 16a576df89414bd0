"""The parser: AST shapes, spans at the right line and column, the statement
separators, and print -> parse round trips of every construct."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.diagnostics import CompileError, Span
from ppdsl.frontend import ast
from ppdsl.frontend.parse import parse

EVERYTHING = """\
# every construct of the language
schedule all_of_it {
    param d = 4                     # devices
    param m = 2 * d; param v = 2
    param q
    let g = d % 2 == 0 ? 3 : 0
    place looped(v)
    backward split
    cost F = 18.522
    cost B[s] = s == d - 1 ? 2 : 1
    cost comm = 0.601
    memory M_B = 1
    memory M_W[s] = M_B / 2
    block period 6 {
        F at s, B at 3*d - 2 - 2*s
        chunk 0: F at 2*i,          B at 6*d + g - 2 - i
        chunk c: F at 3*d - 2 - i,  B at 3*d + g - 1 + 2*i
        W fill
    }
    order {
        let w = min(d - i,
                    m)
        for j in 0..w { F(j) }
        F(w, 1) & B(0, 1); F(w + 1) & B(1)
        interleave { for j in w..m { F(j) } }
        with { for j in 0..m { B(j); W(j) } }
        for c in reversed(chunks) { for j in reversed(0..m) { B(j, c) } }
        repeat 2 { F(0) }
        if i == 0 and not (i > 1 or i != 2) { F(0) }
        else if i >= 1 { F(-1 // 2 % 3) }
        else { W(max(0, floor(1/2), ceil(3/2))) }
    }
    expect peak_memory <= d * M_B
    expect peak_memory[0] < 2
    expect bubble <= (d - 1) / (3*m + d - 1)
    expect makespan == 3*m + d - 1
}
"""


def strip(node):
    """The node with every span (and an expectation's source text) set to None."""
    if isinstance(node, tuple):
        return tuple(strip(x) for x in node)
    if dataclasses.is_dataclass(node) and not isinstance(node, Span):
        changes = {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            blank = isinstance(value, Span) or f.name == "text"
            changes[f.name] = None if blank else strip(value)
        return dataclasses.replace(node, **changes)
    return node


def stmts(text: str):
    return parse(text, "t.pp").stmts


def test_everything_parses_to_the_expected_statement_kinds():
    """Each top-level construct becomes its AST node, in source order."""
    module = parse(EVERYTHING, "t.pp")
    assert module.name == "all_of_it"
    kinds = [type(s).__name__ for s in module.stmts]
    assert kinds == (
        ["Param"] * 4
        + ["Let", "Place", "Backward", "Cost", "Cost", "Cost", "Memory", "Memory"]
        + ["BlockDecl", "OrderDecl"]
        + ["ExpectDecl"] * 4
    )


def test_param_without_value_and_decimal_literal():
    """`param q` has no default; 18.522 is kept as an exact rational."""
    module = parse(EVERYTHING, "t.pp")
    params = {s.name: s for s in module.stmts if isinstance(s, ast.Param)}
    assert params["q"].default is None
    cost_f = next(s for s in module.stmts if isinstance(s, ast.Cost) and s.name == "F")
    assert cost_f.value == ast.Number(Fraction("18.522"), cost_f.value.span)


def test_spans_point_at_line_and_column():
    """Spans count lines and columns from 1; end_column is the last character."""
    module = parse(EVERYTHING, "t.pp")
    assert module.span == Span("t.pp", 2, 10, 2, 18)  # the schedule's name
    place = next(s for s in module.stmts if isinstance(s, ast.Place))
    assert place.span == Span("t.pp", 7, 5, 7, 19)
    assert place.kind_span == Span("t.pp", 7, 11, 7, 16)
    order = next(s for s in module.stmts if isinstance(s, ast.OrderDecl))
    first_for = order.body[1]
    assert isinstance(first_for, ast.For)
    call = first_for.body[0]
    assert isinstance(call, ast.PassCall) and call.kind == "F"
    assert call.span == Span("t.pp", 23, 25, 23, 28)


def test_expect_keeps_its_bound_as_written():
    """An expectation keeps the bound's text for messages, and its device index."""
    expects = [s for s in stmts(EVERYTHING) if isinstance(s, ast.ExpectDecl)]
    assert [e.text for e in expects] == ["d * M_B", "2", "(d - 1) / (3*m + d - 1)", "3*m + d - 1"]
    assert expects[1].device == ast.Number(Fraction(0), expects[1].device.span)
    assert [e.op for e in expects] == ["<=", "<", "<=", "=="]


def test_block_lines():
    """Block lines: slots for every chunk, a numbered chunk, a named chunk, W fill."""
    block = next(s for s in stmts(EVERYTHING) if isinstance(s, ast.BlockDecl))
    lines = block.lines
    assert [getattr(x, "chunk", "fill") for x in lines] == [None, 0, "c", "fill"]
    assert [s.kind for s in lines[0].slots] == ["F", "B"]
    assert isinstance(lines[3], ast.Fill) and lines[3].kind == "W"


def test_grouped_block_header():
    """`block period T group G every U`: the group's size and spacing as expressions,
    spanning from `group`; a plain block has no group."""
    (block,) = stmts("schedule s { block period 3 * v * g group g every 3 { F at i } }")
    assert isinstance(block.group, ast.Group)
    assert isinstance(block.group.size, ast.Name) and block.group.size.id == "g"
    assert block.group.spacing == ast.Number(Fraction(3), block.group.spacing.span)
    assert block.group.span.column == 37
    (plain,) = stmts("schedule s { block period 3 { F at i } }")
    assert plain.group is None


def test_order_constructs():
    """Overlapped pairs, interleave (with `with` on the next line), else-if chains,
    reversed ranges."""
    order = next(s for s in stmts(EVERYTHING) if isinstance(s, ast.OrderDecl))
    kinds = [type(s).__name__ for s in order.body]
    assert kinds == ["Let", "For", "Overlap", "Overlap", "Interleave", "For", "Repeat", "If"]
    pair = order.body[2]
    assert (pair.forward.kind, pair.backward.kind, len(pair.backward.args)) == ("F", "B", 2)
    rev = order.body[5]
    assert isinstance(rev.range, ast.ReversedRange)
    assert isinstance(rev.range.inner, ast.NamedRange)
    if_ = order.body[7]
    assert isinstance(if_.else_[0], ast.If) and if_.else_[0].else_


def test_operator_precedence():
    """`a + b * c` groups the product; `-x // 2 % 3` is left-associative."""
    (let,) = stmts("schedule s { let x = 1 + 2 * 3 - -4 // 5 % 6 }")
    e = let.value
    assert isinstance(e, ast.Binary) and e.op == "-"
    assert e.left.op == "+" and e.left.right.op == "*"
    assert e.right.op == "%" and e.right.left.op == "//"
    assert e.right.left.left == ast.Unary(
        "-", ast.Number(Fraction(4), e.right.left.left.operand.span), e.right.left.left.span
    )


def test_separators():
    """`;` and newlines separate statements; newlines inside ( ) and [ ] do not."""
    a = strip(
        parse("schedule s {\n\n param d = 4;; param m = (1 +\n 2)\n place [0,\n 1]\n}\n", "a")
    )
    b = strip(parse("schedule s { param d = 4\nparam m = (1 + 2); place [0, 1] }", "b"))
    assert dataclasses.replace(a, file=None) == dataclasses.replace(b, file=None)


def test_round_trip_of_every_construct():
    """format_module prints source that parses back to the same AST."""
    module = parse(EVERYTHING, "t.pp")
    text = ast.format_module(module)
    again = parse(text, "t.pp")
    assert strip(again) == strip(module)
    assert ast.format_module(again) == text


def test_syntax_error_is_one_located_diagnostic():
    """A syntax error raises CompileError with one located diagnostic."""
    with pytest.raises(CompileError) as info:
        parse("schedule s {\n  param d = = 4\n}\n", "t.pp")
    (diag,) = info.value.diagnostics
    assert diag.span is not None and (diag.span.line, diag.span.column) == (2, 13)
    assert diag.message.startswith("unexpected '='")


# --- property: printed expressions parse back to themselves ------------------------

_SPAN = Span("p", 1, 1, 1, 1)
_names = st.sampled_from(["d", "m", "i", "s", "T_F", "x1"]).map(lambda n: ast.Name(n, _SPAN))
_numbers = st.one_of(
    st.integers(0, 1000).map(Fraction),
    st.decimals(0, 100, places=3, allow_nan=False, allow_infinity=False).map(Fraction),
).map(lambda v: ast.Number(v, _SPAN))


def _extend(children):
    binary = st.tuples(
        st.sampled_from(["+", "-", "*", "/", "//", "%", "==", "<", ">=", "and", "or"]),
        children,
        children,
    ).map(lambda t: ast.Binary(t[0], t[1], t[2], _SPAN))
    unary = st.tuples(st.sampled_from(["-", "not"]), children).map(
        lambda t: ast.Unary(t[0], t[1], _SPAN)
    )
    cond = st.tuples(children, children, children).map(lambda t: ast.Cond(*t, _SPAN))
    call = st.tuples(st.sampled_from(["min", "max"]), st.lists(children, min_size=1, max_size=3))
    return st.one_of(binary, unary, cond, call.map(lambda t: ast.Call(t[0], tuple(t[1]), _SPAN)))


expressions = st.recursive(st.one_of(_names, _numbers), _extend, max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(expressions)
def test_printed_expression_parses_back(expr):
    """format_expr adds exactly the parentheses needed: parse(print(e)) == e."""
    (let,) = stmts(f"schedule s {{ let x = {ast.format_expr(expr)} }}")
    assert strip(let.value) == strip(expr)


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        (
            "schedule s {\n param d = 4\n order { F(0) \n",
            (3, 8),
            "'{' opened at 3:8 is never closed",
        ),
        (
            "schedule s {\n order {\n  for j in 0..m {\n   F(j)\n  \n }\n}\n",
            (3, 17),
            "'{' opened at 3:17 is never closed",
        ),
        ("schedule s {\n cost B[s = 1\n}\n", (2, 11), "unexpected '='; expected ']'"),
        ("schedule s {\n cost B[s] = (1\n}\n", (3, 1), "'}' does not match '(' opened at 2:14"),
        ("schedule s {\n param d = 4\n}\n}\n", (4, 1), "'}' closes nothing"),
        (
            "schedule s {\n param d = 4\n block period 3 {\n  F at\n }\n}\n",
            (4, 7),
            "expected a value after 'at'",
        ),
        (
            "schedule s {\n block period 6 group 2 every {\n  F at i\n }\n}\n",
            (2, 31),
            "expected a value after 'every'",
        ),
        (
            "schedule s {\n block period 6 group every 3 {\n  F at i\n }\n}\n",
            (2, 23),
            "expected a value after 'group'",
        ),
        (
            "schedule s {\n block period 6 group 2 {\n  F at i\n }\n}\n",
            (2, 25),
            "unexpected '{'; expected 'every'",
        ),
        (
            "schedule s {\n block period 6 grup 2 every 3 {\n  F at i\n }\n}\n",
            (2, 17),
            "unexpected name 'grup'; did you mean 'group'?",
        ),
        ("schedule s {\n param m = 2 *\n}\n", (2, 15), "expected a value after '*'"),
        ("schedule s {\n param m =\n}\n", (2, 11), "expected a value after '='"),
        (
            "schedule s {\n plase parallel\n}\n",
            (2, 2),
            "unknown statement 'plase'; did you mean 'place'?",
        ),
        (
            "schedule s {\n order {\n  fr j in 0..m { F(j) }\n }\n}\n",
            (3, 3),
            "unknown statement 'fr'; did you mean 'for'?",
        ),
        (
            "schedule s {\n order {\n  iff i == 0 { F(0) }\n }\n}\n",
            (3, 3),
            "unknown statement 'iff'; did you mean 'if'?",
        ),
        (
            "schedule s {\n block period 3 {\n  F att s\n }\n}\n",
            (3, 5),
            "unexpected name 'att' after 'F'; did you mean 'at'?",
        ),
        (
            "schedule s {\n param d = 4 param m = 2\n}\n",
            (2, 14),
            "'param' starts a new statement: put it on its own line or after ';'",
        ),
        (
            "schedule s {\n order {\n  interleave { F(0) } { F(1) }\n }\n}\n",
            (3, 23),
            "unexpected '{'; expected 'with'",
        ),
        (
            "schedule s {\n}\nschedule t {\n}\n",
            (3, 1),
            "a file holds one schedule; this is a second one",
        ),
        ("schedule s {\n param d = 8 $ 2\n}\n", (2, 14), "unexpected character '$'"),
        (
            "schedule s {\n expect peak_memory 4\n}\n",
            (2, 21),
            "unexpected number 4; expected a comparison (<= < == >= >) or '['",
        ),
        ("# only a comment\n", (2, 1), "unexpected end of file; expected 'schedule'"),
    ],
)
def test_syntax_error_labels(text: str, where: tuple[int, int], message: str):
    """Common syntax mistakes get a message saying what is wrong, at the right place."""
    with pytest.raises(CompileError) as info:
        parse(text, "t.pp")
    (diag,) = info.value.diagnostics
    assert diag.message == message
    assert diag.span is not None and (diag.span.line, diag.span.column) == where


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.pp"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_round_trip_through_the_printer(path: Path):
    """Every example printed canonically parses back to the same AST and elaborates
    to the same schedule."""
    from ppdsl.frontend.elaborate import elaborate
    from ppdsl.ir.schedule import format_schedule

    module = parse(path.read_text(encoding="utf-8"), path.name)
    text = ast.format_module(module)
    again = parse(text, path.name)
    assert strip(again) == strip(module)
    assert format_schedule(elaborate(again, {})) == format_schedule(elaborate(module, {}))


def test_absurd_nesting_is_an_error_not_a_crash():
    """A 5000-term expression is a located CompileError, not a RecursionError."""
    text = "schedule s {\n param d = 1\n param m = " + "+".join(["1"] * 5000) + "\n}\n"
    with pytest.raises(CompileError) as info:
        parse(text, "t.pp")
    (diag,) = info.value.diagnostics
    assert "nest more than 200 levels deep here" in diag.message and "--max-depth" in diag.message
    assert diag.span is not None and diag.span.line == 3
