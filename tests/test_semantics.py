"""The domain's rules in `ppdsl.semantics`: the dependency relation (as data and
as the arrays the kernels take) against the zero-bubble paper's list, the
transfer rule, memory deltas, placements and their spellings, defaults, number
formats; and that a placement added there alone is usable from a `.pp` file."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from ppdsl import semantics
from ppdsl.compiler import compile_source
from ppdsl.ir.schedule import Costs, MemoryModel, Placement
from ppdsl.semantics import (
    KINDS,
    NEED_KIND,
    NEED_STAGE_OFFSET,
    NEED_TRANSFER,
    PassKind,
    TransferKind,
)
from tests.factories import BW, B, F, W


def test_needs_are_the_papers():
    """F(j,s) after F(j,s-1); B(j,s) after F(j,s) and B(j,s+1); W(j,s) after
    B(j,s); BW like B with the next stage's BW; none beyond the model's ends."""
    S = 4
    assert semantics.needs(F, 3, 2, S) == [(F, 3, 1)]
    assert semantics.needs(F, 3, 0, S) == []
    assert semantics.needs(B, 3, 2, S) == [(F, 3, 2), (B, 3, 3)]
    assert semantics.needs(B, 3, 3, S) == [(F, 3, 3)]
    assert semantics.needs(W, 3, 2, S) == [(B, 3, 2)]
    assert semantics.needs(BW, 3, 2, S) == [(F, 3, 2), (BW, 3, 3)]


def test_recompute_needs():
    """R(j,s) re-runs F(j,s); on a recomputed stage B and BW also wait for R(j,s),
    elsewhere there is no R to wait for (an optional need)."""
    R, S = PassKind.R, 4
    assert semantics.needs(R, 3, 2, S) == [(F, 3, 2)]
    assert semantics.needs(B, 3, 2, S, recompute={2}) == [(F, 3, 2), (R, 3, 2), (B, 3, 3)]
    assert semantics.needs(BW, 3, 3, S, recompute={3}) == [(F, 3, 3), (R, 3, 3)]
    assert semantics.needs(B, 3, 2, S, recompute={1, 3}) == [(F, 3, 2), (B, 3, 3)]
    assert semantics.receives(R) == semantics.sends(R) == ()
    assert semantics.pass_kinds(True, recompute=True) == (F, R, B, W)
    plain = semantics.need_arrays(with_optional=False)[0]
    assert R.code not in plain[B.code] and R.code in NEED_KIND[B.code]


def test_need_arrays_are_the_needs():
    """The arrays every kernel takes say exactly what NEEDS says, and are read-only."""
    for kind in KINDS:
        listed = semantics.NEEDS[kind]
        for slot in range(semantics.MAX_NEEDS):
            if slot < len(listed):
                need = listed[slot]
                assert NEED_KIND[kind.code, slot] == need.kind.code
                assert NEED_STAGE_OFFSET[kind.code, slot] == need.stage_offset
                carried = -1 if need.carries is None else need.carries.code
                assert NEED_TRANSFER[kind.code, slot] == carried
                assert semantics.NEED_OPTIONAL[kind.code, slot] == need.optional
            else:
                assert NEED_KIND[kind.code, slot] == -1
    with pytest.raises(ValueError):
        NEED_KIND[0, 0] = 3


def test_transfer_rule():
    """F takes an activation from s-1 and hands one to s+1; B and BW take an input
    gradient from s+1 and hand one to s-1; W moves nothing."""
    assert semantics.receives(F) == ((TransferKind.ACT, -1),)
    assert semantics.sends(F) == ((TransferKind.ACT, +1),)
    assert semantics.receives(B) == semantics.receives(BW) == ((TransferKind.GRAD, +1),)
    assert semantics.sends(B) == semantics.sends(BW) == ((TransferKind.GRAD, -1),)
    assert semantics.receives(W) == semantics.sends(W) == ()
    assert semantics.transfer_pass(TransferKind.GRAD, True, split_backward=False) is BW
    assert semantics.transfer_pass(TransferKind.GRAD, False, split_backward=True) is B


def test_memory_deltas_and_table():
    """F +M_B, B -(M_B - M_W), W -M_W, BW -M_B; the table is exact over the common
    denominator (a budget in `also` scales with it)."""
    a, w = Fraction(3, 2), Fraction(1, 3)
    deltas = {k: semantics.memory_delta(k, a, w) for k in KINDS}
    assert deltas == {F: a, B: w - a, W: -w, BW: -a, PassKind.R: 0}
    table, scale = semantics.delta_table((a, a), (w, w), also=(Fraction(1, 4),))
    assert scale == 12 and table.dtype == np.int64
    assert [Fraction(int(x), scale) for x in table[:, 1]] == [deltas[k] for k in KINDS]
    assert semantics.allocates_at_start(F) and not semantics.allocates_at_start(W)


def test_memory_peak_is_the_largest_prefix_sum():
    """`memory_peak`: the largest prefix sum over the scale and where it is first
    reached, exact past int64 (a table of Python ints), (0, None) when memory
    never rises."""
    kind, stage = np.zeros(5, dtype=np.int8), np.arange(5)
    for dtype in (np.int64, object):
        table = np.array([[2, 2, -2, 4, -6]], dtype=dtype)
        assert semantics.memory_peak(table, 2, kind, stage) == (3, 3)
    huge = np.array([[2**70, 2**70, -1]], dtype=object)
    assert semantics.memory_peak(huge, 1, kind[:3], stage[:3]) == (2**71, 1)
    falling = np.array([[-1, 1]], dtype=np.int64)
    assert semantics.memory_peak(falling, 1, kind[:2], stage[:2]) == (0, None)
    assert semantics.memory_peak(falling, 1, kind[:0], stage[:0]) == (0, None)


def test_torch_action_strings_round_trip():
    """`format_torch_actions` writes torch's letters (B as I, BW as B) and
    `parse_torch_action` reads each back; other text is None, an over-long index
    a ValueError."""
    codes = [k.code for k in KINDS]
    texts = semantics.format_torch_actions(codes, range(10, 15), range(5))
    assert texts == ["0F10", "1I11", "2W12", "3B13", "4R14"]
    assert [semantics.parse_torch_action(t) for t in texts] == [
        (k, 10 + i, i) for i, k in enumerate(KINDS)]
    for other in ("0X1", "F1", "0F", "0F1 ", "1RESHARD", ""):
        assert semantics.parse_torch_action(other) is None, other
    with pytest.raises(ValueError, match="more than 7 digits"):
        semantics.parse_torch_action("0F12345678")


def test_recomputed_memory_deltas():
    """On a stage marked recompute: F keeps M_I, R brings it to M_B, B and W free
    as usual; a microbatch-stage's deltas sum to 0; the table scales M_I too."""
    a, w, i = Fraction(3, 2), Fraction(1, 3), Fraction(1, 5)
    R = PassKind.R
    deltas = {k: semantics.memory_delta(k, a, w, i) for k in KINDS}
    assert deltas == {F: i, R: a - i, B: w - a, W: -w, BW: -a}
    assert deltas[F] + deltas[R] + deltas[B] + deltas[W] == 0
    table, scale = semantics.delta_table((a, a), (w, w), kept_input=(None, i))
    assert scale == 30
    assert Fraction(int(table[F.code, 0]), scale) == a
    assert Fraction(int(table[F.code, 1]), scale) == i
    assert Fraction(int(table[R.code, 1]), scale) == a - i
    assert semantics.allocates_at_start(R)


