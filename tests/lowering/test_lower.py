"""The array passes of issue 13 (lowering, early receives, the deadlock index, the
receive-buffer peak) against the object-per-pass implementations they replaced
(kept in tests/oracles/): same programs, same moved receives, same waits, cycles,
unmatched and duplicated transfers, on random schedules (deadlocking ones
included), on hand-broken programs and on the examples' order and block forms
at random sizes."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis import rendezvous
from ppdsl.analysis.checks import deadlock
from ppdsl.backend.codegen import generate
from ppdsl.frontend.elaborate import elaborate
from ppdsl.frontend.parse import parse
from ppdsl.ir.rank import Exchange, RankArrays, RankProgram, format_rank_programs
from ppdsl.lowering.early_receives import pull_receives_forward
from ppdsl.lowering.lower import lower, lower_arrays
from ppdsl.testing import schedules
from tests.oracles import early_receives as old_early
from tests.oracles import lower as old_lower
from tests.oracles import rendezvous as old_rendezvous

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.pp"))


def _waits(found) -> tuple:
    """`stuck_waits`'s result with each Wait as a tuple (the oracle's Wait is
    another class)."""
    cycles, unmatched, duplicates = found
    plain = [[(w.rank, w.op_index, w.peer, w.transfer, w.sending) for w in c] for c in cycles]
    return plain, unmatched, duplicates


def _agree(s) -> None:
    """Every array pass equals its oracle on schedule `s`."""
    expected = old_lower.lower(s)
    arrays = lower_arrays(s)
    assert arrays.programs() == expected
    assert format_rank_programs(arrays) == format_rank_programs(expected)
    assert format_rank_programs(arrays, False) == format_rank_programs(expected, False)
    assert arrays.receive_buffers_peaks() == [old_lower.receive_buffers_peak(p) for p in expected]
    for sends_block in (True, False):
        assert _waits(rendezvous.stuck_waits(arrays, sends_block)) == _waits(
            old_rendezvous.stuck_waits(expected, sends_block)
        )
    try:
        pulled = old_early.pull_receives_forward(expected)
    except ValueError:
        with pytest.raises(ValueError):
            pull_receives_forward(arrays)
        return
    moved = pull_receives_forward(arrays)
    assert format_rank_programs(moved) == format_rank_programs(pulled)
    assert moved.programs() == pulled
    assert pull_receives_forward(expected) == pulled
    assert moved.receive_buffers_peaks() == [old_lower.receive_buffers_peak(p) for p in pulled]
    assert _waits(rendezvous.stuck_waits(moved)) == _waits(old_rendezvous.stuck_waits(pulled))
    assert deadlock.check(s, moved) == deadlock.check(s, pulled)


@settings(max_examples=80, deadline=None)
@given(schedules())
def test_array_passes_equal_the_object_passes(s):
    """Random valid orders on random placements (many deadlock under the plain
    lowering): the array lowering, early receives and rendezvous equal the old ones."""
    _agree(s)
    assert deadlock.check(s, lower_arrays(s)) == deadlock.check(s, old_lower.lower(s))


def _broken(programs: tuple[RankProgram, ...], rng: random.Random) -> tuple[RankProgram, ...]:
    """Drop one posted op or post one twice: unmatched and duplicated transfers."""
    spots = [
        (r, i) for r, p in enumerate(programs) for i, op in enumerate(p.ops) if type(op) is Exchange
    ]
    if not spots:
        return programs
    r, i = rng.choice(spots)
    op = programs[r].ops[i]
    if rng.random() < 0.5 and (op.sends or op.recvs):
        changed = Exchange(op.sends[1:], op.recvs) if op.sends else Exchange((), op.recvs[1:])
    else:
        changed = Exchange(op.sends + op.sends[:1], op.recvs + op.recvs[:1])
    ops = programs[r].ops[:i] + (changed,) + programs[r].ops[i + 1 :]
    return programs[:r] + (RankProgram(r, ops),) + programs[r + 1 :]


@settings(max_examples=40, deadline=None)
@given(schedules(), st.integers(0, 2**32 - 1))
def test_broken_programs_report_the_same(s, seed):
    """Programs with a transfer dropped or doubled: the same unmatched, duplicated
    ops, waits and diagnostics from the arrays as from the objects, and early
    receives leave them unchanged in both."""
    programs = _broken(old_lower.lower(s), random.Random(seed))
    for sends_block in (True, False):
        assert _waits(rendezvous.stuck_waits(programs, sends_block)) == _waits(
            old_rendezvous.stuck_waits(programs, sends_block)
        )
        assert deadlock.check(s, programs, sends_block=sends_block) == deadlock.check(
            s, RankArrays.of_programs(programs), sends_block=sends_block
        )
    arrays = RankArrays.of_programs(programs)
    assert arrays.programs() == programs
    if old_early.pull_receives_forward(programs) is programs:
        assert pull_receives_forward(arrays) is arrays


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(EXAMPLES), st.integers(1, 5), st.integers(0, 6))
def test_examples_at_random_sizes(path, d, extra):
    """The examples' order and block forms at random d and m: the same programs,
    moved receives and reports."""
    text = path.read_text()
    module = parse(text, str(path))
    try:
        s = elaborate(module, {"d": str(d), "m": str(2 * d + extra)})
    except Exception:  # a size the file refuses (its own `require`/limits)
        return
    _agree(s)
    assert lower(s) == old_lower.lower(s)
    moved = pull_receives_forward(lower_arrays(s))
    objects = moved.programs()
    moved.derived.clear()  # codegen from the arrays, not from the cached objects
    assert generate(s, moved).files == generate(s, objects).files


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.stem in ("zb_v", "interleaved_1f1b")])
def test_lowering_takes_any_integer_width(path, monkeypatch):
    """The flat schedule's arrays as int8/int16/int32 (as narrow as a flat pass may
    make them) lower to the same programs as int64, moved receives included."""
    from ppdsl.ir import flat as flat_ir
    from ppdsl.lowering import lower as lower_module

    s = elaborate(parse(path.read_text(), str(path)), {"d": "32"})  # kind * stages > 127
    wide = pull_receives_forward(lower_arrays(s))
    full = flat_ir.flatten(s)
    narrow = dataclasses.replace(
        full,
        kind=full.kind.astype(np.int8),
        stage=full.stage.astype(np.int16),
        microbatch=full.microbatch.astype(np.int32),
        device=full.device.astype(np.int8),
        offsets=full.offsets.astype(np.int32),
        derived={},
    )
    monkeypatch.setattr(lower_module, "flatten", lambda schedule: narrow)
    moved = pull_receives_forward(lower_arrays(s))
    assert format_rank_programs(moved) == format_rank_programs(wide)
    assert moved.programs() == wide.programs()
