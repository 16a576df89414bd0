"""The closing tables of a run (ppdsl/runtime/training/summary.py, docs/runtime.md
"ppdsl run"), from measurements written by hand: the memory table and its note
on the real M_W, the replicas' agreement, the time lines without a profile, and
the memory model with measured ratios in place of the file's."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

from ppdsl.ir.schedule import MemoryModel
from ppdsl.runtime.execution.pipeline import load_schedule
from ppdsl.runtime.training.summary import (
    memory_table,
    plan_costs,
    replicas_summary,
    timing_summary,
    with_real_mw,
)
from tests.paths import ROOT


def _rank(rank: int, mw: str, busy: float | None) -> dict[str, Any]:
    return {"rank": rank, "stages": [rank], "predicted_peak": "2", "measured_peak": "2",
            "measured_peak_bytes": 1024 * (rank + 1), "mw_ratio": {str(rank): mw},
            "predicted_peak_real_mw": "3/2", "predicted_busy_share": 0.5,
            "measured_busy_share": busy}


def test_memory_table_rows_and_the_real_mw_note() -> None:
    """One row per rank (stages, peaks in M_B, bytes, the measured M_W/M_B, busy
    shares, '-' where unmeasured); under a split backward whose measured M_W/M_B
    differs from the file's, a note says which column to compare."""
    plan = load_schedule(ROOT / "examples" / "zb_h1.pp", {"d": 2, "m": 2}).plan
    text = memory_table(plan, [_rank(0, "1/4", 0.25), _rank(1, "1/4", None)])
    rows = text.splitlines()
    assert rows[-3].split() == ["0", "0", "2", "2", "1024", "1/4", "3/2", "0.50", "0.25"]
    assert rows[-2].split() == ["1", "1", "2", "2", "2048", "1/4", "3/2", "0.50", "-"]
    assert rows[-1] == ("note: the file's memory model has M_W/M_B = 1/2; this model keeps 1/4 of "
                        "a microbatch's activation from B to W (measured), so the 'pred. (real "
                        "M_W)' column is the one to compare.")
    agreeing = memory_table(plan, [_rank(0, "1/2", 0.25), _rank(1, "1/2", 0.3)])
    assert "note:" not in agreeing


def test_replicas_agree_or_differ() -> None:
    """Per pipeline rank, its replicas' whole parameters (and buffers, where
    any) are equal or DIFFER."""
    ranks = [{"rank": r, "pp_rank": r % 2, "whole_parameters_sha256": h, "buffers_sha256": b}
             for r, h, b in [(0, "aa" * 32, None), (1, "bb" * 32, "x"), (2, "aa" * 32, None),
                             (3, "cc" * 32, "y")]]
    assert replicas_summary(ranks, 2, "replicate").splitlines()[1:] == [
        "pipeline rank 0: replicas on global ranks 0, 2 (replicate): parameters equal "
        "(sha256 aaaaaaaaaaaa)",
        "pipeline rank 1: replicas on global ranks 1, 3 (replicate): parameters DIFFER "
        "(sha256 bbbbbbbbbbbb), buffers DIFFER",
    ]


def test_time_lines_without_a_profile() -> None:
    """Without --costs-from the prediction is the makespan in the file's units,
    with the way to predict milliseconds; no measured step, no lines."""
    plan = load_schedule(ROOT / "examples" / "1f1b.pp", {"d": 2, "m": 2}).plan
    mine = {"median_step_time_ms": 12.0, "predicted_step_time_ms": None,
            "resimulated_step_time_ms": 10.0, "ranks": 2, "cores": 2, "gap_sources": []}
    assert timing_summary(plan, mine).splitlines()[1:] == [
        "measured step time 12.0 ms (median over steps 2.., slowest rank)",
        f"  predicted makespan 9 in {plan.file}'s cost units; to predict milliseconds, give "
        "--costs-from the output of `ppdsl profile -o`",
        "  predicted 10.0 ms: simulated under this run's mean pass times (no transfer cost); "
        "measured/predicted 1.200",
    ]
    assert timing_summary(plan, {"median_step_time_ms": None}) == ""


def test_plan_costs_are_the_costs_file(tmp_path: Path) -> None:
    """The costs a plan was compiled with under --costs-from come back, step
    costs included."""
    costs_file = tmp_path / "costs.pp"
    costs_file.write_text("schedule costs {\n    cost F = 3\n    cost BW = 6\n    cost comm = 0.5\n"
                          "    cost optimizer = 1.5\n    cost norm = 0.25\n}\n")
    plan = load_schedule(ROOT / "examples" / "1f1b.pp", {"d": 2, "m": 2},
                         costs_from=costs_file).plan
    costs = plan_costs(plan)
    assert (costs.forward, costs.comm, costs.norm) == ((3.0, 3.0), 0.5, 0.25)
    assert costs.optimizer == (1.5, 1.5)


def test_real_mw_replaces_the_files_where_measured() -> None:
    """Measured M_W/M_B (and M_I/M_B of a recomputed stage) replace the file's
    values for the stages measured; the others keep the file's."""
    memory = MemoryModel((Fraction(2), Fraction(2)), (Fraction(1), Fraction(1)),
                         (None, Fraction(1, 2)))
    real = with_real_mw(memory, {0: Fraction(1, 4)}, {1: Fraction(1, 8)})
    assert real.weight_retained == (Fraction(1, 2), Fraction(1))
    assert real.kept_input == (None, Fraction(1, 4))
    assert real.activation == memory.activation
