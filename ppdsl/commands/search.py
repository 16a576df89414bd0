"""Search for the schedule with the smallest bubble (or makespan) under a memory
budget and write it as an ordinary .pp file (order form) that `ppdsl check`
accepts.

Memory is in M_B, the activation one microbatch leaves on one 1F1B stage:
`--memory 8`, `2p` (p = devices), `1.5p`, or `0.5x1f1b` (half of 1F1B's p·M_B).
A V-shape stage is half a 1F1B stage, so budgets compare across placements.

Budgets are counted in work (`--evaluations` for the heuristics, `--effort` in
CP-SAT deterministic time for the exact engine), so the same arguments and
`--seed` write the same file on every machine. `--exact` always runs the exact
engine and reports a lower bound and whether the schedule is proven optimal."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from fractions import Fraction

from ppdsl.commands.budget import activation_budget, add_budget_arguments
from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    add_topology_argument,
    output_file,
    topology_from_args,
    write_output,
)
from ppdsl.compiler import compile_source
from ppdsl.costs_file import evaluate_costs, load_costs_file
from ppdsl.diagnostics import CompileError, Diagnostic
from ppdsl.frontend.syntax_errors import KEYWORDS
from ppdsl.ir.schedule import Costs, MemoryModel
from ppdsl.search import SearchInputError, emit_pp, references
from ppdsl.search.combined import (
    AUTO_EFFORT,
    AUTO_EXACT_PASSES,
    EXACT_EFFORT,
    Outcome,
    SearchOptions,
    find,
)
from ppdsl.search.driver import DEFAULT_EVALUATIONS
from ppdsl.search.exact import OBJECTIVES
from ppdsl.search.frontier import FRONTIER_EVALUATIONS
from ppdsl.search.problem import build_problem, measured_unit, parse_placement, with_topology
from ppdsl.search.progress import ProgressBar
from ppdsl.semantics import format_short

HELP = "find the best schedule under a memory budget and write it as a .pp file"
SEARCH_MAX_PASSES = 20_000
"""The largest problem `search` takes by default (`--max-passes`): the heuristics'
evaluations each simulate every pass."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", "-d", type=int, required=True, help="pipeline ranks (p)")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches")
    parser.add_argument(
        "--memory",
        default=None,
        metavar="BUDGET",
        help="peak activation per device, in M_B: 8, 2p, 1.5p, 0.5x1f1b (required); with "
        "--frontier an optional range LO:HI (4:2p, 2:, :16); with a byte unit (80GiB) the "
        "whole device (needs --params and --unit-bytes)",
    )
    add_budget_arguments(parser)
    parser.add_argument(
        "--placement",
        default="parallel",
        help="parallel (default), vshape, 'looped(v)' or dualpipe (two lanes: half the "
        "microbatches down the devices, half up a second copy of the model); with --frontier "
        "a comma list compared under the same costs (parallel,vshape,looped(2),dualpipe)",
    )
    parser.add_argument(
        "--frontier",
        action="store_true",
        help="the best schedule at every reachable peak-memory level, from the smallest "
        "feasible to where the bubble reaches its floor (a table; --json, --svg, --pp-dir); "
        "--costs are then those of one 1F1B stage, a placement with v chunks per device "
        "running each chunk in 1/v of them (--costs-from: each placement takes the file's "
        "per-stage values for its own stages, as written: profile each stage count)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="with --frontier: print the points as JSON, a list of {memory, bubble, "
        "makespan, bound, optimal, placement, recompute, file, activation, copies} (the "
        "table goes to stderr)",
    )
    parser.add_argument(
        "--svg", metavar="FILE", default=None,
        help="with --frontier: draw bubble against peak memory, named schedules marked",
    )
    parser.add_argument(
        "--pp-dir", metavar="DIR", default=None,
        help="with --frontier: write each frontier point's schedule as a .pp file here",
    )
    parser.add_argument(
        "--named", metavar="FILE.pp", action="append", default=None,
        help="with --frontier: a named schedule to set against the frontier, compiled with "
        "-D d, -D m under the frontier's costs and memory model (repeatable)",
    )
    parser.add_argument(
        "--recompute", metavar="K[,K...]", default=None,
        help="with --frontier: also search each placement with the stages of its first K "
        "devices recomputed (K = d: every stage; R right before B); needs --objective makespan "
        "(R is busy time, so a bubble would hide its cost)",
    )
    parser.add_argument(
        "--dp", metavar="N", type=int, default=1,
        help="with --frontier: N data-parallel replicas; each point's step time adds the "
        "gradient reductions (--costs reduce=..., or --costs-from's cost reduce[s]) still "
        "running after the last pass, and the frontier compares step times (needs "
        "--objective makespan)",
    )
    add_topology_argument(parser)
    parser.add_argument(
        "--kept-input", metavar="FRACTION", default="1/16",
        help="with --recompute: M_I / M_B, what a recomputed stage's F keeps (default 1/16)",
    )
    parser.add_argument(
        "--parameter-memory", metavar="M", default=None,
        help="with --frontier: the model state (weights, gradients, optimizer state) of one "
        "1F1B stage, in M_B; a placement holding the parameters twice per device (dualpipe) "
        "adds it to its points' memory for the second copy (default 0: activations only)",
    )
    parser.add_argument(
        "--levels", metavar="N", type=int, default=48,
        help="with --frontier: at most N memory levels per placement (default 48)",
    )
    parser.add_argument(
        "--costs",
        default=None,
        metavar="F=..,B=..,W=..,comm=..",
        help="pass durations and transfer cost (default 1, 1, 1, 0); per stage: F=1:1:2:2; "
        "bytes= and grad_bytes=: what a stage sends on and reduces, for --topology",
    )
    parser.add_argument(
        "--costs-from",
        metavar="COSTS.pp",
        default=None,
        help="pass costs and per-stage memory from this file (what `ppdsl profile -o` writes) "
        "instead of --costs and --weight-memory; budgets stay in 1F1B stages (the model's "
        "activation is d of them) and the .pp is written in the file's units",
    )
    parser.add_argument(
        "--weight-memory",
        default=None,
        metavar="FRACTION",
        help="M_W / M_B: the part of an F's activation held from B until W "
        "(default 1/2; 1 counts it held until W, as the controllable-memory paper does)",
    )
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="bubble",
        help="minimise the bubble (the worst device's idle share of its span; default) "
        "or the makespan",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="always run the exact engine (CP-SAT) after the heuristics, with "
        f"--effort {EXACT_EFFORT:g} unless given: a lower bound, the gap, and a proof "
        "of optimality where the gap closes",
    )
    parser.add_argument(
        "--evaluations",
        type=int,
        default=None,
        metavar="N",
        help="heuristic refinement and local-search evaluations after the block and "
        f"heuristic sweeps (default {DEFAULT_EVALUATIONS}; {FRONTIER_EVALUATIONS} per level "
        "with --frontier)",
    )
    parser.add_argument(
        "--effort",
        type=float,
        default=None,
        metavar="UNITS",
        help="exact engine budget in CP-SAT deterministic time (about a second of work "
        f"each; default {EXACT_EFFORT:g} with --exact, else {AUTO_EFFORT:g} for problems "
        f"up to {AUTO_EXACT_PASSES} passes; 0 turns it off; with --frontier, per level, "
        "default 0)",
    )
    parser.add_argument(
        "--span-bound",
        type=float,
        default=0.0,
        metavar="UNITS",
        help="before the exact engine's whole model, spend UNITS of its --effort on the "
        "same model with one device's span (the worst in the best schedule so far) as "
        "the objective: a stronger lower bound where the bubble's own stays at the idle "
        "bound (docs/exact.md, \"One device's span on the whole model\"; default 0: off)",
    )
    parser.add_argument(
        "--time",
        type=float,
        default=None,
        metavar="SECONDS",
        help="optional wall-clock cap; a run it stops early depends on the machine "
        "(the summary and the file say so)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--name", default="found", help="schedule name in the .pp file (a name such as found_1)"
    )
    parser.add_argument(
        "--max-passes", metavar="N", type=int, default=SEARCH_MAX_PASSES,
        help="the largest problem searched, in passes (stages x microbatches x 3; default "
        f"{SEARCH_MAX_PASSES:,}: about ten minutes on a slow machine)",
    )
    parser.add_argument(
        "-o", "--output", metavar="FILE", help="write the .pp here (default stdout)"
    )
    parser.add_argument(
        "--progress",
        action="store_true",
        help="draw the progress bar even when stderr is not a terminal",
    )


