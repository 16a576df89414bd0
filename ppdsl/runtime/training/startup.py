"""A rank's run before its first step: every rank runs the same compiled
schedule (fingerprints), the model is built and follows the protocol, the batch
splits into m microbatches on each replica, then the runner, the optimizer, the
LR schedule, the checkpoints (resumed from the newest) and the opening lines.
Any failure prints one clear message (from rank 0) and every rank exits 1.
`start` returns the `Run` record the loop (`ppdsl.runtime.training.train`) and
the closing tables (`ppdsl.runtime.training.summary`) read."""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ppdsl.backend.plan import Plan
from ppdsl.ir.rank import Op
from ppdsl.runtime.execution.data_parallel import dp_pp_mesh
from ppdsl.runtime.execution.group import agree, differing, placement_of
from ppdsl.runtime.execution.memory import DevicePeak
from ppdsl.runtime.execution.pipeline import CompiledPipeline, PipelineRunner
from ppdsl.runtime.execution.precision import MasterWeights, dtype_of
from ppdsl.runtime.execution.trace import Tracer
from ppdsl.runtime.models.hf import PREFIX, HFOptions, import_library, is_hf_spec, pipeline_model
from ppdsl.runtime.models.model import ModelError, build_model
from ppdsl.runtime.training.checkpoint import Checkpointer, CheckpointError, run_identity
from ppdsl.runtime.training.optim import OptimizerStep, lr_lambda, make_optimizer
from ppdsl.runtime.worker import faults
from ppdsl.runtime.worker.attempt import attempt_note
from ppdsl.runtime.worker.bootstrap import EXIT_INVALID, Worker
from ppdsl.runtime.worker.cpu import resident_bytes
from ppdsl.runtime.worker.watchdog import Watchdog, group_timeout

__all__ = ["Run", "start", "say", "startup_error"]


def say(rank: int, text: str) -> None:
    """Print a line of the run once (from rank 0)."""
    if rank == 0:
        print(text, flush=True)


def _build_model(opts: argparse.Namespace, num_stages: int) -> Any:
    """The user's factory's model, or `--model hf:DIR` cut by `ppdsl.runtime.models.hf`."""
    if not is_hf_spec(opts.model):
        return build_model(opts.model, num_stages)
    options = HFOptions(seq_len=opts.seq_len, seed=opts.seed, data=opts.data,
                        data_dtype=opts.data_dtype, cut=opts.cut, eval_data=opts.eval_data,
                        max_seq_len=opts.max_seq_len, pack=opts.pack)
    return pipeline_model(opts.model[len(PREFIX):], num_stages, options)


def startup_error(rank: int, error: str) -> int:
    """Print a start-up error once (from rank 0); the exit code of every rank."""
    if rank == 0:
        print(f"ppdsl: error: {error}", file=sys.stderr, flush=True)
    return EXIT_INVALID


