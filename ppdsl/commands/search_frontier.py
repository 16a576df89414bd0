"""`ppdsl search --frontier`: the best schedule found at every reachable peak-memory
level (`ppdsl.search.frontier`), printed as a table, `--json` as a list of points,
`--svg` as a figure, `--pp-dir` as one `.pp` file per point; the papers' named
schedules (the search's references, and every `--named FILE.pp` compiled under the
same costs and memory model) set against it."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    output_directory,
    output_file,
    topology_from_args,
    write_output,
)
from ppdsl.ir.schedule import Costs, MemoryModel
from ppdsl.search import SearchInputError, emit_pp
from ppdsl.search.combined import SearchOptions
from ppdsl.search.frontier import (
    FRONTIER_EVALUATIONS,
    Frontier,
    FrontierOptions,
    FrontierPoint,
    NamedPoint,
    compile_named,
    frontier,
    frontier_at,
    named_points,
)
from ppdsl.search.problem import (
    SearchProblem,
    build_problem,
    chunk_costs,
    parse_budget,
    parse_placement,
    with_topology,
)
from ppdsl.search.progress import ProgressBar
from ppdsl.semantics import format_short

__all__ = ["run_frontier", "parse_range", "split_placements"]


def split_placements(text: str) -> list[str]:
    """`parallel,vshape,looped(2)` -> the placements, in order, each once."""
    words = [w.strip() for w in re.split(r",(?![^(]*\))", text) if w.strip()]
    if not words:
        raise UsageError("--placement: name at least one placement (parallel, vshape, looped(2))")
    return list(dict.fromkeys(words))


def parse_range(text: str | None, devices: int) -> tuple[Fraction | None, Fraction | None]:
    """`--memory` under --frontier: `LO:HI`, `LO:`, `:HI` (budgets as `--memory`
    spells them), or nothing (every level)."""
    if text is None or not text.strip():
        return None, None
    low_text, colon, high_text = text.partition(":")
    if not colon:
        raise UsageError(
            f"--memory {text!r}: with --frontier give a range LO:HI (e.g. 4:2p, 1:, :16) or leave it out"
        )
    try:
        low = parse_budget(low_text, devices) if low_text.strip() else None
        high = parse_budget(high_text, devices) if high_text.strip() else None
    except SearchInputError as err:
        raise UsageError(str(err)) from None
    if low is not None and high is not None and low > high:
        raise UsageError(f"--memory {text}: the range's low end is above its high end")
    return low, high


def _problems(args: argparse.Namespace, measured_for: Callable[[str], tuple[Costs, MemoryModel] | None]) -> list[SearchProblem]:
    """One problem per placement, costs per 1F1B stage scaled to each placement's chunks."""
    out = []
    for text in split_placements(args.placement):
        try:
            problem = build_problem(
                devices=args.devices,
                microbatches=args.microbatches,
                placement=text,
                costs=args.costs,
                memory=None,
                weight_fraction=args.weight_memory or "1/2",
                measured=measured_for(text),
            )
        except SearchInputError as err:
            raise UsageError(str(err)) from None
        if args.costs_from is None:
            problem = _with_chunk_costs(problem)
        problem = _over_links(args, problem)
        passes = problem.num_stages * problem.num_microbatches * 3
        if passes > args.max_passes:
            raise UsageError(
                f"--placement {text}: {passes:,} passes; search takes at most {args.max_passes:,} "
                "(raise it with --max-passes N)"
            )
        out.append(problem)
    return out


def _recompute(args: argparse.Namespace) -> tuple[tuple[int, ...], Fraction]:
    """`--recompute 2,4` and `--kept-input 1/16`, checked."""
    if args.recompute is None:
        return (), Fraction(1, 16)
    try:
        counts = tuple(int(x) for x in args.recompute.split(",") if x.strip())
        kept = Fraction(args.kept_input)
    except (ValueError, ZeroDivisionError):
        raise UsageError(
            f"--recompute {args.recompute!r} --kept-input {args.kept_input!r}: expected device "
            "counts such as 2,4 and a fraction such as 1/16"
        ) from None
    bad = [k for k in counts if not 1 <= k <= args.devices]
    if bad or not counts:
        raise UsageError(f"--recompute {args.recompute}: each K is a device count from 1 to {args.devices}")
    if not 0 <= kept < 1:
        raise UsageError(f"--kept-input {args.kept_input}: M_I is part of M_B, from 0 up to (not) 1")
    return counts, kept


