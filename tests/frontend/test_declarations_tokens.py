"""Costs and memory that follow a microbatch's tokens (docs/language.md,
"Costs in tokens"): `cost F[s] = a + b*tokens + c*tokens^2` elaborated to
exact coefficients per stage, the defaults (BW = B + W, M_W = M_B / 2) kept
as functions of tokens, the nominal length, and the `^` operator."""

from __future__ import annotations

from fractions import Fraction

import pytest

from ppdsl.compiler import compile_source
from ppdsl.diagnostics import CompileError
from ppdsl.frontend import ast
from ppdsl.frontend.expressions import Scope, compile_expr
from ppdsl.frontend.parse import parse
from ppdsl.ir.schedule import format_schedule
from ppdsl.semantics import DEFAULT_TOKENS, PassKind

ORDER = "order { for j in 0..m { F(j) }; for j in 0..m { B(j); W(j) } }"


def _compile(body: str, overrides: dict[str, str] | None = None):
    text = "schedule t {\n    param d = 2\n    param m = 3\n" + body + "\n    " + ORDER + "\n}\n"
    return compile_source(text, "t.pp", overrides or {}).schedule


def test_cost_in_tokens_keeps_exact_coefficients_per_stage() -> None:
    """`cost F[s] = s + 2*tokens + tokens^2/1000`: (s, 2, 1/1000) on each stage,
    and the nominal durations those at the file's `param tokens`."""
    schedule = _compile("    param tokens = 100\n    cost F[s] = s + 2*tokens + tokens^2/1000")
    costs = schedule.costs
    assert costs.tokens[PassKind.F.code] == ((0.0, 2.0, 0.001), (1.0, 2.0, 0.001))
    assert costs.forward == (210.0, 211.0)
    assert costs.follows_tokens


def test_nominal_length_is_the_param_or_the_default() -> None:
    """Without `param tokens` a microbatch has DEFAULT_TOKENS; `-D tokens=N`
    moves the nominal costs, not the coefficients."""
    default = _compile("    cost F = tokens / 1024")
    assert default.costs.forward == (DEFAULT_TOKENS / 1024,) * 2
    given = _compile("    param tokens = 512\n    cost F = tokens / 1024", {"tokens": "2048"})
    assert given.costs.forward == (2.0, 2.0)
    assert given.costs.tokens[PassKind.F.code][0] == (0.0, 1 / 1024, 0.0)


def test_defaults_follow_the_tokens() -> None:
    """BW defaults to B + W and M_W to M_B / 2 at every length, so both are
    functions of tokens where B, W and M_B are; a constant stays constant."""
    schedule = _compile("    cost B = 1 + tokens\n    cost W = 3\n    memory M_B = 4*tokens + 2")
    bw = schedule.costs.tokens[PassKind.BW.code]
    assert bw == ((4.0, 1.0, 0.0), (4.0, 1.0, 0.0))
    assert schedule.costs.tokens[PassKind.W.code][0] == (3.0, 0.0, 0.0)
    m_b, m_w, _ = schedule.memory.tokens
    assert m_b[0] == (2, 4, 0) and m_w[0] == (1, 2, 0)
    assert schedule.memory.at(10).activation == (Fraction(42),) * 2


def test_files_without_tokens_print_as_before() -> None:
    """Costs that do not mention tokens have no per-token terms, and the
    schedule's text has no per-token line (the golden files hold)."""
    plain = _compile("    cost F = 2")
    assert plain.costs.tokens == () and plain.memory.tokens == ()
    assert "in tokens" not in format_schedule(plain)
    follows = _compile("    cost F = 2 + tokens")
    assert "  costs in tokens F=2+1*t " in format_schedule(follows)


def test_a_later_constant_replaces_a_cost_in_tokens() -> None:
    """A second `cost F` without tokens drops the first one's terms."""
    schedule = _compile("    cost F = tokens\n    cost F = 5")
    assert not schedule.costs.follows_tokens


@pytest.mark.parametrize("source, value", [
    ("2^10", 1024), ("-2^2", -4), ("(-2)^2", 4), ("2^3^2", 512), ("(1/2)^2", Fraction(1, 4)),
    ("3*2^2", 12), ("2^0", 1),
])
def test_power_binds_tighter_than_minus_and_product(source: str, value: Fraction) -> None:
    """`^` binds tighter than unary minus on its left and `*`, right to left;
    the canonical printer writes it back to the same tree."""
    expr = parse(f"schedule t {{\n    let x = {source}\n}}\n", "p.pp").stmts[0]
    assert isinstance(expr, ast.Let)
    assert compile_expr(expr.value, Scope([]))({}) == value
    again = parse(f"schedule t {{\n    let x = {ast.format_expr(expr.value)}\n}}\n", "p.pp")
    assert ast.format_expr(again.stmts[0].value) == ast.format_expr(expr.value)  # type: ignore[union-attr]


def test_memory_in_tokens_must_stay_non_negative() -> None:
    """A memory amount that falls below 0 for some length from 1 token is a
    located error naming that length."""
    with pytest.raises(CompileError) as caught:
        _compile("    memory M_B = tokens^2 - 10*tokens + 24")
    diagnostic = caught.value.diagnostics[0]
    assert "at tokens = 5 this one is -1" in diagnostic.message
    assert diagnostic.span.line == 4
