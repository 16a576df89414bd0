"""`ppdsl.runtime.execution.autograd_access` against the installed torch: every private
piece of autograd the B/W split reads (docs/runtime.md, "The B/W split") is
pinned here by name, so a torch release that renames or changes one fails the
test of that accessor rather than training wrong."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from ppdsl.runtime.execution import autograd_access as access
from ppdsl.runtime.execution.split import defer, split_aware


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).requires_grad_()


def _close(got: object, want: object) -> None:
    got_ = (got,) if isinstance(got, torch.Tensor) else tuple(got)  # type: ignore[arg-type]
    want_ = (want,) if isinstance(want, torch.Tensor) else tuple(want)  # type: ignore[arg-type]
    assert len(got_) == len(want_)
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got_, want_, strict=True))


def _node(out: torch.Tensor) -> object:
    assert out.grad_fn is not None
    return out.grad_fn


# How a user's model makes each native node the split knows (not how node_classes
# builds them): the class found must be the one these leave.
_MADE_BY = {
    "addmm": (access.ADDMM, lambda: nn.Linear(4, 3)(_leaf(2, 4))),
    "mm": (access.MM, lambda: nn.Linear(4, 3, bias=False)(_leaf(2, 4))),
    "layer_norm": (access.LAYER_NORM, lambda: nn.LayerNorm(4)(_leaf(2, 4))),
    "embedding": (access.EMBEDDING, lambda: nn.Embedding(5, 4)(torch.tensor([1, 3]))),
    "convolution": (access.CONVOLUTION, lambda: nn.Conv2d(2, 3, 3)(_leaf(1, 2, 5, 5))),
}


@pytest.mark.parametrize("op", sorted(_MADE_BY))
def test_node_classes_are_the_classes_modules_leave(op: str) -> None:
    """`node_classes().native` maps the node an nn module leaves to its kind."""
    kind, make = _MADE_BY[op]
    assert access.node_classes().native[type(_node(make()))] == kind


def test_adapter_and_accumulator_classes() -> None:
    """`node_classes()` names weight.t()'s node, a cast's node and a leaf's
    accumulator, whose `variable` is the parameter."""
    classes = access.node_classes()
    w = _leaf(3, 4)
    t = _node(w.t())
    assert type(t) is classes.transpose
    assert type(_node(w.to(torch.bfloat16))) is classes.to_copy
    acc = t.next_functions[0][0]  # type: ignore[attr-defined]
    assert type(acc) is classes.accumulate and acc.variable is w
    assert classes.embedding in classes.native


def test_addmm_saved_input_and_scalars() -> None:
    """`linear_input[ADDMM]` reads addmm's mat1 (the layer's input), and
    `addmm_scalars` its (alpha, beta)."""
    x, w, b = _leaf(2, 4), _leaf(3, 4), _leaf(3)
    node = _node(torch.addmm(b, x, w.t(), beta=2, alpha=3))
    assert torch.equal(access.linear_input[access.ADDMM](node), x)
    assert access.addmm_scalars(node) == (3, 2)
    saved = access.read_saved(node, access.ADDMM)
    assert torch.equal(saved.mat1, x) and (saved.alpha, saved.beta) == (3, 2)
    assert access.read_saved(node, access.ADDMM, weight=False).activations() == ()


def test_mm_saved_input() -> None:
    """`linear_input[MM]` reads mm's self (a bias-free linear's input)."""
    x, w = _leaf(2, 4), _leaf(3, 4)
    node = _node(x.mm(w.t()))
    assert torch.equal(access.linear_input[access.MM](node), x)
    saved = access.read_saved(node, access.MM)
    assert torch.equal(saved.mat1, x) and (saved.alpha, saved.beta) == (1, 1)


def test_layer_norm_saved_and_weight_half() -> None:
    """`read_saved` reads a layer norm's input, shape, mean, rstd, weight and bias;
    `layer_norm_backward` on them gives autograd's weight and bias gradients."""
    x, w, b = _leaf(2, 4), _leaf(4), _leaf(4)
    y = F.layer_norm(x, (4,), w, b, eps=1e-5)
    saved = access.read_saved(_node(y), access.LAYER_NORM)
    assert isinstance(saved, access.LayerNormSaved)
    assert torch.equal(saved.input, x) and list(saved.normalized_shape) == [4]
    mean = x.detach().mean(-1, keepdim=True)
    rstd = (x.detach().var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    _close(saved.mean, mean)
    _close(saved.rstd, rstd)
    assert saved.weight is w and saved.bias is b
    assert [t.data_ptr() for t in saved.activations()] == [
        t.data_ptr() for t in (saved.input, saved.mean, saved.rstd)]
    dy = torch.randn(2, 4)
    _, dw, db = access.layer_norm_backward(dy, saved, [False, True, True])
    want = torch.autograd.grad(y, (w, b), dy)
    _close((dw, db), want)


@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_embedding_saved_and_weight_half(padding_idx: int | None) -> None:
    """`read_saved` reads an embedding's indices, table size, padding index (-1
    read back signed) and frequency scaling; `embedding_is_sparse` its sparse
    flag; `embedding_backward` gives autograd's table gradient."""
    table = _leaf(5, 4)
    ids = torch.tensor([[1, 2], [4, 1]])
    y = F.embedding(ids, table, padding_idx=padding_idx, scale_grad_by_freq=True)
    node = _node(y)
    saved = access.read_saved(node, access.EMBEDDING)
    assert isinstance(saved, access.EmbeddingSaved)
    assert torch.equal(saved.indices, ids) and saved.num_weights == 5
    assert saved.padding_idx == (-1 if padding_idx is None else padding_idx % 5
                                 if padding_idx >= 0 else padding_idx + 5)
    assert saved.scale_grad_by_freq is True and access.embedding_is_sparse(node) is False
    assert access.embedding_is_sparse(_node(F.embedding(ids, table, sparse=True))) is True
    dy = torch.randn(2, 2, 4)
    _close(access.embedding_backward(dy, saved),
                               torch.autograd.grad(y, table, dy)[0])


def test_convolution_saved_and_weight_half() -> None:
    """`read_saved` reads a convolution's input, weight, bias sizes and
    geometry; `convolution_backward` gives autograd's weight and bias
    gradients."""
    x, w, b = _leaf(1, 4, 7, 7), _leaf(6, 2, 3, 3), _leaf(6)
    y = F.conv2d(x, w, b, stride=2, padding=1, dilation=1, groups=2)
    saved = access.read_saved(_node(y), access.CONVOLUTION)
    assert isinstance(saved, access.ConvolutionSaved)
    assert torch.equal(saved.input, x) and torch.equal(saved.weight, w)
    assert list(saved.bias_sizes) == [6] and list(saved.stride) == [2, 2]
    assert list(saved.padding) == [1, 1] and list(saved.dilation) == [1, 1]
    assert saved.transposed is False and list(saved.output_padding) == [0, 0]
    assert saved.groups == 2
    dy = torch.randn(y.shape)
    _, dw, db = access.convolution_backward(dy, saved, [False, True, True])
    _close((dw, db), torch.autograd.grad(y, (w, b), dy))


def test_gradient_edge_equals_torchs() -> None:
    """`gradient_edge(node)` is the edge torch's own `get_gradient_edge` makes
    for the node's output, and `engine_grad` captures the gradient there."""
    x, w = _leaf(2, 4), _leaf(3, 4)
    h = x.mm(w.t())
    y = (h * h).sum()
    edge = access.gradient_edge(_node(h))
    assert isinstance(edge, GradientEdge) and edge == get_gradient_edge(h)
    assert len(edge) == len(GradientEdge._fields)
    (dh,) = access.engine_grad([y], [None], [edge], retain_graph=True)
    _close(dh, 2 * h.detach())


@pytest.mark.parametrize("fallback", [False, True])
def test_engine_grad_equals_autograd_grad(fallback: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`engine_grad` returns what `torch.autograd.grad(..., allow_unused=True)`
    does, by the engine's entry point (and by `grad` without it), None for an
    input nothing reaches."""
    if fallback:
        monkeypatch.setattr(access, "_ENGINE", None)
    else:
        assert access._ENGINE is not None  # the entry point this torch has
    x, w, unused = _leaf(2, 4), _leaf(3, 4), _leaf(3)
    y = torch.tanh(x @ w.t())
    dy = torch.randn(2, 3)
    dx, dw, none = access.engine_grad([y], [dy], [x, w, unused], retain_graph=True)
    want = torch.autograd.grad(y, (x, w), dy)
    _close((dx, dw), want)
    assert none is None and x.grad is None and w.grad is None  # nothing accumulated


@split_aware
class _Gain(torch.autograd.Function):
    """y = x * gain, its gain's gradient deferred."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, gain)  # type: ignore[attr-defined]
        return x * gain

    @staticmethod
    def backward(ctx: object, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, gain = ctx.saved_tensors  # type: ignore[attr-defined]
        defer(ctx, lambda: None, (x,), (dy,))
        return dy * gain, None


class _Plain(torch.autograd.Function):
    """y = 2x, not split-aware."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    @staticmethod
    def backward(ctx: object, dy: torch.Tensor) -> torch.Tensor:
        return 2 * dy


_CLASSES: dict[str, tuple[Callable[[], torch.Tensor], type | None]] = {
    "split-aware Function": (lambda: _Gain.apply(_leaf(3), _leaf(3)), _Gain),
    "plain Function": (lambda: _Plain.apply(_leaf(3)), _Plain),
    "native node": (lambda: _leaf(3) * 2, None),
}


@pytest.mark.parametrize("name", sorted(_CLASSES))
def test_node_class_predicates(name: str) -> None:
    """`function_of` names the Function a node class runs the backward of (None
    for a native node); `is_compiled_region` is true of none of these (a compiled
    region's node: test_runtime_split's compiled-regions test)."""
    make, function = _CLASSES[name]
    node_class = type(_node(make()))
    assert access.function_of(node_class) is function
    assert access.is_compiled_region(node_class) is False


def test_foreach_add_adds_in_place() -> None:
    """`foreach_add_` adds a list of tensors into another, in place."""
    into = [torch.ones(2), torch.zeros(3)]
    access.foreach_add_(into, [torch.full((2,), 2.0), torch.ones(3)])
    assert into[0].tolist() == [3.0, 3.0] and into[1].tolist() == [1.0, 1.0, 1.0]


def test_version_counts_in_place_writes_only() -> None:
    """`version` (Tensor._version, what post-validation compares) rises with each
    in-place write, including a gradient's accumulation, and not with a read."""
    g = torch.ones(3)
    before = access.version(g)
    _ = g.sum() + g * 2
    assert access.version(g) == before
    g.add_(1.0)
    assert access.version(g) == before + 1
    w = torch.ones(2, requires_grad=True)
    (w * 2).sum().backward()
    first = access.version(w.grad)
    (w * 3).sum().backward()
    assert access.version(w.grad) > first


def test_foreach_mul_and_norm() -> None:
    """`foreach_mul_` scales in place; `foreach_norm` gives each tensor's 2-norm."""
    xs = [torch.full((2,), 3.0), torch.full((1,), 4.0)]
    access.foreach_mul_(xs, 0.5)
    assert torch.equal(xs[0], torch.full((2,), 1.5)) and torch.equal(xs[1], torch.full((1,), 2.0))
    norms = access.foreach_norm([torch.tensor([3.0, 4.0]), torch.tensor([1.0])], 2.0)
    assert [float(n) for n in norms] == [5.0, 1.0]


def test_own_buffers_are_the_modules_own() -> None:
    """`own_buffers` lists the module's registered buffers, not its children's,
    and leaves out a buffer set to None."""
    norm = nn.BatchNorm1d(2)
    outer = nn.Sequential(norm)
    outer.register_buffer("step", torch.zeros(()))
    outer.register_buffer("unset", None)
    assert [name for name, _ in access.own_buffers(outer)] == ["step"]
    assert {name for name, _ in access.own_buffers(norm)} == {
        "running_mean", "running_var", "num_batches_tracked"}
