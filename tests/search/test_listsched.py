"""`ppdsl.search.listsched.list_schedule` called directly (docs/architecture.md's
search, the zero-bubble paper's automatic scheduler): the orders it returns hold
every pass once in a valid order within the budget, each knob does what the
module says, and a deadlock under the budget comes back as `ok = False`."""

from __future__ import annotations

import numpy as np
import pytest

from ppdsl.analysis.executor import evaluate
from ppdsl.search.driver import Arrays, arrays_for
from ppdsl.search.listsched import PARAM_NAMES, list_schedule
from ppdsl.search.problem import build_problem
from ppdsl.semantics import PassKind, need_arrays

NEEDS = need_arrays(with_optional=False)[:3]
F, B, W = PassKind.F.code, PassKind.B.code, PassKind.W.code
LETTER = {F: "F", B: "B", W: "W"}


def _schedule(
    d: int,
    m: int,
    placement: str,
    memory: str,
    *,
    caps: int | None = None,
    noise: np.ndarray | None = None,
    limit: int | None = None,
    **knobs: int,
):
    """list_schedule on the search's own arrays for this problem, the integer
    knobs given by their PARAM_NAMES (others 0), no noise, no in-flight cap
    unless given. Returns (orders per device as (kind, stage, microbatch),
    ok, the arrays, the flat output)."""
    problem = build_problem(devices=d, microbatches=m, placement=placement, costs=None, memory=memory)
    a = arrays_for(problem)
    num_stages = problem.placement.num_stages
    params = np.zeros(len(PARAM_NAMES), dtype=np.int64)
    for name, value in knobs.items():
        params[PARAM_NAMES.index(name)] = value
    out = list_schedule(
        a.dev_stages,
        a.stage_device,
        m,
        a.dur,
        a.comm,
        a.mem,
        np.full(d, a.limit if limit is None else limit, dtype=np.int64),
        np.full(num_stages, m + 1 if caps is None else caps, dtype=np.int64),
        params,
        np.zeros((2, num_stages, m)) if noise is None else noise,
        *NEEDS,
    )
    offsets, kind, microbatch, stage, ok = out
    orders = [
        [(int(kind[i]), int(stage[i]), int(microbatch[i])) for i in range(offsets[x], offsets[x + 1])]
        for x in range(d)
    ]
    return orders, bool(ok), a, out


def _assert_valid(orders, a: Arrays, m: int, out) -> None:
    """Every F, B and W of every (stage, microbatch) once, on its stage's device;
    per stage each kind in microbatch order and each B after its F, each W after
    its B; the executor (another module) times them without a cycle, within the
    budget."""
    num_stages = len(a.stage_device)
    seen = set()
    for dev, order in enumerate(orders):
        done: set[tuple[int, int, int]] = set()
        last = {(k, s): -1 for k in (F, B, W) for s in range(num_stages)}
        for k, s, j in order:
            assert a.stage_device[s] == dev, f"{LETTER[k]}({s}, {j}) on device {dev}"
            assert last[k, s] == j - 1, f"{LETTER[k]}({s}, {j}) out of microbatch order"
            last[k, s] = j
            if k == B:
                assert (F, s, j) in done
            if k == W:
                assert (B, s, j) in done
            done.add((k, s, j))
        seen |= done
    assert seen == {(k, s, j) for k in (F, B, W) for s in range(num_stages) for j in range(m)}
    metrics = evaluate(*out[:4], a.stage_device, a.dur, a.comm, a.mem, m)
    assert metrics.ok
    assert int(metrics.peak.max()) <= a.limit


def test_b_first_with_w_in_gaps_reaches_zb_h1_at_1f1b_memory() -> None:
    """B first, W in every gap, under 1F1B's memory (d M_B): d F in the warm-up,
    then the zero-bubble paper's ZB-H1 makespan 3m + d - 1 (docs/papers.md)."""
    orders, ok, a, out = _schedule(4, 8, "parallel", "4", b_first=1, w_mode=0)
    assert ok
    _assert_valid(orders, a, 8, out)
    assert [(k, j) for k, _, j in orders[0][:5]] == [(F, 0), (F, 1), (F, 2), (F, 3), (B, 0)]
    metrics = evaluate(*out[:4], a.stage_device, a.dur, a.comm, a.mem, 8)
    assert metrics.makespan == 3 * 8 + 4 - 1


