"""The B/W split, done the way the zero-bubble paper does it: per layer.

For a layer y = x W^T + b the input gradient needs only W (dx = dy W), while the
weight gradient needs the layer's input and output gradient (dW = dy^T x). So B
computes every input gradient of the stage and keeps, per layer, its output
gradient dy and the input x it saved; the autograd graph and every other saved
activation are freed at the end of B. W later turns (x, dy) into dW and frees it.

How, without touching the forward. The stage's forward is the plain module's,
kernel for kernel: nothing is wrapped, so it costs what it costs and saves what it
saves. `backward_input` (B) walks the autograd graph the forward left and finds
the nodes of the layers it can split: ``addmm``/``mm`` (nn.Linear, F.linear, any
matmul with a parameter), native layer norm, embedding and convolution. It then
runs ONE ``torch.autograd.grad`` asking for the stage input's gradient and, as
extra outputs, the gradient arriving at each of those nodes (a ``GradientEdge``
capture). The autograd engine computes only what that needs, so the nodes run
with their weight outputs masked off (``native_layer_norm_backward`` and
``convolution_backward`` with an output mask, addmm without its weight matmul).
The captured dy and the tensors the node saved (addmm's ``mat1``, layer norm's
input, mean and rstd, convolution's input, embedding's indices) go into the
microbatch's `WStash`; W runs the weight half of the same native backward on them.

Nothing here depends on which thread runs what: B hands everything to the stash
it is given, and on CUDA (where autograd runs nodes on a device worker thread) the
engine returns the captured gradients to the caller as on CPU.

A parameter is split only when *every* use of it in the graph is such a node (or a
split-aware Function, below). Any other parameter with a gradient gets it during B
from plain autograd (correct, not deferred); `uncovered_parameters` names them so
the runtime can say so before training. Frozen parameters (``requires_grad=False``)
have no edge in the graph and never get a gradient.

Your own layer: write it as a ``torch.autograd.Function`` decorated with
`split_aware` whose backward returns the input gradient and hands the weight
gradient to `defer` (docs/runtime.md shows one). B gives the Function's ctx the
stash; in a fused backward, or outside the runtime, `defer` runs the work at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge

__all__ = [
    "WStash",
    "backward_input",
    "split_aware",
    "defer",
    "accumulate_grad",
    "uncovered_parameters",
]


class WStash:
    """The weight-gradient work a B left for its W.

    `tensors` are the layer inputs it holds (counted as the microbatch's retained
    activation, M_W); `gradients` are the layer output gradients (gradient buffers,
    not activations, so outside the memory model: the meter reports their bytes
    apart). `graph` is set when the runtime keeps the whole autograd graph of the
    microbatch-stage until W (`--release w`): every saved activation stays alive
    until `run` drops it."""

    def __init__(self) -> None:
        self.work: list[Callable[[], None]] = []
        self.tensors: list[torch.Tensor] = []
        self.gradients: list[torch.Tensor] = []
        self.graph: torch.Tensor | None = None

    def add(
        self,
        fn: Callable[[], None],
        activations: Sequence[torch.Tensor] = (),
        gradients: Sequence[torch.Tensor] = (),
    ) -> None:
        """Defer `fn` (it accumulates weight gradients) until `run`; it holds
        `activations` and `gradients` alive meanwhile (what the meter counts)."""
        self.work.append(fn)
        self.tensors.extend(activations)
        self.gradients.extend(gradients)

    def run(self) -> None:
        """W: run the deferred work in order, then free everything."""
        for fn in self.work:
            fn()
        self.work.clear()
        self.tensors.clear()
        self.gradients.clear()
        self.graph = None


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` into `param.grad` as autograd would (nothing for a frozen
    parameter, one that does not require grad)."""
    if not param.requires_grad:
        return
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad if grad.is_contiguous() else grad.contiguous()
    else:
        param.grad.add_(grad)


# --- user layers -------------------------------------------------------------------

_FunctionType = TypeVar("_FunctionType", bound=type)
_STASH_ATTR = "_ppdsl_w_stash"


