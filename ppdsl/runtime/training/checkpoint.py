"""Checkpoints with torch.distributed.checkpoint: save a pipeline's training state
and resume it, under the same layout bit for bit as if never interrupted, or
under another one (cut, pipeline degree, schedule, replica count) resharded.

What is kept, each rank writing its own part (`dcp.save`, collective), keyed by
the model's own names (`model_names`: a transformers stage's whole-model name,
e.g. `model.layers.3.mlp.up_proj.weight`; a factory model's `stage{k}.{name}`,
k its model stage), so that the keys do not depend on where a tensor sits:

- `model.{name}`: every parameter and persistent buffer (a parameter kept in
  bf16: its fp32 master, what the optimizer steps); a DP replica, a tied
  parameter's second owner or a bidirectional placement's second copy writes
  the same key with the same value, saved once;
- `optim.{name}.{key}`: the optimizer's state of that parameter (Adam's
  `exp_avg`, `exp_avg_sq`, `step`; SGD's `momentum_buffer`);
- `ppdsl.process{rank}`, per process one pickled record: the step counter, the
  data position (anything the caller passes as `extra`), the optimizer's
  hyper-parameters, the LR scheduler's and the `OptimizerStep`'s state (fp16's
  loss scale) and the RNG states (torch CPU and CUDA, Python's `random`).

A resume asks DCP for the keys of this rank's tensors; its planner reads them
from whichever ranks wrote them, in whatever shards, so the same checkpoint
loads into any other cut, degree, schedule (ZB-V's V placement, DualPipe's
copies) or replica count (`--dp`, `--dp-mode`). A process the old run did not
have takes process 0's record (its RNG stream then differs from an
uninterrupted run's; the weights and optimizer state do not). Checkpoints of
the earlier format (keyed by stage, `process{rank}` records) are refused with a
message saying so.

A post-validated step still pending is resolved before saving. A checkpoint is a
directory `step-00000012` under the checkpoint directory. It is written under a
temporary name (`.partial-step-00000012`) and renamed by the coordinating rank
once every rank's part and torch's `.metadata` are on disk, so a save killed at
any point never looks complete; `latest_checkpoint` finds the newest complete
one and `Checkpointer.resume` clears the partial ones.

`Checkpointer` is what the training loop uses: saves that run in the background
(`torch.distributed.checkpoint.async_save` on a gloo group of their own: the
state is copied before the step goes on, then written while it trains), kept to
the newest K, and a resume that checks the checkpoint against the run
(`run_identity`, written as `ppdsl.json`: the layout, stages -> ranks ->
names, and the model's architecture and every tensor's shape). What the model
cannot survive (another architecture, a name or shape the other lacks) is
refused, each difference named; a layout change is resharded and described
(`Checkpointer.resharded`: "resharded from d=4 one_f_one_b to d=2 zb_v: N
tensors moved").
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ppdsl.runtime.errors import first_line
from ppdsl.runtime.execution.group import agree, gather

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path",
           "CheckpointError", "Checkpointer", "run_identity", "identity_differences",
           "model_names", "resharding"]

_STEP_DIR = re.compile(r"step-(\d+)")
_PARTIAL = ".partial-"
# What a ppdsl run writes beside torch's files: the run set-up it was made by.
IDENTITY_FILE = "ppdsl.json"
# The per-process record's key prefix (this format), and the earlier format's key.
_RECORD = "ppdsl.process"
_OLD_RECORD = re.compile(r"process\d+")
# ppdsl.json's format: 2 keys checkpoints by the model's own names
_FORMAT = 2


def _dcp():
    """torch.distributed.checkpoint, imported on first use: it brings DTensor and
    its planners (about a second of every rank's start-up on a small CPU), which a
    run that neither saves nor resumes never needs."""
    import torch.distributed.checkpoint as dcp

    return dcp


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


def _model_name(module: nn.Module, model_stage: int, name: str) -> str:
    """The model's own name of `module`'s tensor `name`: the whole model's (a
    stage that maps its names, `hf_name`), else `stage{model_stage}.{name}`."""
    mapped = getattr(module, "hf_name", None)
    if callable(mapped):
        try:
            return str(mapped(name))
        except (KeyError, ValueError):  # a tensor of the stage's own (not the model's)
            pass
    return f"stage{model_stage}.{name}"


def model_names(runner: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers by the model's own names
    (module docstring); a tensor two local stages share (a tie, a copy) under
    each of its names."""
    found: dict[str, torch.Tensor] = {}
    for s, module in sorted(runner.stages.items()):
        k = runner.plan.model_stage(s)
        for name, tensor in module.state_dict(keep_vars=True).items():
            found.setdefault(_model_name(module, k, name), tensor)
    return found