def start(plan: Plan, fingerprint: str, ops: Sequence[Op], opts: argparse.Namespace,
          worker: Worker) -> Run | int:
    """The start-up checks, the model, runner, optimizer and checkpoints, the
    opening lines: the run, or the exit code when it stops here."""
    rank = worker.rank
    if is_hf_spec(opts.model):
        import_library(opts.model[len(PREFIX):])
    bare = resident_bytes()  # the runtime and the model's code, before any of its tensors
    if not _same_program(plan, fingerprint, rank):
        return EXIT_INVALID
    batch_size = opts.batch_size if opts.batch_size is not None else 2 * plan.num_microbatches * opts.dp
    torch.manual_seed(opts.seed)  # torch seeds its default generator at random otherwise
    random.seed(opts.seed)
    model, error = _model(plan, opts, batch_size)
    error = agree(error)
    if error is not None:
        return startup_error(rank, error)
    replica, pp_rank = placement_of(rank, plan.num_devices)
    try:
        runner = _runner(plan, ops, fingerprint, opts, model, worker.device, pp_rank)
    except ModelError as exc:  # the same message on every rank
        return startup_error(rank, str(exc))
    # bf16 parameters: the optimizer steps their fp32 masters (its state is fp32 too)
    master = MasterWeights(runner.parameters()) if runner.param_dtype is not None else None
    trained = master.parameters(runner.parameters()) if master is not None else runner.parameters()
    optimizer = make_optimizer(opts.optimizer, trained, opts.lr, opts.weight_decay, opts.momentum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(opts.lr_schedule, opts.steps, opts.warmup_steps)
    )
    stepper = OptimizerStep(runner, optimizer, max_norm=opts.clip_grad_norm,
                            validation=opts.optimizer_validation, master=master)
    last_step = opts.steps if opts.stop_after is None else min(opts.steps, opts.stop_after)
    # --save-model with checkpoints: each checkpoint also holds the model as a
    # transformers checkpoint (its `hf` folder), written before it becomes visible
    export = ((lambda where: model.save(where / "hf", runner))
              if opts.save_model else None)
    checkpointer = None
    first_step = 0
    if opts.checkpoint_dir:
        checkpointer = Checkpointer(
            opts.checkpoint_dir, runner, optimizer, stepper=stepper, scheduler=scheduler,
            identity=run_identity(plan, runner, model=opts.model, world_size=worker.world,
                                  dp=opts.dp, dp_mode=opts.dp_mode,
                                  architecture=_architecture(opts.model),
                                  cut=getattr(model, "cut", None)),
            keep=opts.keep_checkpoints, asynchronous=not opts.sync_checkpoints,
            on_event=lambda point, at: faults.reached(point, at),
        )
        resumed = _resume(checkpointer, opts, rank)
        if isinstance(resumed, str):
            return startup_error(rank, resumed)
        first_step = resumed
    if first_step >= last_step:
        say(rank, f"ppdsl: the checkpoint is already at step {first_step} of {last_step}: "
                  "nothing left to train")
        return 0
    _opening_lines(plan, opts, worker, model, batch_size)
    if worker.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(worker.device)
    tracer = Tracer(rank, worker.device)
    runner.tracer = tracer
    dist.barrier()  # the ranks' trace epochs line up here
    tracer.start()
    return Run(
        plan=plan, opts=opts, rank=rank, world=worker.world, device=worker.device,
        watchdog=worker.watchdog, model=model, runner=runner, optimizer=optimizer,
        scheduler=scheduler, stepper=stepper, checkpointer=checkpointer, export=export,
        first_step=first_step, last_step=last_step, batch_size=batch_size, replica=replica,
        pp_rank=pp_rank, tracer=tracer, device_peak=runner.device_peak,
        last_saved=first_step if first_step else None, bare_resident=bare,
    )


def _same_program(plan: Plan, fingerprint: str, rank: int) -> bool:
    """Whether every rank runs the same compiled directory: each offers its
    program's fingerprint and its manifest's (collective; rank 0 names the odd
    ones out)."""
    theirs = differing([fingerprint, plan.fingerprint], note=plan.name)
    if theirs is None:
        return True
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
    return False


def _model(plan: Plan, opts: argparse.Namespace, batch_size: int) -> tuple[Any, str | None]:
    """The user's model, and what is wrong with it or with the batch for it
    (this rank's view; the caller agrees on it with the others)."""
    m, dp = plan.num_microbatches, opts.dp
    model: Any = None
    try:
        model = _build_model(opts, plan.num_model_stages)
        if batch_size % (m * dp):
            raise ModelError(
                f"--batch-size {batch_size} does not split into {m} microbatches"
                + (f" on each of {dp} replicas" if dp > 1 else "")
                + f"; use a multiple of {m * dp}"
            )
        if getattr(model, "documents", None) is not None and dp > 1:
            raise ModelError("documents (--data FILE.npz) with --dp are not supported yet: "
                             "train them on one pipeline")
        if opts.eval_every is not None and getattr(model, "eval_batch", None) is None:
            raise ModelError(
                f"--eval-every needs evaluation data, but --model {opts.model!r} has no "
                "eval_batch(index, batch_size) -> (inputs, targets) (docs/runtime.md, the "
                "model protocol)"
            )
    except ModelError as exc:
        return model, str(exc)
    except Exception as exc:
        return model, f"building the model failed: {type(exc).__name__}: {exc}"
    return model, None


