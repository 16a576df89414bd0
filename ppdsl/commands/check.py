"""Check a schedule: parse, elaborate, prove dependencies, collision-freedom,
memory bounds and deadlock-freedom, simulate, and check every `expect`.
Exit 0 when valid, 1 when the file is invalid, 2 on bad usage."""

from __future__ import annotations

import argparse
import sys

from ppdsl import json_text
from ppdsl.analysis.comm_rules import COMM_MODELS
from ppdsl.commands import check_family
from ppdsl.commands.common import ExitCode, UsageError, add_schedule_arguments
from ppdsl.commands.fix import add_fix_arguments, compile_with_fixes
from ppdsl.diagnostics import CompileError, render_all
from ppdsl.ir.rank import format_rank_programs
from ppdsl.ir.schedule import format_schedule
from ppdsl.report import diagnostic_json, schedule_json

HELP = "prove a schedule valid (or say where it is not)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser, optional_file=True)
    add_fix_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print a machine-readable result")
    parser.add_argument(
        "--no-early-receives", action="store_true",
        help="check the plain lowering, each receive posted just before its pass (as a "
        "runtime without ppdsl's early receives would run it): its deadlocks are reported "
        "as cycles of waits",
    )
    parser.add_argument(
        "--comm-model", choices=COMM_MODELS, default=None,
        help="the rules the lowered programs are proven deadlock-free under: rendezvous "
        "(blocking exchanges, the default for FILE), nccl (NCCL's streams and in-order "
        "matching, as the runtime's NCCL transport posts them; the default for --torch) or "
        "gloo (tagged, non-blocking posts)",
    )
    torch = parser.add_argument_group(
        "torch's own program", "check the program torch.distributed.pipelining lowers for one "
        "of its schedule classes (its comm insertion), without running it; instead of FILE")
    torch.add_argument("--torch", metavar="CLASS", default=None,
                       help="a schedule class, e.g. ScheduleInterleaved1F1B")
    torch.add_argument("--pp", type=int, default=None, metavar="N", help="pipeline ranks")
    torch.add_argument("--v", type=int, default=1, metavar="V", help="stages per rank")
    torch.add_argument("--m", type=int, default=None, metavar="M",
                       help="microbatches (default: the stages, at least 2 x --pp)")
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
    torch = args.torch is not None or args.file is None
    if args.comm_model is None:
        args.comm_model = "nccl" if torch else "rendezvous"
    if torch:
        return _run_torch(args)
    if check_family.wanted(args):
        return check_family.run(args)
    if not args.json:
        compiled = compile_with_fixes(args)
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
        compiled = compile_with_fixes(args)
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


def _run_torch(args: argparse.Namespace) -> ExitCode:
    """`--torch CLASS --pp N --v V`: torch's own lowered program under
    `--comm-model` (`ppdsl.commands.check_torch`)."""
    from ppdsl.analysis import comm_rules
    from ppdsl.analysis.checks.deadlock import verdict_diagnostics
    from ppdsl.commands.check_torch import default_microbatches, torch_program_csv
    from ppdsl.diagnostics import CompileError, register_source
    from ppdsl.interchange import from_torch_csv, torch_comm_items

    if args.torch is None:
        raise UsageError("give a FILE, or --torch CLASS --pp N [--v V]")
    if args.pp is None or args.pp < 1 or args.v < 1 or (args.m is not None and args.m < 1):
        raise UsageError("--torch needs --pp N (and --v, --m) as positive integers")
    m = args.m if args.m is not None else default_microbatches(args.pp * args.v, args.pp)
    text = torch_program_csv(args.torch, args.pp, args.v, m)
    file = f"<torch {args.torch} pp={args.pp} v={args.v} m={m}>"
    register_source(file, text)
    schedule = from_torch_csv(text, file)
    items = torch_comm_items(text, schedule) or []
    found = verdict_diagnostics(comm_rules.run(items, args.comm_model), items, args.comm_model,
                                "torch's comm insertion orders these operations")
    if found:
        raise CompileError(found)
    ops = sum(len(row) for row in items)
    print(f"{file}: ok under {args.comm_model}'s rules: {args.pp} ranks, "
          f"{schedule.num_stages} stages, {m} microbatches, {ops} actions")
    return ExitCode.OK
