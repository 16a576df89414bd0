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
from pathlib import Path

from ppdsl.commands.common import (
    ExitCode,
    add_dp_arguments,
    add_schedule_arguments,
    check_dp_arguments,
    compile_from_args,
)
from ppdsl.diagnostics import CompileError, Diagnostic, render_all
from ppdsl.render import TimelineStyle, render_svg, render_timeline

HELP = "draw the simulated timeline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "--width", type=int, default=None,
        help="columns per band (default: the terminal's width); wider timelines wrap",
    )
    parser.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    parser.add_argument(
        "--svg", metavar="OUT.svg", default=None,
        help="also write the timeline as an SVG figure (a bar per pass, to scale)",
    )
    add_dp_arguments(parser)


def run(args: argparse.Namespace) -> ExitCode:
    check_dp_arguments(args)
    compiled = compile_from_args(args)
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    if args.color == "auto":
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    else:
        color = args.color == "always"
    width = args.width or shutil.get_terminal_size((120, 24)).columns
    style = TimelineStyle(width=max(width, 40), color=color)
    lanes = None
    if args.dp > 1 or compiled.schedule.costs.declared_collectives():
        from ppdsl.analysis.collectives import comm_lanes

        lanes = comm_lanes(compiled.schedule, compiled.timeline, args.dp_mode)
    sys.stdout.write(render_timeline(compiled.schedule, compiled.timeline, style, lanes))
    if args.svg:
        try:
            Path(args.svg).write_text(
                render_svg(compiled.schedule, compiled.timeline), encoding="utf-8"
            )
        except OSError as exc:
            raise CompileError([Diagnostic("error", f"cannot write '{args.svg}': {exc}")]) from None
        print(f"wrote {args.svg}", file=sys.stderr)
    return ExitCode.OK
