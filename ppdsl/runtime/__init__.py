"""The runtime: ppdsl as a library in your own training loop, and what generated
rank programs call (transfers, the B/W split, memory measurement, start-up
checks; docs/runtime.md).

    from ppdsl.runtime import load_schedule, PipelineRunner, OptimizerStep

The names below are imported on first use, so that `import ppdsl.runtime.training.options`
(what `ppdsl run` reads its options with) does not import torch.
"""

from __future__ import annotations

from ppdsl.runtime._lazy import lazy_getattr
from ppdsl.runtime.models.model import PipelineModel, split_layers

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
    "split",
    "split_aware",
    "defer",
]

_LAZY = {
    "load_schedule": "execution.pipeline",
    "CompiledPipeline": "execution.pipeline",
    "PipelineRunner": "execution.pipeline",
    "ScheduleError": "execution.pipeline",
    "Hooks": "execution.engine",
    "OptimizerStep": "training.optim",
    "StepOutcome": "training.optim",
    "make_optimizer": "training.optim",
    "lr_lambda": "training.optim",
    "LossScaler": "execution.precision",
    "save_checkpoint": "training.checkpoint",
    "load_checkpoint": "training.checkpoint",
    "latest_checkpoint": "training.checkpoint",
    "torch_schedule": "execution.torch_bridge",
    "split": "execution.split",
    "split_aware": "execution.split",
    "defer": "execution.split",
}


__getattr__ = lazy_getattr(__name__, _LAZY)
