"""Checkpoints with torch.distributed.checkpoint: save a pipeline's training state
and resume it so that the run continues bit for bit as if never interrupted.

What is kept, each rank writing its own part (`dcp.save`, collective):

- the weights of every stage, keyed `stage{s}.{name}` (so a data-parallel replica
  of the same stages writes the same keys, saved once);
- the optimizer's state by those names (torch's `get_optimizer_state_dict`), under
  `optim.pp{rank}` (param groups differ between pipeline ranks);
- per process, one pickled record: the step counter, the data position (anything
  the caller passes as `extra`), the LR scheduler's and the `OptimizerStep`'s
  state (fp16's loss scale), and the RNG states (torch CPU and CUDA, Python's
  `random`), with the schedule's stage placement to check a resume against.

A post-validated step still pending is resolved before saving. A checkpoint is a
directory `step-00000012` under the checkpoint directory. It is written under a
temporary name (`.partial-step-00000012`) and renamed by the coordinating rank
once every rank's part and torch's `.metadata` are on disk, so a save killed at
any point never looks complete; `latest_checkpoint` finds the newest complete
one and `Checkpointer.resume` clears the partial ones.

`Checkpointer` is what the training loop uses: saves that run in the background
(`torch.distributed.checkpoint.async_save` on a gloo group of their own: the
state is copied before the step goes on, then written while it trains), kept to
the newest K, and a resume that checks the checkpoint was made by the same run
set-up (`identity`: schedule, model, placement, world size), naming what differs.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ppdsl.runtime.errors import first_line
from ppdsl.runtime.execution.group import gather

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path",
           "CheckpointError", "Checkpointer", "run_identity", "identity_differences"]

_STEP_DIR = re.compile(r"step-(\d+)")
_PARTIAL = ".partial-"
# What a ppdsl run writes beside torch's files: the run set-up it was made by.
IDENTITY_FILE = "ppdsl.json"


class CheckpointError(RuntimeError):
    """A checkpoint that does not fit this run."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """Where the checkpoint after `step` steps lives."""
    return Path(directory) / f"step-{step:08d}"


def _complete(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and (child / ".metadata").is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under `directory`, or None (a save that was
    interrupted is never complete: it has not been renamed to its step yet)."""
    found = _complete(directory)
    return found[-1][1] if found else None


def _partial_path(final: Path) -> Path:
    return final.parent / f"{_PARTIAL}{final.name}"


def _commit(partial: Path, final: Path, identity: dict[str, Any] | None) -> None:
    """Make a fully written checkpoint visible under its step's name (the
    coordinating rank only, once every rank's part and `.metadata` are written)."""
    if identity is not None:
        (partial / IDENTITY_FILE).write_text(json.dumps(identity, indent=1, sort_keys=True))
    if final.exists():  # the same step saved again after a restart: the new one wins
        old = final.parent / f"{_PARTIAL}old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)


def _modules(runner: Any) -> nn.ModuleDict:
    return nn.ModuleDict({f"stage{s}": m for s, m in sorted(runner.stages.items())})


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _layout(runner: Any) -> dict[str, Any]:
    return {"num_stages": runner.plan.num_stages, "stage_device": list(runner.plan.stage_device),
            "rank": runner.rank}


