"""Lifespans (the controllable-memory paper's rule, ppdsl.analysis.lifespans):
reported per stage and device, checked by `expect lifespan`, and the block's
steady-state peak derived from lifespans and from prefix sums, which agree."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis import lifespans
from ppdsl.cli import main
from ppdsl.compiler import compile_file, compile_source
from ppdsl.diagnostics import CompileError
from ppdsl.report import stats_table
from ppdsl.testing import block_sources, grouped_block_sources

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _example(name: str, **params: int):
    return compile_file(EXAMPLES / f"{name}.pp", {k: str(v) for k, v in params.items()})


@pytest.mark.parametrize("d", [2, 4, 8])
def test_zb_h1_lifespans_are_3d(d: int):
    """ZB-H1: every stage lives from F at s to W ending at 3d + s, i.e. 3d, holds
    ⌈3d/3⌉ = d microbatches; the rule's device sum is d·M_B, the steady state is
    the paper's (d-i+1)·M_B + (i-1)·M_W, which the elaborated schedule reaches."""
    compiled = _example("zb_h1", d=d)
    found = lifespans.block_memory(compiled.schedule)
    assert [x.length for x in found.lifespans] == [3 * d] * d
    assert [found.held(s) for s in range(d)] == [d] * d
    assert found.rule == (d,) * d
    half = Fraction(1, 2)
    paper = tuple((d - i) + i * half for i in range(d))
    assert found.steady == paper
    assert compiled.timeline.peak_memory == paper


def test_one_f_one_b_lifespans_shrink_down_the_pipeline():
    """1F1B: stage s lives 3(d - s) and holds d - s microbatches, freed by BW."""
    found = lifespans.block_memory(_example("1f1b", d=4).schedule)
    assert [x.length for x in found.lifespans] == [12, 9, 6, 3]
    assert {x.frees.value for x in found.lifespans} == {"BW"}
    assert found.rule == found.steady == (4, 3, 2, 1)


def test_v_zb_rule_overcounts_chunks_that_peak_apart():
    """V-ZB at d=4: each device's two chunks peak at different times, so the
    ⌈l/T⌉ sum (9) exceeds the exact steady state (8 = p 1F1B stages), which the
    elaborated schedule reaches; stats says why."""
    compiled = _example("v_zb", d=4)
    found = lifespans.block_memory(compiled.schedule)
    assert found.rule == (9,) * 4 and found.steady == (8,) * 4
    assert compiled.timeline.peak_memory == found.steady
    assert "do not all peak at once" in stats_table(compiled)


def test_few_microbatches_never_reach_the_steady_state():
    """1F1B with m = 2 < d: the elaborated peak (2) is below the block's steady
    state (4): stats names the warm-up/cool-down as the reason."""
    head = (EXAMPLES / "1f1b.pp").read_text().split("# zero-bubble paper Table 1")[0]
    # the example requires m >= d for its peak bound; this test goes below it
    source = "".join(
        line for line in head.splitlines(keepends=True) if not line.lstrip().startswith("require")
    ) + "}\n"
    compiled = compile_source(source, "few.pp", {"m": "2"})
    found = lifespans.block_memory(compiled.schedule)
    assert found.steady[0] == 4 and compiled.timeline.peak_memory[0] == 2
    text = stats_table(compiled)
    assert "rank 0: the elaborated peak 2 is below the block's steady state 4" in text
    assert "m = 2 microbatches" in text


def test_w_fill_lifespans_come_from_the_fill():
    """V-Half's W are filled: lifespans end at the filled W, and the steady state
    equals the elaborated peak (6 chunk units at d=4)."""
    compiled = _example("v_half", d=4)
    found = lifespans.block_memory(compiled.schedule)
    assert {x.frees.value for x in found.lifespans} == {"W"}
    assert found.lifespans[0].length == 28
    assert found.steady == (6,) * 4 == compiled.timeline.peak_memory


def test_order_form_has_no_lifespans():
    """A schedule written as an order has no block, so no lifespan table."""
    compiled = _example("gpipe")
    assert lifespans.block_memory(compiled.schedule) is None
    assert "lifespan" not in stats_table(compiled)


def test_stats_json_reports_lifespans(capsys: pytest.CaptureFixture[str]):
    """`stats --json` carries the block: per stage lifespan and ⌈l/T⌉, per device
    the rule's and the steady state's peak."""
    assert main(["stats", "--json", str(EXAMPLES / "zb_h1.pp")]) == 0
    block = json.loads(capsys.readouterr().out)["block"]
    assert block["period"] == 3
    assert [x["lifespan"] for x in block["lifespans"]] == [12] * 4
    assert [x["ceil_lifespan_over_period"] for x in block["lifespans"]] == [4] * 4
    assert [x["steady_state_peak"] for x in block["devices"]] == [4, 3.5, 3, 2.5]


def test_violated_lifespan_is_located_with_a_note_at_the_f_slot():
    """A broken `expect lifespan` is an error at the expect, noting the stage's F
    slot line and its ⌈l/T⌉."""
    source = """schedule s {
    param d = 2
    param m = 4
    backward fused
    block period 3 {
        F at s
        BW at 3*d - 2 - 2*s
    }
    expect lifespan < 6
}
"""
    with pytest.raises(CompileError) as info:
        compile_source(source, "life.pp")
    [error] = [d for d in info.value.diagnostics if d.severity == "error"]
    assert error.span.line == 9
    assert "stage 0's lifespan is 6, not below the bound 6" in error.message
    [(span, note)] = error.notes
    assert span.line == 6 and "holds ⌈6 / 3⌉ = 2 microbatches" in note


def test_derivations_that_disagree_are_an_internal_error(monkeypatch: pytest.MonkeyPatch):
    """The two derivations of the steady state are compared on every block: a
    miscounted one (here the lifespan rule losing M_W) fails loudly, and the CLI
    exits 3 (internal error), not 0."""
    real = lifespans._intervals

    def wrong(schedule, passes, stage, member=0):
        return real(schedule, passes, stage, member)[:1]

    monkeypatch.setattr(lifespans, "_intervals", wrong)
    with pytest.raises(AssertionError, match="by its lifespans but"):
        _example("zb_h1")
    assert main(["check", str(EXAMPLES / "zb_h1.pp")]) == 3


def _both_ways(schedule):
    """`steady_peaks` in int64 and in Fractions (the exact path forced)."""
    fast = lifespans.steady_peaks(schedule)
    saved = lifespans._EXACT_BITS
    lifespans._EXACT_BITS = 0  # every sum "too large": Fractions throughout
    try:
        exact = lifespans.steady_peaks(schedule)
    finally:
        lifespans._EXACT_BITS = saved
    return fast, exact


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.pp")
                                        if "block period" in p.read_text()))
def test_steady_state_in_integers_equals_fractions(name: str):
    """Both steady-state derivations, run over integers (all pieces or passes at
    once), equal the same derivations in Fractions, on every block example at
    two sizes."""
    for d in (2, 5):
        s = _example(name, d=d).schedule
        fast, exact = _both_ways(s)
        assert fast == exact, (name, d)


@settings(max_examples=80, deadline=None)
@given(st.one_of(block_sources(), grouped_block_sources()))
def test_steady_state_in_integers_equals_fractions_on_random_blocks(source: str):
    """The same on random (grouped) blocks the compiler accepts."""
    try:
        s = compile_source(source, "random_block.pp").schedule
    except CompileError:
        return
    fast, exact = _both_ways(s)
    assert fast == exact, source