def test_w_right_after_its_b() -> None:
    """`w_mode` 2 runs each W right after its B; 0 lets another pass come between."""
    for w_mode, adjacent in ((2, True), (0, False)):
        orders, ok, a, out = _schedule(4, 8, "parallel", "4", b_first=1, w_mode=w_mode)
        assert ok
        _assert_valid(orders, a, 8, out)
        follows = all(
            order[i - 1] == (B, s, j) for order in orders for i, (k, s, j) in enumerate(order) if k == W
        )
        assert follows is adjacent


def test_f_first_runs_the_warm_up_as_far_as_memory_allows() -> None:
    """`b_first` 0 takes an F over a ready B: with room for every microbatch, the
    first device runs all m forwards before any backward."""
    orders, ok, a, out = _schedule(4, 8, "parallel", "8", b_first=0)
    assert ok
    _assert_valid(orders, a, 8, out)
    assert [k for k, _, _ in orders[0][:8]] == [F] * 8
    orders, ok, a, out = _schedule(4, 8, "parallel", "8", b_first=1)
    assert [k for k, _, _ in orders[0][:8]] != [F] * 8


@pytest.mark.parametrize("memory", ["1", "2", "3", "4"])
@pytest.mark.parametrize("w_mode", [0, 1, 2])
def test_orders_stay_within_the_budget(memory: str, w_mode: int) -> None:
    """Under every budget from one microbatch's M_B up, with each W rule, the
    orders are complete, valid and never above the budget."""
    orders, ok, a, out = _schedule(4, 8, "parallel", memory, b_first=1, w_mode=w_mode)
    assert ok
    _assert_valid(orders, a, 8, out)


@pytest.mark.parametrize("cap", [1, 2])
def test_in_flight_cap_per_stage(cap: int) -> None:
    """`caps[s]`: at most that many microbatches between F and B on a stage."""
    orders, ok, a, out = _schedule(4, 8, "parallel", "8", caps=cap, b_first=0)
    assert ok
    _assert_valid(orders, a, 8, out)
    widest = 0
    for order in orders:
        in_flight: dict[int, int] = {}
        for k, s, _ in order:
            in_flight[s] = in_flight.get(s, 0) + (k == F) - (k == B)
            widest = max(widest, in_flight[s])
    assert widest == cap


@pytest.mark.parametrize("memory", ["1", "2", "3"])
def test_admission_control_avoids_the_multi_chunk_deadlock(memory: str) -> None:
    """On a V-shape under a tight budget, admitting a first chunk without room
    for its later chunks deadlocks (`ok` False, orders short); `admission` 1
    finishes every pass within the budget."""
    orders, ok, a, out = _schedule(4, 8, "vshape", memory, b_first=1)
    assert not ok
    assert sum(len(o) for o in orders) < 3 * 8 * 8
    orders, ok, a, out = _schedule(4, 8, "vshape", memory, b_first=1, admission=1)
    assert ok
    _assert_valid(orders, a, 8, out)


def test_a_budget_below_one_forward_is_not_ok() -> None:
    """A budget no F fits in: nothing can start, `ok` is False and no pass is placed."""
    orders, ok, a, out = _schedule(2, 2, "parallel", "1", limit=0, b_first=1)
    assert not ok
    assert orders == [[], []]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "knobs",
    [
        {"b_first": 1, "w_mode": 1, "admission": 1, "f_priority": 1, "b_priority": 1},
        {"b_first": 0, "w_mode": 0, "admission": 3, "f_priority": 2, "prefer_pair": 1},
        {"b_first": 1, "w_mode": 0, "admission": 1, "gated": 1, "gated_stall": 1},
        {"b_first": 1, "w_mode": 2, "admission": 1, "gated": 1},
    ],
)
def test_noise_and_every_knob_give_valid_orders(seed: int, knobs: dict[str, int]) -> None:
    """Seeded priority noise with the priority, pairing and gating knobs on a
    two-chunk placement still gives complete, valid orders within the budget."""
    rng = np.random.default_rng(seed)
    noise = rng.random((2, 8, 6)) * 3.0
    orders, ok, a, out = _schedule(4, 6, "vshape", "4", noise=noise, **knobs)
    assert ok
    _assert_valid(orders, a, 6, out)
