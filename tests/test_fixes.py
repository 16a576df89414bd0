"""Proven fixes (issue 40): candidate edits at the lines an error involves, each
offered only once the edited file compiles, smallest first."""

from __future__ import annotations

import os

import pytest

from ppdsl.compiler import compile_source
from ppdsl.diagnostics import CompileError, Diagnostic
from ppdsl.fixes import _shifted, apply_fix, find_fixes
from tests.paths import EXAMPLES

FILE = "examples/1f1b.pp"
ORIGINAL = (EXAMPLES / "1f1b.pp").read_text(encoding="utf-8")


def _rejected(text: str) -> list[Diagnostic]:
    with pytest.raises(CompileError) as info:
        compile_source(text, FILE)
    return info.value.diagnostics


@pytest.mark.parametrize(
    ("old", "delta", "new"),
    [
        ("3*d - 1 - 2*s", "-1", "3*d - 2 - 2*s"),
        ("s + 1", "-1", "s"),
        ("s", "+1", "s + 1"),
        ("3", "+1", "4"),
        ("2*(d - 1 - i)", "-1", "2*(d - 1 - i) - 1"),
        ("6*d - 5*s - 5", "+d", "6*d - 5*s - 5 + d"),
    ],
)
def test_an_offset_moves_by_its_top_level_constant(old: str, delta: str, new: str):
    """A shift adjusts the expression's top-level integer term, never one inside
    brackets or a product, and appends a term otherwise."""
    assert _shifted(old, delta) == new


def test_a_moved_offset_gets_the_edit_back_as_its_first_fix():
    """BW moved by one collides; the first fix, the smallest, moves it back, and
    the fixed file is the example itself."""
    text = ORIGINAL.replace("BW at 3*d - 2 - 2*s", "BW at 3*d - 1 - 2*s")
    found = find_fixes(_rejected(text), text, FILE, budget_seconds=60)
    fixes = [f for d in found for f in d.fixes]
    assert fixes, [d.message for d in found]
    assert apply_fix(text, fixes[0]) == ORIGINAL
    assert fixes[0].edits[0].line == 16


def test_every_offered_fix_compiles():
    """A changed period is fixed, and each fix offered gives a file that compiles
    (its expectations included)."""
    text = ORIGINAL.replace("block period 3 {", "block period 4 {")
    found = find_fixes(_rejected(text), text, FILE, budget_seconds=60)
    fixes = [f for d in found for f in d.fixes]
    assert any("period 3" in f.description for f in fixes)
    for fix in fixes:
        compile_source(apply_fix(text, fix), FILE)


def test_no_fix_without_budget():
    """The search stops at its time budget: with none, no candidate is tried."""
    text = ORIGINAL.replace("block period 3 {", "block period 4 {")
    found = find_fixes(_rejected(text), text, FILE, budget_seconds=0)
    assert not any(d.fixes for d in found)



@pytest.mark.slow
def test_a_search_of_small_files_never_starts_numba():
    """A fresh `ppdsl check` whose file runs its kernels as plain Python searches
    fixes the same way (docs/language.md, Fixes): DualPipeV with a loop bound
    moved, whose 40 candidates' kernel calls would pass `jit.SMALL` and import
    numba (about a second, the whole budget), gets its fix without it."""
    import subprocess
    import sys

    from tests.paths import ROOT

    script = (
        "import sys\n"
        "from ppdsl.compiler import compile_source\n"
        "from ppdsl.diagnostics import CompileError\n"
        "from ppdsl.fixes import find_fixes\n"
        "from tests.mutations import corpus\n"
        "mutant = next(m for m in corpus() if m.example == 'dualpipe_v'\n"
        "              and m.description == \"loop bound 'd - 1 - i' -> 'd - 1 - i - 1'\")\n"
        "try:\n"
        "    compile_source(mutant.text, 'examples/dualpipe_v.pp')\n"
        "except CompileError as err:\n"
        "    found = find_fixes(err.diagnostics, mutant.text, 'examples/dualpipe_v.pp',\n"
        "                       budget_seconds=120)\n"
        "    print(any(d.fixes for d in found), 'numba' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PPDSL_JIT"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, env={**env, "PYTHONPATH": str(ROOT)}, check=True)
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr
