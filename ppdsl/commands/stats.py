"""Print a schedule's makespan, bubble ratio, idle fraction and per-device peak
memory against its declared bounds; with data parallelism (`--dp`, declared
`cost reduce`/`cost gather`, or `--params`), its communication lane's exposed
time and the model-state bytes per device; with `--bytes`, every rank's
whole-device bytes by component (`analysis.device_bytes`)."""

from __future__ import annotations

import argparse
import math
import sys

from ppdsl import json_text
from ppdsl.analysis.device_bytes import (
    DeviceOptions,
    ModelBytes,
    RankBytes,
    StageBytes,
    device_bytes,
)
from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    add_bytes_arguments,
    add_dp_arguments,
    add_lengths_arguments,
    add_schedule_arguments,
    add_topology_argument,
    check_dp_arguments,
    compile_from_args,
    device_options,
    lengths_from_args,
    with_lengths,
)
from ppdsl.compiler import Compiled
from ppdsl.diagnostics import render_all
from ppdsl.report import bytes_json, bytes_table, dp_json, dp_table, schedule_json, stats_table

HELP = "makespan, bubble ratio and per-device peak memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument(
        "--json", action="store_true",
        help="print a machine-readable result (with each device's memory over time)",
    )
    add_dp_arguments(parser)
    add_topology_argument(parser)
    parser.add_argument(
        "--params", type=float, default=None, metavar="N",
        help="with this many model parameters, also report parameter, gradient and "
        "optimizer-state bytes per device (replicate vs shard: --dp-mode)",
    )
    add_bytes_arguments(parser)
    add_lengths_arguments(parser)
    parser.add_argument(
        "--bytes", action="store_true",
        help="every rank's whole-device bytes by component over the step (needs --params and "
        "--unit-bytes)",
    )
    parser.add_argument(
        "--unit-bytes", type=float, default=None, metavar="B",
        help="with --bytes: the bytes of one unit of the schedule's memory model (M_B = 1)",
    )
    parser.add_argument(
        "--boundary-bytes", type=int, default=0, metavar="B",
        help="with --bytes: the bytes of the tensor a stage sends on (default 0)",
    )


def run(args: argparse.Namespace) -> ExitCode:
    check_dp_arguments(args)
    if args.params is not None and not args.params > 0:
        raise UsageError(f"--params must be positive, not {args.params:g}")
    options = device_options(args) if args.bytes else None
    if args.bytes and (args.params is None or args.unit_bytes is None
                       or not 0 < args.unit_bytes < math.inf or not 0 < args.params < math.inf
                       or args.boundary_bytes < 0):
        raise UsageError("--bytes needs a finite --params N and a positive, finite --unit-bytes B (the bytes of "
                         "one M_B); --boundary-bytes must not be negative")
    compiled = compile_from_args(args)
    lengths = lengths_from_args(args, compiled.schedule.num_microbatches)
    compiled = with_lengths(compiled, args, memory_over_time=args.json)
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    costs = compiled.schedule.costs
    data_parallel = args.dp > 1 or args.params is not None or bool(costs.declared_collectives())
    if args.json:
        result = schedule_json(compiled, memory_profile=True)
        if data_parallel:
            result["data_parallel"] = dp_json(compiled, args.dp_mode, args.dp, args.params)
        if options is not None:
            result["device_bytes"] = bytes_json(_device_bytes(compiled, args, options), options)
        json_text.dump(result, sys.stdout.write, 2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(stats_table(compiled))
        if lengths is not None:
            follows = [what for what, yes in (("costs", compiled.schedule.costs.follows_tokens),
                                              ("memory", compiled.schedule.memory.follows_tokens))
                       if yes]
            sys.stdout.write(
                f"lengths {','.join(map(str, lengths))}: "
                + (f"{' and '.join(follows)} at each microbatch's tokens\n" if follows
                   else "nothing in the file follows tokens (costs and memory as without)\n"))
        if data_parallel:
            sys.stdout.write(dp_table(compiled, args.dp_mode, args.dp, args.params))
        if options is not None:
            sys.stdout.write(bytes_table(
                _device_bytes(compiled, args, options),
                f"whole-device bytes per rank ({args.params:g} parameters split evenly, "
                f"{options.param_dtype} parameters, {options.optimizer}, autocast "
                f"{options.precision}, dp {options.dp} {options.dp_mode}):"))
    return ExitCode.OK


def _device_bytes(compiled: Compiled, args: argparse.Namespace,
                  options: DeviceOptions) -> tuple[RankBytes, ...]:
    """`--params` split evenly over the model stages, each sending `--boundary-bytes`."""
    stages = compiled.schedule.placement.num_model_stages
    model = ModelBytes(tuple(StageBytes(round(args.params / stages), args.boundary_bytes)
                             for _ in range(stages)), args.unit_bytes)
    return device_bytes(compiled.schedule, compiled.lowered, model, options)
