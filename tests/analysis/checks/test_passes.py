"""The passes check: every (kind, microbatch, stage) exactly once, on the device
the placement says; every finding located and nothing left out of a message."""

from __future__ import annotations

from dataclasses import replace

from ppdsl.analysis.checks import check_schedule, passes
from ppdsl.ir.schedule import Pass, PassKind
from tests.factories import BW, B, F, W, make_schedule, one_f_one_b_orders, placement, with_spans


def _s(orders, d=2, m=2, split=True, kind="parallel"):
    return make_schedule(placement(kind, d), m, orders, split_backward=split)


def _valid(d=2, m=2):
    return one_f_one_b_orders(d, m, split=True)


def test_valid_schedule_has_no_findings():
    """A complete 1F1B order passes."""
    assert passes.check(_s(_valid())) == []


def test_missing_passes_listed_in_full_per_device():
    """Missing passes are grouped per device and all listed (runs of microbatches)."""
    d, m = 2, 12
    orders = one_f_one_b_orders(d, m, split=True)
    orders[1] = [p for p in orders[1] if p[0] is not W]  # device 1 loses all its W
    orders[0] = [p for p in orders[0] if p != (B, 5, 0)]
    found = passes.check(_s(orders, d, m))
    assert [x.message for x in found] == [
        "device 0 never runs 1 pass that its stages need: B5; add it to its order",
        "device 1 never runs 12 passes that its stages need: W0-W11; add them to its order",
    ]
    assert all(x.span is not None for x in found)


def test_duplicate_points_at_both():
    """A pass run twice is an error at the second run with a note at the first."""
    orders = with_spans(_valid())
    dup = orders[0][0]
    orders = (orders[0] + (replace(dup, span=orders[0][-1].span),), orders[1])
    found = passes.check(_s(orders))
    assert len(found) == 1
    assert "F0:s0 runs again on device 0; every pass runs exactly once" in found[0].message
    assert found[0].span == orders[0][-1].span
    assert found[0].notes[0][0] == dup.span


def test_wrong_device_names_placement():
    """A pass on a device that does not hold its stage says where it belongs."""
    orders = _valid()
    orders[0].append(orders[1].pop())  # BW/W of stage 1 moved to device 0
    found = check_schedule(_s(orders))
    messages = [x.message for x in found]
    assert any("but the placement (parallel) puts stage 1 on device 1" in msg for msg in messages)
    assert any("device 1 never runs 1 pass" in msg for msg in messages)


def test_out_of_range_and_wrong_kind():
    """Microbatch/stage out of range and BW in a split schedule are located errors."""
    orders = _valid()
    orders[0].append((F, 7, 0))
    orders[0].append((F, 0, 5))
    orders[1].append((BW, 0, 1))
    found = passes.check(_s(orders))
    text = "\n".join(x.message for x in found)
    assert "device 0 runs F7:s0: microbatch out of range (m = 2: microbatches 0..1)" in text
    assert "device 0 runs F0:s5: stage out of range (the placement has 2 stages: 0..1)" in text
    assert "device 1 runs BW0:s1: a fused backward BW in a split-backward schedule" in text
    fused = [[(k if k is F else BW, j, s) for k, j, s in o if k is not W] for o in _valid()]
    fused[0].append((PassKind.B, 0, 0))
    found = passes.check(_s(fused, split=False))
    assert any("B0:s0: B/W in a fused-backward schedule; write BW" in x.message for x in found)


def test_check_schedule_stops_after_passes():
    """When passes fail, the dependency check (which assumes exactly-once) is skipped."""
    orders = _valid()
    orders[0] = orders[0][::-1]  # also a dependency violation
    del orders[1][0]
    found = check_schedule(_s(orders))
    assert found and all("never runs" in x.message for x in found)


def test_findings_sorted_by_location():
    """check_schedule returns findings sorted by span."""
    orders = _valid(2, 4)
    orders[1].insert(0, (F, 9, 1))
    orders[0].insert(3, (F, 8, 0))
    found = check_schedule(_s(orders, m=4))
    keys = [x.sort_key() for x in found]
    assert keys == sorted(keys) and len(found) == 2


def test_one_error_per_source_line_listing_every_pass():
    """Passes made by one loop line that are out of range give one error at that
    line listing them all, not one error each."""
    orders = with_spans(_valid(2, 2))
    line = orders[0][0].span
    extra = tuple(Pass(PassKind.F, j, 0, line) for j in range(2, 10))
    found = passes.check(_s((orders[0] + extra, orders[1])))
    assert [x.message for x in found] == [
        "device 0 runs F2-F9:s0 (8 passes): microbatch out of range (m = 2: microbatches 0..1)"
    ]
    assert found[0].span == line


def test_repeated_line_is_one_error():
    """A line whose passes all run a second time gives one error listing them."""
    orders = with_spans(_valid(2, 3))
    loop_line, repeat_line = orders[0][0].span, orders[0][-1].span
    orders = (tuple(replace(p, span=loop_line) if p.kind is F else p for p in orders[0]), orders[1])
    again = tuple(replace(p, span=repeat_line) for p in orders[0] if p.kind is F)
    found = passes.check(_s((orders[0] + again, orders[1]), m=3))
    assert [x.message for x in found] == [
        "F0-F2:s0 (3 passes) run again on device 0; every pass runs exactly once: remove the repeat"
    ]
    assert found[0].span == repeat_line
    assert found[0].notes[0] == (loop_line, "the first run of F0:s0: pass 0 of the order")


def test_missing_pass_points_at_the_loop_that_makes_its_neighbour():
    """A loop one short is the error's line (issue 40: the loop that should have made
    the pass), not the schedule header; the one cause on every device is one error."""
    import pytest

    from ppdsl.compiler import compile_source
    from ppdsl.diagnostics import CompileError

    text = (
        "schedule s {\n    param d = 2\n    param m = 4\n    backward fused\n    order {\n"
        "        for j in 0..m { F(j) }\n        for j in 0..m - 1 { BW(j) }\n    }\n}\n"
    )
    with pytest.raises(CompileError) as info:
        compile_source(text, "loop.pp")
    [error] = info.value.diagnostics
    assert error.span is not None and error.span.line == 7
    assert error.message.startswith("on devices 0\u20131: device 0 never runs 1 pass")
    assert "the nearest BW of stage 0 on device 0, BW2:s0, is made here" in error.notes[0][1]
