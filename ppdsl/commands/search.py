"""Search for the schedule with the smallest bubble under a memory budget and
write it as an ordinary .pp file (order form) that `ppdsl check` accepts.

Memory is in M_B, the activation one microbatch leaves on one 1F1B stage:
`--memory 8`, `2p` (p = devices), `1.5p`, or `0.5x1f1b` (half of 1F1B's p·M_B).
A V-shape stage is half a 1F1B stage, so budgets compare across placements."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

from ppdsl.commands.common import ExitCode, UsageError
from ppdsl.costs_file import evaluate_costs, load_costs_file
from ppdsl.diagnostics import CompileError, Diagnostic
from ppdsl.ir.schedule import Costs, MemoryModel
from ppdsl.search import SearchInputError, emit_pp, references, search
from ppdsl.search.problem import build_problem, measured_unit, parse_placement
from ppdsl.search.progress import ProgressBar
from ppdsl.semantics import format_short, placement_spelling

HELP = "find the best schedule under a memory budget and write it as a .pp file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", "-d", type=int, required=True, help="pipeline ranks (p)")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches")
    parser.add_argument(
        "--memory",
        required=True,
        metavar="BUDGET",
        help="peak activation per device, in M_B: 8, 2p, 1.5p, 0.5x1f1b",
    )
    parser.add_argument(
        "--placement",
        default="parallel",
        help="parallel (default), vshape, or 'looped(v)'",
    )
    parser.add_argument(
        "--costs",
        default=None,
        metavar="F=..,B=..,W=..,comm=..",
        help="pass durations and transfer cost (default 1, 1, 1, 0); per stage: F=1:1:2:2",
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
        "--time",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="time for the randomised refinement after the block and heuristic sweeps (default 5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the refinement")
    parser.add_argument("--name", default="found", help="schedule name in the .pp file")
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


def _measured(args: argparse.Namespace) -> tuple[Costs, MemoryModel] | None:
    """`--costs-from`: the file's costs and memory for this placement."""
    if args.costs_from is None:
        return None
    if args.costs is not None or args.weight_memory is not None:
        given = "--costs" if args.costs is not None else "--weight-memory"
        raise UsageError(f"--costs-from gives the costs and memory model; drop {given}")
    try:
        placement = parse_placement(args.placement, max(args.devices, 1))
    except SearchInputError as err:
        raise CompileError([Diagnostic("error", str(err))]) from None
    spelling = placement_spelling(placement.stage_device, placement.num_devices)
    return evaluate_costs(load_costs_file(args.costs_from), max(args.devices, 1), spelling)


def run(args: argparse.Namespace) -> ExitCode:
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
    except SearchInputError as err:
        raise CompileError([Diagnostic("error", str(err))]) from None
    if args.time < 0:
        raise CompileError([Diagnostic("error", f"--time {args.time}: must be >= 0 seconds")])
    bar = ProgressBar(args.progress or sys.stderr.isatty())
    try:
        result = search(problem, seconds=args.time, seed=args.seed, progress=bar)
    finally:
        bar.close()
    best = result.best
    peaks = result.peak_memory()
    refs = references(problem)
    fitting = [r for r in refs if r.peak <= problem.budget]
    beats = None
    if fitting:
        ref = min(fitting, key=lambda r: r.bubble)
        verb = "beats" if best.metrics.bubble < ref.bubble - 1e-9 else "matches"
        if best.metrics.bubble > ref.bubble + 1e-9:
            verb = "is worse than"
        beats = (
            f"{verb} {ref.name} (bubble {ref.bubble:.4f}, peak {format_short(ref.peak)} M_B) "
            "under the same costs"
        )
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
        best.orders(),
        name=args.name,
        command=_command_line(list(argv)),
        method=best.method,
        bubble=best.metrics.bubble,
        makespan=best.metrics.makespan,
        peak=max(peaks) * unit,
        beats=("Found schedule " + beats) if beats else None,
        memory_note=note,
    )
    summary = sys.stdout
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise CompileError(
                [Diagnostic("error", f"cannot write '{args.output}': {exc}")]
            ) from None
    else:
        sys.stdout.write(text)
        summary = sys.stderr
    m = best.metrics
    lines = [
        f"searched {result.tried} candidates in {result.seconds:.1f} s",
        f"best: {best.method}",
        f"bubble {m.bubble:.4f}, makespan {m.makespan:g}, idle {m.idle:.4f}",
        "peak memory per device (M_B): "
        + " ".join(format_short(p) for p in peaks)
        + f"  (budget {format_short(problem.budget)})",
    ]
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
