"""A run's measured pass times beside the simulator (`ppdsl.analysis.run_gap`):
the mean costs, the re-simulated step, and where the measured step's time went."""

from __future__ import annotations

from ppdsl.analysis.run_gap import gap_sources, mean_costs, simulated_timeline
from ppdsl.compiler import compile_file
from ppdsl.ir.schedule import Costs, MemoryModel, PassKind
from tests.paths import ROOT


def _orders_1f1b() -> tuple[tuple[tuple[PassKind, int, int], ...], ...]:
    c = compile_file(ROOT / "examples" / "1f1b.pp", {"d": "2", "m": "2"}).schedule
    return tuple(tuple((p.kind, p.microbatch, p.stage) for p in o) for o in c.orders)


def test_simulated_makespan_of_measured_pass_times() -> None:
    """Re-simulating a compiled order under per-stage mean pass times gives the
    simulator's makespan for those costs (1F1B d=2 m=2, F 2, BW 3: rank 1 runs F0 at
    2, BW0 at 4, F1 at 7, BW1 at 9; rank 0's BW1 then runs 12..15). Stage 0's
    forwards took 1, 1 and 4 ms: their mean (2), stall included, is its cost, not
    their median (1)."""
    durations = {("F", 0): [1.0, 1.0, 4.0], ("F", 1): [2.0], ("BW", 0): [3.0], ("BW", 1): [3.0]}
    costs = mean_costs(durations, 2, Costs.of((1, 1), (1, 1), (1, 1), (2, 2), 0.0))
    assert costs.forward == (2.0, 2.0) and costs.fused_backward == (3.0, 3.0)
    orders = _orders_1f1b()
    timeline = simulated_timeline(orders, (0, 1), 2, False, costs, MemoryModel((1, 1), (0, 0)))
    assert float(timeline.makespan) == 15.0
    assert PassKind.BW.value == "BW"


def test_mean_costs_keep_the_fallback_where_a_kind_did_not_run() -> None:
    """A fused schedule runs no B or W: their costs stay the fallback's, as do
    the transfer cost and a stage no pass of the kind was measured on."""
    fallback = Costs.of((1, 1), (5, 6), (7, 8), (2, 2), 0.5)
    costs = mean_costs({("F", 1): [4.0, 6.0]}, 2, fallback)
    assert costs.forward == (1, 5.0)
    assert costs.backward_input == (5, 6) and costs.backward_weight == (7, 8)
    assert costs.comm == fallback.comm


def test_gap_sources_name_each_cause_on_its_worst_rank() -> None:
    """1F1B d=2 m=2 predicted under F 1, BW 2 (makespan 9, each rank busy 6):
    measured passes of 60 and 70 ms, 1 ms exchanging and 1 ms in the optimizer,
    a 91 ms step. The causes come largest excess first, each on the rank where
    it exceeds most: the passes on rank 1 (70 against 6), the engine's work
    between passes on rank 0 (91 - 60 - 2 = 29 against no overhead), the
    optimizer step (1 against 0), the exchanges (1 against 3 idle)."""
    orders = _orders_1f1b()
    costs = Costs.of((1, 1), (1, 1), (1, 1), (2, 2), 0.0)
    timeline = simulated_timeline(orders, (0, 1), 2, False, costs, MemoryModel((1, 1), (0, 0)))
    assert timeline.makespan == 9
    durations = [
        {("F", 0): [10.0, 10.0], ("BW", 0): [20.0, 20.0],
         ("exchange", -1): [1.0], ("optimizer", -1): [1.0]},
        {("F", 1): [10.0, 10.0], ("BW", 1): [25.0, 25.0],
         ("exchange", -1): [1.0], ("optimizer", -1): [1.0]},
    ]
    found = gap_sources(timeline, orders, (0, 1), costs, durations, 1, 91.0)
    assert [(g.cause.split(" ")[0], g.rank) for g in found] == [
        ("passes", 1), ("engine", 0), ("optimizer", 0), ("exchanges", 0)]
    assert (found[0].measured_ms, found[0].predicted_ms, found[0].excess_ms) == (70.0, 6.0, 64.0)
    assert found[1].measured_ms == 29.0 and found[3].predicted_ms == 3.0
