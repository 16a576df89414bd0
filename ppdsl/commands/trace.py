"""Lay a run's measured trace (`ppdsl run --trace OUT.json`) beside the simulated
timeline, and check it against the proven rank programs.

The schedule is the one the trace names (its file and parameters, as the run
compiled it) unless `--against FILE.pp -D ...` names another; the costs are
the run's (`--costs-from` replaces them). The report gives, per rank and pass
kind, measured against predicted durations; the step's time outside passes by
cause; and the passes whose start slipped most against the simulation.
Conformance: every pass ran exactly once per step, in the proven order on each
rank, and every exchange posted exactly the program's transfers. A violation is
printed as `TRACE.json: rank R, step S: ...` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    add_costs_from_argument,
    add_defines_argument,
    add_limit_arguments,
    costs_from_args,
    output_file,
    parse_defines,
    write_output,
)
from ppdsl.compiler import Compiled, compile_file
from ppdsl.diagnostics import render_all
from ppdsl.ir.schedule import Costs
from ppdsl.semantics import PassKind

HELP = "a run's trace beside the simulation, checked against the rank programs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", metavar="TRACE.json", help="what `ppdsl run --trace` wrote")
    parser.add_argument(
        "--against", metavar="FILE.pp", default=None,
        help="the schedule to compare with (default: the file the trace names, with the "
        "parameters it ran with)",
    )
    add_defines_argument(parser, "with --against, override a parameter's default")
    add_costs_from_argument(parser)
    parser.add_argument(
        "--check-only", action="store_true",
        help="only check conformance (no timeline report)",
    )
    parser.add_argument("--top", type=int, default=5, metavar="N",
                        help="how many slipped passes to list (default 5)")
    parser.add_argument(
        "-o", "--output", metavar="COSTS.pp", default=None,
        help="write the run's own costs as a costs file for --costs-from (what the trace "
        "measured: passes, overhead, transfers, optimizer, jitter; the rest from the run's "
        "costs, given again with --costs-from when the run had them)")
    add_limit_arguments(parser)


def read_trace(path: str) -> dict[str, Any]:
    """The trace file as JSON, with its `otherData`; a UsageError for a file that
    is missing or is not a `ppdsl run --trace` trace."""
    try:
        trace = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read the trace {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not JSON ({exc}): give what `ppdsl run --trace` wrote") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list) or not isinstance(trace.get("otherData"), dict):
        raise UsageError(f"{path} is no ppdsl trace (no traceEvents and otherData): give what "
                         "`ppdsl run --trace` wrote")
    for index, event in enumerate(events):
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        args = event.get("args")
        if not (isinstance(event.get("pid"), int) and isinstance(args, dict)
                and isinstance(args.get("step"), int)
                and isinstance(event.get("ts"), int | float)
                and isinstance(event.get("dur"), int | float)):
            raise UsageError(f"{path}: event {index} is no slice `ppdsl run --trace` writes "
                             "(pid, ts, dur and args.step)")
    return trace


def _compile(args: argparse.Namespace, meta: dict[str, Any]) -> tuple[Compiled, bool]:
    """The schedule to check against and whether its costs are in ms."""
    if args.against is not None:
        file, defines = args.against, parse_defines(args.defines)
    else:
        if args.defines:
            raise UsageError("-D needs --against (without it the trace's own parameters are used)")
        file = meta.get("file")
        if not isinstance(file, str) or not Path(file).is_file():
            raise UsageError(f"the trace names the schedule {file!r}, which is not a file here: "
                             "give it with --against FILE.pp -D ...")
        defines = {str(k): str(v) for k, v in (meta.get("params") or {}).items()}
    compiled = compile_file(file, defines, costs=costs_from_args(args))
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    if args.costs_from:
        return compiled, True
    run_costs = meta.get("costs")
    if meta.get("costs_from") and isinstance(run_costs, dict):
        schedule = compiled.schedule
        per_kind = {k: run_costs[k.value] for k in PassKind if k.value in run_costs}
        if all(len(v) == schedule.num_stages for v in per_kind.values()):
            costs = Costs.by_kind(per_kind, float(run_costs.get("comm", 0.0)),
                                  overlap=schedule.costs.overlap).with_step_costs(
                run_costs.get("overhead", ()), run_costs.get("optimizer", ()),
                float(run_costs.get("norm", 0.0)),
                float(run_costs.get("jitter", 0.0))).with_receive_cost(
                float(run_costs.get("recv", 0.0)))
            return replace(compiled, schedule=replace(schedule, costs=costs)), True
    return compiled, False


def run(args: argparse.Namespace) -> ExitCode:
    from ppdsl.analysis.trace_check import check_trace, steps_of
    from ppdsl.analysis.trace_timeline import compare_timeline, format_timeline

    if args.top < 0:
        raise UsageError(f"--top must be 0 or more, not {args.top}")
    if args.output:
        output_file(args.output)
    trace = read_trace(args.trace)
    compiled, in_ms = _compile(args, trace["otherData"])
    findings = check_trace(args.trace, trace, compiled.programs)
    if findings:
        for line in findings:
            print(f"{line}", file=sys.stderr)
        print(f"{args.trace}: {len(findings)} violation{'s' if len(findings) > 1 else ''} of "
              f"the proven rank programs of {compiled.schedule.name}", file=sys.stderr)
        return ExitCode.INVALID
    steps = steps_of(trace)
    print(f"{args.trace}: conforms to the rank programs of {compiled.schedule.name} "
          f"({len({s.rank for s in steps})} ranks, {len({s.step for s in steps})} steps: "
          "every pass once, in order; every exchange as proven)")
    one_clock = trace["otherData"].get("clock") == "host"
    if not args.check_only and steps:
        print()
        sys.stdout.write(format_timeline(compare_timeline(steps, compiled.schedule, in_ms,
                                                          args.top, one_clock)))
    if args.output and steps:
        _write_costs(args, trace["otherData"], steps, compiled, in_ms, one_clock)
    return ExitCode.OK


def _write_costs(args: argparse.Namespace, meta: dict[str, Any], steps: list[Any],
                 compiled: Compiled, in_ms: bool, one_clock: bool) -> None:
    """`-o COSTS.pp`: the run's own costs (`analysis.calibrate`)."""
    import shlex

    from ppdsl import __version__
    from ppdsl.analysis.calibrate import CalibrationError, calibrate, costs_text

    schedule = compiled.schedule
    found = calibrate(steps, schedule, one_clock, schedule.costs.norm if in_ms else 0.0)
    argv = getattr(args, "argv", None) or sys.argv[1:]
    params = ", ".join(f"{k}={v}" for k, v in (meta.get("params") or {}).items())
    header = [
        f"Measured from a run's trace by ppdsl trace {__version__}: ppdsl "
        + " ".join(shlex.quote(a) for a in argv),
        f"the run: {meta.get('schedule', schedule.name)}"
        + (f" ({params})" if params else "")
        + f", {meta.get('device', '?')}, {meta.get('steps', '?')} steps"
        + (f", costs from {meta['costs_from']}" if meta.get("costs_from") else "")
        + "; costs in milliseconds ("
        + ("CUDA events" if str(meta.get("device", "")).startswith("cuda") else "wall time") + ")",
    ]
    try:
        # the compiled memory model is the run's unless the run had a costs file
        # that was not given again
        text = costs_text(found, schedule, in_ms, header,
                          memory=bool(args.costs_from) or not meta.get("costs_from"))
    except CalibrationError as exc:
        raise UsageError(f"{args.trace}: {exc}") from None
    write_output(args.output, text)
    print(f"wrote the run's own costs to {args.output}; use them with --costs-from "
          f"{args.output}", file=sys.stderr)
