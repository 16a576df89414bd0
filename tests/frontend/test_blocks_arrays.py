"""Block repetition on arrays (issue 13) equals the Python version it replaced
(tests/oracles/blocks.py) exactly: the same orders, Pass for Pass, from random
blocks (placements, slot starts and durations, groups, recomputed stages, W
fill, costs), from random valid orders given to the warm-up/cool-down step,
and from every example in block form at random d and m; run as plain Python
and compiled by numba."""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl import jit
from ppdsl.diagnostics import CompileError, Span
from ppdsl.frontend import block_form, blocks
from ppdsl.frontend.elaborate import elaborate
from ppdsl.frontend.parse import parse
from ppdsl.ir.schedule import Block, BlockSlot, Costs, Pass, PassKind
from tests.factories import placement, random_valid_orders, with_spans
from tests.oracles import blocks as old

F, B, W, BW, R = PassKind.F, PassKind.B, PassKind.W, PassKind.BW, PassKind.R
EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.pp"))
BLOCK_EXAMPLES = [p for p in EXAMPLES if "block period" in p.read_text()]
MODES = ("python", "numba")


def _costs(draw, num_stages: int) -> Costs:
    """Per-stage costs with zeros among them (ties and zero-length passes), and
    0.1 (no exact binary fraction: a W fill's times need Fractions)."""
    value = st.sampled_from([0.0, 0.1, 0.5, 1.0, 1.0, 2.0, 3.0])
    kinds = {k: [draw(value) for _ in range(num_stages)] for k in (F, B, W, R)}
    kinds[BW] = [b + w for b, w in zip(kinds[B], kinds[W], strict=True)]
    return Costs.by_kind(kinds, draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])))


