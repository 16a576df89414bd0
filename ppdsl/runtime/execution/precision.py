"""Mixed precision: autocast for the forward, fp16's loss scaling with
torch.amp.GradScaler's semantics (the decision taken once for the whole
pipeline), and parameters kept in a lower dtype with fp32 master weights.

Under fp16 the last stage multiplies the loss by the scale, so every gradient in
the pipeline is scaled; each rank unscales its own gradients before the
optimizer step (`ppdsl.runtime.training.optim.OptimizerStep`), and whether any gradient on
any rank is inf or NaN is one all-reduced flag: every rank skips the step, or
none does, and every rank updates the scale the same way (halve it on a skip,
double it after `growth_interval` clean steps). bf16 needs no scaling.

Parameter dtype (`--param-dtype bf16`), FSDP2's MixedPrecisionPolicy semantics
without FSDP: the stages' parameters are bf16, so the forward and backward
compute in bf16 and the gradients arrive in bf16; `MasterWeights` keeps an fp32
copy of every such parameter, which is what the optimizer holds (so its state,
Adam's moments, is fp32 too). Before a step the bf16 gradients are copied into
the masters' fp32 `.grad`; after it the masters are rounded back into the bf16
parameters. Under `--dp-mode shard` FSDP2 does the same itself: its shards stay
fp32 (the masters) and a gathered stage is bf16 (`param_dtype`). Autocast
(`--precision`) is a separate layer on top: it decides the dtype of each op's
inputs inside the forward, whatever the parameters are stored in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ppdsl.runtime.choices import PRECISIONS
from ppdsl.runtime.execution import autograd_access as access

__all__ = ["PRECISIONS", "autocast_dtype", "dtype_of", "cast_parameters", "MasterWeights",
           "LossScaler"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision (None for fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a `--param-dtype` / `--reduce-dtype` value."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, not {name!r}")
    return _DTYPES[name]


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Store `module`'s floating-point parameters in `dtype`, in place (the same
    Parameter objects; buffers, such as rotary frequencies, are left as they
    are, as FSDP2's MixedPrecisionPolicy leaves them)."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


class MasterWeights:
    """fp32 master copies of the parameters stored in a lower dtype (module
    docstring). `parameters()` is what the optimizer takes: the master of each
    low-precision parameter, the parameter itself where it is fp32 already."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        """(the model's low-precision parameter, its fp32 master)."""
        self._master: dict[int, nn.Parameter] = {}
        for p in params:
            if p.is_floating_point() and p.dtype != torch.float32:
                master = nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                self.pairs.append((p, master))
                self._master[id(p)] = master

    def of(self, param: nn.Parameter) -> nn.Parameter:
        """What the optimizer steps for the model's `param` (its master, or itself)."""
        return self._master.get(id(param), param)

    def parameters(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """`params` with each low-precision one replaced by its master."""
        return [self.of(p) for p in params]

    @torch.no_grad()
    def take_gradients(self) -> None:
        """The model's gradients, in fp32, on the masters (None stays None); the
        model's own are dropped (the next step's are new tensors)."""
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def copy_back(self) -> None:
        """The masters' values rounded into the model's parameters."""
        for p, master in self.pairs:
            p.copy_(master)


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
