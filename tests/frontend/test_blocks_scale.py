"""Block repetition at scale (issue 13): the array version's memory table
counts what the memory model counts, and a large repetition (above the size
where kernels compile) gives the orders of the Python version it replaced
(tests/oracles/blocks.py)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from ppdsl.frontend.blocks import _CHANNELS, _EXTREME, repeat_block
from ppdsl.frontend.elaborate import elaborate
from ppdsl.frontend.parse import parse
from ppdsl.ir.schedule import MemoryModel, PassKind
from tests.oracles import blocks as old

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("recomputed", [False, True])
def test_extreme_deltas_are_the_memory_model_s(recomputed):
    """Per kind and channel, the table's change is the memory model's delta in
    units of M_B, with M_W and (on a recomputed stage) M_I at 0 or M_B."""
    for c, (w, i) in enumerate(_CHANNELS):
        model = MemoryModel((Fraction(1),), (Fraction(w),), (Fraction(i),) if recomputed else ())
        for kind in PassKind:
            assert _EXTREME[kind.code, int(recomputed), c] == model.delta(kind, 0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, d, m", [("v_zb", 12, 80), ("interleaved_1f1b", 8, 176), ("v_half", 10, 100)]
)
def test_large_repetitions_equal_the_python_version(name, d, m):
    """Over 5000 passes (the kernel compiles): the same orders as the oracle."""
    path = EXAMPLES / f"{name}.pp"
    s = elaborate(parse(path.read_text(), str(path)), {"d": str(d), "m": str(m)})
    assert s.block is not None and sum(len(o) for o in s.orders) > 5000
    recompute = frozenset(s.recompute)
    w_fill = s.split_backward and not any(x.kind is PassKind.W for x in s.block.slots)
    args = (s.block, s.placement, m)
    kwargs = dict(split_backward=s.split_backward, w_fill=w_fill, costs=s.costs, recompute=recompute)
    expected = old.repeat_block(*args, **kwargs)
    assert repeat_block(*args, **kwargs) == expected == s.orders
