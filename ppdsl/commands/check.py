"""Check a schedule: parse, elaborate, prove dependencies, collision-freedom,
memory bounds and deadlock-freedom, simulate, and check every `expect`.
Exit 0 when valid, 1 when the file is invalid, 2 on bad usage."""

from __future__ import annotations

import argparse
import sys

from ppdsl import json_text
from ppdsl.analysis.comm_rules import COMM_MODELS
from ppdsl.commands import check_family
from ppdsl.commands.common import ExitCode, add_schedule_arguments, compile_from_args
from ppdsl.diagnostics import CompileError, render_all
from ppdsl.ir.rank import format_rank_programs
from ppdsl.ir.schedule import format_schedule
from ppdsl.report import diagnostic_json, schedule_json

HELP = "prove a schedule valid (or say where it is not)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a machine-readable result")
    parser.add_argument(
        "--no-early-receives", action="store_true",
        help="check the plain lowering, each receive posted just before its pass (as a "
        "runtime without ppdsl's early receives would run it): its deadlocks are reported "
        "as cycles of waits",
    )
    parser.add_argument(
        "--comm-model", choices=COMM_MODELS, default="rendezvous",
        help="the rules the lowered programs are proven deadlock-free under: rendezvous "
        "(blocking exchanges, the default), nccl (NCCL's streams and in-order matching, as "
        "the runtime's NCCL transport posts them) or gloo (tagged, non-blocking posts)",
    )
    parser.add_argument(
        "--ir", action="store_true",
        help="also print the schedule IR in its canonical text form (per-device pass orders)",
    )
    parser.add_argument(
        "--programs", action="store_true",
        help="also print the lowered per-rank programs (passes and send/recv exchanges)",
    )
    check_family.add_arguments(parser)


def run(args: argparse.Namespace) -> ExitCode:
    if check_family.wanted(args):
        return check_family.run(args)
    if not args.json:
        compiled = compile_from_args(args)
        if compiled.warnings:
            print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
        s, t = compiled.schedule, compiled.timeline
        print(
            f"{args.file}: ok: schedule {s.name}, {s.num_devices} devices, {s.num_stages} stages, "
            f"{s.num_microbatches} microbatches; makespan {float(t.makespan):g}, "
            f"bubble {float(t.bubble_ratio):.4f}, peak memory {max(t.peak_memory)}"
        )
        if args.ir:
            print(format_schedule(s), end="")
        if args.programs:
            print(format_rank_programs(compiled.programs), end="")
        return ExitCode.OK
    try:
        compiled = compile_from_args(args)
    except CompileError as err:
        result = {"valid": False, "diagnostics": [diagnostic_json(d) for d in err.diagnostics]}
        print(json_text.dumps(result, 2))
        return ExitCode.INVALID
    result = {
        "valid": True,
        "diagnostics": [diagnostic_json(d) for d in compiled.warnings],
        "schedule": schedule_json(compiled),
    }
    if args.ir:
        result["ir"] = format_schedule(compiled.schedule)
    if args.programs:
        result["programs"] = format_rank_programs(compiled.programs)
    json_text.dump(result, sys.stdout.write, 2)
    sys.stdout.write("\n")
    return ExitCode.OK
