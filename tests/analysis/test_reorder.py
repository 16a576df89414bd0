"""An order chosen per step (ppdsl/analysis/reorder.py): its search times
orders as the simulator does, its permutations are bijections of the slots
whose exact peaks are rechecked, and the plan carries the per-token costs."""

from __future__ import annotations

import random
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis import reorder
from ppdsl.analysis.memory import peak_memory_at
from ppdsl.analysis.simulate import simulate
from ppdsl.backend.plan import Plan, plan_from_schedule
from ppdsl.compiler import compile_file
from ppdsl.ir.schedule import KINDS, MEMORY_NAMES, Costs, Schedule
from tests.factories import schedules
from tests.paths import EXAMPLES


def _with_tokens(schedule: Schedule, rng: random.Random, memory: bool = True) -> Schedule:
    """`schedule` with random costs a + b*t + c*t^2 per kind and stage, and
    M_B = t, M_W = t/2 (M_I = t/8) per microbatch when `memory`."""
    S = schedule.num_stages
    costs = schedule.costs.with_tokens(
        [[(rng.choice([0.0, 0.25, 1.0]), rng.choice([0.0, 1e-3, 2e-3]),
           rng.choice([0.0, 1e-7])) for _ in range(S)] for _ in KINDS])
    if not memory:
        return replace(schedule, costs=costs)
    amounts = {"M_B": Fraction(1), "M_W": Fraction(1, 2), "M_I": Fraction(1, 8)}
    tokens = tuple(tuple((Fraction(0), amounts[n], Fraction(0)) for _ in range(S))
                   for n in MEMORY_NAMES)
    return replace(schedule, costs=costs, memory=replace(schedule.memory, tokens=tokens))


def _example(name: str, **params: int) -> tuple[Schedule, Plan]:
    compiled = compile_file(EXAMPLES / name, {k: str(v) for k, v in params.items()})
    schedule = _with_tokens(compiled.schedule, random.Random(0))
    return schedule, plan_from_schedule(schedule, compiled.programs, None)


def _peaks_by_definition(schedule: Schedule, lengths: list[int]) -> tuple[Fraction, ...]:
    """Each device's largest prefix sum of its passes' deltas, each at its
    microbatch's length, in Fractions pass by pass."""
    peaks = []
    for order in schedule.orders:
        level, top = Fraction(0), Fraction(0)
        for p in order:
            level += schedule.memory.at(lengths[p.microbatch]).delta(p.kind, p.stage)
            top = max(top, level)
        peaks.append(top)
    return tuple(peaks)


@settings(max_examples=40, deadline=None)
@given(schedules(), st.integers(0, 2**32 - 1))
def test_chosen_order_is_timed_as_the_simulator_times_it(schedule: Schedule, seed: int) -> None:
    """choose_order's predicted step equals `simulate` under its slots' lengths
    to the bit, its baseline equals `reorder.simulate`, it is never worse than
    the order given, and its bound is the exact peak of those slots."""
    rng = random.Random(seed)
    schedule = _with_tokens(schedule, rng, memory=not schedule.recompute)
    lengths = [rng.choice([128, 512, 4096]) for _ in range(schedule.num_microbatches)]
    choice = reorder.choose_order(schedule, lengths, time_budget_s=1.0)
    assert sorted(choice.permutation) == list(range(schedule.num_microbatches))
    slots = reorder.slot_lengths(lengths, choice.permutation)
    assert choice.predicted == simulate(schedule, lengths=slots).step_time
    assert choice.baseline == reorder.simulate(schedule, lengths)
    assert choice.predicted <= choice.baseline
    assert choice.bound == _peaks_by_definition(schedule, slots)


@settings(max_examples=30, deadline=None)
@given(schedules(), st.integers(0, 2**32 - 1))
def test_equal_lengths_simulate_as_the_constant_costs(schedule: Schedule, seed: int) -> None:
    """Every microbatch of one length L: the per-microbatch simulation equals
    the plain one under the costs a + b*L + c*L^2 (the path the reference
    simulator checks)."""
    rng = random.Random(seed)
    tokens = _with_tokens(schedule, rng, memory=False)
    length = rng.choice([1, 100, 2048])
    cube = tokens.costs.duration_cube([length])[:, :, 0]
    constant = replace(schedule, costs=replace(tokens.costs, durations=tuple(map(tuple, cube)),
                                               tokens=()))
    timed = simulate(tokens, lengths=[length] * schedule.num_microbatches)
    plain = simulate(constant)
    assert timed.start == plain.start and timed.end == plain.end
    assert timed.step_time == plain.step_time


