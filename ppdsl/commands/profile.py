"""Measure a model's pass costs and activation memory stage by stage: T_F, T_B
(fused), T_I and T_W of the B/W split, the plain stage's forward, M_B and M_W in
bytes, the bytes each stage sends on and the time to move them. `-o FILE` writes
them as `cost` and `memory` statements that check, show, stats, compare, search,
compile and run take with `--costs-from FILE`: the zero-bubble paper's loop,
profile then schedule, on your model and your hardware.

On CPU the profile runs on one thread unless OMP_NUM_THREADS says otherwise, as
`ppdsl run`'s ranks do, and then times passes in that thread's CPU time (other
work on the machine does not count). On CUDA passes are timed by CUDA events and
the TF32 settings are recorded; `--precision bf16|fp16` profiles under autocast."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    check_model_file,
    output_file,
    write_output,
)
from ppdsl.diagnostics import CompileError, Diagnostic

HELP = "measure a model's pass costs and memory per stage (for --costs-from)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="FILE.py:FACTORY",
                        help="model factory, e.g. examples/models/tiny_gpt.py:stages")
    parser.add_argument("--stages", type=int, required=True, metavar="N",
                        help="cut the model into N stages (the schedule's S)")
    parser.add_argument("--microbatch-size", type=int, default=2, metavar="B",
                        help="samples per microbatch (default 2, what `ppdsl run` uses by default)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: CUDA when available, else CPU")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed runs; the report is their median (default 20)")
    parser.add_argument("--norms", choices=["b", "w"], default="b",
                        help="when the split computes layer norms' weight gradients: b (in B, as "
                             "the zero-bubble paper's implementation; default) or w (deferred to W)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="fp32 (default), or the forward and loss under bf16/fp16 autocast, as "
                             "`ppdsl run --precision` trains (a bf16 run needs bf16 costs)")
    parser.add_argument("--no-transfer", action="store_true",
                        help="skip measuring the transfer between stages (cost comm = 0)")
    parser.add_argument("--dp", type=int, default=1, metavar="N",
                        help="also measure each stage's data-parallel collectives over N "
                        "processes (NCCL with a GPU each, else gloo, said so): cost reduce (all-reduce; reduce-scatter with --dp-mode shard) "
                        "and cost gather (all-gather) of its parameter bytes")
    parser.add_argument("--dp-mode", choices=["replicate", "shard"], default="replicate",
                        help="what cost reduce measures (default replicate: an all-reduce)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument("-o", "--output", metavar="COSTS.pp", default=None,
                        help="write cost and memory statements for --costs-from")
    parser.add_argument("--progress", action="store_true",
                        help="draw the progress bar even when stderr is not a terminal")


def run(args: argparse.Namespace) -> ExitCode:
    from ppdsl.runtime.model import ModelError
    from ppdsl.runtime.profile import prepare_device, profile_model, to_costs_pp
    from ppdsl.search.progress import ProgressBar

    if args.stages < 1:
        raise UsageError(f"--stages {args.stages}: need at least 1 stage")
    if args.microbatch_size < 1:
        raise UsageError(f"--microbatch-size {args.microbatch_size}: need at least 1 sample")
    if args.dp < 1:
        raise UsageError(f"--dp {args.dp}: need at least 1 rank")
    if args.warmup < 0 or args.repeats < 1:
        raise UsageError("--warmup must be >= 0 and --repeats >= 1")
    check_model_file(args.model)
    if args.output:
        output_file(args.output)
    device, error = prepare_device(args.device)
    if error is not None:
        raise UsageError(error)
    bar = ProgressBar(args.progress or sys.stderr.isatty())
    try:
        profile = profile_model(
            args.model, args.stages, args.microbatch_size, device,
            warmup=args.warmup, repeats=args.repeats, transfer=not args.no_transfer,
            progress=bar, norms=args.norms, dp=args.dp, dp_mode=args.dp_mode,
            precision=args.precision,
        )
    except ModelError as exc:
        raise CompileError([Diagnostic("error", str(exc))]) from None
    finally:
        bar.close()
    if args.output:
        argv = getattr(args, "argv", None) or sys.argv[1:]
        command = "ppdsl " + " ".join(shlex.quote(a) for a in argv)
        write_output(args.output, to_costs_pp(profile, command))
    if args.json:
        print(json.dumps(profile.to_json(), indent=2))
    else:
        sys.stdout.write(profile.table())
    if args.output:
        print(f"wrote {args.output}; use it with --costs-from {args.output}", file=sys.stderr)
    return ExitCode.OK