def test_placements_and_their_spellings():
    """Each named placement's map, its spelling back, and the command-line forms."""
    assert semantics.placement_devices("parallel", 3) == (0, 1, 2)
    assert semantics.placement_devices("looped", 3, 2) == (0, 1, 2, 0, 1, 2)
    assert semantics.placement_devices("vshape", 3) == (0, 1, 2, 2, 1, 0)
    assert semantics.placement_devices("wave", 2, 3) == (0, 1, 1, 0, 0, 1)
    for text in ("parallel", "vshape", "looped(3)", "wave(3)"):
        name, v = semantics.read_placement(text)
        devices = semantics.placement_devices(name, 4, v)
        assert semantics.placement_spelling(devices, 4) == text
    assert semantics.placement_spelling((0, 0, 1), 2) == "[0, 0, 1]"
    assert semantics.read_placement("Looped3") == ("looped", 3)
    with pytest.raises(ValueError, match="unknown placement"):
        semantics.read_placement("zigzag")
    with pytest.raises(ValueError, match="needs its chunk count"):
        semantics.placement_devices("looped", 4)


def test_bidirectional_placement_lanes():
    """dualpipe: the V's map as two pipelines of d stages (microbatches 0..m/2-1 down,
    the rest up); needs stay inside a lane; stage d+k is a copy of model stage k; its
    spelling is its name, never the V's."""
    d, S = 3, 6
    assert semantics.placement_devices("dualpipe", d) == (0, 1, 2, 2, 1, 0)
    assert semantics.placement_lanes("dualpipe") == 2 and semantics.placement_lanes("vshape") == 1
    assert [semantics.microbatch_lane(j, 5, 2) for j in range(5)] == [0, 0, 0, 1, 1]
    assert semantics.needs(F, 0, 3, S, lanes=2) == []  # the up pipeline's first stage
    assert semantics.needs(B, 0, 2, S, lanes=2) == [(F, 0, 2)]  # the down pipeline's last
    assert semantics.needs(B, 0, 2, S) == [(F, 0, 2), (B, 0, 3)]
    assert [semantics.model_stage(s, S, 2) for s in range(S)] == [0, 1, 2, 0, 1, 2]
    assert list(semantics.lane_stages(1, S, 2)) == [3, 4, 5]
    devices = semantics.placement_devices("dualpipe", d)
    assert semantics.placement_spelling(devices, d, lanes=2) == "dualpipe"
    assert semantics.placement_spelling(devices, d) == "vshape"
    assert Placement.named("dualpipe", d).lanes == 2