def split_aware(function: _FunctionType) -> _FunctionType:
    """Mark a ``torch.autograd.Function`` whose backward hands its weight gradient
    to `defer`. Its parameters count as split (pass them to ``apply`` so autograd
    records them); B gives each of its nodes the microbatch's stash."""
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise TypeError("split_aware decorates a torch.autograd.Function subclass")
    function._ppdsl_split_aware = True  # type: ignore[attr-defined]
    return function


def defer(
    ctx: Any,
    fn: Callable[[], None],
    activations: Sequence[torch.Tensor] = (),
    gradients: Sequence[torch.Tensor] = (),
) -> None:
    """From a `split_aware` Function's backward: run `fn` (which accumulates weight
    gradients, e.g. with `accumulate_grad`) in W, holding `activations` (the
    tensors it reads, counted as M_W) and `gradients` until then. In a fused
    backward, or outside the runtime, `fn` runs now."""
    stash = getattr(ctx, _STASH_ATTR, None)
    if stash is None:
        fn()
    else:
        stash.add(fn, activations, gradients)


# --- the graph's split-able nodes ----------------------------------------------------


@dataclass(frozen=True)
class _Kinds:
    """Autograd node classes, found by building each op once (their Python names
    are torch internals; their identity is what matters)."""

    addmm: type
    mm: type
    layer_norm: type
    embedding: type
    convolution: type
    transpose: type
    to_copy: type
    accumulate: type


@cache
def _kinds() -> _Kinds:
    with torch.enable_grad():
        w = torch.zeros(2, 2, requires_grad=True)
        x = torch.zeros(1, 2, requires_grad=True)
        addmm = torch.addmm(torch.zeros(2, requires_grad=True), x, w.t()).grad_fn
        mm = x.mm(w.t()).grad_fn
        view = w.view(4).grad_fn
        assert addmm is not None and mm is not None and view is not None
        transpose = addmm.next_functions[2][0]
        layer_norm = F.layer_norm(x, (2,), w[0], w[1]).grad_fn
        embedding = F.embedding(torch.zeros(1, dtype=torch.long), w).grad_fn
        convolution = F.conv1d(x.view(1, 1, 2), w.view(2, 1, 2)).grad_fn
        to_copy = w.to(torch.float64).grad_fn
        return _Kinds(
            type(addmm), type(mm), type(layer_norm), type(embedding), type(convolution),
            type(transpose), type(to_copy), type(view.next_functions[0][0]),
        )


# For each native node kind, the input slots that may lead to a parameter whose
# gradient W can compute, and the adapter chains allowed on the way (T: a
# transpose, as nn.Linear's weight.t(); C: a dtype cast, as autocast's).
_SLOTS = {"addmm": (0, 2), "mm": (1,), "layer_norm": (1, 2), "embedding": (0,), "convolution": (1, 2)}


@dataclass
class _Use:
    """A native node's slot that leads, through adapters, to a parameter."""

    node: Any
    kind: str
    slot: int
    adapters: tuple[str, ...]
    param: torch.Tensor


@dataclass
class _Analysis:
    native: list[tuple[Any, str, list[_Use]]]
    """Native nodes with at least one deferred slot, with those slots."""
    user: list[Any]
    """Nodes of split-aware Functions."""
    eager: list[torch.Tensor]
    """Parameters the split does not cover: B computes their gradient."""
    forced: list[torch.Tensor]
    """Parameters of split-aware Functions. B asks for them too, which makes the
    Function's node run even where no input gradient passes through it; its
    backward defers what it defers and returns the rest (None when all of it)."""


