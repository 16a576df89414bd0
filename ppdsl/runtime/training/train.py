"""The entry point generated rank programs call (`ppdsl run` starts them): a
training loop written on the library (`ppdsl.runtime.execution.pipeline`), as a user's own
loop would be, with the options people expect, a per-step line and the closing
predicted-vs-measured table.

    torchrun --nproc-per-node 4 build/zb_v/launch.py --model examples/models/tiny_gpt.py:stages

With `--dp N` the world is N replicas of the pipeline on a ("dp", "pp") mesh:
global rank = replica * P + pipeline rank (P = the schedule's device count),
each replica trains on its contiguous share of the step's batch
(`ppdsl.runtime.execution.data_parallel`).

The run reads like the compiler's driver: `main` checks that this process runs
the program of its rank and hands `_run` to the worker's bootstrap
(`ppdsl.runtime.worker.bootstrap`: device, process group, watchdog), and `_run`
is start-up (`ppdsl.runtime.training.startup`), the loop, the finish and the
closing tables (`ppdsl.runtime.training.summary`). Any start-up failure prints
one clear message (from rank 0, or from the rank that saw it) and every rank
exits 1. Later, a rank that dies or hangs makes the others exit 1 naming it,
within `--timeout` seconds.

Each step: the ranks holding the first or the last stage build the batch
(`model.batch`; nobody else does), `runner.step`, then the optimizer step
(`OptimizerStep`: clipping, inf/NaN skips, fp16 unscaling, sync or
post-validated), the LR scheduler, and a checkpoint every `--checkpoint-every`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ppdsl.backend.plan import Plan
from ppdsl.ir.rank import Op
from ppdsl.runtime.execution.group import agree, placement_of
from ppdsl.runtime.execution.pipeline import PipelineRunner
from ppdsl.runtime.execution.structure import flatten, unflatten
from ppdsl.runtime.models.model import LossError, ModelError
from ppdsl.runtime.training.options import add_training_options, check_training_options
from ppdsl.runtime.training.reorder import agreed_order
from ppdsl.runtime.training.startup import Run, say, start, startup_error
from ppdsl.runtime.training.summary import summary
from ppdsl.runtime.worker import faults, progress
from ppdsl.runtime.worker.bootstrap import EXIT_INVALID, Worker, run_worker, world_from_env
from ppdsl.runtime.worker.watchdog import fail

__all__ = ["main", "parse_options"]


def parse_options(argv: Sequence[str] | None, prog: str = "launch.py") -> argparse.Namespace:
    """The options of a generated rank program (`ppdsl run` passes them on)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Train with a ppdsl-compiled pipeline schedule (run under torchrun)."
    )
    add_training_options(parser)
    args = parser.parse_args(argv)
    problem = check_training_options(args)
    if problem is not None:
        parser.error(problem)
    return args


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
    opts.dp = opts.dp if opts.dp is not None else int(compiled_dp.get("dp", 1))
    opts.dp_mode = opts.dp_mode or compiled_dp.get("mode", "replicate")
    problem = _placement_problem(plan, opts.dp, rank_in_file, Path(manifest))
    if problem is not None:
        if problem:
            print(problem, file=sys.stderr)
        return EXIT_INVALID
    return run_worker(lambda worker: _run(plan, fingerprint, ops, opts, worker),
                      device=opts.device, share_gpu=opts.share_gpu, timeout=opts.timeout)


def _placement_problem(plan: Plan, dp: int, rank_in_file: int, manifest: Path) -> str | None:
    """Why this process cannot run the program of pipeline rank `rank_in_file`
    (not under torchrun, a world that is not dp x the schedule's ranks, another
    rank's program), or None; "" when another rank says it."""
    found = world_from_env()
    if found is None:
        return ("ppdsl: start this program with torchrun (or `ppdsl run`), e.g. "
                f"torchrun --nproc-per-node {plan.num_devices * dp} {manifest.parent / 'launch.py'} "
                "--model examples/models/tiny_gpt.py:stages")
    rank, world = found
    if world != plan.num_devices * dp:
        return "" if rank != 0 else (
            f"ppdsl: schedule {plan.name!r} was compiled for {plan.num_devices} ranks"
            + (f" and runs {dp} data-parallel replicas ({dp * plan.num_devices} processes)"
               if dp > 1 else "")
            + f" but torchrun started {world}; use --nproc-per-node {dp * plan.num_devices} "
            "in all (or recompile with -D d=..., or change --dp)")
    pp_rank = placement_of(rank, plan.num_devices)[1]
    if rank_in_file != pp_rank:
        return (f"ppdsl: rank {rank}: was handed the program of pipeline rank {rank_in_file}, not "
                f"{pp_rank}; start it through the generated launch.py")
    return None


