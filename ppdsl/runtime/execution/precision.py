"""Mixed precision: autocast for the forward, and fp16's loss scaling with
torch.amp.GradScaler's semantics, the decision taken once for the whole pipeline.

Under fp16 the last stage multiplies the loss by the scale, so every gradient in
the pipeline is scaled; each rank unscales its own gradients before the
optimizer step (`ppdsl.runtime.training.optim.OptimizerStep`), and whether any gradient on
any rank is inf or NaN is one all-reduced flag: every rank skips the step, or
none does, and every rank updates the scale the same way (halve it on a skip,
double it after `growth_interval` clean steps). bf16 needs no scaling.
"""

from __future__ import annotations

from typing import Any

import torch

from ppdsl.runtime.execution import autograd_access as access

__all__ = ["PRECISIONS", "autocast_dtype", "LossScaler"]

PRECISIONS = ("fp32", "bf16", "fp16")
"""The precisions `--precision` offers."""


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision (None for fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


class LossScaler:
    """A dynamic loss scale (GradScaler's defaults); `update` takes the global
    found-inf decision, so all ranks keep the same scale."""

    def __init__(
        self,
        device: torch.device,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        """The current scale (a tensor on the device, read by the last stage's F)."""
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0
        """Clean steps since the scale last changed."""

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide `grads` by the scale, in place."""
        if grads:
            access.foreach_mul_(grads, 1.0 / float(self.scale))

    def update(self, found_inf: bool) -> None:
        """After a step: halve the scale if any rank found inf/NaN, else count a
        clean step and double it every `growth_interval` of them."""
        if found_inf:
            self.scale.mul_(self.backoff_factor)
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale.mul_(self.growth_factor)
                self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps."""
        return {"scale": float(self.scale), "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s values."""
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker = int(state["growth_tracker"])