def _analyse(root: Any) -> _Analysis:
    """Walk the graph from `root` once, find each parameter's uses, and decide."""
    k = _kinds()
    native_types = {k.addmm: "addmm", k.mm: "mm", k.layer_norm: "layer_norm",
                    k.embedding: "embedding", k.convolution: "convolution"}
    adapters = {k.transpose: "T", k.to_copy: "C"}
    # parents[child] = [(consumer, slot)] for accumulate and adapter nodes only
    parents: dict[Any, list[tuple[Any, int]]] = {}
    order: list[Any] = []  # accumulate nodes in first-seen order (stable results)
    natives: list[tuple[Any, str]] = []
    user: list[Any] = []
    seen = {root}
    stack = [root]
    acc_type = k.accumulate
    while stack:
        node = stack.pop()
        t = type(node)
        kind = native_types.get(t)
        if kind is not None:
            natives.append((node, kind))
        elif getattr(getattr(t, "_forward_cls", None), "_ppdsl_split_aware", False):
            user.append(node)
        for slot, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            ct = type(child)
            if ct is acc_type or ct in adapters:
                found = parents.get(child)
                if found is None:
                    parents[child] = found = []
                    if ct is acc_type:
                        order.append(child)
                found.append((node, slot))
            if child not in seen:
                seen.add(child)
                if ct is not acc_type:
                    stack.append(child)
    user_ids = {id(u) for u in user}
    native_kind = {id(n): kind for n, kind in natives}

    def chains(child: Any, path: tuple[str, ...]) -> list[tuple[Any, int, tuple[str, ...]]] | None:
        """Every (native node, slot, adapters) reaching `child`; None if any
        consumer on the way is neither a split-able slot nor an adapter."""
        found: list[tuple[Any, int, tuple[str, ...]]] = []
        for consumer, slot in parents[child]:
            ct = type(consumer)
            if ct in adapters:
                more = chains(consumer, (adapters[ct], *path))
                if more is None:
                    return None
                found += more
            elif id(consumer) in user_ids:
                found.append((consumer, -1, path))
            elif slot in _SLOTS.get(native_kind.get(id(consumer), ""), ()):
                found.append((consumer, slot, path))
            else:
                return None
        return found

    uses: dict[int, list[_Use]] = {}
    eager: list[torch.Tensor] = []
    forced: list[torch.Tensor] = []
    for acc in order:
        param = acc.variable
        reached = chains(acc, ())
        if reached is None or not all(
            slot == -1 or _supported(native_kind[id(n)], slot, path, n)
            for n, slot, path in reached
        ):
            eager.append(param)
            continue
        if any(slot == -1 for _, slot, _ in reached):
            forced.append(param)
            continue
        for n, slot, path in reached:
            uses.setdefault(id(n), []).append(_Use(n, native_kind[id(n)], slot, path, param))
    native = [(n, kind, uses[id(n)]) for n, kind in natives if id(n) in uses]
    return _Analysis(native, user, eager, forced)


def _supported(kind: str, slot: int, path: tuple[str, ...], node: Any) -> bool:
    """Whether W knows the weight-gradient formula for this slot and adapter chain."""
    if path.count("T") > 1 or any(a not in ("T", "C") for a in path):
        return False
    if kind == "addmm":
        return (slot == 2) or (slot == 0 and "T" not in path)
    if kind == "mm":
        return True
    if kind == "embedding":
        return not node._saved_sparse and "T" not in path
    return "T" not in path  # layer_norm, convolution


def _padding_idx(value: int) -> int:
    # The saved padding index is an int64 read back unsigned: -1 comes back as 2**64 - 1.
    return value - 2**64 if value >= 2**63 else value


