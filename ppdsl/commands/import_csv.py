"""Read torch.distributed.pipelining's action CSV (one row per rank, cells like
`0F1`; its compute-only or compute+comms form), check it like a `.pp` file (every
error points at its CSV cell), check a compute+comms CSV's own transfers under
`--comm-model` (NCCL's rules by default; a deadlock is its cycle of waits, each
at its row and cell), and write it as an order-form `.pp` file that
`ppdsl check` accepts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ppdsl import limits
from ppdsl.analysis import comm_rules
from ppdsl.analysis.checks.deadlock import verdict_diagnostics
from ppdsl.analysis.comm_rules import COMM_MODELS
from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    add_limit_arguments,
    output_file,
    write_output,
)
from ppdsl.compiler import compile_schedule
from ppdsl.diagnostics import CompileError, Diagnostic, register_source, render_all
from ppdsl.interchange import from_torch_csv, to_pp, torch_comm_items

HELP = "read torch.distributed.pipelining's action CSV; write an order-form .pp"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the .csv of per-rank actions")
    parser.add_argument(
        "--placement",
        default=None,
        metavar="KIND",
        help="parallel, looped(v), vshape or wave(v); checked against the actions "
        "(default: inferred from which rank runs each stage)",
    )
    parser.add_argument(
        "--devices", type=int, default=None, metavar="D", help="ranks (default: CSV rows)"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="M",
        help="microbatches (default: the largest microbatch index + 1)",
    )
    parser.add_argument(
        "--comm-model", choices=COMM_MODELS, default="nccl",
        help="the rules a compute+comm CSV's own SEND/RECV actions are checked under "
        "(default nccl: lone ops on their pair's communicator, BATCH_P2P groups on the "
        "group's, in issue order, unbuffered); a deadlock is its cycle of waits at the rows",
    )
    parser.add_argument(
        "-o", "--output", metavar="OUT", default=None, help="write the .pp here instead of stdout"
    )
    add_limit_arguments(parser)


def run(args: argparse.Namespace) -> ExitCode:
    for flag, value in (("--devices", args.devices), ("--microbatches", args.microbatches)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: expected a positive integer")
    if args.output:
        output_file(args.output)
    path = Path(args.file)
    try:
        if path.is_file():
            limits.check_source(path.stat().st_size, args.file)
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise CompileError([Diagnostic("error", f"no such file: '{args.file}'")]) from None
    except IsADirectoryError:
        raise CompileError([Diagnostic("error", f"'{args.file}' is a directory, not a CSV file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CompileError([Diagnostic("error", f"cannot read '{args.file}': {exc}")]) from None
    register_source(args.file, text)
    schedule = from_torch_csv(
        text,
        args.file,
        placement=args.placement,
        num_devices=args.devices,
        num_microbatches=args.microbatches,
    )
    items = torch_comm_items(text, schedule)
    if items is not None:  # the CSV's own transfers, run as the backend would
        found = verdict_diagnostics(
            comm_rules.run(items, args.comm_model), items, args.comm_model,
            "post one of these operations earlier, or the pair as one BATCH_P2P group")
        if found:
            raise CompileError(found)
    compiled = compile_schedule(schedule, warn_unbounded=False)  # to_pp writes the bound
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    pp = to_pp(schedule, source=path.name)
    if args.output:
        write_output(args.output, pp)
    else:
        sys.stdout.write(pp)
    return ExitCode.OK
