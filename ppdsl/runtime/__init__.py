"""The runtime: ppdsl as a library in your own training loop, and what generated
rank programs call (transfers, the B/W split, memory measurement, start-up
checks; docs/runtime.md).

    from ppdsl.runtime import load_schedule, PipelineRunner, OptimizerStep

The names below are imported on first use, so that `import ppdsl.runtime.options`
(what `ppdsl run` reads its options with) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ppdsl.runtime.model import PipelineModel, split_layers

__all__ = [
    "PipelineModel",
    "split_layers",
    "load_schedule",
    "CompiledPipeline",
    "PipelineRunner",
    "ScheduleError",
    "Hooks",
    "OptimizerStep",
    "StepOutcome",
    "make_optimizer",
    "lr_lambda",
    "LossScaler",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "torch_schedule",
]

_LAZY = {
    "load_schedule": "pipeline",
    "CompiledPipeline": "pipeline",
    "PipelineRunner": "pipeline",
    "ScheduleError": "pipeline",
    "Hooks": "engine",
    "OptimizerStep": "optim",
    "StepOutcome": "optim",
    "make_optimizer": "optim",
    "lr_lambda": "optim",
    "LossScaler": "precision",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "torch_schedule": "torch_bridge",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ppdsl.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ppdsl.runtime.{module}"), name)