def _native_work(node: Any, kind: str, uses: list[_Use]) -> tuple[Callable[[torch.Tensor], None], list[torch.Tensor]]:
    """(work(dy) accumulating the slots' weight gradients, activations it keeps).
    Saved tensors are read now: B frees them."""
    slots = {u.slot for u in uses}

    def finish(use: _Use, grad: torch.Tensor) -> None:
        # Broadcast reduction before the cast, in the order autograd does them.
        if grad.shape != use.param.shape:
            grad = grad.sum_to_size(use.param.shape)
        accumulate_grad(use.param, grad)  # casts to the parameter's dtype

    if kind in ("addmm", "mm"):
        x = node._saved_mat1 if kind == "addmm" else node._saved_self
        alpha = node._saved_alpha if kind == "addmm" else 1
        beta = node._saved_beta if kind == "addmm" else 1
        weight_slot = 2 if kind == "addmm" else 1

        def work(dy: torch.Tensor) -> None:
            for use in uses:
                if use.slot == weight_slot:
                    # d(mat2) = mat1^T dy; through weight.t(): dW = dy^T mat1
                    g = dy.t().mm(x) if "T" in use.adapters else x.t().mm(dy)
                    if alpha != 1:
                        g = g * alpha
                else:  # addmm's `self`, e.g. nn.Linear's bias
                    g = dy if beta == 1 else dy * beta
                finish(use, g)

        return work, [x] if weight_slot in slots else []
    if kind == "layer_norm":
        saved = (node._saved_input, node._saved_normalized_shape, node._saved_result1,
                 node._saved_result2, node._saved_weight, node._saved_bias)
        mask = [False, 1 in slots, 2 in slots]

        def work_layer_norm(dy: torch.Tensor) -> None:
            x, shape, mean, rstd, weight, bias = saved
            _, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
                dy, x, shape, mean, rstd, weight, bias, mask
            )
            for use in uses:
                finish(use, grad_weight if use.slot == 1 else grad_bias)

        return work_layer_norm, [saved[0], saved[2], saved[3]]
    if kind == "embedding":
        indices = node._saved_indices
        rows = node._saved_weight_sym_argsize_0
        padding = _padding_idx(node._saved_padding_idx)
        by_freq = node._saved_scale_grad_by_freq

        def work_embedding(dy: torch.Tensor) -> None:
            g = torch.ops.aten.embedding_dense_backward(dy, indices, rows, padding, by_freq)
            for use in uses:
                finish(use, g)

        return work_embedding, [indices]
    assert kind == "convolution"
    conv = (node._saved_input, node._saved_weight, node._saved_bias_sym_sizes_opt,
            node._saved_stride, node._saved_padding, node._saved_dilation,
            node._saved_transposed, node._saved_output_padding, node._saved_groups)
    mask = [False, 1 in slots, 2 in slots]

    def work_convolution(dy: torch.Tensor) -> None:
        x, weight, bias_sizes, stride, padding, dilation, transposed, out_pad, groups = conv
        _, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            dy, x, weight, bias_sizes, stride, padding, dilation, transposed, out_pad, groups, mask
        )
        for use in uses:
            finish(use, grad_weight if use.slot == 1 else grad_bias)

    return work_convolution, [conv[0]]


def backward_input(
    output: torch.Tensor,
    grad_output: torch.Tensor | None,
    input: torch.Tensor | None,
    stash: WStash,
    *,
    retain_graph: bool = False,
) -> torch.Tensor | None:
    """B: backpropagate `grad_output` from `output`; return the gradient of `input`
    (None when `input` is None) and leave every split parameter's weight-gradient
    work in `stash`. Parameters the split does not cover get their gradient now."""
    root = output.grad_fn
    if root is None:
        return None
    plan = _analyse(root)
    works: list[Callable[[torch.Tensor], None]] = []
    edges: list[GradientEdge] = []
    for node, kind, uses in plan.native:
        work, keep = _native_work(node, kind, uses)
        works.append(work)
        edges.append(GradientEdge(node, 0))
        stash.tensors.extend(keep)
    for node in plan.user:
        setattr(node, _STASH_ATTR, stash)
    asked = plan.eager + plan.forced
    inputs: list[Any] = ([input] if input is not None else []) + edges + asked
    if not inputs:
        return None
    found = torch.autograd.grad(
        output, inputs, grad_output, retain_graph=retain_graph, allow_unused=True
    )
    offset = 1 if input is not None else 0
    for work, dy in zip(works, found[offset : offset + len(edges)], strict=True):
        if dy is not None:
            stash.add(_bind(work, dy), (), (dy,))
    for param, grad in zip(asked, found[offset + len(edges) :], strict=True):
        if grad is not None:
            accumulate_grad(param, grad)
    return found[0] if input is not None else None


def _bind(work: Callable[[torch.Tensor], None], dy: torch.Tensor) -> Callable[[], None]:
    return lambda: work(dy)


def uncovered_parameters(stage: nn.Module, example_input: torch.Tensor) -> list[str]:
    """Names of `stage`'s trainable parameters whose gradient B computes (not
    deferred to W), found from the graph of one forward on `example_input`."""
    with torch.enable_grad():
        x = example_input
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        out = stage(x)
        if out.grad_fn is None:
            return []
        plan = _analyse(out.grad_fn)
    eager = {id(p) for p in plan.eager}
    return [name for name, p in stage.named_parameters() if id(p) in eager]
