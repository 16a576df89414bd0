"""What recomputing only some microbatches of a stage would buy (issue 25).

The language marks whole stages `recompute` (docs/language.md): every
microbatch of a marked stage runs R, and its F keeps M_I. This bench measures
the finer choice the language cannot say yet: at a memory budget, take the
frontier's schedule with every stage recomputed (`ppdsl.search.frontier`'s
variant K = d, R right before B), then drop R pair by pair, (microbatch,
stage) from the latest microbatch down, keeping a drop when the peak stays
within the budget and the makespan does not grow. The F of a pair without R
keeps M_B (an absent R is no need: the compiler's executor times the orders,
`ppdsl.analysis.executor.timed`); the peak is the prefix sums of those deltas
per device. The orders are the search's; only R passes go.

Beside it, under the same costs, the search's best with no recomputation and
with the stages of the first d/2 devices and of all devices recomputed (the
frontier's per-stage variants), all by makespan (R is busy time).

Unit costs, M_W = M_B, M_I = M_B/16, V-shape (chunks at 1/2 a 1F1B stage's
costs), `EVALUATIONS` per search: the same numbers on every machine.
`python -m bench recompute_mix [--write]` (`--write`: bench/results/recompute_mix.md).
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

from ppdsl.analysis.executor import timed
from ppdsl.ir.flat import flat_arrays
from ppdsl.ir.schedule import Pass
from ppdsl.search.combined import Outcome, SearchOptions, find
from ppdsl.search.driver import arrays_for
from ppdsl.search.problem import (
    SearchInputError,
    SearchProblem,
    build_problem,
    chunk_costs,
    with_recompute,
)
from ppdsl.semantics import PassKind, format_short

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "recompute_mix.md"

CASES = ((4, 8, Fraction(1)), (4, 8, Fraction(3, 2)), (8, 16, Fraction(1)), (8, 16, Fraction(2)))
"""(p, m, budget in M_B): budgets where the frontier's step-time points recompute."""
EVALUATIONS = {4: 1000, 8: 200}
KEPT_INPUT = Fraction(1, 16)


def _problem(p: int, m: int) -> SearchProblem:
    problem = build_problem(devices=p, microbatches=m, placement="vshape", costs=None,
                            memory=None, weight_fraction="1")
    return replace(problem, costs=chunk_costs(problem.costs, problem.model_chunks_per_device))


def _search(problem: SearchProblem, budget: Fraction) -> Outcome | None:
    options = SearchOptions(objective="makespan", evaluations=EVALUATIONS[problem.num_devices],
                            effort=0.0)
    try:
        return find(replace(problem, budget=budget), options)
    except SearchInputError:
        return None


def measure(
    problem: SearchProblem, orders: tuple[tuple[Pass, ...], ...], keep: frozenset[tuple[int, int]]
) -> tuple[float, Fraction]:
    """(makespan, peak in M_B) of `orders` (every stage of `problem` marked
    recompute) with R dropped for the (microbatch, stage) pairs in `keep`,
    whose F then keeps M_B."""
    rows = [[q for q in o if not (q.kind is PassKind.R and (q.microbatch, q.stage) in keep)]
            for o in orders]
    real = arrays_for(problem, fused=False)
    _, end, ok = timed(*flat_arrays(rows), real.stage_device, real.dur, real.comm,
                       problem.num_microbatches)
    assert ok, "dropping R never adds a wait"
    mm = problem.memory
    peak = Fraction(0)
    for row in rows:
        level = Fraction(0)
        for q in row:
            a, w = mm.activation[q.stage], mm.weight_retained[q.stage]
            i = mm.kept(q.stage) or Fraction(0)
            full = (q.microbatch, q.stage) in keep
            level += {PassKind.F: a if full else i, PassKind.R: a - i, PassKind.B: -(a - w),
                      PassKind.W: -w}[q.kind]
            peak = max(peak, level)
    return float(end.max()), peak


def mixed(problem: SearchProblem, orders, budget: Fraction) -> tuple[float, Fraction, int, int]:
    """The greedy drop: (makespan, peak, pairs without R, pairs)."""
    pairs = sorted({(q.microbatch, q.stage) for o in orders for q in o if q.kind is PassKind.R},
                   reverse=True)
    keep: frozenset[tuple[int, int]] = frozenset()
    best = measure(problem, orders, keep)
    for pair in pairs:
        trial = measure(problem, orders, keep | {pair})
        if trial[1] <= budget and trial[0] <= best[0]:
            keep, best = keep | {pair}, trial
    return best[0], best[1], len(keep), len(pairs)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    begin = time.monotonic()
    lines = [
        "| p | m | budget | none recomputed | first d/2 devices | every stage | "
        "per (microbatch, stage) | pairs without R | gain on the best per-stage |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p, m, budget in CASES:
        plain = _problem(p, m)
        stages = plain.num_stages
        half = frozenset(s for dev in range(p // 2) for s in plain.placement.chunks(dev))
        every = with_recompute(plain, frozenset(range(stages)), KEPT_INPUT)
        found = {
            "none": _search(plain, budget),
            "half": _search(with_recompute(plain, half, KEPT_INPUT), budget),
            "every": _search(every, budget),
        }
        shown = {k: "-" if v is None else f"{v.metrics.makespan:g}" for k, v in found.items()}
        best_stage = min(v.metrics.makespan for v in found.values() if v is not None)
        outcome = found["every"]
        assert outcome is not None
        makespan, peak, dropped, pairs = mixed(every, outcome.orders, budget)
        lines.append(
            f"| {p} | {m} | {format_short(budget)} | {shown['none']} | {shown['half']} | "
            f"{shown['every']} | {makespan:g} (peak {format_short(peak)}) | {dropped} of {pairs} | "
            f"{best_stage - makespan:g} ({(best_stage - makespan) / best_stage:.1%}) |"
        )
        print(lines[-1], flush=True)
    tail = (f"Evaluations per search: {EVALUATIONS[4]} at p = 4, {EVALUATIONS[8]} at p = 8. "
            f"{(time.monotonic() - begin) / 60:.1f} min on {platform.machine()} (2 cores shared "
            f"with other jobs), Python {platform.python_version()}.")
    print(tail)
    if "--write" in argv:
        RESULTS.write_text(
            "# Recomputing some microbatches of a stage, not all\n\n"
            "Generated by `python -m bench recompute_mix --write` (bench/bench_recompute_mix.py, "
            "whose docstring says how). Makespans in one 1F1B stage's unit pass times; memory "
            "in M_B per device; '-': nothing found within the budget. The per-(microbatch, "
            "stage) column is measured, not compiled: the language marks whole stages.\n\n"
            + "\n".join(lines) + "\n\n" + tail + "\n"
        )


if __name__ == "__main__":
    main()
