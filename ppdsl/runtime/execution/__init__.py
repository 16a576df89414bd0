"""One rank running a compiled step (docs/runtime.md): the plan's passes in order,
their transfers, the B/W split, the memory meter, mixed precision, data-parallel
lanes. `PipelineRunner` is the face; the engine, transport and split below it are
reached through it."""

from __future__ import annotations

from ppdsl.runtime._lazy import lazy_getattr

__all__ = ["load_schedule", "CompiledPipeline", "PipelineRunner", "ScheduleError", "Hooks",
           "StepResult", "LossScaler", "torch_schedule"]

__getattr__ = lazy_getattr(__name__, {
    "load_schedule": "pipeline",
    "CompiledPipeline": "pipeline",
    "PipelineRunner": "pipeline",
    "ScheduleError": "pipeline",
    "Hooks": "engine",
    "StepResult": "engine",
    "LossScaler": "precision",
    "torch_schedule": "torch_bridge",
})
