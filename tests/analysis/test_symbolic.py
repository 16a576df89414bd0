"""The symbolic family check (docs/testing.md, "A block proven for every d"):
the papers' blocks proven for 2 <= d <= 10,000 by CP-SAT, a colliding block
caught with its witness, an unprovable property and files outside the check
named as such."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppdsl.analysis.symbolic import prove_block
from ppdsl.frontend.elaborate import elaborate
from ppdsl.frontend.parse import parse
from tests.paths import EXAMPLES


def _prove(text: str, file: str, low: int = 2, high: int = 10_000):
    module = parse(text, file)
    return prove_block(module, elaborate(module, {"d": str(low)}), low, high)


def _prove_file(path: Path, low: int = 2, high: int = 10_000):
    return _prove(path.read_text(), str(path), low, high)


@pytest.mark.parametrize("name", ["zb_h1", "1f1b", "zb_h2"])
def test_paper_blocks_are_proven_for_every_d(name):
    """ZB-H1, 1F1B and ZB-H2: collisions, dependencies and the peak bound proven to d = 10,000."""
    result = _prove_file(EXAMPLES / f"{name}.pp")
    assert result.status == "proven", result.reason
    assert result.proven[:2] == ("collision-freedom", "dependencies")
    assert any(p.startswith("peak_memory <=") for p in result.proven)
    assert "deadlock-freedom of the lowered programs" in result.not_decided


@pytest.mark.parametrize(("name", "why"), [
    ("zb_v", "an order form, not a block"), ("v_half", "not affine"),
])
def test_files_outside_the_check_are_named(name, why):
    """An order-form file and a block with a conditional let are outside, with the reason."""
    result = _prove_file(EXAMPLES / f"{name}.pp")
    assert result.status == "outside" and why in result.reason


BLOCK = """\
schedule b {{
    param d = 4
    param m = 2 * d
    place parallel
    backward fused
    block period {period} {{
        F at s
        BW at {bw}
    }}
    expect peak_memory <= {bound} * M_B
}}
"""


def test_a_collision_is_a_counterexample_with_its_witness():
    """BW at 2d + 1 - s collides with F modulo 3 at some d: the witness (d, i, m) is one."""
    result = _prove(BLOCK.format(period=3, bw="2*d + 1 - s", bound="d"), "c.pp")
    assert result.status == "counterexample"
    witness = result.counterexample
    d, i = witness["d"], witness["i"]
    # F of stage i at i + 3q and BW at 2d + 1 - i overlap: their difference is 0 or 1 mod 3
    assert (2 * d + 1 - 2 * i) % 3 in (0, 2) and witness["m"] >= 1


def test_a_memory_bound_too_small_is_not_proven():
    """1F1B's block under a bound of d - 1 activations is unproven, at device 0."""
    result = _prove(BLOCK.format(period=3, bw="3*d - 2 - 2*s", bound="(d - 1)"), "m.pp")
    assert result.status == "unproven" and result.counterexample["i"] == 0
    assert result.proven == ("collision-freedom", "dependencies")


def test_a_dependency_broken_for_large_d_is_found():
    """A backward at 2d + s (before B of the next stage for every d) breaks a dependency."""
    result = _prove(BLOCK.format(period=100_000, bw="2*d + s", bound="d"), "dep.pp")
    assert result.status == "unproven" and "BW" in result.reason