def test_peak_at_lengths_follows_each_microbatch() -> None:
    """peak_memory_at equals the Fraction prefix sums written from the
    definition, and differs from the nominal peak when lengths differ."""
    schedule, _ = _example("zb_v.pp", d=4, m=8)
    lengths = [4096, 128, 128, 512, 128, 2048, 128, 256]
    assert peak_memory_at(schedule, lengths) == _peaks_by_definition(schedule, lengths)
    assert peak_memory_at(schedule, [128] * 8) != peak_memory_at(schedule, lengths)


def test_plan_keeps_the_per_token_costs() -> None:
    """The manifest's plan carries the per-token costs and memory: read back,
    it simulates every step as the compiled schedule does."""
    schedule, plan = _example("1f1b.pp", d=4, m=8)
    back = Plan.from_json(plan.to_json())
    assert back.cost_model().tokens == schedule.costs.tokens
    assert back.memory.tokens == schedule.memory.tokens
    lengths = [4096, 128, 256, 128, 512, 128, 1024, 128]
    assert reorder.simulate(back, lengths) == simulate(schedule, lengths=lengths).step_time
    choice = reorder.choose_order(back, lengths)
    assert choice.bound == peak_memory_at(schedule, reorder.slot_lengths(lengths,
                                                                         choice.permutation))


def test_reordering_shortens_a_long_tailed_step() -> None:
    """ZB-V, d=4, m=8, one long microbatch among short ones: the order found
    is shorter than the order given."""
    schedule, plan = _example("zb_v.pp", d=4, m=8)
    lengths = [128, 128, 128, 128, 128, 128, 128, 4096]
    choice = reorder.choose_order(plan, lengths, time_budget_s=1.0)
    assert choice.predicted < choice.baseline
    assert choice.inverse[choice.permutation[7]] == 7


def test_memory_limit_is_kept_or_refused() -> None:
    """A limit the order given breaks but another order keeps is met by the
    permutation returned; a limit no order keeps is a ReorderError."""
    schedule, plan = _example("1f1b.pp", d=4, m=8)
    lengths = [4096, 4096, 128, 128, 128, 128, 128, 128]
    given = max(peak_memory_at(schedule, lengths))
    best = min(max(peak_memory_at(schedule, reorder.slot_lengths(lengths, p)))
               for p in _rotations(8))
    assert best < given
    choice = reorder.choose_order(plan, lengths, memory_limit=best, time_budget_s=1.0)
    assert max(choice.bound) <= best
    assert any("within its limit" in line for line in choice.proof)
    with pytest.raises(reorder.ReorderError, match="memory limit"):
        reorder.choose_order(plan, lengths, memory_limit=128, time_budget_s=1.0)


def _rotations(m: int) -> list[list[int]]:
    return [[(j + r) % m for j in range(m)] for r in range(m)]


def test_lengths_that_do_not_fit_are_refused() -> None:
    """A length per microbatch, each a whole number >= 1: else a ValueError
    that says so."""
    _, plan = _example("1f1b.pp", d=4, m=8)
    with pytest.raises(ValueError, match="7 lengths for 8 microbatches"):
        reorder.choose_order(plan, [128] * 7)
    with pytest.raises(ValueError, match=">= 1"):
        reorder.simulate(plan, [128] * 7 + [0])


def test_constant_costs_are_the_plain_simulation() -> None:
    """Without per-token costs, lengths change nothing: the step is the
    compiled timeline's."""
    compiled = compile_file(EXAMPLES / "zb_h1.pp", {"d": "4", "m": "8"})
    assert not compiled.schedule.costs.follows_tokens
    assert reorder.simulate(compiled, [1, 2, 3, 4, 5, 6, 7, 8]) == compiled.timeline.step_time
    assert Costs.unit(2).coefficients().shape == (4, len(KINDS), 2)


def test_constant_costs_keep_the_order_given() -> None:
    """Where nothing follows the tokens every order is alike: the order given
    is returned after one simulation, still checked."""
    compiled = compile_file(EXAMPLES / "zb_v.pp", {"d": "4", "m": "8"})
    choice = reorder.choose_order(compiled, [4096, 1, 2, 3, 4, 5, 6, 7])
    assert choice.permutation == tuple(range(8)) and choice.evaluated == 1
    assert choice.predicted == compiled.timeline.step_time and len(choice.proof) == 2
