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
directory `step-00000012` under the checkpoint directory; `latest_checkpoint`
finds the newest complete one (torch writes `.metadata` last).
"""

from __future__ import annotations

import pickle
import random
import re
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

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path",
           "CheckpointError"]

_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that does not fit this run."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """Where the checkpoint after `step` steps lives."""
    return Path(directory) / f"step-{step:08d}"


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under `directory`, or None."""
    found = []
    root = Path(directory)
    if not root.is_dir():
        return None
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and (child / ".metadata").is_file():
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


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
    picklable to restore with it (e.g. a data loader's position)."""
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
    path = Path(path)
    dcp.save(state, checkpoint_id=str(path), process_group=process_group)
    return path


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
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot load the checkpoint {str(path)!r}: {first[:300]}") from exc
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
