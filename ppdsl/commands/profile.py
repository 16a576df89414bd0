"""Measure a model's pass costs and activation memory stage by stage: T_F, T_B
(fused), T_I and T_W of the B/W split, the plain stage's forward, M_B and M_W in
bytes, the bytes each stage sends on and the time to move them. `-o FILE` writes
them as `cost` and `memory` statements that check, show, stats, compare, search,
compile and run take with `--costs-from FILE`; with them the step's costs besides
passes (`cost overhead`: the engine's work per pass, its passes run through
`PipelineRunner`; `cost optimizer[s]`; `cost norm`: the gradient-norm all-reduce): the zero-bubble paper's loop,
profile then schedule, on your model and your hardware.

On CPU the profile runs on one thread unless OMP_NUM_THREADS says otherwise, as
`ppdsl run`'s ranks do, and then times its stage runs in that thread's CPU time
(other work on the machine does not count); the pass costs it writes are the
engine's, timed in wall time on a pipeline of gloo processes, one per core
(`--devices`), as a run's ranks run them. On CUDA passes are timed by CUDA events and
the TF32 settings are recorded; `--precision bf16|fp16` profiles under autocast."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    check_model_file,
    output_file,
    write_output,
)
from ppdsl.diagnostics import CompileError, Diagnostic
from ppdsl.runtime.choices import DEVICES, DP_MODES, OPTIMIZERS, PRECISIONS

HELP = "measure a model's pass costs and memory per stage (for --costs-from)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="FILE.py:FACTORY",
                        help="model factory, e.g. examples/models/tiny_gpt.py:stages")
    parser.add_argument("--stages", type=int, default=None, metavar="N",
                        help="cut the model into N stages (the schedule's S; needed unless "
                        "--per-layer)")
    parser.add_argument("--per-layer", action="store_true",
                        help="with --model hf:DIR: measure each layer alone (embedding, every "
                        "decoder layer, head); with --stages, the stages are the cut's (--cut) "
                        "sums of their layers")
    parser.add_argument("--cut", default="balanced", metavar="balanced|equal|0,5,11",
                        help="with --per-layer --stages: where the stages start (default "
                        "balanced: the slowest stage as fast as the layers allow)")
    parser.add_argument("--seq-len", type=int, default=64, metavar="L",
                        help="with --model hf:DIR: tokens per sample (default 64)")
    parser.add_argument("--lengths", default=None, metavar="L,L,...",
                        help="measure the passes at each of these tokens per sample (the "
                        "model's samples cut to their first L tokens; at least 2 lengths) and "
                        "write costs and memory in tokens (-o: `cost F[s] = a + b*tokens + "
                        "c*tokens^2`; docs/language.md)")
    parser.add_argument("--microbatch-size", type=int, default=2, metavar="B",
                        help="samples per microbatch (default 2, what `ppdsl run` uses by default)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto: CUDA when available, else CPU")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed runs; the report is their median (default 20)")
    parser.add_argument("--norms", choices=["in-b", "deferred"], default="in-b",
                        help="when the split computes layer norms' weight gradients: in-b (in B, as "
                             "the zero-bubble paper's implementation; default) or deferred (to W)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32 (default), or the forward and loss under bf16/fp16 autocast, as "
                             "`ppdsl run --precision` trains (a bf16 run needs bf16 costs)")
    parser.add_argument("--no-transfer", action="store_true",
                        help="skip measuring the transfer between stages (cost comm = 0)")
    parser.add_argument("--dp", type=int, default=1, metavar="N",
                        help="also measure each stage's data-parallel collectives over N "
                        "processes (NCCL with a GPU each, else gloo, said so): cost reduce (all-reduce; reduce-scatter with --dp-mode shard) "
                        "and cost gather (all-gather) of its parameter bytes")
    parser.add_argument("--dp-mode", choices=DP_MODES, default="replicate",
                        help="what cost reduce measures (default replicate: an all-reduce)")
    parser.add_argument("--optimizer", choices=[*OPTIMIZERS, "none"], default="adam",
                        help="the optimizer whose step per stage `cost optimizer[s]` measures, "
                        "as `ppdsl run --optimizer` (default adam); none: measure no step costs "
                        "(overhead, optimizer, norm)")
    parser.add_argument("--devices", type=int, default=None, metavar="N",
                        help="time the passes as a run of N ranks runs them: a pipeline of N "
                        "gloo processes, the stages placed looped (N divides --stages; CPU "
                        "only). Default on CPU: the most that divide --stages without "
                        "outnumbering the usable cores; on CUDA 1 (every stage on this process)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.add_argument("-o", "--output", metavar="COSTS.pp", default=None,
                        help="write cost and memory statements for --costs-from")
    parser.add_argument("--progress", action="store_true",
                        help="draw the progress bar even when stderr is not a terminal")


def run(args: argparse.Namespace) -> ExitCode:
    from ppdsl.runtime.measure.costs_pp import to_costs_pp
    from ppdsl.runtime.measure.profile import profile_model
    from ppdsl.runtime.measure.stages import prepare_device
    from ppdsl.runtime.models.model import ModelError
    from ppdsl.search.progress import ProgressBar

    if args.per_layer:
        return _per_layer(args)
    if args.stages is None:
        raise UsageError("--stages N is needed (or --per-layer with --model hf:DIR)")
    if args.stages < 1:
        raise UsageError(f"--stages {args.stages}: need at least 1 stage")
    if args.microbatch_size < 1:
        raise UsageError(f"--microbatch-size {args.microbatch_size}: need at least 1 sample")
    if args.dp < 1:
        raise UsageError(f"--dp {args.dp}: need at least 1 rank")
    if args.warmup < 0 or args.repeats < 1:
        raise UsageError("--warmup must be >= 0 and --repeats >= 1")
    if args.devices is not None and (args.devices < 1 or args.stages % args.devices):
        raise UsageError(f"--devices {args.devices}: give a number of processes that divides "
                         f"--stages {args.stages} (each holds --stages / N stages, looped)")
    check_model_file(args.model)
    if args.output:
        output_file(args.output)
    device, error = prepare_device(args.device)
    if error is not None:
        raise UsageError(error)
    if device.type == "cuda" and (args.devices or 1) > 1:
        raise UsageError(f"--devices {args.devices}: the pipeline of processes runs on CPU; "
                         "on CUDA the engine's passes are timed on this process (--devices 1)")
    bar = ProgressBar(args.progress or sys.stderr.isatty())
    if args.lengths is not None:
        return _in_tokens(args, device, bar)
    try:
        profile = profile_model(
            args.model, args.stages, args.microbatch_size, device,
            warmup=args.warmup, repeats=args.repeats, transfer=not args.no_transfer,
            progress=bar, norms=args.norms, dp=args.dp, dp_mode=args.dp_mode,
            precision=args.precision,
            optimizer=None if args.optimizer == "none" else args.optimizer,
            devices=args.devices,
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


def _lengths(text: str) -> list[int]:
    items = [x.strip() for x in text.split(",")]
    if not all(x.isdigit() and int(x) >= 1 for x in items):
        raise UsageError(f"--lengths {text}: whole numbers of tokens >= 1, comma-separated")
    lengths = sorted(set(int(x) for x in items))
    if len(lengths) < 2:
        raise UsageError(f"--lengths {text}: at least 2 different lengths (3 or more fit the "
                         "tokens^2 term)")
    return lengths


def _in_tokens(args: argparse.Namespace, device: Any, bar: Any) -> ExitCode:
    """`--lengths`: the passes measured at each length, fitted in tokens."""
    from ppdsl.runtime.measure.costs_pp import to_costs_pp_in_tokens
    from ppdsl.runtime.measure.profile import profile_model
    from ppdsl.runtime.models.model import ModelError

    lengths = _lengths(args.lengths)
    profiles = []
    try:
        for length in lengths:
            profiles.append(profile_model(
                args.model, args.stages, args.microbatch_size, device, warmup=args.warmup,
                repeats=args.repeats, transfer=not args.no_transfer, progress=bar,
                norms=args.norms, dp=1, precision=args.precision, optimizer=None,
                devices=args.devices, seq_len=length))
    except ModelError as exc:
        raise CompileError([Diagnostic("error", str(exc))]) from None
    finally:
        bar.close()
    argv = getattr(args, "argv", None) or sys.argv[1:]
    text = to_costs_pp_in_tokens(profiles, "ppdsl " + " ".join(shlex.quote(a) for a in argv))
    if args.output:
        write_output(args.output, text)
        print(f"wrote {args.output}; use it with --costs-from {args.output} and --lengths",
              file=sys.stderr)
    if args.json:
        print(json.dumps([p.to_json() for p in profiles], indent=2))
    else:
        sys.stdout.write(text)
    return ExitCode.OK


def _per_layer(args: argparse.Namespace) -> ExitCode:
    """`--per-layer`: each layer of a `hf:DIR` model measured alone; with
    `--stages`, the cut and its stages' costs (`-o` writes them)."""
    from ppdsl.runtime.measure.costs_pp import to_costs_pp
    from ppdsl.runtime.measure.cut import choose_cut, describe, profile_layers, stage_profile
    from ppdsl.runtime.measure.stages import prepare_device
    from ppdsl.runtime.models.hf import PREFIX, HFOptions, is_hf_spec, pipeline_model
    from ppdsl.runtime.models.model import ModelError
    from ppdsl.search.progress import ProgressBar

    if not is_hf_spec(args.model):
        raise UsageError("--per-layer is for --model hf:DIR (a transformers checkpoint folder)")
    if args.stages is not None and args.stages < 1:
        raise UsageError(f"--stages {args.stages}: need at least 1 stage")
    if args.output and args.stages is None:
        raise UsageError("-o with --per-layer needs --stages N (the costs file is per stage)")
    if args.microbatch_size < 1 or args.seq_len < 1:
        raise UsageError("--microbatch-size and --seq-len must be at least 1")
    if args.output:
        output_file(args.output)
    device, error = prepare_device(args.device)
    if error is not None:
        raise UsageError(error)
    bar = ProgressBar(args.progress or sys.stderr.isatty())
    try:
        model = pipeline_model(args.model[len(PREFIX):], 1, HFOptions(seq_len=args.seq_len))
        layers = profile_layers(model, args.microbatch_size, device, warmup=args.warmup,
                                repeats=args.repeats, progress=bar)
        cut = (choose_cut(layers, args.stages, args.cut)
               if args.stages is not None else None)
    except ModelError as exc:
        raise UsageError(str(exc)) from None
    finally:
        bar.close()
    if args.json:
        print(json.dumps(layers.to_json(cut), indent=2))
    else:
        sys.stdout.write(layers.table())
        if cut is not None:
            print(f"cut ({args.cut}) into {args.stages} stages: {describe(cut, layers.num_layers)}")
            sys.stdout.write(layers.stage_table(cut))
    if args.output and cut is not None:
        argv = getattr(args, "argv", None) or sys.argv[1:]
        command = "ppdsl " + " ".join(shlex.quote(a) for a in argv)
        text = to_costs_pp(stage_profile(layers, cut, args.model, device=str(device)), command)
        text = f"# cut: {','.join(map(str, cut))}\n" + text
        write_output(args.output, text)
        print(f"wrote {args.output}; use it with --costs-from {args.output} "
              f"and --cut {','.join(map(str, cut))}", file=sys.stderr)
    return ExitCode.OK
