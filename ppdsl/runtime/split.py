"""The B/W split, done the way the zero-bubble paper does it: per layer.

For a layer y = x W^T + b the input gradient needs only W (dx = dy W), while the
weight gradient needs the layer's input and output gradient (dW = dy^T x). So B
runs the ordinary autograd backward of the stage, in which every split-aware
layer computes dx only and leaves (x, dy) in the microbatch's *W stash*; the
autograd graph and every other saved activation are freed at the end of B. W
later turns the stash into dW (and frees it). In a fused backward (BW) the layers
compute dW on the spot.

`prepare_stage` makes a stage split-aware in place: nn.Linear, nn.Embedding and
nn.LayerNorm get a forward that goes through the custom autograd functions below.
A parameter of any other module gets its gradient during B from plain autograd
(still correct, but not deferred); `prepare_stage` returns their names so the
runtime can say so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WStash", "prepare_stage", "stash_scope"]


class WStash:
    """The weight-gradient work a B left for its W: closures, the layer inputs they
    hold (`tensors`: counted as the microbatch's retained activation, M_W) and the
    output gradients they hold (`gradients`: gradient buffers, not activations, so
    outside the memory model; the meter reports their bytes apart).

    `graph` is set when the runtime keeps the whole autograd graph of the
    microbatch-stage until W (`--release w`): every saved activation stays alive
    until `run` drops it."""

    def __init__(self) -> None:
        self.work: list[Callable[[], None]] = []
        self.tensors: list[torch.Tensor] = []
        self.gradients: list[torch.Tensor] = []
        self.graph: torch.Tensor | None = None

    def add(self, fn: Callable[[], None], activation: torch.Tensor, gradient: torch.Tensor) -> None:
        self.work.append(fn)
        self.tensors.append(activation)
        self.gradients.append(gradient)

    def run(self) -> None:
        for fn in self.work:
            fn()
        self.work.clear()
        self.tensors.clear()
        self.gradients.clear()
        self.graph = None


class _State(threading.local):
    def __init__(self) -> None:
        self.stash: WStash | None = None  # None: compute weight gradients on the spot


_state = _State()


class stash_scope:
    """Inside this context, split-aware layers running backward defer their weight
    gradients into `stash`; with `stash=None` they compute them immediately (fused)."""

    def __init__(self, stash: WStash | None) -> None:
        self.stash = stash

    def __enter__(self) -> WStash | None:
        self._previous = _state.stash
        _state.stash = self.stash
        return self.stash

    def __exit__(self, *exc: object) -> None:
        _state.stash = self._previous


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.detach().clone()
    else:
        param.grad.add_(grad)


def _defer(fn: Callable[[], None], activation: torch.Tensor, gradient: torch.Tensor) -> None:
    if _state.stash is None:
        fn()
    else:
        _state.stash.add(fn, activation, gradient)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        # Parameters ride on ctx, not in save_for_backward: they are not activations, and
        # a saved-tensor hook would hand back a different Python object than the Parameter.
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias
        out = x.matmul(weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None

        def weight_grad(x=x, grad_out=grad_out) -> None:
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            _accumulate(weight, g2.t().matmul(x.reshape(-1, x.shape[-1])))
            if bias is not None:
                _accumulate(bias, g2.sum(0))

        _defer(weight_grad, x, grad_out)
        return grad_x, None, None


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight

        def weight_grad(ids=ids, grad_out=grad_out) -> None:
            g = torch.zeros_like(weight)
            g.index_add_(0, ids.reshape(-1), grad_out.reshape(-1, weight.shape[1]))
            _accumulate(weight, g)

        _defer(weight_grad, ids, grad_out)
        return None, None


class _Affine(torch.autograd.Function):
    """y = x_hat * gamma + beta, the affine part of LayerNorm."""

    @staticmethod
    def forward(ctx: Any, x_hat: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor):
        ctx.save_for_backward(x_hat)
        ctx.gamma, ctx.beta = gamma, beta
        return x_hat * gamma + beta

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        (x_hat,) = ctx.saved_tensors
        gamma, beta = ctx.gamma, ctx.beta
        grad_x = grad_out * gamma

        def weight_grad(x_hat=x_hat, grad_out=grad_out) -> None:
            dims = tuple(range(grad_out.dim() - gamma.dim()))
            _accumulate(gamma, (grad_out * x_hat).sum(dims))
            _accumulate(beta, grad_out.sum(dims))

        _defer(weight_grad, x_hat, grad_out)
        return grad_x, None, None


def _linear_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _Linear.apply(x, module.weight, module.bias)

    return forward


def _embedding_forward(module: nn.Embedding) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(ids: torch.Tensor) -> torch.Tensor:
        return _Embedding.apply(ids, module.weight)

    return forward


def _layer_norm_forward(module: nn.LayerNorm) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        x_hat = F.layer_norm(x, module.normalized_shape, None, None, module.eps)
        return _Affine.apply(x_hat, module.weight, module.bias)

    return forward


def _plain_embedding(m: nn.Module) -> bool:
    return (
        type(m) is nn.Embedding
        and m.padding_idx is None
        and m.max_norm is None
        and not m.scale_grad_by_freq
        and not m.sparse
    )


def prepare_stage(stage: nn.Module) -> list[str]:
    """Route the stage's Linear, Embedding and affine LayerNorm layers through the
    split-aware functions. Returns the names of parameters that stay with plain
    autograd (their gradient is computed during B, not deferred to W)."""
    covered: set[int] = set()
    for module in stage.modules():
        forward: Callable[[torch.Tensor], torch.Tensor]
        if type(module) is nn.Linear:
            forward = _linear_forward(module)
        elif isinstance(module, nn.Embedding) and _plain_embedding(module):
            forward = _embedding_forward(module)
        elif (
            type(module) is nn.LayerNorm
            and module.elementwise_affine
            and module.bias is not None
        ):
            forward = _layer_norm_forward(module)
        else:
            continue
        # An instance attribute shadows the class's forward for this module only.
        object.__setattr__(module, "forward", forward)
        covered.update(id(p) for p in module.parameters(recurse=False))
    return [name for name, p in stage.named_parameters() if id(p) not in covered]
