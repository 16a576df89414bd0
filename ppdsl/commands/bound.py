"""The lower bound on the bubble and the makespan that any schedule with this
file's placement, passes, costs and memory bound could reach, from the exact
engine (CP-SAT, docs/exact.md), and how far this file's schedule is from it.

The memory bound is the file's `expect peak_memory` clauses (per device where
they name one); a file without any is bounded by its own highest peak, and the
output says so. The budget is CP-SAT deterministic time (`--effort`), so the
answer is the same on every machine; `--time` only caps it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from fractions import Fraction

from ppdsl.commands.common import UsageError, add_schedule_arguments, compile_from_args
from ppdsl.diagnostics import CompileError, Diagnostic, render_all
from ppdsl.ir.schedule import Schedule
from ppdsl.search.exact import ExactOptions, ExactProblem, ExactResult, measure, solve
from ppdsl.search.progress import ProgressBar

HELP = "lower bound on bubble and makespan for this file's placement, costs and memory"

DEFAULT_EFFORT = 30.0
"""CP-SAT deterministic time per objective."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "--objective",
        choices=("bubble", "makespan", "both"),
        default="both",
        help="which lower bound (default both)",
    )
    parser.add_argument(
        "--effort",
        type=float,
        default=DEFAULT_EFFORT,
        metavar="UNITS",
        help=f"CP-SAT deterministic time per objective (default {DEFAULT_EFFORT:g})",
    )
    parser.add_argument(
        "--time",
        type=float,
        default=None,
        metavar="SECONDS",
        help="optional wall-clock cap per objective (a capped answer depends on the machine)",
    )
    parser.add_argument("--json", action="store_true", help="print a machine-readable result")
    parser.add_argument(
        "--progress",
        action="store_true",
        help="draw the progress bar even when stderr is not a terminal",
    )


def memory_budgets(schedule: Schedule, peaks: tuple[Fraction, ...]) -> tuple[
    tuple[Fraction, ...], list[str]
]:
    """Per device, the tightest `expect peak_memory` upper bound of the file
    (`<=`, `==`, or `<`: the largest reachable level below it); devices with
    none get the schedule's highest peak. Returns the budgets and where they
    came from, in words."""
    mm = schedule.memory
    grain = Fraction(1, math.lcm(*(Fraction(x).denominator for x in (*mm.activation, *mm.weight_retained))))
    d = schedule.num_devices
    budgets: list[Fraction | None] = [None] * d
    sources: list[str] = []
    for e in schedule.expects:
        if e.metric != "peak_memory" or e.op not in ("<=", "==", "<"):
            continue
        bound = Fraction(e.bound)
        if e.op == "<":
            bound = math.ceil(bound / grain) * grain - grain
        devices = range(d) if e.device is None else [e.device]
        for dev in devices:
            current = budgets[dev] if 0 <= dev < d else None
            if 0 <= dev < d and (current is None or bound < current):
                budgets[dev] = bound
        where = f"line {e.span.line}" if e.span is not None else "the file"
        target = "every device" if e.device is None else f"device {e.device}"
        sources.append(f"expect peak_memory {e.op} {e.text} ({target}, {where})")
    if any(b is None for b in budgets):
        top = max(peaks)
        sources.append(
            f"no expect peak_memory for {'any device' if not sources else 'some devices'}: "
            f"bounded by this schedule's own highest peak {_num(top)}"
        )
        budgets = [top if b is None else b for b in budgets]
    return tuple(b for b in budgets if b is not None), sources


def _num(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def _text(value: Fraction | None, objective: str) -> str:
    if value is None:
        return "-"
    return f"{float(value):.6g}" if objective == "bubble" else f"{float(value):g}"


def _line(objective: str, own: Fraction | None, result: ExactResult) -> str:
    own_text = _text(own, objective)
    bound = _text(result.bound, objective)
    if result.status == "infeasible":  # pragma: no cover - the file's own schedule fits
        return f"{objective}: no schedule fits the memory bound"
    parts = [f"{objective}: this schedule {own_text}, lower bound {bound}"]
    if own is not None and own <= result.bound:
        parts.append("optimal")
    elif result.value is not None and own is not None and result.value < own:
        parts.append(
            f"a better schedule exists ({_text(result.value, objective)}; "
            "ppdsl search --exact finds such orders)"
        )
        if result.optimal:
            parts.append("and it is optimal")
    else:
        parts.append(f"gap {float(own - result.bound) if own is not None else 0:.4g}")
    return ", ".join(parts)


def run(args: argparse.Namespace) -> int:
    if args.effort < 0 or (args.time is not None and args.time < 0):
        raise UsageError("--effort and --time must be >= 0")
    compiled = compile_from_args(args)
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    schedule = compiled.schedule
    budgets, sources = memory_budgets(schedule, compiled.timeline.peak_memory)
    problem = ExactProblem(
        schedule.placement,
        schedule.num_microbatches,
        schedule.split_backward,
        schedule.costs,
        schedule.memory,
        budgets,
    )
    objectives = ("bubble", "makespan") if args.objective == "both" else (args.objective,)
    bar = ProgressBar(args.progress or sys.stderr.isatty())
    results = {}
    try:
        for objective in objectives:
            options = ExactOptions(objective, args.effort, 1, args.time)
            try:
                results[objective] = solve(
                    problem, options, hint=schedule.orders, progress=bar.solver
                )
            except ValueError as err:
                raise CompileError([Diagnostic("error", f"exact engine: {err}")]) from None
    finally:
        bar.close()
    own = {o: measure(problem, schedule.orders, o) for o in objectives}
    if args.json:
        out = {
            "file": args.file,
            "memory_bound": [str(b) for b in budgets],
            "memory_bound_from": sources,
        }
        for objective, r in results.items():
            mine = own[objective]
            out[objective] = {
                "schedule": None if mine is None else float(mine),
                "bound": float(r.bound),
                "bound_exact": str(r.bound),
                "best_found": None if r.value is None else float(r.value),
                "schedule_optimal": mine is not None and mine <= r.bound,
                "status": r.status,
                "deterministic_time": r.deterministic_time,
                "seconds": r.wall_seconds,
                "capped": r.capped,
                "time_scale": r.time_scale,
                "exact_costs": r.exact_costs,
            }
        print(json.dumps(out, indent=2))
        return 0
    lines = [
        f"{schedule.name} ({args.file}): d={schedule.num_devices}, m={schedule.num_microbatches}, "
        f"{schedule.placement.kind} placement, {'split' if schedule.split_backward else 'fused'} "
        "backward",
        "memory bound: " + "; ".join(sources),
    ]
    for objective, r in results.items():
        lines.append(_line(objective, own[objective], r))
        note = (
            f"  (CP-SAT, {r.deterministic_time:.1f} deterministic units, {r.wall_seconds:.1f} s; "
            f"time unit 1/{r.time_scale} of a cost"
        )
        if not r.exact_costs:
            note += "; costs rounded, so the bound is the rounded problem's"
        lines.append(note + ")")
        if r.capped:
            lines.append(f"  --time {args.time:g} stopped the solver early: this bound depends on the machine")
    if "bubble" in results:
        lines.append(
            "bubble here is the worst device's idle share of its span "
            "(the paper's; `ppdsl stats` reports the longest-span device's, the same when "
            "devices are equally busy)"
        )
    print("\n".join(lines))
    return 0
