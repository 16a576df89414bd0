"""Compile a schedule into per-rank torch programs: rank<N>.py for every rank, a
launch.py that picks the rank's program from torchrun's RANK, and manifest.json
(schedule, params, placement, costs, per-rank torch action lists, fingerprint).
Start it with `torchrun --nproc-per-node D OUT/launch.py --model FILE.py:FACTORY`
(D x N processes with `--dp N`: N data-parallel replicas of the pipeline)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ppdsl import limits
from ppdsl.analysis.comm_rules import COMM_MODELS
from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    add_dp_arguments,
    add_schedule_arguments,
    check_dp_arguments,
    compile_from_args,
    output_directory,
)
from ppdsl.diagnostics import render_all

HELP = "generate per-rank torch programs (run them with torchrun)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    add_dp_arguments(parser)
    parser.add_argument(
        "-o", "--output", metavar="DIR", default=None,
        help="output directory (default: build/<file name without .pp>)",
    )
    parser.add_argument(
        "--comm-model", choices=COMM_MODELS, default="rendezvous",
        help="the rules the programs are proven under; nccl posts each rank's receives in "
        "its peers' send order (NCCL matches transfers by order) for the NCCL transport",
    )


def default_output(file: str) -> Path:
    """build/<stem>, the stem reduced to safe characters."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(file).stem) or "schedule"
    return Path("build") / stem


def run(args: argparse.Namespace) -> ExitCode:
    from ppdsl.backend.codegen import write
    from ppdsl.compiler import generate

    check_dp_arguments(args)
    out = output_directory(args.output if args.output else default_output(args.file))
    compiled = compile_from_args(args)
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    # a long codegen reports its progress like the compile before it
    with limits.progress(args.file) as phase:
        phase("codegen: the plan and its fingerprint")
        generated = generate(compiled, args.dp, args.dp_mode)
        try:
            write(generated, out, phase)
        except OSError as exc:
            raise UsageError(f"cannot write into '{out}': {exc.strerror or exc}") from None
    d = compiled.schedule.num_devices * args.dp
    print(
        f"wrote {out}/: rank0.py..rank{d - 1}.py, launch.py, manifest.json "
        f"(fingerprint {generated.plan.fingerprint[:12]})\n"
        f"run it: torchrun --nproc-per-node {d} {out}/launch.py "
        "--model examples/models/tiny_gpt.py:stages --steps 20"
    )
    return ExitCode.OK