def _runner(plan: Plan, ops: Sequence[Op], fingerprint: str, opts: argparse.Namespace,
            model: Any, device: torch.device, pp_rank: int) -> PipelineRunner:
    """This rank's `PipelineRunner` over the model's stages (on a ("dp", "pp")
    mesh with `--dp` above 1); a `ModelError` when the model does not fit it."""
    schedule = CompiledPipeline(plan, {pp_rank: tuple(ops)}, fingerprint)
    mesh = dp_pp_mesh(opts.dp, plan.num_devices, device.type) if opts.dp > 1 else None
    return PipelineRunner(
        schedule, model.stage, model.loss, device=device, precision=opts.precision,
        release=opts.release, tied=tuple(getattr(model, "tied", ()) or ()),
        timeout=group_timeout(opts.timeout), mesh=mesh, dp_mode=opts.dp_mode,
        share_gpu=opts.share_gpu,
        param_dtype=dtype_of(opts.param_dtype) if opts.param_dtype != "fp32" else None,
        reduce_dtype=dtype_of(opts.reduce_dtype),
    )


def _resume(checkpointer: Checkpointer, opts: argparse.Namespace, rank: int) -> int | str:
    """The step to start from (0-based: the newest checkpoint's step, else 0),
    said in a line; or why the checkpoints cannot be used."""
    try:
        resumed = checkpointer.resume(require=opts.resume)
    except CheckpointError as exc:
        return str(exc)
    if resumed is None:
        say(rank, f"ppdsl: no checkpoint in {opts.checkpoint_dir} yet: starting at step 1"
            + attempt_note())
        return 0
    say(rank, f"ppdsl: resumed from {resumed[1]} (after step {resumed[0]})"
        + (f", {checkpointer.resharded}" if checkpointer.resharded else "") + attempt_note())
    return resumed[0]


def _architecture(spec: str) -> str:
    """What a checkpoint's model must be to resume: a transformers folder's
    architecture (config.json's `model_type`, which a folder of weights and one
    of a config alone both hold), else the factory `--model` names."""
    if not is_hf_spec(spec):
        return spec
    try:
        config = json.loads((Path(spec[len(PREFIX):]) / "config.json").read_text())
    except (OSError, ValueError):
        return spec
    return str(config.get("model_type", spec))


def _opening_lines(plan: Plan, opts: argparse.Namespace, worker: Worker, model: Any,
                   batch_size: int) -> None:
    """The run's first lines: the schedule, the world, the batch, the device and
    the optimizer; the cut of a transformers model."""
    dp, device = opts.dp, worker.device
    say(
        worker.rank,
        f"ppdsl: schedule {plan.name} ({plan.file}): "
        + (f"{dp} {opts.dp_mode} replicas x {plan.num_devices} pipeline ranks = " if dp > 1 else "")
        + f"{worker.world} ranks, {plan.num_stages} stages, "
        f"{plan.num_microbatches} microbatches, batch {batch_size}"
        + (f" ({batch_size // dp} per replica)" if dp > 1 else "") + f", {device.type}"
        + (" (gloo, shared GPU: transfers staged through host memory)" if opts.share_gpu
           else " (gloo)" if device.type == "cpu" else " (nccl)")
        + f", {opts.optimizer}" + (f", {opts.precision}" if opts.precision != "fp32" else "")
        + (f", {opts.param_dtype} parameters (fp32 master weights)"
           if opts.param_dtype != "fp32" else "")
        + (f", clip {opts.clip_grad_norm:g} ({opts.optimizer_validation})"
           if opts.clip_grad_norm is not None else ""),
    )
    if getattr(model, "cut", None):
        say(worker.rank, "ppdsl: cut (first decoder layer of each stage): "
                         + ",".join(str(c) for c in model.cut))


@dataclass
class Run:
    """One rank's run, as its start-up leaves it for the loop and the summary."""

    plan: Plan
    opts: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    watchdog: Watchdog
    """Stops every rank when this one fails (`fail`)."""
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
    reorders: list[tuple[float, float, float]] = field(default_factory=list)
    """Per step under `--reorder` (rank 0's): seconds choose_order took, the
    predicted step in the order given and in the order chosen."""
    last_saved: int | None = None
    """The step of the last checkpoint saved (or resumed from), or None."""
    pending: tuple[Any, torch.Tensor, int] | None = None
    """The last step's line, its numbers being all-reduced in the background."""
    bare_resident: int | None = None
    """This process's resident bytes before the model was built (the bare
    runtime: torch, the process group), or None where it cannot be read."""

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
