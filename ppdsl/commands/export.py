"""Write a checked schedule in another tool's format. `--format torch-csv`:
torch.distributed.pipelining's compute-only action CSV (one row per rank, cells
like `0F1`, `0I1`, `0W1`, `0B1`), which its `_load_csv` reads."""

from __future__ import annotations

import argparse
import sys

from ppdsl.commands.common import (
    ExitCode,
    add_schedule_arguments,
    compile_from_args,
    output_file,
    write_output,
)
from ppdsl.diagnostics import Diagnostic, render_all
from ppdsl.interchange import to_torch_csv

HELP = "write a schedule as torch.distributed.pipelining's action CSV"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "--format",
        choices=["torch-csv"],
        default="torch-csv",
        help="output format (default: torch-csv)",
    )
    parser.add_argument(
        "-o", "--output", metavar="OUT", default=None, help="write here instead of stdout"
    )


def run(args: argparse.Namespace) -> ExitCode:
    if args.output:
        output_file(args.output)
    compiled = compile_from_args(args)
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    placement = compiled.schedule.placement
    if placement.lanes > 1:
        refusal = Diagnostic(
            "error",
            f"placement '{placement.kind}' runs {placement.lanes} pipelines; torch's action "
            "format runs one, so its runtime would send every microbatch through all "
            f"{placement.num_stages} stages: run it with `ppdsl run` or ppdsl's PipelineRunner",
            compiled.schedule.span,
        )
        print(render_all([refusal], sys.stderr), file=sys.stderr)
        return ExitCode.INVALID
    text = to_torch_csv(compiled.schedule)
    if args.output:
        # newline="": keep the csv module's CRLF row ends, as torch writes them
        write_output(args.output, text, newline="")
    else:
        sys.stdout.write(text)
    return ExitCode.OK