def _command_line(argv: list[str]) -> str:
    return "ppdsl search " + " ".join(shlex.quote(a) for a in argv)


def _measured(
    args: argparse.Namespace, placement_text: str | None = None
) -> tuple[Costs, MemoryModel] | None:
    """`--costs-from`: the file's costs and memory for this placement (default
    `--placement`)."""
    if args.costs_from is None:
        return None
    if args.costs is not None or args.weight_memory is not None:
        given = "--costs" if args.costs is not None else "--weight-memory"
        raise UsageError(f"--costs-from gives the costs and memory model; drop {given}")
    try:
        placement = parse_placement(placement_text or args.placement, max(args.devices, 1))
    except SearchInputError as err:
        raise UsageError(str(err)) from None
    spelling = placement.spelling()
    return evaluate_costs(load_costs_file(args.costs_from), max(args.devices, 1), spelling)


def _check_arguments(args: argparse.Namespace) -> None:
    """The flags' values, refused (a UsageError) before any work."""
    wrong = []
    if not args.name.isidentifier() or args.name in KEYWORDS or not args.name.isascii():
        wrong.append(f"--name {args.name!r}: a schedule name is a word such as found_1 "
                     "(letters, digits, _; not a keyword)")
    if args.max_passes < 1:
        wrong.append(f"--max-passes {args.max_passes}: must be >= 1")
    for flag, value in (("--devices", args.devices), ("--microbatches", args.microbatches)):
        if value > args.max_passes:  # before building anything of that size
            wrong.append(f"{flag} {value}: the problem would exceed --max-passes {args.max_passes:,}")
    if args.time is not None and args.time < 0:
        wrong.append(f"--time {args.time:g}: must be >= 0 seconds")
    if args.evaluations is not None and args.evaluations < 0:
        wrong.append(f"--evaluations {args.evaluations}: must be >= 0")
    if args.effort is not None and args.effort < 0:
        wrong.append(f"--effort {args.effort:g}: must be >= 0")
    if args.span_bound < 0:
        wrong.append(f"--span-bound {args.span_bound:g}: must be >= 0")
    if args.output:
        output_file(args.output)
    frontier_only = [flag for flag, given in (
        ("--json", args.json), ("--svg", args.svg), ("--pp-dir", args.pp_dir),
        ("--named", args.named), ("--recompute", args.recompute), ("--dp", args.dp != 1),
        ("--parameter-memory", args.parameter_memory is not None))
        if given]
    if args.frontier:
        if args.output:
            wrong.append("-o writes one schedule; with --frontier use --pp-dir DIR for the points")
        if args.exact:
            wrong.append("--exact runs 60 units per search; with --frontier give --effort UNITS "
                         "per level")
        if args.time is not None:
            wrong.append("--time caps one search; a frontier's work is --evaluations and "
                         "--effort per level")
        if args.span_bound:
            wrong.append("--span-bound bounds one search; a frontier's levels run --effort only")
        if args.levels < 1:
            wrong.append(f"--levels {args.levels}: must be >= 1")
        if args.parameter_memory is not None:
            try:
                if Fraction(args.parameter_memory) < 0:
                    raise ValueError
            except (ValueError, ZeroDivisionError):
                wrong.append(f"--parameter-memory {args.parameter_memory!r}: a number of M_B "
                             ">= 0 such as 3/2")
        if args.dp < 1:
            wrong.append(f"--dp {args.dp}: must be at least 1")
        if args.dp > 1 and args.objective != "makespan":
            wrong.append("--dp compares step times with the exposed reduction: add "
                         "--objective makespan")
        if args.recompute is not None and args.objective != "makespan":
            wrong.append("--recompute adds R passes, busy time a bubble does not count against "
                         "the step: add --objective makespan")
    else:
        if args.memory is None:
            wrong.append("--memory BUDGET is required (or ask for --frontier)")
        if frontier_only:
            wrong.append(f"{', '.join(frontier_only)} go with --frontier")
    if wrong:
        raise UsageError("; ".join(wrong))