def _with_chunk_costs(problem: SearchProblem) -> SearchProblem:
    from dataclasses import replace

    return replace(problem, costs=chunk_costs(problem.costs, problem.model_chunks_per_device))


def _file_name(name: str, point: FrontierPoint) -> str:
    placement = re.sub(r"[^a-z0-9]+", "", point.placement.lower())
    memory = format_short(point.memory, 6).replace(".", "_")
    return f"{name}_{placement}_{memory}.pp"


def _write_points(
    args: argparse.Namespace, result: Frontier, command: str, recheck: Callable[[str, str, float], None]
) -> dict[int, str]:
    """Each frontier point as a `.pp` file under --pp-dir, compiled again by
    `recheck` (`ppdsl search`'s); returns point index -> path."""
    folder = output_directory(args.pp_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for n, point in enumerate(result.points):
        path = folder / _file_name(args.name, point)
        m = point.outcome.metrics
        exact = point.outcome.exact
        notes = []
        if exact is not None and point.bound is not None:
            notes.append(
                f"# Exact engine (CP-SAT, docs/exact.md) at budget {format_short(point.budget)}: "
                + ("optimal (lower bound reached)." if point.optimal
                   else f"lower bound {point.bound:.6g}, not proven optimal.")
            )
        text = emit_pp(
            point.problem,
            point.orders,
            name=f"{args.name}_{n}",
            command=command,
            method=point.method,
            bubble=m.bubble,
            makespan=m.makespan,
            peak=point.activation,
            beats=f"Frontier point {n} of {len(result.points)} ({point.placement}).",
            notes=tuple(notes),
        )
        recheck(text, str(path), m.bubble)
        write_output(path, text)
        written[n] = str(path)
    return written


def _named(args: argparse.Namespace, problems: list[SearchProblem], problem_for) -> list[NamedPoint]:
    out = named_points(problems, args.dp)
    for path in args.named or ():
        if not Path(path).is_file():
            raise UsageError(f"--named {path}: no such file")
        out.append(compile_named(path, problem_for, args.devices, args.microbatches, args.dp,
                                 Fraction(args.parameter_memory or 0),
                                 topology=topology_from_args(args)))
    return out


def _table(result: Frontier, files: dict[int, str], dp: int) -> list[str]:
    step = dp > 1
    lines = [
        "| memory | bubble | makespan |" + (" step | exposed reduction |" if step else "")
        + " lower bound | optimal | placement | parameter copies | recompute | file |",
        "|---|---|---|" + ("---|---|" if step else "") + "---|---|---|---|---|---|",
    ]
    for n, p in enumerate(result.points):
        bound = "-" if p.bound is None else f"{p.bound:.4f}" if result.objective == "bubble" else f"{p.bound:g}"
        lines.append(
            f"| {format_short(p.memory)} | {p.bubble:.4f} | {p.makespan:g} | "
            + (f"{p.step:g} | {p.exposed:g} | " if step else "")
            + f"{bound} | "
            f"{'yes' if p.optimal else 'no' if p.bound is not None else '-'} | {p.placement} | "
            f"{p.copies} | {','.join(map(str, p.recompute)) or '-'} | {files.get(n, '-')} |"
        )
    if any(p.bound is not None for p in result.points):
        lines.append("(lower bound and optimal hold for the point's placement at its level's "
                     "budget: docs/exact.md)")
    return lines


def _named_lines(result: Frontier, named: list[NamedPoint]) -> list[str]:
    """Each named schedule against the frontier's best at its memory, by the objective."""
    if not named:
        return []
    lines = [
        "",
        "| named schedule | placement | memory | bubble | step time | frontier there | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    by_makespan = result.objective == "makespan"
    for n in sorted(named, key=lambda x: (x.memory, x.bubble, x.name)):
        at = frontier_at(result.points, n.memory)
        mine = n.step if by_makespan else n.bubble
        if at is None:
            there, verdict = "-", "below the frontier"
        else:
            theirs = at.step if by_makespan else at.bubble
            there = (f"{at.step:g}" if by_makespan else f"{at.bubble:.4f}") + f" ({at.placement})"
            verdict = ("below the frontier" if mine < theirs - 1e-9
                       else "on the frontier" if mine <= theirs + 1e-9 else "above the frontier")
        lines.append(
            f"| {n.name} | {n.placement} | {format_short(n.memory)} | {n.bubble:.4f} | "
            f"{n.step:g} | {there} | {verdict} |"
        )
    return lines


def _json(result: Frontier, files: dict[int, str], dp: int) -> str:
    rows: list[dict[str, object]] = [
        {
            "memory": float(p.memory),
            "bubble": round(p.bubble, 12),
            "makespan": round(p.makespan, 9),
            "bound": None if p.bound is None else round(p.bound, 12),
            "optimal": p.optimal,
            "placement": p.placement,
            "recompute": list(p.recompute),
            "file": files.get(n),
            "activation": float(p.activation),
            "copies": p.copies,
        }
        for n, p in enumerate(result.points)
    ]
    if dp > 1:  # the step time with the exposed reduction, which the frontier compares
        for row, p in zip(rows, result.points, strict=True):
            row["step"] = round(p.step, 9)
    return json.dumps(rows, indent=2) + "\n"


def run_frontier(
    args: argparse.Namespace,
    command: str,
    measured_for: Callable[[str], tuple[Costs, MemoryModel] | None],
    recheck: Callable[[str, str, float], None],
) -> ExitCode:
    """`ppdsl search --frontier` (the flags are checked by `search`): `measured_for`
    gives `--costs-from`'s costs per placement, `recheck` compiles a written file."""
    from ppdsl.search.figure import frontier_svg

    if args.svg:
        output_file(args.svg)
    low, high = parse_range(args.memory, args.devices)
    problems = _problems(args, measured_for)
    by_placement = {
        p.placement.spelling(): p for p in problems
    }

    def problem_for(spelling: str) -> SearchProblem:
        if spelling in by_placement:
            return by_placement[spelling]
        return _problems_for_named(args, spelling, measured_for)

    recompute, kept = _recompute(args)
    options = FrontierOptions(
        SearchOptions(
            objective=args.objective,
            evaluations=FRONTIER_EVALUATIONS if args.evaluations is None else args.evaluations,
            seed=args.seed,
            exact=False,
            effort=args.effort or 0.0,
            time_cap=None,
        ),
        low,
        high,
        args.levels,
        recompute,
        kept,
        args.dp,
        Fraction(args.parameter_memory or 0),
    )
    named = _named(args, problems, problem_for)
    bar = ProgressBar(args.progress or sys.stderr.isatty())
    try:
        result = frontier(problems, options, progress=bar, named=named)
    except ValueError as err:  # the exact model refuses (e.g. weights too large)
        raise UsageError(f"exact engine: {err}") from None
    finally:
        bar.close()
    files = _write_points(args, result, command, recheck) if args.pp_dir else {}
    if args.svg:
        title = f"{command.split(' --svg')[0]}"
        write_output(args.svg, frontier_svg(result, named, title=title[:110]))
    lines = [
        f"frontier: d={args.devices} m={args.microbatches}, placements "
        + ", ".join(by_placement)
        + f"; {len(result.searched)} levels searched, {len(result.points)} on the frontier",
        *_table(result, files, args.dp),
        *_named_lines(result, named),
    ]
    if args.svg:
        lines.append(f"wrote {args.svg}")
    if args.json:
        sys.stdout.write(_json(result, files, args.dp))
        print("\n".join(lines), file=sys.stderr)
    else:
        print("\n".join(lines))
    return ExitCode.OK


def _problems_for_named(args: argparse.Namespace, spelling: str, measured_for) -> SearchProblem:
    """The frontier's model on a placement it does not search (a `--named` file's)."""
    try:
        parse_placement(spelling, args.devices)
        problem = build_problem(
            devices=args.devices,
            microbatches=args.microbatches,
            placement=spelling,
            costs=args.costs,
            memory=None,
            weight_fraction=args.weight_memory or "1/2",
            measured=measured_for(spelling),
        )
    except SearchInputError as err:
        raise UsageError(f"--named: {err}") from None
    return _over_links(args, problem if args.costs_from is not None else _with_chunk_costs(problem))


def _over_links(args: argparse.Namespace, problem: SearchProblem) -> SearchProblem:
    """`--topology`: the problem's transfers and reductions timed over its links."""
    try:
        return with_topology(problem, topology_from_args(args), args.dp)
    except SearchInputError as err:
        raise UsageError(str(err)) from None