def _run(plan: Plan, fingerprint: str, ops: Sequence[Op], opts: argparse.Namespace,
         worker: Worker) -> int:
    """This rank's training: start-up, the loop, the finish, the summary; the
    exit code."""
    run = start(plan, fingerprint, ops, opts, worker)
    if isinstance(run, int):
        return run
    code = _loop(run)
    if code is not None:
        return code
    _finish(run)
    summary(run)
    return 0


def _loop(run: Run) -> int | None:
    """The training steps; an exit code when the first step finds bad input."""
    # The per-step line's numbers are all-reduced in the background and printed
    # one step late: a blocking collective per step would be a barrier, undoing
    # what post-validation saves.
    for step in range(run.first_step, run.last_step):
        faults.set_step(step + 1)
        progress.at(f"step {step + 1}: building its batch and starting")
        shapes: dict[str, Any] = {}
        if getattr(run.model, "documents", None) is not None:
            inputs, targets, shapes = _documents(run, step)
        else:
            inputs, targets = _batch(run, step)
            if step == run.first_step:
                error = agree(_batch_problem(inputs, step, run.batch_size))
                if error is not None:
                    return startup_error(run.rank, error)
        try:
            loss, t0 = _step(run, step, inputs, targets, shapes)
        except ModelError as exc:  # the probe at the first step: the same on every rank
            return startup_error(run.rank, str(exc))
        # The step before's line is printed before its checkpoint can become visible:
        # a run restarted from that checkpoint has printed every step it holds.
        _flush_report(run)
        _checkpoint(run, step)
        _record(run, step, loss, time.perf_counter() - t0)
        every = run.opts.eval_every
        if every and ((step + 1) % every == 0 or step + 1 == run.last_step):
            _evaluate(run, step)
    return None


def _batch(run: Run, step: int) -> tuple[Any, Any]:
    """The step's inputs and targets, built only on the ranks that use them (the
    first and the last stage's); (None, None) elsewhere."""
    runner, tracer = run.runner, run.tracer
    tracer.step = step
    tracer.timed = run.timed(step)
    if not (runner.is_first or runner.is_last):
        return None, None
    tracer.begin()
    inputs, targets = run.model.batch(step, run.batch_size)
    tracer.end("data", "data", {}, None)
    return inputs, targets


def _documents(run: Run, step: int) -> tuple[Any, Any, dict[str, Any]]:
    """A document step's microbatches (`model.documents`, `ppdsl.lengths`' rule):
    the inputs and targets as lists of the m microbatches where they are used
    (None elsewhere), and on every rank alike each microbatch's tokens and
    share of the step's loss (`runner.step`'s `lengths` and `weights`)."""
    runner, tracer, batches = run.runner, run.tracer, run.model.documents
    tracer.step = step
    tracer.timed = run.timed(step)
    microbatches = batches.step(step, runner.plan.num_microbatches)
    if run.opts.reorder:
        microbatches = _reordered(run, microbatches)
    shapes = {"lengths": batches.lengths(microbatches), "weights": batches.weights(microbatches)}
    if not (runner.is_first or runner.is_last):
        return None, None, shapes
    tracer.begin()
    pairs = [batches.tensors(mb) for mb in microbatches]
    tracer.end("data", "data", {}, None)
    return [p[0] for p in pairs], [p[1] for p in pairs], shapes


def _reordered(run: Run, microbatches: list[Any]) -> list[Any]:
    """The step's microbatches in the order of the schedule's slots chosen
    under the plan's per-token costs (`ppdsl.runtime.training.reorder`, the
    same on every rank); its time and predictions kept for the summary."""
    runner = run.runner
    if not run.reorders and runner.rank == 0 and not runner.plan.cost_model().follows_tokens:
        say(run.rank, "ppdsl: note: --reorder: the schedule's costs do not follow the tokens "
                      "(no per-token costs), so every order predicts the same step")
    choice = agreed_order(runner.plan, run.model.documents.lengths(microbatches), runner.group)
    if choice.seconds is not None:
        assert choice.given is not None and choice.predicted is not None
        run.reorders.append((choice.seconds, choice.given, choice.predicted))
    return [microbatches[j] for j in choice.slots]


def _batch_problem(inputs: Any, step: int, batch_size: int) -> str | None:
    """What is wrong with the first step's batch on this rank, or None."""
    if inputs is None:
        return None
    leaves = flatten(inputs, "the inputs")[0]
    got = leaves[0].shape[0] if leaves and leaves[0].dim() else None
    if got != batch_size:
        return f"batch({step}, {batch_size}) returned {got} samples, expected {batch_size}"
    return None


