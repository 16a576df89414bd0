"""Print a schedule's makespan, bubble ratio, idle fraction and per-device peak
memory against its declared bounds."""

from __future__ import annotations

import argparse
import sys

from ppdsl import json_text
from ppdsl.commands.common import ExitCode, add_schedule_arguments, compile_from_args
from ppdsl.diagnostics import render_all
from ppdsl.report import schedule_json, stats_table

HELP = "makespan, bubble ratio and per-device peak memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "--json", action="store_true",
        help="print a machine-readable result (with each device's memory over time)",
    )


def run(args: argparse.Namespace) -> ExitCode:
    compiled = compile_from_args(args)
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    if args.json:
        print(json_text.dumps(schedule_json(compiled, memory_profile=True), 2))
    else:
        sys.stdout.write(stats_table(compiled))
    return ExitCode.OK
