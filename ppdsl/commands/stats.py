"""Print a schedule's makespan, bubble ratio, idle fraction and per-device peak
memory against its declared bounds; with data parallelism (`--dp`, declared
`cost reduce`/`cost gather`, or `--params`), its communication lane's exposed
time and the model-state bytes per device."""

from __future__ import annotations

import argparse
import sys

from ppdsl import json_text
from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    add_dp_arguments,
    add_schedule_arguments,
    check_dp_arguments,
    compile_from_args,
)
from ppdsl.diagnostics import render_all
from ppdsl.report import dp_json, dp_table, schedule_json, stats_table

HELP = "makespan, bubble ratio and per-device peak memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "--json", action="store_true",
        help="print a machine-readable result (with each device's memory over time)",
    )
    add_dp_arguments(parser)
    parser.add_argument(
        "--params", type=float, default=None, metavar="N",
        help="with this many model parameters, also report parameter, gradient and "
        "optimizer-state bytes per device (replicate vs shard: --dp-mode)",
    )


def run(args: argparse.Namespace) -> ExitCode:
    check_dp_arguments(args)
    if args.params is not None and not args.params > 0:
        raise UsageError(f"--params must be positive, not {args.params:g}")
    compiled = compile_from_args(args)
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    costs = compiled.schedule.costs
    data_parallel = args.dp > 1 or args.params is not None or bool(costs.declared_collectives())
    if args.json:
        result = schedule_json(compiled, memory_profile=True)
        if data_parallel:
            result["data_parallel"] = dp_json(compiled, args.dp_mode, args.dp, args.params)
        json_text.dump(result, sys.stdout.write, 2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(stats_table(compiled))
        if data_parallel:
            sys.stdout.write(dp_table(compiled, args.dp_mode, args.dp, args.params))
    return ExitCode.OK
