"""Compile a schedule and train with it on this machine: starts torchrun
(python -m torch.distributed.run) with one process per device on loopback, gloo on
CPU when there is no GPU and NCCL with CUDA. Prints a line per step (loss, step
time, samples/s, and tokens/s for a model whose inputs are tokens) and, at the end, predicted vs measured peak activation memory and
compute share per rank. Exit status is that of the ranks (0 when all succeeded)."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ppdsl.commands.common import (
    ExitCode,
    UsageError,
    add_schedule_arguments,
    check_model_file,
    compile_from_args,
    output_directory,
    output_file,
)
from ppdsl.compiler import Compiled
from ppdsl.diagnostics import render_all
from ppdsl.runtime.choices import CUT_RULES
from ppdsl.runtime.training.options import (
    add_training_options,
    check_training_options,
    training_argv,
    training_default,
)

HELP = "compile and train locally under torchrun (gloo on CPU, NCCL on GPUs)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    add_training_options(parser, forward=True)
    parser.add_argument("-o", "--output", metavar="DIR", default=None,
                        help="keep the generated programs in DIR (default: a temporary folder)")
    parser.add_argument(
        "--max-restarts", type=int, default=0, metavar="N",
        help="when a rank fails, let torchrun restart every rank up to N times (default 0); "
        "with --checkpoint-dir each restart continues from the newest complete checkpoint",
    )


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(launch: Path, nproc: int, port: int, rank_args: list[str],
                     max_restarts: int = 0) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(port),
        "--max-restarts", str(max_restarts),
        str(launch), *rank_args,
    ]


_TORCHRUN_LOG = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d")


# torchrun's log line for a worker that failed (printed before it restarts the group)
_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_FAILED_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_FAILED_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


def _filter_torchrun(stream, out, max_restarts: int = 0) -> list[tuple[int, int | None]]:
    """Pass the ranks' output through; drop torchrun's own failure report (a traceback
    of the launcher and a summary box): the ranks have already said what went wrong.
    With restarts allowed, say which rank failed each time torchrun restarts them.
    Returns the failed ranks and their exit codes that the box named."""
    restarts_left = max_restarts
    skipping = False
    failed: list[tuple[int, int | None]] = []
    for line in stream:
        if skipping:
            rank, code = _FAILED_RANK.match(line), _FAILED_EXIT.match(line)
            if rank:
                failed.append((int(rank.group(1)), None))
            elif code and failed and failed[-1][1] is None:
                failed[-1] = (failed[-1][0], int(code.group(1)))
            continue
        if _TORCHRUN_LOG.match(line):
            worker = _WORKER_FAILED.search(line)
            if worker and restarts_left > 0:
                restarts_left -= 1
                which = (int(worker.group(2)), int(worker.group(1)))
                out.write(f"ppdsl run: {_describe_failures([which])}; torchrun restarts "
                          f"every rank ({restarts_left} more restart"
                          f"{'s' if restarts_left != 1 else ''} allowed)\n")
                out.flush()
            continue
        if line.startswith("Traceback (most recent call last)"):
            pending = [line]
            nxt = next(stream, "")
            if "torch/distributed/run.py" in nxt or "torchrun" in nxt or "runpy" in nxt:
                skipping = True
                continue
            pending.append(nxt)
            out.writelines(pending)
            continue
        out.write(line)
        out.flush()
    return failed


def _describe_failures(failed: list[tuple[int, int | None]]) -> str:
    """`rank 1 killed by SIGKILL, rank 0 exit code 1, ...` for torchrun's failed
    ranks: the ones that died first, those torchrun stopped (SIGTERM) last."""
    parts = []
    for rank, code in sorted(set(failed), key=lambda f: (f[1] == -signal.SIGTERM, f[0])):
        if code is None:
            parts.append(f"rank {rank}")
        elif code == -signal.SIGTERM:
            parts.append(f"rank {rank} stopped by torchrun (SIGTERM)")
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            parts.append(f"rank {rank} killed by {name}")
        else:
            parts.append(f"rank {rank} exit code {code}")
    return ", ".join(parts)


def programs_for_transport(compiled: Compiled, args: argparse.Namespace) -> Compiled:
    """The programs the ranks will run, proven under the rules of the transport
    they will run on: ranks on their own GPUs talk NCCL, which matches the n-th
    send between two ranks to the n-th receive (no tags), so their receives must
    be posted in their peers' send order (`--comm-model nccl`); gloo (CPU, and a
    shared GPU's staging) matches by tag and runs the programs as compiled."""
    if args.device != "cuda" or args.share_gpu or getattr(args, "comm_model", None) == "nccl":
        return compiled
    args.comm_model = "nccl"
    return compile_from_args(args)


