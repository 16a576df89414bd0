"""The symbolic check of order forms (docs/testing.md, "An order form proven for
every d and m"): ZB-V's order proven for 2 <= d <= 10,000 and every m >= 2d - 1,
mutants of it refuted with a witness instance that the concrete check confirms,
and files outside the fragment named as such."""

from __future__ import annotations

import pytest

from ppdsl.analysis.symbolic_order import prove_order
from ppdsl.families import FamilyFile
from ppdsl.frontend.elaborate import elaborate
from ppdsl.frontend.parse import parse, parse_expression
from tests.paths import EXAMPLES

ZB_V = (EXAMPLES / "zb_v.pp").read_text()


def _prove(text: str, low: int = 2, high: int = 10_000, m_range=None):
    module = parse(text, "f.pp")
    return prove_order(module, elaborate(module, {"d": str(low)}), low, high, m_range)


def _mutant(old: str, new: str) -> str:
    assert old in ZB_V
    return ZB_V.replace(old, new)


def test_zb_v_is_proven_for_every_d_to_10000_and_every_m():
    """ZB-V: each pass once, dependencies and 2d * M_B proven, 2 <= d <= 10,000, m >= 2d - 1."""
    result = _prove(ZB_V)
    assert result.status == "proven", result.reason
    assert result.proven == ("each pass once", "dependencies", "peak_memory <= 2 * d * M_B")
    assert result.m_range == "m >= 2 * d - 1"  # from the file's require, with no cap
    assert "deadlock-freedom of the lowered programs" in result.not_decided
    assert "expect bubble == 0" in result.not_decided


def test_an_m_range_is_stated_with_the_requires():
    """`--for m=LOW..HIGH`'s ends join the file's requires in what is proven."""
    m_range = (parse_expression("d", "m"), parse_expression("4*d", "m"))
    result = _prove(ZB_V, 2, 64, m_range)
    assert result.status == "proven", result.reason
    assert result.m_range == "m >= 2 * d - 1, d <= m <= 4 * d"


@pytest.mark.parametrize(("old", "new", "why"), [
    # W of chunk 0 before its own B, in the steady state
    ("B(t, 0); W(t, 0)", "W(t, 0); B(t, 0)", "not ordered after the B it needs"),
    # one forward of chunk 0 fewer in the steady state
    ("if t < m - 2*d + i + 1", "if t < m - 2*d + i", "does not run F of chunk 0"),
    # the bound one activation short of ZB-V's peak
    ("expect peak_memory <= 2 * d * M_B", "expect peak_memory <= (2 * d - 1) * M_B",
     "holds more after"),
])
def test_a_mutant_is_refuted_at_an_instance_the_concrete_check_confirms(tmp_path, old, new,
                                                                         why):
    """A swapped pair, a dropped pass or a wrong bound: a counterexample (d, i, m), invalid when compiled."""
    text = _mutant(old, new)
    result = _prove(text)
    assert result.status == "counterexample" and why in result.reason
    witness = result.counterexample
    assert 2 <= witness["d"] and 0 <= witness["i"] < witness["d"]
    assert witness["m"] >= 2 * witness["d"] - 1
    path = tmp_path / "mutant.pp"
    path.write_text(text)
    outcome = FamilyFile(str(path), {}).check({"d": witness["d"], "m": witness["m"]})
    assert outcome.failed


def test_a_swap_that_keeps_the_order_valid_is_still_proven():
    """Swapping the cool-down's two B's keeps every checked property: proven, not refuted."""
    result = _prove(_mutant("B(m - d + k, 0); B(m - i + k, 1)",
                            "B(m - i + k, 1); B(m - d + k, 0)"))
    assert result.status == "proven", result.reason


@pytest.mark.parametrize(("name", "why"), [
    ("looped_bfs", "placement looped"),
    ("dualpipe_v", "a `let` inside the order is not decided"),
])
def test_files_outside_the_fragment_are_named(name, why):
    """A looped placement and an order with a `let` in it are outside, with the reason."""
    path = EXAMPLES / f"{name}.pp"
    module = parse(path.read_text(), str(path))
    params = {"d": "4", "m": "8"}
    result = prove_order(module, elaborate(module, params), 2, 10_000)
    assert result.status == "outside" and why in result.reason


def test_a_condition_outside_the_fragment_is_named():
    """An `if` on a disjunction is outside: the check decides conjunctions of comparisons."""
    text = _mutant("if t < m - 2*d + i + 1", "if t < m - 2*d + i + 1 or t > m")
    assert "disjunction" in _prove(text).reason