def test_defaults():
    """Unit pass costs, BW = B + W unless given, no transfer cost; M_W = M_B / 2."""
    costs = Costs.unit(2)
    assert costs.forward == costs.backward_input == costs.backward_weight == (1.0, 1.0)
    assert costs.fused_backward == (2.0, 2.0) and costs.comm == 0.0
    given = Costs.of((1.0,), (3.0,), (0.5,))
    assert given.fused_backward == (3.5,)
    assert MemoryModel.default(1) == MemoryModel((Fraction(1),), (Fraction(1, 2),))


def test_number_formats():
    """Each format on the values the messages and files show."""
    assert semantics.format_number(3.0) == "3" and semantics.format_number(1.5) == "1.5"
    assert semantics.format_number(Fraction(6, 4)) == "3/2"
    assert semantics.format_exact(Fraction(9, 2)) == "9/2 (4.5)"
    assert semantics.format_exact(Fraction(1, 3), 6) == "1/3 (0.333333)"
    assert semantics.format_decimal(0.11111111111111112) == "0.111111"
    assert semantics.format_short(Fraction(8)) == "8"
    assert semantics.format_short(Fraction(1, 3), 4) == "0.3333"
    assert semantics.format_ratio("3/4") == "3/4" and semantics.format_ratio("1/13") == "0.077"
    assert semantics.format_literal(Fraction("18.522")) == "18.522"
    assert semantics.format_literal(Fraction(1, 3)) == "1/3"


def test_a_placement_added_to_semantics_alone_is_usable(monkeypatch: pytest.MonkeyPatch):
    """Registering a placement in semantics.PLACEMENTS (nothing else) makes
    `place NAME(v)` elaborate, check and simulate, and spells it back by name."""

    def reversed_looped(d: int, v: int) -> tuple[int, ...]:
        return tuple(d - 1 - s % d for s in range(v * d))

    monkeypatch.setitem(semantics.PLACEMENTS, "backwards", reversed_looped)
    text = """schedule s {
    param d = 2
    param m = 2
    place backwards(2)
    order {
        for c in chunks { for j in 0..m { F(j, c) } }
        for c in reversed(chunks) { for j in 0..m { B(j, c); W(j, c) } }
    }
    expect peak_memory <= 4 * M_B
}
"""
    compiled = compile_source(text, "backwards.pp")
    placement = compiled.schedule.placement
    assert placement == Placement("backwards", 2, (1, 0, 1, 0))
    assert placement.spelling() == "backwards(2)"
    assert compiled.timeline.makespan > 0
    assert PassKind.F in {p.kind for p in compiled.schedule.orders[0]}