def run(args: argparse.Namespace) -> ExitCode:
    problem = check_training_options(args)
    if problem is not None:
        raise UsageError(problem)
    _check_run_arguments(args)
    compiled = compile_from_args(args)
    if compiled.warnings:
        print(render_all(compiled.warnings, sys.stderr), file=sys.stderr)
    from ppdsl.runtime.models.hf import is_hf_spec  # these import torch: only when running
    from ppdsl.runtime.worker.devices import choose_device

    model_record = None
    if is_hf_spec(args.model):
        model_record = _check_hf_model(args, compiled.schedule.placement.num_model_stages)

    # Every rank runs on this machine: decide the device once, before torchrun starts.
    dp = args.dp or 1
    choice = choose_device(args.device or training_default("device"),
                           compiled.schedule.num_devices * dp, share_gpu=bool(args.share_gpu))
    if choice.error is not None:
        raise UsageError(choice.error)
    if choice.note is not None:
        print(choice.note, file=sys.stderr)
    assert choice.kind is not None
    args.device = choice.kind
    compiled = programs_for_transport(compiled, args)
    if args.trace:
        args.trace = os.path.abspath(args.trace)
    rank_args = training_argv(args)
    if args.max_restarts and not args.checkpoint_dir:
        print("ppdsl run: note: --max-restarts without --checkpoint-dir: a restart trains "
              "again from step 1", file=sys.stderr)
    return launch(compiled, rank_args, args.output, dp=dp,
                  dp_mode=args.dp_mode or "replicate", max_restarts=args.max_restarts,
                  model_record=model_record)


def _check_run_arguments(args: argparse.Namespace) -> None:
    """What `run`'s own flags get wrong, refused before compiling and launching."""
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: need 0 or more restarts")
    if args.output:
        output_directory(args.output)
    if args.json_out:
        output_directory(args.json_out)
    if args.trace:
        output_file(args.trace)
    check_model_file(args.model)


def _check_hf_model(args: argparse.Namespace, num_stages: int) -> dict[str, object]:
    """`--model hf:DIR` and its data, checked before torchrun starts; `--cut
    balanced` chosen here from a per-layer profile (one process, one thread, as a
    rank runs) and handed to the ranks as the list of stage starts. Returns what
    the manifest records of the model."""
    from ppdsl.runtime.models.hf import PREFIX, HFOptions, preflight
    from ppdsl.runtime.models.model import ModelError

    def value(dest: str) -> Any:
        given = getattr(args, dest)
        return given if given is not None else training_default(dest)

    options = HFOptions(seq_len=value("seq_len"), seed=value("seed"), data=args.data,
                        data_dtype=value("data_dtype"), cut=value("cut"),
                        eval_data=args.eval_data, max_seq_len=args.max_seq_len, pack=args.pack)
    directory = args.model[len(PREFIX):]
    try:
        cut = preflight(directory, num_stages, options)
        if cut is None:
            from ppdsl.runtime.measure.cut import balanced_cut, describe, profile_folder

            microbatch = max((args.batch_size or 0) // (2 * num_stages), 1)
            layers = profile_folder(directory, options.seq_len, microbatch, seed=options.seed)
            cut = balanced_cut(layers, num_stages)
            print(f"ppdsl: balanced cut from a per-layer profile: {describe(cut, layers.num_layers)}",
                  file=sys.stderr)
            args.cut = ",".join(map(str, cut))
    except ModelError as exc:
        raise UsageError(str(exc)) from None
    return {"spec": args.model, "cut": list(cut), "cut_rule": options.cut
            if options.cut in CUT_RULES else "list"}


def launch(compiled: Compiled, rank_args: list[str], output: str | None = None,
           dp: int = 1, dp_mode: str = "replicate", max_restarts: int = 0,
           model_record: dict[str, object] | None = None) -> ExitCode:
    """Generate `compiled` into `output` (or a temporary folder) and run it under
    torchrun on this machine, `dp` replicas of the pipeline, restarting every rank
    up to `max_restarts` times after a failure; OK when every rank succeeded
    (in the last attempt), else INVALID."""
    from ppdsl.backend.codegen import write
    from ppdsl.compiler import generate

    tmp = None
    if output:
        out = Path(output)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="ppdsl-run-")
        out = Path(tmp.name)
    try:
        write(generate(compiled, dp, dp_mode), out)
        if model_record is not None:  # the model and its cut, beside the schedule
            manifest = out / "manifest.json"
            data = json.loads(manifest.read_text())
            data["model"] = model_record
            manifest.write_text(json.dumps(data, indent=1) + "\n")
        cmd = torchrun_command(out / "launch.py", compiled.schedule.num_devices * dp, free_port(),
                               rank_args, max_restarts)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   MASTER_ADDR="127.0.0.1")
        proc = subprocess.Popen(cmd, env=env, stdout=None, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        failed = _filter_torchrun(proc.stderr, sys.stderr, max_restarts)
        code = proc.wait()
    finally:
        if tmp is not None:
            tmp.cleanup()
    if code != 0:
        which = f": {_describe_failures(failed)}" if failed else ""
        print(f"ppdsl run: the ranks failed{which} (torchrun exit status {code})", file=sys.stderr)
        return ExitCode.INVALID
    return ExitCode.OK