def save_checkpoint(
    path: str | Path,
    runner: Any,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    stepper: Any = None,
    scheduler: Any = None,
    extra: Any = None,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Save the training state after `step` steps into `path` (a directory);
    collective over `process_group` (default: the world). `extra`: anything
    picklable to restore with it (e.g. a data loader's position). The directory
    appears only once the whole checkpoint is written (see the module's text)."""
    path = Path(path)
    partial = _partial_path(path)
    coordinator = dist.get_rank(process_group) == 0
    if coordinator:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier(group=process_group)  # nobody writes into a partial being cleared
    dcp.save(_state(runner, optimizer, step=step, stepper=stepper, scheduler=scheduler,
                    extra=extra), checkpoint_id=str(partial), process_group=process_group)
    if coordinator:  # dcp.save returns there once every rank's part and .metadata are written
        _commit(partial, path, None)
    dist.barrier(group=process_group)
    return path


def _state(
    runner: Any,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    stepper: Any = None,
    scheduler: Any = None,
    extra: Any = None,
) -> dict[str, Any]:
    """What one rank saves (see the module's text)."""
    if stepper is not None:
        stepper.resolve()
    modules = _modules(runner)
    record = {
        "step": step,
        "extra": extra,
        "layout": _layout(runner),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "stepper": stepper.state_dict() if stepper is not None else None,
        "rng": _rng_state(),
    }
    state = {
        "model": get_model_state_dict(modules),
        f"optim.pp{runner.rank}": get_optimizer_state_dict(modules, optimizer),
        f"process{dist.get_rank()}": pickle.dumps(record),
    }
    return state


def load_checkpoint(
    path: str | Path,
    runner: Any,
    optimizer: torch.optim.Optimizer,
    *,
    stepper: Any = None,
    scheduler: Any = None,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Restore what `save_checkpoint` wrote into the runner's stages, the
    optimizer, the stepper and scheduler and the RNGs; returns {"step": steps done,
    "extra": what was saved with it}. Collective; raises CheckpointError when the
    checkpoint was made for another pipeline layout."""
    modules = _modules(runner)
    key = f"process{dist.get_rank()}"
    state: dict[str, Any] = {
        "model": get_model_state_dict(modules),
        f"optim.pp{runner.rank}": get_optimizer_state_dict(modules, optimizer),
        key: b"",
    }
    try:
        dcp.load(state, checkpoint_id=str(path), process_group=process_group)
    except Exception as exc:
        raise CheckpointError(f"cannot load the checkpoint {str(path)!r}: {first_line(exc, 300)}") from exc
    record = pickle.loads(state[key])
    if record["layout"] != _layout(runner):
        raise CheckpointError(
            f"the checkpoint {str(path)!r} was saved by a pipeline with stages on ranks "
            f"{record['layout']['stage_device']}; this run has {list(runner.plan.stage_device)}"
        )
    set_model_state_dict(modules, state["model"])
    set_optimizer_state_dict(modules, optimizer, state[f"optim.pp{runner.rank}"])
    if scheduler is not None and record["scheduler"] is not None:
        scheduler.load_state_dict(record["scheduler"])
    if stepper is not None and record["stepper"] is not None:
        stepper.load_state_dict(record["stepper"])
    _set_rng_state(record["rng"])
    return {"step": record["step"], "extra": record["extra"]}


def run_identity(
    plan: Any,
    runner: Any,
    *,
    model: str,
    world_size: int,
    dp: int,
    dp_mode: str,
) -> dict[str, Any]:
    """The run set-up a checkpoint belongs to: schedule, stage placement, world
    size and data parallelism, and the model (its factory and every stage's
    parameter names, shapes and dtypes, gathered from all ranks: collective)."""
    mine = {
        str(s): [[name, list(p.shape), str(p.dtype).removeprefix("torch.")]
                 for name, p in module.named_parameters()]
        for s, module in sorted(runner.stages.items())
    }
    parameters: dict[str, Any] = {}
    for found in gather(mine):
        parameters.update(found)
    return {
        "schedule": plan.name,
        "schedule_file": plan.file,
        "fingerprint": plan.fingerprint,
        "placement": list(plan.stage_device),
        "world_size": world_size,
        "dp": dp,
        "dp_mode": dp_mode if dp > 1 else None,
        "model": model,
        "parameters": dict(sorted(parameters.items(), key=lambda kv: int(kv[0]))),
    }


def _parameter_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    for stage in sorted(set(saved) | set(current), key=int):
        theirs = {name: (shape, dtype) for name, shape, dtype in saved.get(stage, [])}
        ours = {name: (shape, dtype) for name, shape, dtype in current.get(stage, [])}
        for name in sorted(set(theirs) | set(ours)):
            if name not in ours:
                return f"stage {stage} has no parameter {name!r}, which the checkpoint holds"
            if name not in theirs:
                return f"stage {stage}'s parameter {name!r} is not in the checkpoint"
            if theirs[name] != ours[name]:
                (s1, d1), (s2, d2) = theirs[name], ours[name]
                return (f"stage {stage}'s parameter {name!r} is {d1} {s1} in the checkpoint, "
                        f"{d2} {s2} in this run")
    return None


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between the run set-up a checkpoint was saved by and this
    run's (`run_identity`), one phrase each; empty when they match."""
    found = []
    if (saved["schedule"], saved["fingerprint"]) != (current["schedule"], current["fingerprint"]):
        if saved["schedule"] != current["schedule"]:
            found.append(f"schedule: saved by {saved['schedule']!r} ({saved['schedule_file']}), "
                         f"this run is {current['schedule']!r} ({current['schedule_file']})")
        else:
            found.append(f"schedule {current['schedule']!r} compiled differently (fingerprint "
                         f"{saved['fingerprint'][:12]} in the checkpoint, "
                         f"{current['fingerprint'][:12]} now: other -D values or costs?)")
    if saved["placement"] != current["placement"]:
        found.append(f"stage placement: stage -> rank {saved['placement']} in the checkpoint, "
                     f"{current['placement']} in this run")
    if (saved["world_size"], saved["dp"]) != (current["world_size"], current["dp"]):
        found.append(f"world size: {saved['world_size']} ranks ({saved['dp']} data-parallel "
                     f"replicas) in the checkpoint, {current['world_size']} ranks "
                     f"({current['dp']} replicas) in this run; resuming with another --dp is "
                     "not supported")
    elif saved["dp_mode"] != current["dp_mode"]:
        found.append(f"--dp-mode: {saved['dp_mode']} in the checkpoint, {current['dp_mode']} "
                     "in this run")
    if saved["model"] != current["model"]:
        found.append(f"model: {saved['model']!r} in the checkpoint, {current['model']!r} in "
                     "this run")
    problem = _parameter_difference(saved["parameters"], current["parameters"])
    if problem is not None:
        found.append(f"model parameters: {problem}")
    return found


class Checkpointer:
    """The training loop's checkpoints under one directory: resume from the newest
    complete one, save in the background, keep the newest `keep`.

    Collective to construct (it makes the gloo process group its saves use, so
    a save in flight never shares a group with the step's own collectives).
    `identity` (`run_identity`) is written beside each checkpoint and checked
    at resume. `on_event(name, step)` is called at "save" (a save started) and
    "saved" (one made visible, on the coordinating rank)."""

    def __init__(
        self,
        directory: str | Path,
        runner: Any,
        optimizer: torch.optim.Optimizer,
        *,
        stepper: Any = None,
        scheduler: Any = None,
        identity: dict[str, Any] | None = None,
        keep: int | None = None,
        asynchronous: bool = True,
        on_event: Any = None,
    ) -> None:
        self.directory = Path(directory)
        self.runner = runner
        self.optimizer = optimizer
        self.stepper = stepper
        self.scheduler = scheduler
        self.identity = identity
        self.keep = keep
        self.asynchronous = asynchronous
        self.on_event = on_event or (lambda name, step: None)
        self.group = dist.new_group(backend="gloo")
        self.coordinator = dist.get_rank() == 0
        self._pending: tuple[Future[Any] | None, Path, Path, int] | None = None

    def resume(self, *, require: bool = False) -> tuple[int, Path] | None:
        """Restore the newest complete checkpoint: (steps done, its path), or None
        when there is none (an error with `require`). Clears what interrupted
        saves left. Raises CheckpointError when the checkpoint belongs to another
        run set-up, naming what differs. Collective."""
        if self.coordinator and self.directory.is_dir():
            for child in self.directory.iterdir():
                if child.name.startswith(_PARTIAL):
                    shutil.rmtree(child, ignore_errors=True)
        dist.barrier(group=self.group)
        found = latest_checkpoint(self.directory)
        if found is None:
            if require:
                raise CheckpointError(f"--resume: no complete checkpoint in "
                                      f"{str(self.directory)!r}")
            return None
        saved_identity = found / IDENTITY_FILE
        if self.identity is not None and saved_identity.is_file():
            differences = identity_differences(json.loads(saved_identity.read_text()),
                                               self.identity)
            if differences:
                raise CheckpointError(
                    f"cannot resume from {str(found)!r}: it was saved by another run set-up:\n"
                    + "\n".join(f"  - {d}" for d in differences)
                    + "\nresume with the set-up it was saved by, or give another "
                    "--checkpoint-dir to start afresh"
                )
        done = load_checkpoint(found, self.runner, self.optimizer, stepper=self.stepper,
                               scheduler=self.scheduler, process_group=self.group)
        return int(done["step"]), found

    def save(self, step: int, extra: Any = None, *, also: Any = None) -> None:
        """Save the state after `step` steps: the state is copied now, written in
        the background (or at once when not asynchronous). At most one save is in
        flight: an earlier one is finished first. `also(folder)`, when given, is
        called (collectively, before the state is saved) to write more into the
        checkpoint's folder, which appears with it."""
        self.wait()
        final = checkpoint_path(self.directory, step)
        partial = _partial_path(final)
        if also is not None:
            also(partial)
        state = _state(self.runner, self.optimizer, step=step, stepper=self.stepper,
                       scheduler=self.scheduler, extra=extra)
        if self.asynchronous:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
            self._pending = (future, partial, final, step)  # type: ignore[assignment]
            self.on_event("save", step)
        else:
            self._pending = (None, partial, final, step)
            self.on_event("save", step)
            dcp.save(state, checkpoint_id=str(partial), process_group=self.group)
            self.wait()

    def poll(self) -> None:
        """Finish a background save that has completed, without waiting."""
        if self._pending is not None and (self._pending[0] is None or self._pending[0].done()):
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight, if any, and make it visible."""
        if self._pending is None:
            return
        future, partial, final, step = self._pending
        self._pending = None
        if future is not None:
            future.result()  # a failed write raises here, on the rank that failed
        if not self.coordinator:
            return
        # The coordinator's save returns once every rank's part and .metadata are written.
        _commit(partial, final, self.identity)
        if self.keep is not None:
            for _, old in _complete(self.directory)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.on_event("saved", step)
