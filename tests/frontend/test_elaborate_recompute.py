"""Recomputation in the compiler: `recompute` marks stages, R is placed by a
block (explicitly or by default just before the backward) or an order, its
dependencies and memory deltas are checked, and export/import and the printer
carry it."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from ppdsl.compiler import compile_source
from ppdsl.diagnostics import CompileError
from ppdsl.frontend.ast import format_module
from ppdsl.frontend.parse import parse
from ppdsl.interchange import from_torch_csv, to_pp, to_torch_csv
from ppdsl.ir.schedule import PassKind, format_pass

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "1f1b_recompute.pp"

BLOCK = """schedule b {{
    param d = 2
    param m = 4
    backward fused
    {marks}
    block period 4 {{
        F at s
        {r}
        BW at 4*d - 2 - 3*s
    }}
}}
"""


def _keys(compiled) -> list[list[tuple]]:
    return [[p.key for p in order] for order in compiled.schedule.orders]


def _rank(compiled, dev: int) -> list[str]:
    return [format_pass(p, False) for p in compiled.schedule.orders[dev]]


def test_default_r_ends_as_the_backward_starts():
    """Without an R line, a recomputed stage's R is placed to end as its BW
    starts: the same orders as the example's explicit `R at 4d - 3 - 3s`."""
    implicit = compile_source(BLOCK.format(marks="recompute", r=""), "b.pp")
    explicit = compile_source(BLOCK.format(marks="recompute", r="R at 4*d - 3 - 3*s"), "b.pp")
    assert _keys(implicit) == _keys(explicit)
    assert _rank(implicit, 1) == "F0 R0 BW0 F1 R1 BW1 F2 R2 BW2 F3 R3 BW3".split()
    slots = {(x.kind, x.stage): x.start for x in implicit.schedule.block.slots}
    assert slots[(PassKind.R, 0)] == slots[(PassKind.BW, 0)] - 1


def test_only_marked_stages_recompute():
    """`recompute[s] = s == 0`: stage 0 runs R and its F keeps M_I only; stage 1
    keeps its activations, has no R and its device peaks at M_B."""
    source = BLOCK.format(marks="recompute[s] = s == 0\n    memory M_I = 1/4", r="")
    compiled = compile_source(source, "b.pp")
    assert compiled.schedule.recompute == {0}
    assert "R" not in " ".join(_rank(compiled, 1))
    assert compiled.timeline.peak_memory == (Fraction(5, 4), Fraction(1))


def test_order_form_r_and_its_dependency():
    """In an order, R(j) is placed by hand; a backward before its R is a
    dependency error located at the backward's call."""
    good = """schedule o {
    param d = 1
    param m = 2
    backward split
    recompute
    order { F(0); F(1); R(0); B(0); W(0); R(1); B(1); W(1) }
}
"""
    compiled = compile_source(good, "o.pp")
    assert _rank(compiled, 0) == "F0 F1 R0 B0 W0 R1 B1 W1".split()
    bad = good.replace("R(1); B(1)", "B(1); R(1)")
    with pytest.raises(CompileError) as info:
        compile_source(bad, "o.pp")
    [error] = info.value.diagnostics
    assert error.span.column == 43  # the B(1) call
    assert any("before R1:s0" in note for _, note in error.notes)


def test_printer_round_trips_recompute_statements():
    """`recompute`, `recompute[s] = ...` and `memory M_I` print back as written."""
    text = EXAMPLE.read_text()
    module = parse(text, "x.pp")
    again = parse(format_module(module), "x.pp")
    assert format_module(again) == format_module(module)
    assert "    recompute\n" in format_module(module)
    marked = parse(BLOCK.format(marks="recompute[s] = s < d", r=""), "b.pp")
    assert "recompute[s] = s < d" in format_module(marked)


def test_export_and_import_carry_r(tmp_path: Path):
    """`export` writes R as `0R1`; `import` marks the stages with R actions and
    writes a `.pp` that compiles back to the same orders."""
    compiled = compile_source(EXAMPLE.read_text(), str(EXAMPLE), {"d": "2", "m": "4"})
    text = to_torch_csv(compiled.schedule)
    assert "0R0" in text and "1R3" in text
    back = from_torch_csv(text, "r.csv")
    assert back.recompute == {0, 1}
    path = tmp_path / "r.pp"
    path.write_text(to_pp(back, source="r.csv"))
    again = compile_source(path.read_text(), str(path))
    assert _keys(again) == _keys(compiled)
    assert again.schedule.recompute == {0, 1}


def test_the_pass_limit_counts_r():
    """The pass limit counts R on each recomputed stage: 1F1B-recompute at d=2,
    m=4 is 2·4·(F, BW) + 2·4 R = 24 passes, refused at 23 (compile and import)."""
    from ppdsl import limits

    source = EXAMPLE.read_text()
    compiled = compile_source(source, str(EXAMPLE), {"d": "2", "m": "4"})
    assert sum(len(order) for order in compiled.schedule.orders) == 24
    text = to_torch_csv(compiled.schedule)
    with limits.using(limits.Limits(passes=24)):
        compile_source(source, str(EXAMPLE), {"d": "2", "m": "4"})
        from_torch_csv(text, "r.csv")
    with limits.using(limits.Limits(passes=23)):
        with pytest.raises(CompileError) as info:
            compile_source(source, str(EXAMPLE), {"d": "2", "m": "4"})
        assert "+ R on 2 recomputed stages makes 24 passes" in info.value.diagnostics[0].message
        with pytest.raises(CompileError) as info:
            from_torch_csv(text, "r.csv")
        assert "+ R on 2 recomputed stages makes 24 passes" in info.value.diagnostics[0].message
