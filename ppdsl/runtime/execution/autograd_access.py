"""The private parts of torch the runtime reads, in one place: most of them are
autograd's, which the B/W split reads; the rest are the ``_foreach_*`` kernels the
optimizer step and loss scale use, a tensor's version counter (post-validation's
test that no gradient changed under it) and a module's own buffers.

The split (`split.py`) works on the graph a plain forward leaves. Most of what it
needs is public (``grad_fn``, ``next_functions``, an accumulator's ``variable``);
the rest is not: which class a native node has, the tensors a node saved
(``node._saved_mat1`` and the like, generated from torch's derivatives.yaml and
named after the op's arguments), the argument lists of the native backward ops
that compute a node's weight half, the autograd engine's entry point, and a
``GradientEdge`` built without its Python constructor. Each is here, named by
what it reads, and tests/runtime/execution/test_autograd_access.py pins each against the installed
torch: a torch release that renames one fails that test by name instead of
training silently wrong. Every name used exists in torch 2.11 and 2.13.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from operator import attrgetter
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge

__all__ = [
    "ADDMM", "MM", "LAYER_NORM", "EMBEDDING", "CONVOLUTION",
    "NodeClasses", "node_classes", "function_of", "is_compiled_region",
    "embedding_is_sparse", "linear_input", "addmm_scalars",
    "AddmmSaved", "LayerNormSaved", "EmbeddingSaved", "ConvolutionSaved", "read_saved",
    "layer_norm_backward", "embedding_backward", "convolution_backward",
    "gradient_edge", "engine_grad", "foreach_add_", "foreach_mul_", "foreach_norm",
    "version", "own_buffers",
]

# --- node classes ----------------------------------------------------------------------

# The native nodes the split knows, by the number B and W know them by.
ADDMM, MM, LAYER_NORM, EMBEDDING, CONVOLUTION = range(5)


@dataclass(frozen=True)
class NodeClasses:
    """Autograd node classes, found by building each op once (their Python names
    are torch internals; their identity is what matters)."""

    native: dict[type, int]
    """The split's native nodes' classes, to their kind (`ADDMM`, ...)."""
    transpose: type
    """``weight.t()``'s node (nn.Linear's weight reaches addmm through it)."""
    to_copy: type
    """``.to(dtype)``'s node (autocast's cast of a weight)."""
    accumulate: type
    """A leaf's accumulator (``AccumulateGrad``)."""
    embedding: type
    """nn.Embedding's node."""


@cache
def node_classes() -> NodeClasses:
    """The node classes of this torch (built once)."""
    with torch.enable_grad():
        w = torch.zeros(2, 2, requires_grad=True)
        x = torch.zeros(1, 2, requires_grad=True)
        addmm = torch.addmm(torch.zeros(2, requires_grad=True), x, w.t()).grad_fn
        mm = x.mm(w.t()).grad_fn
        view = w.view(4).grad_fn
        assert addmm is not None and mm is not None and view is not None
        layer_norm = F.layer_norm(x, (2,), w[0], w[1]).grad_fn
        embedding = F.embedding(torch.zeros(1, dtype=torch.long), w).grad_fn
        convolution = F.conv1d(x.view(1, 1, 2), w.view(2, 1, 2)).grad_fn
        native = {
            type(addmm): ADDMM, type(mm): MM, type(layer_norm): LAYER_NORM,
            type(embedding): EMBEDDING, type(convolution): CONVOLUTION,
        }
        return NodeClasses(
            native, type(addmm.next_functions[2][0]), type(w.to(torch.float64).grad_fn),
            type(view.next_functions[0][0]), type(embedding),
        )


def function_of(node_class: type) -> type | None:
    """The ``torch.autograd.Function`` whose backward nodes of `node_class` run
    (its node class names it as ``_forward_cls``); None for a native node."""
    return getattr(node_class, "_forward_cls", None)


def is_compiled_region(node_class: type) -> bool:
    """Whether nodes of `node_class` are a torch.compile'd region's backward
    (``CompiledFunctionBackward``: one node the split cannot look into)."""
    return node_class.__name__.startswith("CompiledFunction")


