"""Proofs for any lengths (docs/language.md): the checks of order,
dependencies and deadlock read the per-device orders and the lowered
exchanges, never the costs, so a schedule's verdicts are the same under any
per-token costs and any step's lengths, and under any permutation of the
step's microbatches among the slots (ppdsl/analysis/reorder.py)."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis.simulate import simulate
from ppdsl.compiler import compile_schedule
from ppdsl.diagnostics import CompileError
from ppdsl.ir.rank import rank_program_texts
from ppdsl.ir.schedule import KINDS, Schedule
from tests.factories import Corruption, corruptions, schedules


def _tokens_costs(schedule: Schedule, rng: random.Random) -> Schedule:
    """`schedule` under random costs a + b*tokens + c*tokens^2."""
    S = schedule.num_stages
    rows = [[(rng.uniform(0, 2), rng.uniform(0, 4e-3), rng.choice([0.0, 1e-6]))
             for _ in range(S)] for _ in KINDS]
    return replace(schedule, costs=schedule.costs.with_tokens(rows))


def _verdicts(schedule: Schedule) -> list[tuple[str, str]]:
    """The errors compile_schedule reports (severity and message), or []."""
    try:
        compile_schedule(schedule)
    except CompileError as exc:
        return sorted((d.severity, d.message) for d in exc.diagnostics)
    return []


def _lengths(schedule: Schedule, rng: random.Random) -> list[int]:
    return [rng.choice([1, 128, 700, 4096]) for _ in range(schedule.num_microbatches)]


@settings(max_examples=40, deadline=None)
@given(schedules(), st.integers(0, 2**32 - 1))
def test_accepted_schedule_stays_proven_under_any_lengths(schedule: Schedule, seed: int) -> None:
    """An accepted schedule is accepted under per-token costs, lowers to the
    same rank programs, and runs to the end under random lengths (no wait
    that never ends, whatever each pass's duration)."""
    rng = random.Random(seed)
    compiled = compile_schedule(schedule)
    tokens = _tokens_costs(schedule, rng)
    again = compile_schedule(tokens)
    assert list(rank_program_texts(again.lowered)) == list(rank_program_texts(compiled.lowered))
    for _ in range(3):
        timeline = simulate(tokens, lengths=_lengths(schedule, rng))
        assert all(len(row) == len(order) for row, order in zip(timeline.end, schedule.orders,
                                                                 strict=True))


@settings(max_examples=40, deadline=None)
@given(corruptions(), st.integers(0, 2**32 - 1))
def test_rejected_schedule_gets_the_same_verdicts(corruption: Corruption, seed: int) -> None:
    """A schedule with one guarantee broken is rejected with the same errors
    under random per-token costs as under its own costs."""
    schedule = corruption.schedule
    if corruption.check == "memory":  # the bound is in the memory model's units, not costs'
        return
    assert _verdicts(_tokens_costs(schedule, random.Random(seed))) == _verdicts(schedule)


@settings(max_examples=40, deadline=None)
@given(schedules(), st.integers(0, 2**32 - 1))
def test_permuted_microbatches_are_the_same_proofs_and_times(schedule: Schedule,
                                                             seed: int) -> None:
    """Renaming a schedule's microbatches by a permutation (within each
    pipeline of a bidirectional placement) keeps it valid, and times every
    pass as the original timed with the lengths moved along: choosing which
    microbatch fills which slot needs no new proof."""
    rng = random.Random(seed)
    m = schedule.num_microbatches
    lanes = schedule.placement.lanes
    rename = list(range(m))
    for lane in range(lanes):
        members = [j for j in range(m) if schedule.placement.microbatch_lane(j, m) == lane]
        shuffled = members[:]
        rng.shuffle(shuffled)
        for j, k in zip(members, shuffled, strict=True):
            rename[j] = k
    renamed = replace(schedule, orders=tuple(
        tuple(replace(p, microbatch=rename[p.microbatch]) for p in order)
        for order in schedule.orders))
    assert _verdicts(renamed) == []
    tokens = _tokens_costs(schedule, rng)
    lengths = _lengths(schedule, rng)
    moved = [0] * m
    for j in range(m):
        moved[rename[j]] = lengths[j]
    original = simulate(tokens, lengths=lengths)
    relabelled = simulate(replace(renamed, costs=tokens.costs), lengths=moved)
    assert relabelled.start == original.start and relabelled.end == original.end