def _exact_lines(outcome: Outcome) -> tuple[list[str], list[str]]:
    """(summary lines, .pp header lines) about the exact engine's result."""
    exact = outcome.exact
    if exact is None and outcome.heuristic.problem.placement.lanes > 1:
        return ["exact engine: not run (its model runs every microbatch through every stage, "
                "not one of DualPipe's lanes)"], []
    if exact is None:
        return ["exact engine: not run (use --exact for a lower bound)"], []
    what = exact.objective
    unit = "" if what == "bubble" else " (cost units)"
    rounding = (
        ""
        if exact.exact_costs
        else f"; costs rounded to 1/{exact.time_scale}, so the bound is the rounded problem's"
    )
    if exact.status == "infeasible":
        line = "exact engine: no schedule fits this memory budget (proven)"
        return [line], ["# " + line + "."]
    if exact.value is None:
        head = f"{what} lower bound {float(exact.bound):.6g}{unit}, nothing found by the solver"
    elif exact.optimal:
        head = f"{what} {float(exact.value):.6g}{unit} is optimal (lower bound reached)"
    else:
        head = (
            f"{what} {float(exact.value):.6g}{unit}, lower bound {float(exact.bound):.6g}, "
            f"gap {float(exact.gap or 0):.3g}: not proven optimal"
        )
    budget = f"CP-SAT, effort {exact.deterministic_time:.1f} deterministic units"
    summary = [
        f"exact engine: {head}",
        f"  ({budget}, {exact.wall_seconds:.1f} s; time unit 1/{exact.time_scale} of a cost"
        f"{rounding})",
    ]
    header = [f"# Exact engine (CP-SAT, docs/exact.md): {head}{rounding}."]
    return summary, header