def _step(run: Run, step: int, inputs: Any, targets: Any,
          shapes: dict[str, Any]) -> tuple[Any, float]:
    """The step's passes and optimizer step: the loss (on the last stage's rank)
    and when the step started (`time.perf_counter`). `shapes`: a document step's
    lengths and loss weights (`runner.step`'s), else empty. A `ModelError` from
    the runner's probe propagates; a failing loss, or a stage's output of a
    shape the lengths do not give (`ShapeError`), stops every rank."""
    runner, rank = run.runner, run.rank
    # Memory is measured on the first step (shapes are static, so every step holds
    # the same); later steps run without the meter's hooks, for clean timings.
    run.optimizer.zero_grad(set_to_none=True)
    # Every step from the same state (no gradients); the first step of several
    # left out: it allocates once for the whole run (cuBLAS's workspaces, one
    # per thread and stream, many times a small model's step).
    peak_window = run.device_peak if run.timed(step) else None
    if peak_window is not None:
        peak_window.start()
    t0 = time.perf_counter()
    if run.dp > 1 and inputs is not None:
        inputs, targets = _share(inputs, run.share), _share(targets, run.share)
    try:
        loss = runner.step(inputs if runner.is_first else None,
                           targets if runner.is_last else None,
                           measure_memory=step == run.first_step, **shapes)
    except LossError as exc:  # one rank's (a ShapeError is one too): it stops the others
        fail(run.watchdog, rank, str(exc))
    if peak_window is not None:  # the passes' peak, before the optimizer allocates
        peak_window.stop()
    run.tracer.begin()
    progress.at("the optimizer step")
    faults.reached("optimizer")
    run.stepper.step()
    run.tracer.end("optimizer", "optimizer", {}, None)
    run.tracer.flush()
    run.scheduler.step()
    return loss, t0


def _checkpoint(run: Run, step: int) -> None:
    """A background save finished is made visible; every `--checkpoint-every`
    steps a checkpoint is saved, in the step's time (what a save costs)."""
    checkpointer, every = run.checkpointer, run.opts.checkpoint_every
    if checkpointer is None:
        return
    checkpointer.poll()
    if every and (step + 1) % every == 0:
        progress.at(f"saving the checkpoint of step {step + 1}")
        checkpointer.save(step + 1, also=run.export)
        run.last_saved = step + 1


def _record(run: Run, step: int, loss: Any, step_time: float) -> None:
    """The step's compute share and memory peak kept; its loss and time
    all-reduced in the background for its line (`_report`)."""
    result, meter = run.runner.last_result, run.runner.meter
    assert result is not None  # a step has run
    if run.timed(step):
        run.shares.append(result.compute_time / max(step_time, 1e-12))
    run.peak_bytes = max(run.peak_bytes, meter.peak_bytes)
    run.peak_units = max(run.peak_units, meter.peak_units)
    stats = torch.full((run.dp + 1,), float("-inf"), device=run.device)
    if loss is not None:
        stats[run.replica] = float(loss)
    stats[run.dp] = step_time
    run.pending = (dist.all_reduce(stats, op=dist.ReduceOp.MAX, async_op=True), stats, step)


def _evaluate(run: Run, step: int) -> None:
    """The validation loss after `step`, and its line."""
    opts = run.opts
    run.stepper.resolve()  # a post-validated step is settled before its weights are used
    _flush_report(run)
    progress.at(f"evaluating after step {step + 1}")
    run.evals[step] = _validate(run.runner, run.model, opts.eval_batches, run.batch_size, run.dp,
                                run.replica, run.share, run.device)
    say(run.rank, f"eval after step {step + 1}: loss {run.evals[step]:.4f} "
                  f"({opts.eval_batches} batch{'es' if opts.eval_batches > 1 else ''} of "
                  f"{run.batch_size}, forward only)")


def _report(run: Run, done: tuple[Any, torch.Tensor, int]) -> None:
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
    say(run.rank, f"step {at + 1:4d}/{run.opts.steps}  loss {loss:.4f}{each}  "
                   f"time {step_time * 1e3:8.1f} ms{rate}")


def _flush_report(run: Run) -> None:
    """Print the pending step's line, if any."""
    if run.pending is not None:
        _report(run, run.pending)
        run.pending = None


def _finish(run: Run) -> None:
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
        say(run.rank, f"ppdsl: saved the trained model to {run.opts.save_model} (transformers "
                       "from_pretrained loads it)")


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
