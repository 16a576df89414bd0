"""Kernels (`ppdsl.jit`) give the same results run as plain Python and compiled
by numba; a small `ppdsl check` imports neither numba nor jinja2 nor the search."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings

from ppdsl import jit
from ppdsl.analysis.checks import dependencies
from ppdsl.analysis.rendezvous import stuck_waits
from ppdsl.analysis.simulate import simulate
from ppdsl.ir.flat import flatten
from ppdsl.lowering.early_receives import pull_receives_forward
from ppdsl.lowering.lower import lower_arrays
from ppdsl.testing import schedules

ROOT = Path(__file__).resolve().parents[1]


def _results(s):
    flat = flatten(s)
    flat.derived.clear()  # the needs are cached per flat schedule
    lowered = lower_arrays(s)
    try:
        moved = pull_receives_forward(lowered).programs()
    except ValueError as err:
        moved = str(err)
    return (
        simulate(s),
        dependencies.check(s),
        stuck_waits(lowered),
        stuck_waits(lowered, sends_block=False),
        moved,
    )


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_python_and_numba_kernels_agree(s):
    """Timeline, dependency findings, waits and moved receives: identical either way."""
    with jit.mode("python"):
        plain = _results(s)
    with jit.mode("numba"):
        compiled = _results(s)
    assert plain == compiled


def test_small_check_imports_no_numba():
    """`ppdsl check` of an example stays off numba, jinja2 and the search (start-up)."""
    code = (
        "import sys; from ppdsl.cli import main; "
        "code = main(['check', 'examples/1f1b.pp']); "
        "heavy = [m for m in ('numba', 'jinja2', 'ppdsl.search', 'torch') if m in sys.modules]; "
        "print(code, heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().endswith("0 []"), out


def test_mode_is_checked():
    """An unknown jit mode is refused."""
    try:
        with jit.mode("fast"):
            pass
    except ValueError as err:
        assert "auto, numba, python" in str(err)
    else:
        raise AssertionError("jit.mode accepted 'fast'")


def test_eager_is_the_compiled_kernel_unless_python_is_forced() -> None:
    """Kernel.eager hands back numba's dispatcher at once (no plain-Python runs
    first), and the plain function under mode("python")."""
    def add(a, b):  # pragma: no cover - numba
        return a + b

    k = jit.kernel(add)
    with jit.mode("python"):
        assert k.eager() is add
    compiled = k.eager()
    assert compiled is not add and compiled(2, 3) == 5 and k.eager() is compiled