# --- what a node saved -----------------------------------------------------------------

embedding_is_sparse: Callable[[Any], bool] = attrgetter("_saved_sparse")
"""An embedding node's ``sparse`` flag (W has the dense formula only)."""

linear_input: dict[int, Callable[[Any], torch.Tensor]] = {
    ADDMM: attrgetter("_saved_mat1"), MM: attrgetter("_saved_self"),
}
"""By kind, reads a linear layer's saved input x (addmm's mat1, mm's self)."""

addmm_scalars: Callable[[Any], tuple[Any, Any]] = attrgetter("_saved_alpha", "_saved_beta")
"""Reads addmm's (alpha, beta)."""


class AddmmSaved(NamedTuple):
    """What W reads of an addmm or mm node (mm: alpha = beta = 1)."""

    mat1: torch.Tensor | None
    """The layer's input x (None when W computes no weight gradient)."""
    alpha: Any
    beta: Any

    def activations(self) -> tuple[torch.Tensor, ...]:
        """The activations among them (what the meter counts as M_W)."""
        return (self.mat1,) if self.mat1 is not None else ()


class LayerNormSaved(NamedTuple):
    """What ``native_layer_norm_backward`` reads."""

    input: torch.Tensor
    normalized_shape: Any
    mean: torch.Tensor
    rstd: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    def activations(self) -> tuple[torch.Tensor, ...]:
        """The activations among them (what the meter counts as M_W)."""
        return (self.input, self.mean, self.rstd)


class EmbeddingSaved(NamedTuple):
    """What ``embedding_dense_backward`` reads."""

    indices: torch.Tensor
    num_weights: Any
    padding_idx: int
    scale_grad_by_freq: bool

    def activations(self) -> tuple[torch.Tensor, ...]:
        """The activations among them (what the meter counts as M_W)."""
        return (self.indices,)


class ConvolutionSaved(NamedTuple):
    """What ``convolution_backward`` reads."""

    input: torch.Tensor
    weight: torch.Tensor
    bias_sizes: Any
    stride: Any
    padding: Any
    dilation: Any
    transposed: bool
    output_padding: Any
    groups: int

    def activations(self) -> tuple[torch.Tensor, ...]:
        """The activations among them (what the meter counts as M_W)."""
        return (self.input,)


def _padding_idx(value: int) -> int:
    # The saved padding index is an int64 read back unsigned: -1 comes back as 2**64 - 1.
    return value - 2**64 if value >= 2**63 else value


def read_saved(node: Any, kind: int, weight: bool = True) -> Any:
    """What W needs from a native `node` of `kind`, read while it is alive (B frees
    it). `weight`: an addmm's weight gets a gradient in W (else its input is not
    kept, only its bias's scalars)."""
    if kind == ADDMM:
        return AddmmSaved(node._saved_mat1 if weight else None, node._saved_alpha,
                          node._saved_beta)
    if kind == MM:
        return AddmmSaved(node._saved_self, 1, 1)
    if kind == LAYER_NORM:
        return LayerNormSaved(node._saved_input, node._saved_normalized_shape,
                              node._saved_result1, node._saved_result2, node._saved_weight,
                              node._saved_bias)
    if kind == EMBEDDING:
        return EmbeddingSaved(node._saved_indices, node._saved_weight_sym_argsize_0,
                              _padding_idx(node._saved_padding_idx),
                              node._saved_scale_grad_by_freq)
    return ConvolutionSaved(node._saved_input, node._saved_weight,
                            node._saved_bias_sym_sizes_opt, node._saved_stride,
                            node._saved_padding, node._saved_dilation, node._saved_transposed,
                            node._saved_output_padding, node._saved_groups)


# --- the native backward ops, weight half only ---------------------------------------

# By their overload: a direct call, not the packet's lookup.
_LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default
_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default