def _saved_tensors(runner: Any, master: Any) -> dict[str, torch.Tensor]:
    """What `model.{name}` holds: each tensor by name, a bf16 parameter's fp32
    master in its place."""
    return {name: (master.of(t) if master is not None and isinstance(t, nn.Parameter)
                   else t).detach()
            for name, t in model_names(runner).items()}


def _optimized(runner: Any, optimizer: torch.optim.Optimizer,
               master: Any) -> dict[str, torch.Tensor]:
    """{model name: the tensor the optimizer steps for it} for the parameters it holds."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    found = {}
    for name, t in model_names(runner).items():
        if isinstance(t, nn.Parameter):
            q = master.of(t) if master is not None else t
            if id(q) in held:
                found[name] = q
    return found


def _master(stepper: Any) -> Any:
    return getattr(stepper, "master", None) if stepper is not None else None


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
    _dcp().save(_state(runner, optimizer, step=step, stepper=stepper, scheduler=scheduler,
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
    master = _master(stepper)
    record = {
        "step": step,
        "extra": extra,
        "hyper": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "stepper": stepper.state_dict() if stepper is not None else None,
        "rng": _rng_state(),
    }
    state: dict[str, Any] = {f"model.{name}": t for name, t in _saved_tensors(runner, master).items()}
    for name, q in _optimized(runner, optimizer, master).items():
        for key, value in optimizer.state.get(q, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"optim.{name}.{key}"] = value
    state[f"{_RECORD}{dist.get_rank()}"] = pickle.dumps(record)
    return state


def _metadata(path: str | Path) -> dict[str, Any]:
    """{key: torch's storage metadata} of the checkpoint at `path`."""
    return dict(_dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _format_problem(path: str | Path, keys: dict[str, Any]) -> str | None:
    """Why the checkpoint's format cannot be loaded, or None."""
    if any(_OLD_RECORD.fullmatch(key) for key in keys):
        return (f"the checkpoint {str(path)!r} was written by an earlier ppdsl, which keyed "
                "checkpoints by stage; this one keys them by the model's own names and cannot "
                "read it: resume it with the ppdsl that wrote it, or give another "
                "--checkpoint-dir to start afresh")
    if not any(key.startswith(_RECORD) for key in keys):
        return f"{str(path)!r} is not a ppdsl checkpoint (it has no {_RECORD}N records)"
    return None


def _shape_problems(keys: dict[str, Any], tensors: dict[str, torch.Tensor],
                    limit: int = 8) -> str | None:
    """What this rank's tensors need that the checkpoint lacks or holds in
    another shape, every one named (up to `limit`, then a count)."""
    found = []
    for name, t in sorted(tensors.items()):
        saved = keys.get(f"model.{name}")
        if saved is None or not hasattr(saved, "size"):
            found.append(f"{name} is not in the checkpoint")
        elif list(saved.size) != list(t.shape):
            found.append(f"{name} is {list(saved.size)} in the checkpoint, {list(t.shape)} "
                         "in this run")
    if not found:
        return None
    shown = found[:limit] + ([f"and {len(found) - limit} more"] if len(found) > limit else [])
    return "the model does not match the checkpoint:\n" + "\n".join(f"  - {f}" for f in shown)


def _state_slot(optimizer: torch.optim.Optimizer, q: torch.Tensor, key: str,
                saved: Any) -> torch.Tensor:
    """The optimizer's state tensor `key` of `q`, made (zeros, as the saved one is
    shaped) when the optimizer has not stepped yet."""
    state = optimizer.state.setdefault(q, {})
    slot = state.get(key)
    if isinstance(slot, torch.Tensor):
        return slot
    dtype = saved.properties.dtype
    if list(saved.size) == list(q.shape) and q.dim() > 0:
        slot = torch.zeros_like(q, dtype=dtype)  # laid out as the parameter (a shard: a DTensor)
    else:  # a scalar such as Adam's step, which torch keeps on the CPU
        slot = torch.zeros(list(saved.size), dtype=dtype)
    state[key] = slot
    return slot


def load_checkpoint(
    path: str | Path,
    runner: Any,
    optimizer: torch.optim.Optimizer,
    *,
    stepper: Any = None,
    scheduler: Any = None,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Restore what `save_checkpoint` wrote into the runner's stages (whatever
    layout saved it), the optimizer, the stepper and scheduler and the RNGs;
    returns {"step": steps done, "extra": what was saved with it}. Collective;
    raises CheckpointError (on every rank) when the checkpoint's format is an
    earlier one or the model's tensors are not all in it in the same shapes."""
    try:
        keys = _metadata(path)
    except Exception as exc:
        raise CheckpointError(f"cannot read the checkpoint {str(path)!r}: "
                              f"{first_line(exc, 300)}") from exc
    master = _master(stepper)
    tensors = _saved_tensors(runner, master)
    problem = agree(_format_problem(path, keys) or _shape_problems(keys, tensors), process_group)
    if problem is not None:
        raise CheckpointError(problem)
    state: dict[str, Any] = {f"model.{name}": t for name, t in tensors.items()}
    for name, q in _optimized(runner, optimizer, master).items():
        prefix = f"optim.{name}."
        for key, saved in keys.items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                state[key] = _state_slot(optimizer, q, key[len(prefix):], saved)
    mine = f"{_RECORD}{dist.get_rank()}"
    record_key = mine if mine in keys else f"{_RECORD}0"
    state[record_key] = b""
    try:
        _dcp().load(state, checkpoint_id=str(path), process_group=process_group)
    except Exception as exc:
        raise CheckpointError(f"cannot load the checkpoint {str(path)!r}: {first_line(exc, 300)}") from exc
    record = pickle.loads(state[record_key])
    if master is not None:
        master.copy_back()
    for group, hyper in zip(optimizer.param_groups, record["hyper"], strict=False):
        group.update(hyper)
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
    architecture: str | None = None,
    cut: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The run a checkpoint belongs to (what `ppdsl.json` records): its layout
    (schedule, pipeline degree, cut, replicas, and per stage its rank, model
    stage and tensor names) and its model (the factory, the architecture:
    `model` unless given, and every tensor's shape by the model's own name),
    gathered from all ranks: collective."""
    mine = {str(s): {"rank": runner.rank, "model_stage": plan.model_stage(s), "names": []}
            for s in sorted(runner.stages)}
    shapes: dict[str, list[int]] = {}
    for s, module in sorted(runner.stages.items()):
        k = plan.model_stage(s)
        for name, t in module.state_dict(keep_vars=True).items():
            whole = _model_name(module, k, name)
            mine[str(s)]["names"].append(whole)
            shapes[whole] = list(t.shape)
    stages: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    for their_stages, their_shapes in gather((mine, shapes)):
        stages.update(their_stages)
        tensors.update(their_shapes)
    return {
        "format": _FORMAT,
        "schedule": plan.name,
        "schedule_file": plan.file,
        "fingerprint": plan.fingerprint,
        "placement": list(plan.stage_device),
        "pipeline_ranks": plan.num_devices,
        "world_size": world_size,
        "dp": dp,
        "dp_mode": dp_mode if dp > 1 else None,
        "cut": list(cut) if cut else None,
        "model": model,
        "architecture": architecture or model,
        "stages": dict(sorted(stages.items(), key=lambda kv: int(kv[0]))),
        "tensors": dict(sorted(tensors.items())),
    }


def _named(items: list[str], limit: int = 8) -> list[str]:
    return items[:limit] + ([f"and {len(items) - limit} more"] if len(items) > limit else [])


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What the model cannot survive between the run a checkpoint was saved by
    and this run's (`run_identity`): another architecture, a tensor one of them
    lacks, another shape; one phrase each (a long list cut at 8 per kind, with
    a count). Empty when the model matches; a layout change is no difference
    (`resharding` describes it)."""
    if saved.get("format") != _FORMAT:
        return ["format: the checkpoint was written by an earlier ppdsl, which keyed "
                "checkpoints by stage; this one keys them by the model's own names and cannot "
                "read it (resume it with the ppdsl that wrote it)"]
    found = []
    if saved["architecture"] != current["architecture"]:
        found.append(f"architecture: {saved['architecture']!r} in the checkpoint, "
                     f"{current['architecture']!r} in this run")
    theirs, ours = saved["tensors"], current["tensors"]
    found += _named([f"tensor {n!r} is in the checkpoint, not in this run's model"
                     for n in sorted(set(theirs) - set(ours))])
    found += _named([f"tensor {n!r} of this run's model is not in the checkpoint"
                     for n in sorted(set(ours) - set(theirs))])
    found += _named([f"tensor {n!r} is {theirs[n]} in the checkpoint, {ours[n]} in this run"
                     for n in sorted(set(theirs) & set(ours)) if theirs[n] != ours[n]])
    return found


def _layout_phrase(identity: dict[str, Any]) -> str:
    """`d=4 one_f_one_b cut 0,2,4,5 x 2 shard replicas`: a layout in words."""
    cut = identity.get("cut")
    return (f"d={identity['pipeline_ranks']} {identity['schedule']}"
            + (f" cut {','.join(str(c) for c in cut)}" if cut else "")
            + (f" x {identity['dp']} {identity['dp_mode']} replicas" if identity["dp"] > 1 else ""))


def _owners(identity: dict[str, Any]) -> dict[str, set[int]]:
    """{tensor name: the pipeline ranks holding it}."""
    found: dict[str, set[int]] = {}
    for stage in identity["stages"].values():
        for name in stage["names"]:
            found.setdefault(name, set()).add(stage["rank"])
    return found


def resharding(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What a resume under another layout does, in words ("resharded from d=4
    one_f_one_b to d=2 zb_v: N tensors moved": moved = held by another set of
    pipeline ranks), or None when the layout is the same."""
    before, after = _owners(saved), _owners(current)
    moved = sum(before.get(n) != ranks for n, ranks in after.items())
    was, now = _layout_phrase(saved), _layout_phrase(current)
    if was == now and not moved:
        return None
    return f"resharded from {was} to {now}: {moved} tensor{'s' if moved != 1 else ''} moved"


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
        self.resharded: str | None = None
        """After `resume`: what was resharded, in words, when the checkpoint's
        layout differs from this run's (`resharding`), else None."""

    def resume(self, *, require: bool = False) -> tuple[int, Path] | None:
        """Restore the newest complete checkpoint: (steps done, its path), or None
        when there is none (an error with `require`), resharded when it was saved
        under another layout (`resharded` says how). Clears what interrupted
        saves left. Raises CheckpointError when the checkpoint's model differs
        from this run's, naming each difference. Collective."""
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
        self.resharded = None
        if self.identity is not None and saved_identity.is_file():
            saved = json.loads(saved_identity.read_text())
            differences = identity_differences(saved, self.identity)
            if differences:
                raise CheckpointError(
                    f"cannot resume from {str(found)!r}: its model differs from this run's:\n"
                    + "\n".join(f"  - {d}" for d in differences)
                    + "\nresume with the model it was saved by, or give another "
                    "--checkpoint-dir to start afresh"
                )
            self.resharded = resharding(saved, self.identity)
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
            future = _dcp().async_save(state, checkpoint_id=str(partial), process_group=self.group)
            self._pending = (future, partial, final, step)  # type: ignore[assignment]
            self.on_event("save", step)
        else:
            self._pending = (None, partial, final, step)
            self.on_event("save", step)
            _dcp().save(state, checkpoint_id=str(partial), process_group=self.group)
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
