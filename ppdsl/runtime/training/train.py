"""The entry point generated rank programs call (`ppdsl run` starts them): a
training loop written on the library (`ppdsl.runtime.execution.pipeline`), as a user's own
loop would be, with the options people expect, a per-step line and the closing
predicted-vs-measured table.

    torchrun --nproc-per-node 4 build/zb_v/launch.py --model examples/models/tiny_gpt.py:stages

With `--dp N` the world is N replicas of the pipeline on a ("dp", "pp") mesh:
global rank = replica * P + pipeline rank (P = the schedule's device count),
each replica trains on its contiguous share of the step's batch
(`ppdsl.runtime.execution.data_parallel`).

Start-up, before any training: the world size must equal dp x the schedule's
device count; every rank must run the same compiled schedule (fingerprint all-gather);
the model must follow the protocol, build the schedule's stage count, and its
stages must chain (the runner's probe at the first step); the batch must split
into m microbatches. Any failure prints one clear message (from rank 0, or from
the rank that saw it) and every rank exits 1. Later, a rank that dies or hangs
makes the others exit 1 naming it, within `--timeout` seconds.

Each step: the ranks holding the first or the last stage build the batch
(`model.batch`; nobody else does), `runner.step`, then the optimizer step
(`OptimizerStep`: clipping, inf/NaN skips, fp16 unscaling, sync or
post-validated), the LR scheduler, and a checkpoint every `--checkpoint-every`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ppdsl.backend.plan import PassKeys, Plan
from ppdsl.ir.rank import Op
from ppdsl.ir.schedule import Costs, MemoryModel
from ppdsl.runtime.errors import PeerError, first_line, peer_failure
from ppdsl.runtime.execution.data_parallel import dp_pp_mesh
from ppdsl.runtime.execution.dtensor import local_tensor
from ppdsl.runtime.execution.group import agree, differing, gather, placement_of
from ppdsl.runtime.execution.memory import DevicePeak, predicted_device_peak
from ppdsl.runtime.execution.pipeline import CompiledPipeline, PipelineRunner
from ppdsl.runtime.execution.structure import flatten, unflatten
from ppdsl.runtime.execution.trace import (
    Tracer,
    chrome_trace,
    gap_sources,
    mean_costs,
    simulated_timeline,
    write_chrome_trace,
)
from ppdsl.runtime.models.hf import PREFIX, HFOptions, is_hf_spec, pipeline_model
from ppdsl.runtime.models.model import LossError, ModelError, build_model
from ppdsl.runtime.training.checkpoint import Checkpointer, CheckpointError, run_identity
from ppdsl.runtime.training.optim import OptimizerStep, lr_lambda, make_optimizer
from ppdsl.runtime.training.options import add_training_options, check_training_options
from ppdsl.runtime.worker import faults, progress
from ppdsl.runtime.worker.attempt import attempt_note, attempt_store
from ppdsl.runtime.worker.cpu import keep_freed_memory
from ppdsl.runtime.worker.devices import choose_device
from ppdsl.runtime.worker.watchdog import Watchdog, fail, group_timeout
from ppdsl.semantics import format_ratio, pass_cost

__all__ = ["main", "parse_options", "memory_table", "timing_summary"]

EXIT_INVALID = 1
EXIT_USAGE = 2


def parse_options(argv: Sequence[str] | None, prog: str = "launch.py") -> argparse.Namespace:
    """The options of a generated rank program (`ppdsl run` passes them on)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Train with a ppdsl-compiled pipeline schedule (run under torchrun)."
    )
    parser.add_argument(
        "--model", required=True, metavar="FILE.py:FACTORY",
        help="the model factory, e.g. examples/models/tiny_gpt.py:stages (docs/runtime.md)",
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument(
        "--batch-size", type=int, default=None,
        help="samples per step, split into m microbatches (default 2*m)",
    )
    add_training_options(parser)
    parser.add_argument(
        "--timeout", type=float, default=60.0,
        help="seconds before a dead or hung rank makes the others stop (default 60)",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto",
        help="auto (default): CUDA when the node has a GPU per local rank, else CPU; "
        "cuda with fewer GPUs than local ranks is an error (exit 2)",
    )
    parser.add_argument(
        "--release", choices=["at-b", "at-w"], default="at-b",
        help="when a split backward frees activations: at-b (default) frees at B what W "
        "does not need; at-w keeps the autograd graph until W (M_W = M_B, the controllable-memory "
        "paper's accounting)",
    )
    parser.add_argument(
        "--json", dest="json_out", metavar="DIR", default=None,
        help="write each rank's measurements to DIR/rank<N>.json",
    )
    parser.add_argument(
        "--trace", metavar="OUT.json", default=None,
        help="write every rank's passes as one Chrome/Perfetto trace (ui.perfetto.dev)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    problem = check_training_options(args)
    if problem is not None:
        parser.error(problem)
    return args


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def main(
    rank_in_file: int,
    ops: Sequence[Op],
    fingerprint: str,
    manifest: str | Path,
    argv: Sequence[str] | None = None,
) -> int:
    """Run this rank's program; returns the exit code (0, 1 for invalid input, 2 for
    a device request the node cannot meet)."""
    opts = parse_options(argv)
    data = json.loads(Path(manifest).read_text())
    plan = Plan.from_json(data)
    compiled_dp = data.get("data_parallel") or {}
    dp = opts.dp if opts.dp is not None else int(compiled_dp.get("dp", 1))
    opts.dp = dp
    opts.dp_mode = opts.dp_mode or compiled_dp.get("mode", "replicate")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print(
            "ppdsl: start this program with torchrun (or `ppdsl run`), e.g. "
            f"torchrun --nproc-per-node {plan.num_devices * dp} {Path(manifest).parent / 'launch.py'} "
            "--model examples/models/tiny_gpt.py:stages",
            file=sys.stderr,
        )
        return EXIT_INVALID
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != plan.num_devices * dp:
        if rank == 0:
            print(
                f"ppdsl: schedule {plan.name!r} was compiled for {plan.num_devices} ranks"
                + (f" and runs {dp} data-parallel replicas ({dp * plan.num_devices} processes)"
                   if dp > 1 else "")
                + f" but torchrun started {world}; use --nproc-per-node {dp * plan.num_devices} "
                "in all (or recompile with -D d=..., or change --dp)",
                file=sys.stderr,
            )
        return EXIT_INVALID
    pp_rank = placement_of(rank, plan.num_devices)[1]
    if rank_in_file != pp_rank:
        print(
            f"ppdsl: rank {rank}: was handed the program of pipeline rank {rank_in_file}, not "
            f"{pp_rank}; start it "
            "through the generated launch.py",
            file=sys.stderr,
        )
        return EXIT_INVALID
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    choice = choose_device(opts.device, local_ranks, share_gpu=opts.share_gpu)
    if choice.error is not None:
        if local_rank == 0:
            print(f"ppdsl: error: {choice.error}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if choice.note is not None and rank == 0:
        print(choice.note, file=sys.stderr, flush=True)
    use_cuda = choice.kind == "cuda"
    if use_cuda:
        # --share-gpu: rank r on GPU r mod count (else one GPU per local rank)
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        keep_freed_memory()
    try:
        store = attempt_store(rank, world, opts.timeout)
        if use_cuda and not opts.share_gpu:
            dist.init_process_group(
                "nccl", timeout=timedelta(seconds=group_timeout(opts.timeout)), device_id=device,
                store=store, rank=rank, world_size=world,
            )
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=group_timeout(opts.timeout)),
                                    store=store, rank=rank, world_size=world)
    except Exception as exc:  # a rank that never arrives, an unreachable MASTER_ADDR
        first = first_line(exc)
        print(
            f"ppdsl: rank {rank}: could not form the group of {world} ranks within "
            f"{opts.timeout:g} s (is every rank started, and MASTER_ADDR:MASTER_PORT "
            f"reachable?): {first[:300]}",
            file=sys.stderr,
        )
        return EXIT_INVALID
    watchdog = Watchdog(rank, world, opts.timeout)
    watchdog.start()
    try:
        code = _run(plan, fingerprint, ops, opts, rank, world, device, watchdog)
    except PeerError as exc:
        fail(watchdog, rank, str(exc))
    except Exception as exc:  # a bug or a model failing mid-training: stop everyone
        if peer_failure(exc):  # a collective with a peer that died or hung; the watchdog names it
            time.sleep(min(2 * watchdog.interval, 2.0))  # let the watchdog name the peer
            fail(watchdog, rank, f"a collective with the other ranks failed: {first_line(exc, 200)}")
        import traceback

        traceback.print_exc()
        fail(watchdog, rank, f"{type(exc).__name__}: {exc}")
    # The heartbeat thread is joined here, before the process group and its store
    # go away: a thread still inside a store call at exit aborts the process
    # ("terminate called without an active exception").
    watchdog.done()
    if code == 0:
        dist.barrier()
    if use_cuda and opts.share_gpu:
        # Ranks sharing a GPU over gloo with FSDP2 (--dp-mode shard) trained and wrote
        # their results, then every one died of SIGSEGV in the interpreter's teardown
        # (torch 2.11, one H200). Past the barrier nothing is left to do: leave
        # without tearing down.
        torch.cuda.synchronize(device)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    dist.destroy_process_group()
    return code


def _build_model(opts: argparse.Namespace, num_stages: int) -> Any:
    """The user's factory's model, or `--model hf:DIR` cut by `ppdsl.runtime.models.hf`."""
    if not is_hf_spec(opts.model):
        return build_model(opts.model, num_stages)
    options = HFOptions(seq_len=opts.seq_len, seed=opts.seed, data=opts.data,
                        data_dtype=opts.data_dtype, cut=opts.cut, eval_data=opts.eval_data)
    return pipeline_model(opts.model[len(PREFIX):], num_stages, options)


def _startup_error(rank: int, error: str) -> int:
    if rank == 0:
        print(f"ppdsl: error: {error}", file=sys.stderr, flush=True)
    return EXIT_INVALID


def _bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, in row-major order, whatever its shape (a 0-dim one too: torch
    cannot view a 0-dim tensor as bytes), layout and dtype (bool, integers)."""
    return t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of named tensors (each name, then its bytes), in the order given: to
    compare runs and replicas."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(_bytes(t.detach()))
    return h.hexdigest()


def _parameters_digest(runner: PipelineRunner, *, whole: bool = False) -> str:
    """`_digest` of this rank's parameters in name order: a sharded one's local
    shard, or with `whole` the whole parameter (gathered over its DP group:
    collective; the same on every replica when they agree)."""
    def value(p: torch.Tensor) -> torch.Tensor:
        if whole:
            return p.full_tensor() if hasattr(p, "full_tensor") else p
        return local_tensor(p.detach())

    return _digest((name, value(p)) for name, p in runner.named_parameters())


def _validate(
    runner: PipelineRunner, model: Any, num_batches: int, batch_size: int, dp: int, replica: int,
    share: slice, device: torch.device,
) -> float:
    """The validation loss: `num_batches` forward-only steps (`runner.evaluate`) on
    the model's `eval_batch` data, each replica on its share; the mean over the
    batches and the replicas, the same on every rank (collective)."""
    total = 0.0
    for index in range(num_batches):
        inputs = targets = None
        if runner.is_first or runner.is_last:
            inputs, targets = model.eval_batch(index, batch_size)
            if dp > 1:
                inputs, targets = _share(inputs, share), _share(targets, share)
        loss = runner.evaluate(inputs if runner.is_first else None,
                               targets if runner.is_last else None)
        if loss is not None:
            total += float(loss)
    stats = torch.full((dp,), float("-inf"), dtype=torch.float64, device=device)
    if runner.is_last:
        stats[replica] = total / num_batches
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return float(stats.mean())


def _share(value: Any, rows: slice) -> Any:
    """This replica's rows of a batch (a tensor or a tuple/list/dict of them)."""
    leaves, spec = flatten(value, "the batch")
    return unflatten(spec, [t[rows] for t in leaves])


def replicas_summary(ranks: list[dict[str, Any]], num_ranks: int, mode: str) -> str:
    """Whether the DP replicas of each pipeline rank ended with the same parameters
    (and buffers, where the stages hold any)."""
    lines = [""]
    for pp in range(num_ranks):
        mine = [r for r in ranks if r["pp_rank"] == pp]
        same = len({r["whole_parameters_sha256"] for r in mine}) == 1
        buffers = {r.get("buffers_sha256") for r in mine}
        lines.append(
            f"pipeline rank {pp}: replicas on global ranks {', '.join(str(r['rank']) for r in mine)} "
            f"({mode}): parameters {'equal' if same else 'DIFFER'} "
            f"(sha256 {mine[0]['whole_parameters_sha256'][:12]})"
            + ("" if buffers == {None} else
               f", buffers {'equal' if len(buffers) == 1 else 'DIFFER'}")
        )
    return "\n".join(lines)


@dataclass
class _Run:
    """One rank's run, as its start-up leaves it for the loop and the summary."""

    plan: Plan
    opts: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    watchdog: Watchdog
    model: Any
    """The user's model (`ppdsl.runtime.models.model`): stages, loss, batches."""
    runner: PipelineRunner
    optimizer: torch.optim.Optimizer
    scheduler: Any
    stepper: OptimizerStep
    checkpointer: Checkpointer | None
    export: Callable[[Path], None] | None
    """What a checkpoint also writes (the model as transformers files), or None."""
    first_step: int
    """The first step to run (0-based; after a resume, the checkpoint's step)."""
    last_step: int
    """One past the last step this run trains (`--stop-after` may stop it early)."""
    batch_size: int
    replica: int
    pp_rank: int
    tracer: Tracer
    device_peak: DevicePeak | None
    step_times: list[float] = field(default_factory=list)
    """Each timed step's time (slowest rank), the first step left out."""
    shares: list[float] = field(default_factory=list)
    """Each timed step's share of this rank's time inside passes."""
    losses: dict[int, float] = field(default_factory=dict)
    """Per step (0-based): the batch's mean loss, the mean over the replicas."""
    evals: dict[int, float] = field(default_factory=dict)
    """Per step evaluated after: the validation loss."""
    peak_bytes: int = 0
    """The meter's largest activation peak, in bytes."""
    peak_units: Fraction = Fraction(0)
    """The same peak in the compiler's units (M_B)."""
    last_saved: int | None = None
    """The step of the last checkpoint saved (or resumed from), or None."""
    pending: tuple[Any, torch.Tensor, int] | None = None
    """The last step's line, its numbers being all-reduced in the background."""

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return int(self.opts.dp)

    @property
    def share(self) -> slice:
        """This replica's rows of each batch."""
        each = self.batch_size // self.dp
        return slice(self.replica * each, (self.replica + 1) * each)

    def timed(self, step: int) -> bool:
        """Whether `step` counts in the step times: all but the first, unless it is
        the only one."""
        return step > self.first_step or self.last_step - self.first_step == 1


def _run(
    plan: Plan,
    fingerprint: str,
    ops: Sequence[Op],
    opts: argparse.Namespace,
    rank: int,
    world: int,
    device: torch.device,
    watchdog: Watchdog,
) -> int:
    """This rank's training: start-up, the loop, the summary; the exit code."""
    run = _start(plan, fingerprint, ops, opts, rank, world, device, watchdog)
    if isinstance(run, int):
        return run
    code = _loop(run)
    if code is not None:
        return code
    _finish(run)
    _summary(run)
    return 0


def _start(
    plan: Plan,
    fingerprint: str,
    ops: Sequence[Op],
    opts: argparse.Namespace,
    rank: int,
    world: int,
    device: torch.device,
    watchdog: Watchdog,
) -> _Run | int:
    """The start-up checks, the model, runner, optimizer and checkpoints, the
    opening lines: the run, or the exit code when it stops here."""
    # Each rank offers its program's fingerprint and its manifest's: one compiled
    # directory for everyone, or nobody starts.
    theirs = differing([fingerprint, plan.fingerprint], note=plan.name)
    if theirs is not None:
        if rank == 0:
            lines = [
                f"  rank {r}: program {fp[:12]}, manifest {mf[:12]} (schedule {n!r})"
                for r, ((fp, mf), n) in enumerate(theirs)
            ]
            print(
                "ppdsl: the ranks run different compiled schedules; start every rank from the "
                "same compiled directory\n" + "\n".join(lines),
                file=sys.stderr, flush=True,
            )
        return EXIT_INVALID
    m = plan.num_microbatches
    dp = opts.dp
    num_ranks = plan.num_devices
    batch_size = opts.batch_size if opts.batch_size is not None else 2 * m * dp
    error = None
    model: Any = None
    torch.manual_seed(opts.seed)  # torch seeds its default generator at random otherwise
    random.seed(opts.seed)
    try:
        model = _build_model(opts, plan.num_model_stages)
        if batch_size % (m * dp):
            raise ModelError(
                f"--batch-size {batch_size} does not split into {m} microbatches"
                + (f" on each of {dp} replicas" if dp > 1 else "")
                + f"; use a multiple of {m * dp}"
            )
        if opts.eval_every is not None and getattr(model, "eval_batch", None) is None:
            raise ModelError(
                f"--eval-every needs evaluation data, but --model {opts.model!r} has no "
                "eval_batch(index, batch_size) -> (inputs, targets) (docs/runtime.md, the "
                "model protocol)"
            )
    except ModelError as exc:
        error = str(exc)
    except Exception as exc:
        error = f"building the model failed: {type(exc).__name__}: {exc}"
    error = agree(error)
    if error is not None:
        return _startup_error(rank, error)
    replica, pp_rank = placement_of(rank, num_ranks)
    schedule = CompiledPipeline(plan, {pp_rank: tuple(ops)}, fingerprint)
    mesh = dp_pp_mesh(dp, num_ranks, device.type) if dp > 1 else None
    try:
        runner = PipelineRunner(
            schedule, model.stage, model.loss, device=device, precision=opts.precision,
            release=opts.release, tied=tuple(getattr(model, "tied", ()) or ()),
            timeout=group_timeout(opts.timeout), mesh=mesh, dp_mode=opts.dp_mode,
            share_gpu=opts.share_gpu,
        )
    except ModelError as exc:  # the same message on every rank
        return _startup_error(rank, str(exc))
    optimizer = make_optimizer(opts.optimizer, runner.parameters(), opts.lr, opts.weight_decay,
                               opts.momentum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(opts.lr_schedule, opts.steps, opts.warmup_steps)
    )
    stepper = OptimizerStep(runner, optimizer, max_norm=opts.clip_grad_norm,
                            validation=opts.optimizer_validation)
    first_step = 0
    last_step = opts.steps if opts.stop_after is None else min(opts.steps, opts.stop_after)
    checkpointer = None
    # --save-model with checkpoints: each checkpoint also holds the model as a
    # transformers checkpoint (its `hf` folder), written before it becomes visible
    export = ((lambda where: model.save(where / "hf", runner.stages))
              if opts.save_model else None)
    if opts.checkpoint_dir:
        checkpointer = Checkpointer(
            opts.checkpoint_dir, runner, optimizer, stepper=stepper, scheduler=scheduler,
            identity=run_identity(plan, runner, model=opts.model, world_size=world, dp=dp,
                                  dp_mode=opts.dp_mode),
            keep=opts.keep_checkpoints, asynchronous=not opts.sync_checkpoints,
            on_event=lambda point, at: faults.reached(point, at),
        )
        try:
            resumed = checkpointer.resume(require=opts.resume)
        except CheckpointError as exc:
            return _startup_error(rank, str(exc))
        if resumed is not None:
            first_step = resumed[0]
            _say(rank, f"ppdsl: resumed from {resumed[1]} (after step {first_step})"
                 + attempt_note())
        else:
            _say(rank, f"ppdsl: no checkpoint in {opts.checkpoint_dir} yet: starting at step 1"
                 + attempt_note())
    if first_step >= last_step:
        _say(rank, f"ppdsl: the checkpoint is already at step {first_step} of {last_step}: "
                   "nothing left to train")
        return 0
    _say(
        rank,
        f"ppdsl: schedule {plan.name} ({plan.file}): "
        + (f"{dp} {opts.dp_mode} replicas x {num_ranks} pipeline ranks = " if dp > 1 else "")
        + f"{world} ranks, {plan.num_stages} stages, "
        f"{m} microbatches, batch {batch_size}"
        + (f" ({batch_size // dp} per replica)" if dp > 1 else "") + f", {device.type}"
        + (" (gloo, shared GPU: transfers staged through host memory)" if opts.share_gpu
           else " (gloo)" if device.type == "cpu" else " (nccl)")
        + f", {opts.optimizer}" + (f", {opts.precision}" if opts.precision != "fp32" else "")
        + (f", clip {opts.clip_grad_norm:g} ({opts.optimizer_validation})"
           if opts.clip_grad_norm is not None else ""),
    )
    if getattr(model, "cut", None):
        _say(rank, "ppdsl: cut (first decoder layer of each stage): "
                   + ",".join(str(c) for c in model.cut))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tracer = Tracer(rank, device)
    runner.tracer = tracer
    dist.barrier()  # the ranks' trace epochs line up here
    tracer.start()
    return _Run(
        plan=plan, opts=opts, rank=rank, world=world, device=device, watchdog=watchdog,
        model=model, runner=runner, optimizer=optimizer, scheduler=scheduler, stepper=stepper,
        checkpointer=checkpointer, export=export, first_step=first_step, last_step=last_step,
        batch_size=batch_size, replica=replica, pp_rank=pp_rank, tracer=tracer,
        device_peak=runner.engine.device_peak,
        last_saved=first_step if first_step else None,
    )


def _report(run: _Run, done: tuple[Any, torch.Tensor, int]) -> None:
    """A step's line, once its numbers' all-reduce has finished."""
    work, stats, at = done
    work.wait()
    dp = run.dp
    # each replica's mean loss on its share; the step's loss is their mean
    loss, step_time = float(stats[:dp].mean()), float(stats[dp])
    run.losses[at] = loss
    if run.timed(at):
        run.step_times.append(step_time)
    rate = f"  {run.batch_size / step_time:9.1f} samples/s"
    tokens_per_sample = getattr(run.model, "tokens_per_sample", None)
    if tokens_per_sample:
        rate += f"  {run.batch_size * tokens_per_sample / step_time:9.0f} tokens/s"
    each = "" if dp == 1 else " (replicas " + " ".join(f"{float(x):.4f}" for x in stats[:dp]) + ")"
    _say(run.rank, f"step {at + 1:4d}/{run.opts.steps}  loss {loss:.4f}{each}  "
                   f"time {step_time * 1e3:8.1f} ms{rate}")


def _flush_report(run: _Run) -> None:
    """Print the pending step's line, if any."""
    if run.pending is not None:
        _report(run, run.pending)
        run.pending = None


def _loop(run: _Run) -> int | None:
    """The training steps; an exit code when the first step finds bad input."""
    opts, runner, tracer, rank = run.opts, run.runner, run.tracer, run.rank
    dp, batch_size, device = run.dp, run.batch_size, run.device
    checkpointer, device_peak, meter = run.checkpointer, run.device_peak, runner.meter
    first_step, last_step = run.first_step, run.last_step
    # The per-step line's numbers are all-reduced in the background and printed
    # one step late: a blocking collective per step would be a barrier, undoing
    # what post-validation saves.
    for step in range(first_step, last_step):
        faults.set_step(step + 1)
        inputs = targets = None
        progress.at(f"step {step + 1}: building its batch and starting")
        tracer.step = step
        tracer.timed = run.timed(step)
        if runner.is_first or runner.is_last:  # data is built only where it is used
            tracer.begin()
            inputs, targets = run.model.batch(step, batch_size)
            tracer.end("data", "data", {}, None)
        if step == first_step:
            error = None
            if inputs is not None:
                leaves = flatten(inputs, "the inputs")[0]
                got = leaves[0].shape[0] if leaves and leaves[0].dim() else None
                if got != batch_size:
                    error = (f"batch({step}, {batch_size}) returned {got} samples, "
                             f"expected {batch_size}")
            error = agree(error)
            if error is not None:
                return _startup_error(rank, error)
        # Memory is measured on the first step (shapes are static, so every step holds
        # the same); later steps run without the meter's hooks, for clean timings.
        run.optimizer.zero_grad(set_to_none=True)
        # Every step from the same state (no gradients); the first step of several
        # left out: it allocates once for the whole run (cuBLAS's workspaces, one
        # per thread and stream: ~64 MiB on an H200, 25x a tiny model's step).
        peak_window = (device_peak if step > first_step or last_step - first_step == 1
                       else None)
        if peak_window is not None:
            peak_window.start()
        t0 = time.perf_counter()
        if dp > 1 and inputs is not None:
            inputs, targets = _share(inputs, run.share), _share(targets, run.share)
        try:
            loss = runner.step(inputs if runner.is_first else None,
                               targets if runner.is_last else None,
                               measure_memory=step == first_step)
        except LossError as exc:  # on the last stage's rank alone: it stops the others
            fail(run.watchdog, rank, str(exc))
        except ModelError as exc:  # the probe at the first step: the same on every rank
            return _startup_error(rank, str(exc))
        if peak_window is not None:  # the passes' peak, before the optimizer allocates
            peak_window.stop()
        tracer.begin()
        progress.at("the optimizer step")
        faults.reached("optimizer")
        run.stepper.step()
        tracer.end("optimizer", "optimizer", {}, None)
        tracer.flush()
        run.scheduler.step()
        # The step before's line is printed before its checkpoint can become visible:
        # a run restarted from that checkpoint has printed every step it holds.
        _flush_report(run)
        if checkpointer is not None:
            checkpointer.poll()
        every = opts.checkpoint_every
        if checkpointer is not None and every and (step + 1) % every == 0:
            progress.at(f"saving the checkpoint of step {step + 1}")
            checkpointer.save(step + 1, also=run.export)  # in the step's time: what a save costs
            run.last_saved = step + 1
        step_time = time.perf_counter() - t0
        result = runner.last_result
        assert result is not None  # a step has run
        if run.timed(step):
            run.shares.append(result.compute_time / max(step_time, 1e-12))
        run.peak_bytes = max(run.peak_bytes, meter.peak_bytes)
        run.peak_units = max(run.peak_units, meter.peak_units)
        stats = torch.full((dp + 1,), float("-inf"), device=device)
        if loss is not None:
            stats[run.replica] = float(loss)
        stats[dp] = step_time
        run.pending = (dist.all_reduce(stats, op=dist.ReduceOp.MAX, async_op=True), stats, step)
        if opts.eval_every and ((step + 1) % opts.eval_every == 0 or step + 1 == last_step):
            run.stepper.resolve()  # a post-validated step is settled before its weights are used
            _flush_report(run)
            progress.at(f"evaluating after step {step + 1}")
            run.evals[step] = _validate(runner, run.model, opts.eval_batches, batch_size, dp,
                                        run.replica, run.share, device)
            _say(rank, f"eval after step {step + 1}: loss {run.evals[step]:.4f} "
                       f"({opts.eval_batches} batch{'es' if opts.eval_batches > 1 else ''} of "
                       f"{batch_size}, forward only)")
    return None


def _finish(run: _Run) -> None:
    """The last step's checks and line, the final checkpoint, the saved model."""
    progress.at("finishing: the last step's checks, the final checkpoint and the summary")
    run.stepper.resolve()  # the last step, if post-validated, is checked here
    _flush_report(run)
    if run.checkpointer is not None:
        if run.last_saved != run.last_step:
            run.checkpointer.save(run.last_step, also=run.export)
        run.checkpointer.wait()
    if run.opts.save_model:
        run.model.save(run.opts.save_model, run.runner.stages)
        _say(run.rank, f"ppdsl: saved the trained model to {run.opts.save_model} (transformers "
                       "from_pretrained loads it)")


def _summary(run: _Run) -> None:
    """The closing lines (optimizer, memory, replicas, time), each rank's
    measurements (`--json`) and the trace (`--trace`); collective."""
    opts, plan, runner, rank, world = run.opts, run.plan, run.runner, run.rank, run.world
    dp, num_ranks, meter, device = run.dp, plan.num_devices, runner.meter, run.device
    outcomes = run.stepper.outcomes
    clipped = sum(o.clipped for o in outcomes)
    skipped = sum(o.skipped for o in outcomes)
    if opts.clip_grad_norm is not None or skipped:
        rolled = sum(o.rolled_back for o in outcomes)
        _say(rank, f"optimizer: {len(outcomes)} steps, {clipped} clipped, {skipped} skipped "
                   "(inf/NaN gradients)"
                   + (f"; post-validation rolled back {rolled}" if opts.optimizer_validation == "post"
                      else ""))
    ratios = runner.measured_mw_ratio()
    kept_ratios = runner.measured_mi_ratio()
    real_memory = _with_real_mw(plan.memory, ratios, kept_ratios)
    pp_rank, device_peak, shares = run.pp_rank, run.device_peak, run.shares
    step_times = run.step_times
    buffers = [(f"stage{s}.{name}", buf) for s, module in sorted(runner.stages.items())
               for name, buf in module.named_buffers()]
    mine = {
        "rank": rank,
        "pp_rank": pp_rank,
        "replica": run.replica,
        "stages": sorted(runner.stages),
        "predicted_peak": str(plan.predicted_peak(pp_rank)),
        "predicted_peak_real_mw": str(plan.predicted_peak(pp_rank, real_memory)),
        "measured_peak": str(run.peak_units),
        "measured_peak_bytes": run.peak_bytes,
        "stash_gradient_bytes": meter.peak_gradient_bytes,
        "weight_copy_bytes": meter.peak_weight_copy_bytes,
        "cuda_peak_bytes": device_peak.bytes if device_peak is not None else None,
        "predicted_cuda_peak_bytes": (_predicted_cuda_peak(plan, pp_rank, runner, real_memory, device_peak)
                                      if device_peak is not None else None),
        "working_bytes": device_peak.working_by_pass() if device_peak is not None else None,
        "stage_bytes": {str(s): b for s, b in runner.stage_bytes().items()},
        "mw_ratio": {str(s): str(r) for s, r in ratios.items()},
        "mi_ratio": {str(s): str(r) for s, r in kept_ratios.items()},
        "predicted_busy_share": plan.predicted_busy_share[pp_rank] if plan.predicted_busy_share else None,
        "measured_busy_share": sum(shares) / len(shares) if shares else None,
        "mean_step_time": sum(step_times) / len(step_times) if step_times else None,
        "step_times_ms": [t * 1e3 for t in step_times],
        "losses": {str(k + 1): v.hex() for k, v in sorted(run.losses.items())},
        "eval_losses": {str(k + 1): v.hex() for k, v in sorted(run.evals.items())},
        "parameters_sha256": _parameters_digest(runner),
        "whole_parameters_sha256": _parameters_digest(runner, whole=True) if dp > 1 else None,
        "buffers_sha256": _digest(buffers) if buffers else None,
        "optimizer_steps": [
            {"step": o.step + 1, "grad_norm": o.grad_norm, "clipped": o.clipped,
             "skipped": o.skipped, "rolled_back": o.rolled_back} for o in outcomes
        ],
    }
    tracer = run.tracer
    durations = gather(tracer.durations)
    mine.update(_predictions(plan, durations, step_times))
    if opts.trace:
        events = gather(tracer.events)
        shared = gather(tracer.shared_clock)
        if rank == 0:
            stages: list[Any] = [None] * world
            for r in range(world):
                order = plan.orders[placement_of(r, num_ranks)[1]]
                stages[r] = f"rank {r} (stage{'s' if len(order) else ''} " + ", ".join(
                    str(st) for st in sorted({st for _, _, st in order})) + ")"
            write_chrome_trace(opts.trace, chrome_trace(events, stages, {
                "schedule": plan.name, "file": plan.file, "device": device.type,
                "time": "CUDA events" if device.type == "cuda" else "perf_counter",
                # "host": every rank's times on one clock (one host's perf_counter,
                # from one epoch), so a pass's start and its input's send compare
                "clock": "host" if all(shared) else "rank",
                "steps": opts.steps, "params": plan.params, "num_ranks": num_ranks, "dp": dp,
                "costs": plan.costs, "costs_from": plan.costs_from, "fingerprint": plan.fingerprint,
            }))
    everyone = gather(mine)
    if opts.json_out:
        out = Path(opts.json_out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(mine, indent=1))
    if rank == 0:
        print(memory_table(plan, everyone), flush=True)
        if dp > 1:
            print(replicas_summary(everyone, num_ranks, opts.dp_mode), flush=True)
        print(timing_summary(plan, mine), flush=True)
        if opts.trace:
            print(f"wrote the trace of every rank to {opts.trace} (open it in ui.perfetto.dev; "
                  f"`ppdsl trace {opts.trace}` checks it against the proof and lays it beside "
                  "the simulation, `-o own.pp` writes this run's own costs)", flush=True)


GAP_TO_EXPLAIN = 1.10
"""measured/predicted step time above which the summary names the gap's largest
sources (issue 22: a comparison whose error exceeds the schedules' difference
cannot be trusted)."""


def plan_costs(plan: Plan) -> Costs:
    """The costs the plan was compiled with (in ms under --costs-from), step
    costs included."""
    costs = plan.costs or {}
    in_use = Costs.of(costs.get("F", ()), costs.get("B", ()), costs.get("W", ()),
                      costs.get("BW", ()), float(costs.get("comm", 0.0)))
    return in_use.with_step_costs(costs.get("overhead", ()), costs.get("optimizer", ()),
                                  float(costs.get("norm", 0.0)), float(costs.get("jitter", 0.0))
                                  ).with_receive_cost(float(costs.get("recv", 0.0)))


def _predictions(
    plan: Plan, durations: list[dict[tuple[str, int], list[float]]], step_times: list[float]
) -> dict[str, Any]:
    """Measured step time (median, ms) against the simulator's step (the makespan,
    plus the step costs the costs file declares): under the costs in use (when
    they are a profile's, in ms) and under this run's own mean pass times; and,
    under a profile's costs, the largest sources of the gap (`gap_sources`)."""
    merged: dict[tuple[str, int], list[float]] = {}
    for d in durations:
        for key, values in d.items():
            merged.setdefault(key, []).extend(values)
    measured = statistics.median(step_times) * 1e3 if step_times else None
    in_use = plan_costs(plan)
    comm = in_use.comm if plan.costs_from else 0.0
    fallback = replace(in_use, comm=comm, recv=in_use.recv if plan.costs_from else 0.0)
    resimulated = None
    sources: list[dict[str, Any]] = []
    num_ranks = plan.num_devices
    if merged and len(in_use.forward) == plan.num_stages:
        run_costs = mean_costs(merged, plan.num_stages, fallback)
        again = simulated_timeline(plan.orders, plan.stage_device, plan.num_microbatches,
                                   plan.split_backward, run_costs, plan.memory, lanes=plan.lanes)
        resimulated = float(again.step_time)
        if plan.costs_from and measured is not None:
            predicted = simulated_timeline(plan.orders, plan.stage_device, plan.num_microbatches,
                                           plan.split_backward, in_use, plan.memory,
                                           lanes=plan.lanes)
            sources = [
                {"cause": g.cause, "rank": g.rank, "measured_ms": g.measured_ms,
                 "predicted_ms": g.predicted_ms}
                for g in gap_sources(predicted, plan.orders, plan.stage_device, in_use,
                                     durations[:num_ranks], len(step_times), measured)
            ]
    predicted_step = plan.predicted_step_time if plan.predicted_step_time is not None \
        else plan.predicted_makespan
    return {
        "median_step_time_ms": measured,
        "predicted_step_time_ms": predicted_step if plan.costs_from else None,
        "predicted_makespan": plan.predicted_makespan,
        "costs_from": plan.costs_from,
        "resimulated_step_time_ms": resimulated,
        "measured_pass_ms": {f"{k}{s}": pass_cost(v) for (k, s), v in sorted(merged.items())
                             if s >= 0},
        "gap_sources": sources,
        "ranks": len(durations),
        "cores": os.cpu_count() or 1,
    }


def timing_summary(plan: Plan, mine: dict[str, Any]) -> str:
    """The closing lines on time: measured step time against the simulator and,
    when it is more than `GAP_TO_EXPLAIN` times the prediction, the largest
    sources of the gap."""
    measured = mine.get("median_step_time_ms")
    if measured is None:
        return ""
    lines = ["", f"measured step time {measured:.1f} ms (median over steps 2.., slowest rank)"]
    predicted = mine.get("predicted_step_time_ms")
    whole = plan.predicted_step_time is not None
    if predicted:
        lines.append(
            f"  predicted {predicted:.1f} ms: the simulated "
            + ("step (passes with their overhead, transfers, the norm all-reduce, the "
               "optimizer)" if whole else "makespan")
            + f" under the costs from {plan.costs_from}; measured/predicted "
            f"{measured / predicted:.3f}"
        )
    elif plan.predicted_makespan is not None:
        lines.append(
            f"  predicted makespan {plan.predicted_makespan:g} in {plan.file}'s cost units; "
            "to predict milliseconds, give --costs-from the output of `ppdsl profile -o`"
        )
    again = mine.get("resimulated_step_time_ms")
    if again:
        lines.append(
            f"  predicted {again:.1f} ms: simulated under this run's mean pass times"
            + (" and the file's other costs" if plan.costs_from else " (no transfer cost)")
            + f"; measured/predicted {measured / again:.3f}"
        )
    ranks, cores = mine.get("ranks"), mine.get("cores")
    if predicted and ranks and cores and ranks > cores:
        lines.append(f"  oversubscribed ({ranks} ranks on {cores} cores): the ranks share cores, "
                     "so their passes take longer than profiled; not a prediction check")
    sources = [g for g in mine.get("gap_sources") or () if g["measured_ms"] > g["predicted_ms"]]
    if predicted and measured / predicted > GAP_TO_EXPLAIN and sources:
        lines.append(f"  the gap (more than {GAP_TO_EXPLAIN:.2f}x), largest sources first, per "
                     "step on the rank where each exceeds its prediction most:")
        for g in sources[:4]:
            lines.append(
                f"    {g['cause']}: rank {g['rank']} {g['measured_ms']:.1f} ms, predicted "
                f"{g['predicted_ms']:.1f} ms (+{g['measured_ms'] - g['predicted_ms']:.1f} ms)"
            )
        if not whole:
            lines.append("    (the costs file has no step costs: `ppdsl profile -o` measures "
                         "overhead, optimizer and norm)")
    return "\n".join(lines)


def _predicted_cuda_peak(plan: Plan, pp_rank: int, runner: PipelineRunner, memory: MemoryModel,
                         device_peak: DevicePeak, *, fresh_gradients: bool = True) -> int:
    """The CUDA peak of a step the memory model predicts, in bytes above the step's
    baseline (`memory.predicted_device_peak`): the activations with the measured
    M_B per stage (and real M_W/M_I), the W stashes' output gradients, the
    parameters' gradients where the step makes them afresh (`fresh_gradients`:
    `zero_grad(set_to_none=True)`, as here; else they are in the baseline), and
    each pass's working memory as a measured step's pass windows read it."""
    grads = {}
    if fresh_gradients:
        for s, module in runner.stages.items():
            local = [local_tensor(p) for p in module.parameters() if p.requires_grad]
            grads[s] = sum(t.numel() * t.element_size() for t in local)
    return predicted_device_peak(PassKeys(plan.orders[pp_rank].passes), memory, runner.stage_bytes(),
                                 working=device_peak.working,
                                 stash_gradients=runner.engine.meter.stash_gradient_bytes(),
                                 first_gradients=grads)


def _with_real_mw(
    memory: MemoryModel, ratios: dict[int, Fraction], kept: dict[int, Fraction] | None = None
) -> MemoryModel:
    """The file's memory model with M_W replaced by the measured M_W/M_B where
    known, and M_I of a recomputed stage by the measured M_I/M_B (`kept`)."""
    kept = kept or {}
    return MemoryModel(
        memory.activation,
        tuple(
            a * ratios[s] if s in ratios else w
            for s, (a, w) in enumerate(zip(memory.activation, memory.weight_retained, strict=True))
        ),
        tuple(
            None if i is None else (memory.activation[s] * kept[s] if s in kept else i)
            for s, i in enumerate(memory.kept_input)
        ),
    )


def memory_table(plan: Plan, ranks: list[dict[str, Any]]) -> str:
    """Predicted vs measured peak activation memory and busy share, one row per rank."""
    mb = plan.memory
    mw_file = sorted({str(w / a) for a, w in zip(mb.activation, mb.weight_retained, strict=True) if a})
    head = (
        f"{'rank':>4}  {'stages':<8} {'peak predicted':>14} {'measured':>9} {'bytes':>10}"
        f"  {'real M_W/M_B':>12} {'pred. (real M_W)':>16}  {'busy pred.':>10} {'measured':>9}"
    )
    lines = [
        "",
        "peak activation memory in the file's units (M_B of a stage = bytes one microbatch "
        "holds after its F) and compute share of the step; real M_W/M_B is the share of a "
        "microbatch's activation this model still holds between its B and its W, measured "
        "per stage (one value per stage of the rank, a/b), and pred. (real M_W) the peak "
        "predicted with it in place of the file's M_W:",
        head,
    ]
    for r in ranks:
        ratio = sorted({format_ratio(v) for v in r["mw_ratio"].values()})
        busy_p = r["predicted_busy_share"]
        busy_m = r["measured_busy_share"]
        lines.append(
            f"{r['rank']:>4}  {','.join(map(str, r['stages'])):<8} {format_ratio(r['predicted_peak']):>14}"
            f" {format_ratio(r['measured_peak']):>9} {r['measured_peak_bytes']:>10}"
            f"  {'/'.join(ratio) if ratio else '-':>12} {format_ratio(r['predicted_peak_real_mw']):>16}"
            f"  {f'{busy_p:.2f}' if busy_p is not None else '-':>10}"
            f" {f'{busy_m:.2f}' if busy_m is not None else '-':>9}"
            + (f"  cuda peak {r['cuda_peak_bytes']} B (predicted {r['predicted_cuda_peak_bytes']} B)"
               if r.get("cuda_peak_bytes") else "")
        )
    if plan.split_backward:
        real = sorted({v for r in ranks for v in r["mw_ratio"].values()}, key=Fraction)
        file_ratio = ", ".join(mw_file)
        if real and any(Fraction(v) not in {Fraction(x) for x in mw_file} for v in real):
            lines.append(
                f"note: the file's memory model has M_W/M_B = {file_ratio}; this model keeps "
                f"{', '.join(format_ratio(v) for v in real)} of a microbatch's activation from B to W "
                "(measured), so the 'pred. (real M_W)' column is the one to compare."
            )
    return "\n".join(lines)