def run(args: argparse.Namespace) -> ExitCode:
    if (whole := activation_budget(args)) is not None:
        args.memory, how = whole
        print(how, file=sys.stderr)
    _check_arguments(args)
    if args.frontier:
        from ppdsl.commands.search_frontier import run_frontier

        argv = getattr(args, "argv", None) or sys.argv[2:]
        return run_frontier(
            args, _command_line(list(argv)), lambda text: _measured(args, text), _recheck
        )
    if args.evaluations is None:
        args.evaluations = DEFAULT_EVALUATIONS
    measured = _measured(args)
    try:
        problem = build_problem(
            devices=args.devices,
            microbatches=args.microbatches,
            placement=args.placement,
            costs=args.costs,
            memory=args.memory,
            weight_fraction=args.weight_memory or "1/2",
            measured=measured,
        )
        problem = with_topology(problem, topology_from_args(args))
    except SearchInputError as err:
        raise UsageError(str(err)) from None
    passes = problem.num_stages * problem.num_microbatches * 3
    if passes > args.max_passes:
        raise UsageError(
            f"{problem.num_stages} stages x {problem.num_microbatches} microbatches x 3 passes "
            f"= {passes:,} passes; search takes at most {args.max_passes:,} (raise it with "
            "--max-passes N; a search's time grows with its passes)"
        )
    options = SearchOptions(
        objective=args.objective,
        evaluations=args.evaluations,
        seed=args.seed,
        exact=args.exact,
        effort=args.effort,
        time_cap=args.time,
        span_bound=args.span_bound,
    )
    bar = ProgressBar(args.progress or sys.stderr.isatty())
    try:
        outcome = find(problem, options, progress=bar, solver_progress=bar.solver)
    except ValueError as err:  # the exact model refuses (e.g. weights too large)
        raise CompileError([Diagnostic("error", f"exact engine: {err}")]) from None
    finally:
        bar.close()
    m = outcome.metrics
    peaks = outcome.peak
    refs = references(problem)
    fitting = [r for r in refs if r.peak <= problem.budget]
    beats = None
    if fitting:
        ref = min(fitting, key=lambda r: r.bubble)
        verb = "beats" if m.bubble < ref.bubble - 1e-9 else "matches"
        if m.bubble > ref.bubble + 1e-9:
            verb = "is worse than"
        beats = (
            f"{verb} {ref.name} (bubble {ref.bubble:.4f}, peak {format_short(ref.peak)} M_B) "
            "under the same costs"
        )
    exact_summary, exact_header = _exact_lines(outcome)
    capped_line = None
    if outcome.capped:
        capped_line = (
            f"--time {args.time:g} stopped the search before its budget: this result "
            "depends on the machine's speed"
        )
        exact_header.append("# " + capped_line + ".")
    argv = getattr(args, "argv", None) or sys.argv[2:]
    written, unit, note = problem, Fraction(1), None
    if measured is not None:
        # The .pp states the costs file's own memory values, so that `ppdsl check
        # --costs-from` the same file reads the same model; the budget follows.
        unit = measured_unit(measured[1], problem.num_devices)
        written = replace(problem, memory=measured[1], budget=problem.budget * unit)
        note = (f"Costs and memory from {args.costs_from} (memory in its units; one 1F1B "
                f"stage = {format_short(unit)} of them).")
    text = emit_pp(
        written,
        outcome.orders,
        name=args.name,
        command=_command_line(list(argv)),
        method=outcome.method,
        bubble=m.bubble,
        makespan=m.makespan,
        peak=max(peaks) * unit,
        beats=("Found schedule " + beats) if beats else None,
        memory_note=note,
        notes=tuple(exact_header),
    )
    _recheck(text, args.output or "<search>", m.bubble)
    summary = sys.stdout
    if args.output:
        write_output(args.output, text)
    else:
        sys.stdout.write(text)
        summary = sys.stderr
    h = outcome.heuristic
    lines = [
        f"searched {h.tried} candidates ({args.evaluations} evaluations, seed {args.seed}) "
        f"in {outcome.seconds:.1f} s",
        f"best: {outcome.method}",
        f"bubble {m.bubble:.4f}, makespan {m.makespan:g}, idle {m.idle:.4f}",
        "peak memory per device (M_B): "
        + " ".join(format_short(p) for p in peaks)
        + f"  (budget {format_short(problem.budget)})",
        *exact_summary,
    ]
    if capped_line:
        lines.append(capped_line)
    if beats:
        lines.append(beats)
    elif refs:
        lines.append(
            "no hand-made schedule fits this budget (smallest: "
            + ", ".join(f"{r.name} {format_short(r.peak)} M_B" for r in refs)
            + ")"
        )
    if args.output:
        lines.append(f"wrote {args.output}; check it with: ppdsl check {args.output}")
    print("\n".join(lines), file=summary)
    return ExitCode.OK


def _recheck(text: str, name: str, bubble: float) -> None:
    """Compile the written text (every check, the exact-arithmetic memory bound,
    the simulation): a found schedule the compiler rejects is a bug in ppdsl."""
    try:
        compiled = compile_source(text, name)
    except CompileError as err:  # pragma: no cover - a bug, reported as one
        raise AssertionError(
            "ppdsl search wrote a schedule its own compiler rejects: "
            + "; ".join(d.message for d in err.diagnostics)
        ) from None
    if abs(compiled.timeline.bubble_ratio - bubble) > 1e-9:  # pragma: no cover - a bug
        raise AssertionError(
            f"search measured bubble {bubble}, the compiler {compiled.timeline.bubble_ratio}"
        )
