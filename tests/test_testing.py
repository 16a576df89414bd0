"""`ppdsl.testing` (docs/testing.md): its strategies draw what they promise,
`check_orders` finds each kind of fault in torch-notation action lists with a
location, and `assert_valid` fails a test with the diagnostics."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.testing import (
    assert_valid,
    check_file,
    check_orders,
    param_values,
    placement,
    placements,
    valid_orders,
)
from tests.paths import EXAMPLES


def _one_f_one_b(d: int, m: int) -> list[list[str]]:
    """1F1B as torch writes it: rank r warms up with d-1-r forwards."""
    rows = []
    for r in range(d):
        warm = min(d - 1 - r, m)
        row = [f"{r}F{j}" for j in range(warm)]
        for j in range(m):
            if warm + j < m:
                row.append(f"{r}F{warm + j}")
            row.append(f"{r}B{j}")
        rows.append(row)
    return rows


def test_a_valid_order_passes_with_its_peak_memory():
    """1F1B at d=4, m=8 is valid; rank 0 peaks at d activations."""
    found = check_orders(_one_f_one_b(4, 8))
    assert found.valid, found.report()
    assert found.peak_memory[0] == 4 and found.schedule is not None


def test_a_missing_pass_is_located():
    """Dropping rank 3's first forward is an error naming that pass (torch 2.13's
    Schedule1F1B last-rank shape)."""
    rows = _one_f_one_b(4, 8)
    rows[3] = rows[3][1:]
    found = check_orders(rows, name="dropped")
    assert not found.valid
    assert any("F0" in d.message or "F of" in d.message or "missing" in d.message
               for d in found.errors), found.report()
    assert all(d.span is not None and d.span.file == "dropped" for d in found.errors)


def test_a_dependency_violation_is_located_at_its_rank():
    """A backward before its forward on rank 1 is an error on line 2 (rank 1)."""
    rows = _one_f_one_b(4, 8)
    k = rows[1].index("1B0")
    rows[1][0], rows[1][k] = rows[1][k], rows[1][0]
    found = check_orders(rows)
    assert not found.valid
    assert any(d.span is not None and d.span.line == 2 for d in found.errors), found.report()


def test_a_memory_bound_is_checked():
    """1F1B's rank 0 holds 4 activations: a bound of 3 is an error, 4 is not."""
    assert not check_orders(_one_f_one_b(4, 8), max_peak_memory=3).valid
    assert check_orders(_one_f_one_b(4, 8), max_peak_memory=4).valid


def test_a_deadlock_without_early_receives_is_reported():
    """Two ranks each waiting on the other's send (a cross order) deadlock under
    plain lowering: the error names a wait."""
    rows = [["0F0", "0F1", "0B1", "0B0"], ["1F1", "1F0", "1B0", "1B1"]]
    plain = check_orders(rows, early_receives=False)
    assert not plain.valid and any("wait" in d.message for d in plain.errors), plain.report()


def test_torch_pipeline_order_dicts_with_idle_steps_are_read():
    """A `pipeline_order`-shaped dict with None idle steps checks like its rows."""
    rows = _one_f_one_b(2, 3)
    as_dict = {r: [None, *row] for r, row in enumerate(rows)}
    assert check_orders(as_dict).valid


def test_assert_valid_raises_with_the_diagnostics():
    """assert_valid passes a valid order and raises AssertionError quoting the error."""
    assert_valid(_one_f_one_b(3, 3))
    with pytest.raises(AssertionError, match="error"):
        assert_valid(_one_f_one_b(3, 3)[:2] + [["2F0"]])


def test_assert_valid_on_a_file_with_parameters():
    """assert_valid on examples/zb_h1.pp at d=3, m=6 passes; at m=2 its require fails."""
    assert_valid(EXAMPLES / "zb_h1.pp", d=3, m=6)
    with pytest.raises(AssertionError, match="requires"):
        assert_valid(EXAMPLES / "zb_h1.pp", d=3, m=2)
    assert check_file(Path(EXAMPLES / "1f1b.pp"), d=2, m=4).makespan == 5 * 3


@settings(max_examples=30, deadline=None)
@given(param_values("d=2..6", "m=d..3*d"))
def test_param_values_respect_dependent_ranges(params):
    """Drawn parameters lie in their ranges, m's depending on d."""
    assert 2 <= params["d"] <= 6 and params["d"] <= params["m"] <= 3 * params["d"]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_drawn_valid_orders_check_valid(data):
    """Every order `valid_orders` draws on a drawn placement passes check_orders."""
    place = data.draw(placements(max_devices=3, kinds=("parallel", "looped", "vshape")))
    m = data.draw(st.integers(1, 4))
    rows = data.draw(valid_orders(place, m, split=data.draw(st.booleans())))
    found = check_orders(rows, num_microbatches=m, placement=place.spelling())
    assert found.valid, found.report()


def test_assert_valid_under_hypothesis_shrinks_the_counterexample():
    """A property that fails for d >= 3 is reported by hypothesis at d=3, the smallest."""
    seen = []

    @settings(max_examples=50, deadline=None, database=None)
    @given(param_values("d=1..8"))
    def prop(params):
        d = params["d"]
        rows = _one_f_one_b(d, d)
        if d >= 3:
            rows[-1] = rows[-1][1:]  # broken from d = 3 on
        seen.append(d)
        assert_valid(rows)

    with pytest.raises(AssertionError) as info:
        prop()
    assert seen[-1] == 3, seen[-10:]
    assert "invalid" in str(info.value)


def test_placement_builder_names():
    """`placement("vshape", 3)` is the V: stage s on s for s < 3, else 5 - s."""
    assert placement("vshape", 3).stage_device == (0, 1, 2, 2, 1, 0)


def test_compute_comm_orders_run_their_own_transfers():
    """torch's compute+comm form: matched sends and receives pass; a receive
    posted before the send it waits on, on both ranks, deadlocks under rendezvous."""
    good = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    assert check_orders(good).valid, check_orders(good).report()
    stuck = [["0F0", "0RECV_B0", "0SEND_F0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]]
    found = check_orders(stuck)
    assert not found.valid and found.errors, found.report()