@st.composite
def blocks_to_repeat(draw):
    """A block on a random placement: a start and duration per (stage, kind),
    whole or halves; a group (G, U) or none; some stages recomputed (an R slot);
    W placed, or left to `W fill`. Half the blocks have free starts (most
    collide or cannot run); half follow one microbatch's path (F along the
    stages, B back, W after its B, R between F and B), so that every
    repetition runs and the warm-up/cool-down step has work to do."""
    d = draw(st.integers(1, 5))
    kind = draw(st.sampled_from(["parallel", "looped", "vshape", "wave"]))
    place = placement(kind, d, draw(st.integers(1, 3)))
    S = place.num_stages
    split = draw(st.booleans())
    fill = split and draw(st.booleans())
    recompute = frozenset(s for s in range(S) if draw(st.integers(0, 3)) == 0)
    backward = B if split else BW
    if draw(st.booleans()):
        free = st.one_of(st.integers(-4, 6 * S + 6), st.fractions(-2, 6 * S, max_denominator=2))
        starts = {(k, s): Fraction(draw(free)) for s in range(S) for k in (F, backward, W, R)}
    else:
        gap = st.sampled_from([Fraction(1, 2), Fraction(1), Fraction(1), Fraction(2), Fraction(3)])
        starts, t = {}, Fraction(0)
        for s in [*range(S), *reversed(range(S))]:
            starts[(backward if (F, s) in starts else F, s)] = t
            t += draw(gap)
        for s in range(S):
            starts[(W, s)] = starts[(backward, s)] + draw(gap)
            starts[(R, s)] = (starts[(F, s)] + starts[(backward, s)]) / 2
    duration = st.sampled_from([Fraction(0), Fraction(1, 2), Fraction(1), Fraction(2), Fraction(3)])
    slots = []
    for s in range(S):
        kinds = [F, B] if fill else ([F, B, W] if split else [F, BW])
        kinds += [R] if s in recompute else []
        for k in kinds:
            line = draw(st.integers(1, 6))
            span = Span("block.pp", line, 5, line, 20)
            slots.append(BlockSlot(k, s, place.stage_device[s], starts[(k, s)], draw(duration), span))
    slots.sort(key=lambda x: (x.span.sort_key(), x.stage))
    period = Fraction(draw(st.integers(1, 4 * S + 4)), draw(st.sampled_from([1, 1, 2])))
    size = draw(st.sampled_from([1, 1, 2, 3]))
    spacing = Fraction(draw(st.integers(1, 4))) if size > 1 else Fraction(0)
    block = Block(period, tuple(slots), None, size, spacing)
    m = size * draw(st.integers(1, 12 // size + 1))
    return block, place, m, split, fill, recompute, _costs(draw, S)


def _repeat(module, block, place, m, split, fill, recompute, costs):
    """The module's repeat_block, or the error it raised."""
    try:
        return module.repeat_block(
            block, place, m, split_backward=split, w_fill=fill, costs=costs, recompute=recompute
        )
    except ValueError as err:
        return str(err)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(blocks_to_repeat())
def test_random_blocks_repeat_as_the_oracle(case):
    """Orders (Pass for Pass, spans included), the timed slots and the W fill's
    timeline: the same as the Python version, as plain Python and under numba."""
    block, place, m, split, fill, recompute, costs = case
    expected = _repeat(old, *case)
    for how in MODES:
        with jit.mode(how):
            assert _repeat(blocks, *case) == expected
    timed = blocks.timed_slots(block, place, m)
    assert timed == old.timed_slots(block, place, m)
    if fill:
        assert blocks.fill_timeline(timed, costs) == old.fill_timeline(timed, costs)


@st.composite
def orders_to_tighten(draw, max_devices: int = 5, microbatches: tuple[int, int] = (1, 12)):
    """Random valid orders (a random topological interleaving) on a random
    placement, R just before the backward on recomputed stages, random costs
    with zeros."""
    d = draw(st.integers(1, max_devices))
    kind = draw(st.sampled_from(["parallel", "looped", "vshape", "wave"]))
    place = placement(kind, d, draw(st.integers(1, 3)))
    S = place.num_stages
    m = draw(st.integers(*microbatches))
    split = draw(st.booleans())
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    recompute = frozenset(s for s in range(S) if draw(st.integers(0, 3)) == 0)
    orders = []
    for order in random_valid_orders(place, m, split, rng):
        with_r = []
        for k, j, s in order:
            if k in (B, BW) and s in recompute:
                with_r.append((R, j, s))
            with_r.append((k, j, s))
        orders.append(with_r)
    return with_spans(orders), place, _costs(draw, S), recompute


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(orders_to_tighten())
def test_random_orders_tighten_as_the_oracle(case):
    """The warm-up/cool-down step (hoisted forwards, cool-down backwards, W in
    idle time, compaction) picks the same orders, under any costs."""
    orders, place, costs, recompute = case
    expected = old.tighten_warm_up_and_cool_down(orders, place, costs, recompute)
    for how in MODES:
        with jit.mode(how):
            assert blocks.tighten_warm_up_and_cool_down(orders, place, costs, recompute) == expected


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(orders_to_tighten(max_devices=3, microbatches=(10, 40)))
def test_long_orders_tighten_as_the_oracle(case):
    """Long orders on few devices, where the look-ahead window (8 S + 16
    positions) binds: the same orders."""
    orders, place, costs, recompute = case
    expected = old.tighten_warm_up_and_cool_down(orders, place, costs, recompute)
    for how in MODES:
        with jit.mode(how):
            assert blocks.tighten_warm_up_and_cool_down(orders, place, costs, recompute) == expected


def test_a_repetition_that_changes_is_tested():
    """The examples' blocks are tightened (V-ZB loses its bubble): the oracle
    test compares real reorderings, not only orders left as they are."""
    module = parse(Path("examples/v_zb.pp").read_text(), "v_zb.pp")
    s = elaborate(module, {"d": "4", "m": "8"})
    assert s.block is not None
    plain = old.timed_slots(s.block, s.placement, 8)
    assert [tuple(p.key for p in o) for o in s.orders] != [
        tuple((slot.kind, j, slot.stage) for _, _, j, slot in row) for row in plain
    ]


def _elaborated(path: Path, d: int, m: int, module=None):
    """The file's orders at d and m (`module`'s repeat_block), or its error."""
    tree = parse(path.read_text(), str(path))
    patch = mock.patch.object(block_form, "repeat_block", module.repeat_block) if module else None
    try:
        if patch:
            with patch:
                return elaborate(tree, {"d": str(d), "m": str(m)}).orders
        return elaborate(tree, {"d": str(d), "m": str(m)}).orders
    except CompileError as err:
        return [str(x) for x in err.diagnostics]


@pytest.mark.slow
@pytest.mark.parametrize("path", BLOCK_EXAMPLES, ids=lambda p: p.stem)
@settings(max_examples=6, deadline=None)
@given(d=st.integers(1, 9), extra=st.integers(0, 12))
def test_examples_repeat_as_the_oracle(path, d, extra):
    """Every example in block form at random d and m: the same orders (or the
    same errors) as the Python version."""
    m = 2 * d + extra
    if "group g" in path.read_text():
        m = d * (1 + extra % 3)  # Megatron's groups: m a multiple of g = d
    expected = _elaborated(path, d, m, old)
    for how in MODES:
        with jit.mode(how):
            assert _elaborated(path, d, m) == expected


def test_block_examples_are_found():
    """The example list the test above draws from holds the block-form files."""
    names = {p.stem for p in BLOCK_EXAMPLES}
    assert {"zb_h1", "1f1b", "interleaved_1f1b", "v_zb", "v_half"} <= names


def test_zero_length_passes_keep_the_pass_order():
    """All-zero costs: ties everywhere; the same orders as the oracle."""
    place = placement("vshape", 2)
    zero = Costs.by_kind({k: [0.0] * 4 for k in (F, B, W)}, 0.0)
    orders = with_spans(random_valid_orders(place, 4, True, random.Random(5)))
    expected = old.tighten_warm_up_and_cool_down(orders, place, zero)
    assert blocks.tighten_warm_up_and_cool_down(orders, place, zero) == expected
    assert all(isinstance(p, Pass) for o in expected for p in o)


def test_times_past_int64_are_ordered_as_fractions():
    """Starts and a period too large for int64 in the block's common unit: the
    repetition falls back to Fractions and orders as the oracle does."""
    place = placement("parallel", 2)
    big = Fraction(2**70, 3)
    span = Span("block.pp", 1, 5, 1, 20)
    slots = tuple(
        BlockSlot(k, s, s, big + start, Fraction(1), span)
        for s in range(2)
        for k, start in ((F, s), (B, 5 - 2 * s), (W, 6 + s))
    )
    block = Block(big, slots, None)
    costs = Costs.unit(2)
    for m in (1, 3, 6):
        case = (block, place, m, True, False, frozenset(), costs)
        assert _repeat(blocks, *case) == _repeat(old, *case)
        assert blocks.timed_slots(block, place, m) == old.timed_slots(block, place, m)
