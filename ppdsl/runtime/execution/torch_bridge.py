"""The other way round: a ppdsl schedule run by torch.distributed.pipelining's own
runtime, for code built on torch's schedules (torchtitan and the like).

`torch_schedule` wraps this rank's stage modules in torch's `PipelineStage`s and
builds torch's `_PipelineScheduleRuntime` from the compiled per-rank orders: the
action lists ppdsl writes (`0F1`, `0I1` = B, `0W1`, `0B1` = a fused backward,
torch's own letters, `ppdsl.interchange`), handed to torch's lowering, which
infers the stage -> rank map from where the actions sit and adds its own
send/receive actions; or the exported CSV (`ppdsl export FILE --format
torch-csv`) through torch's `_load_csv`. From then on it is torch's schedule:
`schedule.step(inputs, target=targets)` on the rank holding stage 0,
`schedule.step(target=targets)` on the one holding the last stage, `step()`
elsewhere; the loss is torch's (`loss_fn` per microbatch, gradients scaled by
1/m), the B/W split is torch's (its `I` keeps the graph until `W`).

torch's classes used here are internal (a leading underscore); they exist from
torch 2.6 on (the GPU machines run 2.11, this suite 2.13).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["torch_schedule"]


def torch_schedule(
    schedule: Any,
    stages: Mapping[int, nn.Module],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    csv: str | Path | None = None,
) -> Any:
    """torch's `_PipelineScheduleRuntime` running `schedule` (a
    `ppdsl.runtime.execution.pipeline.CompiledPipeline`) on this rank's `stages` ({stage:
    module}; every stage this rank holds). `csv`: load the orders from that
    exported file with torch's `_load_csv` instead of from `schedule`."""
    try:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime
    except ImportError as exc:  # torch before 2.6
        raise RuntimeError(
            f"torch {torch.__version__} has no _PipelineScheduleRuntime (torch 2.6 or later "
            "runs a schedule from action lists)"
        ) from exc
    if schedule.plan.memory.recompute:
        raise ValueError(
            "this schedule recomputes stages (R passes); torch.distributed.pipelining has no "
            "recompute action: run it with ppdsl's own runtime (PipelineRunner)"
        )
    if schedule.plan.lanes > 1:
        raise ValueError(
            f"schedule {schedule.plan.name!r} runs {schedule.plan.lanes} pipelines (a "
            "bidirectional placement); torch's runtime runs one: use PipelineRunner"
        )
    rank = dist.get_rank(group)
    mine = schedule.stages_of(rank)
    missing = [s for s in mine if s not in stages]
    if missing:
        raise ValueError(f"rank {rank} holds stages {list(mine)}; no module given for {missing}")
    device = torch.device(device)
    wrapped = [
        PipelineStage(stages[s].to(device), s, schedule.num_stages, device, group=group)
        for s in mine
    ]
    runtime = _PipelineScheduleRuntime(wrapped, schedule.num_microbatches, loss_fn=loss_fn)
    if csv is not None:
        runtime._load_csv(str(csv))
    else:
        actions = {r: [_Action.from_str(a) for a in row]
                   for r, row in enumerate(schedule.torch_actions())}
        runtime._prepare_schedule_with_comms(actions)
    return runtime