def layer_norm_backward(dy: torch.Tensor, s: LayerNormSaved, mask: list[bool]) -> Any:
    """(d input, d weight, d bias) of a layer norm, those `mask` asks for."""
    return _LAYER_NORM_BACKWARD(dy, s.input, s.normalized_shape, s.mean, s.rstd, s.weight,
                                s.bias, mask)


def embedding_backward(dy: torch.Tensor, s: EmbeddingSaved) -> torch.Tensor:
    """The gradient of an embedding's (dense) table."""
    return _EMBEDDING_BACKWARD(dy, s.indices, s.num_weights, s.padding_idx,
                               s.scale_grad_by_freq)  # type: ignore[no-any-return]


def convolution_backward(dy: torch.Tensor, s: ConvolutionSaved, mask: list[bool]) -> Any:
    """(d input, d weight, d bias) of a convolution, those `mask` asks for."""
    return _CONVOLUTION_BACKWARD(dy, s.input, s.weight, s.bias_sizes, s.stride, s.padding,
                                 s.dilation, s.transposed, s.output_padding, s.groups, mask)


# --- the engine ------------------------------------------------------------------------

# GradientEdge's fields after (node, output_nr), at their defaults (2.13 adds
# `ownership_token`, which only a Python Function's edge needs).
_EDGE_DEFAULTS = tuple(GradientEdge._field_defaults.values())


def gradient_edge(node: Any) -> GradientEdge:
    """``GradientEdge(node, 0)``: the gradient arriving at `node` (its only input),
    as a capture for `engine_grad`, built without a Python call."""
    return tuple.__new__(GradientEdge, (node, 0, *_EDGE_DEFAULTS))


# The autograd engine's entry point, as torch.autograd.grad calls it.
_ENGINE = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)

# On CUDA, autograd's device thread makes its first cuBLAS call before any CUDA
# context is current on that thread; torch then sets the primary context (the
# one every other thread uses) and warns. Harmless, and once per rank: not the
# user's to see (seen with torch 2.11 on an H100, `make gpu-check`).
warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current "
                        "CUDA context", category=UserWarning)


def engine_grad(outputs: list[torch.Tensor], grads: list[torch.Tensor | None],
                inputs: list[Any], retain_graph: bool) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, allow_unused=True)``. For plain
    tensors and gradients of their shapes (the runtime's case) it calls the engine
    as `grad` does, without `grad`'s argument checks in Python (about 6 us a call,
    measured on CPU); anything else goes through `grad` itself, checks and all."""
    if _ENGINE is not None:
        given: list[torch.Tensor] = []
        for out, grad in zip(outputs, grads, strict=True):
            if type(out) is not torch.Tensor:
                break
            if grad is None:
                if out.numel() != 1 or not out.is_floating_point():
                    break
                given.append(torch.ones_like(out, memory_format=torch.preserve_format))
            elif (type(grad) is torch.Tensor and grad.shape == out.shape
                  and grad.is_complex() == out.is_complex()):
                given.append(grad)
            else:
                break
        else:
            return _ENGINE.run_backward(  # type: ignore[no-any-return]
                tuple(outputs), tuple(given), retain_graph, False, tuple(inputs), True, False
            )
    return torch.autograd.grad(
        outputs, inputs, grads, retain_graph=retain_graph, allow_unused=True
    )


# --- beyond autograd ---------------------------------------------------------------

foreach_add_ = torch._foreach_add_
"""``torch._foreach_add_``: adds a list of tensors into another, one call."""

foreach_mul_ = torch._foreach_mul_
"""``torch._foreach_mul_``: scales a list of tensors in place, one call."""

foreach_norm = torch._foreach_norm
"""``torch._foreach_norm(tensors, ord)``: each tensor's norm, one call."""


def version(tensor: torch.Tensor) -> int:
    """``tensor._version``: the counter every in-place write bumps (reads do not)."""
    return int(tensor._version)


def own_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module._buffers``: the buffers `module` itself registered (not its
    children's), by name; a buffer set to None is left out."""
    return [(name, buf) for name, buf in module._buffers.items() if buf is not None]
