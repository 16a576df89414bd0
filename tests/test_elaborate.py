"""Elaboration: the order form, the block form, params and -D overrides, located errors."""

from __future__ import annotations

from fractions import Fraction

import pytest

from ppdsl.diagnostics import CompileError
from ppdsl.elaborate import elaborate
from ppdsl.ir.schedule import PassKind, format_schedule
from ppdsl.parse import parse

ONE_F_ONE_B = """\
schedule one_f_one_b {
    param d = 4
    param m = 8
    backward fused
    order {
        let w = min(d - 1 - i, m)          # warm-up forwards
        for j in 0..w { F(j) }
        interleave { for j in w..m { F(j) } } with { for j in 0..m { BW(j) } }
    }
    expect peak_memory <= d * M_B
}
"""

# DESIGN.md's 1F1B order, p=4, m=8
GOLDEN_1F1B = """\
  rank 0: F0 F1 F2 F3 BW0 F4 BW1 F5 BW2 F6 BW3 F7 BW4 BW5 BW6 BW7
  rank 1: F0 F1 F2 BW0 F3 BW1 F4 BW2 F5 BW3 F6 BW4 F7 BW5 BW6 BW7
  rank 2: F0 F1 BW0 F2 BW1 F3 BW2 F4 BW3 F5 BW4 F6 BW5 F7 BW6 BW7
  rank 3: F0 BW0 F1 BW1 F2 BW2 F3 BW3 F4 BW4 F5 BW5 F6 BW6 F7 BW7
"""


def build(text: str, overrides: dict[str, str] | None = None):
    return elaborate(parse(text, "t.pp"), overrides or {})


def error_of(text: str, overrides: dict[str, str] | None = None):
    with pytest.raises(CompileError) as info:
        build(text, overrides)
    (diag,) = info.value.diagnostics
    return diag


def test_one_f_one_b_order_matches_design_golden():
    """1F1B written with interleave reproduces DESIGN.md's order for d=4 m=8 exactly."""
    text = format_schedule(build(ONE_F_ONE_B))
    assert text.endswith(GOLDEN_1F1B)
    assert "params d=4 m=8\n" in text
    assert "backward fused" in text
