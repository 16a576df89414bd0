"""The loop `ppdsl run` executes (docs/runtime.md, "ppdsl run"): start-up, steps,
the optimizer with post-validation, checkpoints, the closing tables, and the
options it takes. Importing this face does not import torch: `ppdsl run` declares
its options from it before torchrun starts."""

from __future__ import annotations

from ppdsl.runtime._lazy import lazy_getattr
from ppdsl.runtime.training.options import (
    add_training_options,
    check_training_options,
    training_argv,
)

__all__ = ["add_training_options", "check_training_options", "training_argv", "main",
           "OptimizerStep", "StepOutcome", "make_optimizer", "lr_lambda", "save_checkpoint",
           "load_checkpoint", "latest_checkpoint"]

__getattr__ = lazy_getattr(__name__, {
    "main": "train",
    "OptimizerStep": "optim",
    "StepOutcome": "optim",
    "make_optimizer": "optim",
    "lr_lambda": "optim",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "latest_checkpoint": "checkpoint",
})
