"""Draw a schedule's simulated timeline in the terminal: one row per device,
F/B/W coloured like the papers' figures, microbatch numbers in each pass; with
data parallelism (`--dp N`, or `cost reduce`/`cost gather` declared), a row per
device for its communication lane (`--dp-mode shard` adds the gathers).
Colour only on a terminal and when NO_COLOR is unset."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    add_dp_arguments,
    add_lengths_arguments,
    add_schedule_arguments,
    check_dp_arguments,
    compile_from_args,
    output_file,
    with_lengths,
    write_output,
)
from ppdsl.diagnostics import render_all
from ppdsl.render import TimelineStyle, render_svg, render_timeline

HELP = "draw the simulated timeline"
_MIN_WIDTH = 40
"""The narrowest band `show` draws (a narrower terminal gets this width)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "--width", type=int, default=None,
        help=f"columns per band, at least {_MIN_WIDTH} (default: the terminal's width); "
        "wider timelines wrap",
    )
    parser.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    parser.add_argument(
        "--svg", metavar="OUT.svg", default=None,
        help="also write the timeline as an SVG figure (a bar per pass, to scale)",
    )
    add_dp_arguments(parser)
    add_lengths_arguments(parser)


def run(args: argparse.Namespace) -> ExitCode:
    check_dp_arguments(args)
    if args.width is not None and args.width < _MIN_WIDTH:
        raise UsageError(f"--width {args.width}: need at least {_MIN_WIDTH} columns")
    if args.svg:
        output_file(args.svg)
    compiled = with_lengths(compile_from_args(args), args, memory_over_time=True)
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    if args.color == "auto":
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    else:
        color = args.color == "always"
    width = args.width or shutil.get_terminal_size((120, 24)).columns
    style = TimelineStyle(width=max(width, _MIN_WIDTH), color=color)
    lanes = None
    if args.dp > 1 or compiled.schedule.costs.declared_collectives():
        from ppdsl.analysis.collectives import comm_lanes

        lanes = comm_lanes(compiled.schedule, compiled.timeline, args.dp_mode)
    sys.stdout.write(render_timeline(compiled.schedule, compiled.timeline, style, lanes))
    if args.svg:
        write_output(args.svg, render_svg(compiled.schedule, compiled.timeline))
        print(f"wrote {args.svg}", file=sys.stderr)
    return ExitCode.OK
