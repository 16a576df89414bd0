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
    "uncovered_in",
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

# Native node kinds, by the number B and W know them by.
_ADDMM, _MM, _LAYER_NORM, _EMBEDDING, _CONVOLUTION = range(5)
# For each kind, the input slots that may lead to a parameter W can compute.
_PARAM_SLOTS = {_ADDMM: (0, 2), _MM: (1,), _LAYER_NORM: (1, 2), _EMBEDDING: (0,), _CONVOLUTION: (1, 2)}


@dataclass(frozen=True)
class _Kinds:
    """Autograd node classes, found by building each op once (their Python names
    are torch internals; their identity is what matters)."""

    native: dict[type, int]
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
        layer_norm = F.layer_norm(x, (2,), w[0], w[1]).grad_fn
        embedding = F.embedding(torch.zeros(1, dtype=torch.long), w).grad_fn
        convolution = F.conv1d(x.view(1, 1, 2), w.view(2, 1, 2)).grad_fn
        native = {
            type(addmm): _ADDMM, type(mm): _MM, type(layer_norm): _LAYER_NORM,
            type(embedding): _EMBEDDING, type(convolution): _CONVOLUTION,
        }
        return _Kinds(
            native, type(addmm.next_functions[2][0]), type(w.to(torch.float64).grad_fn),
            type(view.next_functions[0][0]),
        )


@dataclass
class _Analysis:
    native: list[tuple[Any, int, list[tuple[int, bool, bool, torch.Tensor]]]]
    """Native nodes with at least one deferred slot: (node, kind, [(slot,
    transposed, cast, parameter)])."""
    user: list[Any]
    """Nodes of split-aware Functions."""
    eager: list[torch.Tensor]
    """Parameters the split does not cover: B computes their gradient."""
    forced: list[torch.Tensor]
    """Parameters of split-aware Functions. B asks for them too, which makes the
    Function's node run even where no input gradient passes through it; its
    backward defers what it defers and returns the rest (None when all of it)."""


_PLAIN, _USER = -1, -2
_ROLES: dict[type, int] = {}


def _roles(k: _Kinds) -> dict[type, int]:
    """Node class -> role: a native kind (>= 0), a split-aware Function, or plain."""
    if not _ROLES:
        _ROLES.update(k.native)
    return _ROLES


def _role_of(t: type) -> int:
    split = getattr(getattr(t, "_forward_cls", None), "_ppdsl_split_aware", False)
    return _USER if split else _PLAIN


def _claim_slots(
    node: Any, kind: int, nexts: tuple, k: _Kinds, claimed: dict[Any, set[tuple[int, int]]],
    uses: list,
) -> None:
    """Claim, edge by edge, the paths from a native node's parameter slots to the
    parameters (through at most one transpose and one cast) where W has the
    formula."""
    transpose, to_copy, acc_type = k.transpose, k.to_copy, k.accumulate
    count = len(nexts)
    for slot in _PARAM_SLOTS[kind]:
        if slot >= count:
            continue
        child = nexts[slot][0]
        if child is None:
            continue
        ct = type(child)
        if ct is acc_type:  # the common case: the parameter itself (a bias, a norm's weight)
            if kind == _EMBEDDING and node._saved_sparse:
                continue
            claimed.setdefault(child, set()).add((id(node), slot))
            uses.append((node, kind, slot, False, False, child))
            continue
        transposed = cast = False
        path = [(child, (id(node), slot))]
        while ct is transpose or ct is to_copy:
            if len(path) == 3:
                break
            if ct is transpose:
                transposed = not transposed
            else:
                cast = True
            parent = child
            child = child.next_functions[0][0]
            ct = type(child)
            path.append((child, (id(parent), 0)))
        if ct is not acc_type or (transposed and (kind not in (_ADDMM, _MM) or slot == 0)) or (
            kind == _EMBEDDING and node._saved_sparse
        ):
            continue  # not a formula W has: no claim
        for target, edge in path:
            claimed.setdefault(target, set()).add(edge)
        uses.append((node, kind, slot, transposed, cast, child))


def _analyse(roots: Sequence[Any]) -> _Analysis:
    """Walk the graph from `roots` (the outputs' nodes) once. A parameter is split
    when every edge into its accumulator, and into each transpose or cast on the
    way, is claimed by a path from a native node's parameter slot (or by a
    split-aware Function)."""
    k = _kinds()
    acc_type = k.accumulate
    adapters = {k.transpose, k.to_copy}
    leafish = adapters | {acc_type}
    edges_in: dict[Any, int] = {}  # accumulators and adapters: edges into them
    claimed: dict[Any, set[tuple[int, int]]] = {}  # ... those claimed: (id(parent), slot)
    uses: list[tuple[Any, int, int, bool, bool, Any]] = []  # node, kind, slot, T, C, acc
    user: list[Any] = []
    user_accs: list[Any] = []
    accs: dict[Any, None] = {}  # accumulators, first seen first (stable results)
    stack = list(dict.fromkeys(roots))  # in order: stable results
    seen = set(stack)
    roles = _roles(k)
    pop, push, mark = stack.pop, stack.append, seen.add
    while stack:
        node = pop()
        t = type(node)
        role = roles.get(t)
        if role is None:
            role = roles[t] = _role_of(t)
        nexts = node.next_functions
        if role >= 0:
            _claim_slots(node, role, nexts, k, claimed, uses)
        elif role == _USER:
            user.append(node)
            for slot, (child, _) in enumerate(nexts):
                if child is not None and type(child) is acc_type:
                    claimed.setdefault(child, set()).add((id(node), slot))
                    user_accs.append(child)
        for child, _ in nexts:
            if child is None:
                continue
            ct = type(child)
            if ct in leafish:
                edges_in[child] = edges_in.get(child, 0) + 1
                if ct is acc_type:
                    if child not in accs:
                        accs[child] = None
                    continue
            if child not in seen:
                mark(child)
                push(child)
    bad: set[Any] = set()
    for node, count in edges_in.items():
        if len(claimed.get(node, ())) < count and node not in bad:
            # Some use of it is not split: so is nothing it leads to.
            while node is not None:
                bad.add(node)
                node = node.next_functions[0][0] if type(node) in adapters else None
    user_set = set(user_accs)
    eager: list[torch.Tensor] = []
    forced: list[torch.Tensor] = []
    covered: set[Any] = set()
    for acc in accs:
        if acc in bad:
            eager.append(acc.variable)
        elif acc in user_set:
            forced.append(acc.variable)
        else:
            covered.add(acc)
    by_node: dict[Any, list[tuple[int, bool, bool, torch.Tensor]]] = {}
    kinds: dict[Any, int] = {}
    for node, kind, slot, transposed, cast, acc in uses:
        if acc in covered:
            if node not in by_node:
                by_node[node] = []
                kinds[node] = kind
            by_node[node].append((slot, transposed, cast, acc.variable))
    native = [(node, kinds[node], found) for node, found in by_node.items()]
    return _Analysis(native, user, eager, forced)


def _padding_idx(value: int) -> int:
    # The saved padding index is an int64 read back unsigned: -1 comes back as 2**64 - 1.
    return value - 2**64 if value >= 2**63 else value


def _saved(node: Any, kind: int, slots: list[tuple[int, bool, bool, torch.Tensor]]) -> tuple[Any, ...]:
    """What W needs from the node, read now (B frees it)."""
    if kind == _ADDMM:
        weight = any(slot == 2 for slot, *_ in slots)
        return (node._saved_mat1 if weight else None, node._saved_alpha, node._saved_beta)
    if kind == _MM:
        return (node._saved_self, 1, 1)
    if kind == _LAYER_NORM:
        return (node._saved_input, node._saved_normalized_shape, node._saved_result1,
                node._saved_result2, node._saved_weight, node._saved_bias)
    if kind == _EMBEDDING:
        return (node._saved_indices, node._saved_weight_sym_argsize_0,
                _padding_idx(node._saved_padding_idx), node._saved_scale_grad_by_freq)
    return (node._saved_input, node._saved_weight, node._saved_bias_sym_sizes_opt,
            node._saved_stride, node._saved_padding, node._saved_dilation,
            node._saved_transposed, node._saved_output_padding, node._saved_groups)


def _activations(kind: int, saved: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """The activations among `saved` (what the meter counts as M_W)."""
    if kind in (_ADDMM, _MM):
        return (saved[0],) if saved[0] is not None else ()
    if kind == _LAYER_NORM:
        return (saved[0], saved[2], saved[3])
    return (saved[0],)


# The native backward ops by their overload: a direct call, not the packet's lookup.
_LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default
_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default


def _weight_grads(
    kind: int, saved: tuple[Any, ...], slots: list[tuple[int, bool, bool, torch.Tensor]],
    dy: torch.Tensor,
) -> None:
    """W for one native node: the weight half of its backward, into `.grad`."""
    if kind in (_ADDMM, _MM):
        x, alpha, beta = saved
        for slot, transposed, cast, param in slots:
            if slot == 0:  # addmm's `self`, e.g. nn.Linear's bias (broadcast over rows)
                g = dy if beta == 1 else dy * beta
                if g.dim() != param.dim() or g.shape != param.shape:
                    g = g.sum(0) if param.dim() == 1 and g.dim() == 2 else g.sum_to_size(param.shape)
                elif g is dy:
                    g = dy.clone()  # .grad must not alias the stashed output gradient
            else:  # d(mat2) = mat1^T dy; through weight.t(): dW = dy^T mat1
                g = dy.t().mm(x) if transposed else x.t().mm(dy)
                if alpha != 1:
                    g = g * alpha
            if cast:
                g = g.to(param.dtype)
            # the parameter requires grad (it has an accumulator) and g is fresh
            found_grad = param.grad
            if found_grad is None:
                param.grad = g
            else:
                found_grad.add_(g)
        return
    if kind == _LAYER_NORM:
        x, shape, mean, rstd, weight, bias = saved
        mask = [False, any(s[0] == 1 for s in slots), any(s[0] == 2 for s in slots)]
        found = _LAYER_NORM_BACKWARD(dy, x, shape, mean, rstd, weight, bias, mask)
    elif kind == _EMBEDDING:
        indices, rows, padding, by_freq = saved
        g = _EMBEDDING_BACKWARD(dy, indices, rows, padding, by_freq)
        found = (None, g)
    else:
        x, weight, bias_sizes, stride, padding_, dilation, transposed_, out_pad, groups = saved
        mask = [False, any(s[0] == 1 for s in slots), any(s[0] == 2 for s in slots)]
        found = _CONVOLUTION_BACKWARD(
            dy, x, weight, bias_sizes, stride, padding_, dilation, transposed_, out_pad, groups, mask
        )
    for slot, _transposed, _cast, param in slots:
        g = found[slot] if kind != _EMBEDDING else found[1]
        if g.shape != param.shape:  # a broadcast `self` reduced, as autograd's sum_to does
            g = g.sum_to_size(param.shape)
        accumulate_grad(param, g)


class _NativeW:
    """One native node's deferred weight gradients (a W stash entry)."""

    __slots__ = ("kind", "saved", "slots", "dy")

    def __init__(self, kind: int, saved: tuple[Any, ...],
                 slots: list[tuple[int, bool, bool, torch.Tensor]], dy: torch.Tensor) -> None:
        self.kind, self.saved, self.slots, self.dy = kind, saved, slots, dy

    def __call__(self) -> None:
        _weight_grads(self.kind, self.saved, self.slots, self.dy)


def backward_input(
    output: torch.Tensor | Sequence[torch.Tensor],
    grad_output: torch.Tensor | None | Sequence[torch.Tensor | None],
    input: torch.Tensor | Sequence[torch.Tensor] | None,
    stash: WStash,
    *,
    retain_graph: bool = False,
) -> Any:
    """B: backpropagate `grad_output` from `output`; return the gradient of `input`
    and leave every split parameter's weight-gradient work in `stash`. Parameters
    the split does not cover get their gradient now.

    `output` and `grad_output` are a tensor and its gradient (None for a scalar
    loss), or sequences of them (a stage returning several tensors); `input` is
    None (returns None), a tensor (returns its gradient) or a sequence (returns a
    list, None for an input nothing reaches)."""
    outputs = [output] if isinstance(output, torch.Tensor) else list(output)
    grads = [grad_output] if grad_output is None or isinstance(grad_output, torch.Tensor) \
        else list(grad_output)
    many = input is not None and not isinstance(input, torch.Tensor)
    wanted: list[torch.Tensor] = [] if input is None else [input] if not many else list(input)  # type: ignore[list-item]
    if not any(o.requires_grad for o in outputs):
        return [None] * len(wanted) if many else None
    plan = _analyse([o.grad_fn for o in outputs if o.grad_fn is not None])
    saved = [_saved(node, kind, slots) for node, kind, slots in plan.native]
    for node in plan.user:
        setattr(node, _STASH_ATTR, stash)
    asked = plan.eager + plan.forced
    edges = [GradientEdge(node, 0) for node, _, _ in plan.native]
    inputs: list[Any] = wanted + edges + asked
    if not inputs:
        return None
    found = torch.autograd.grad(
        outputs, inputs, grads, retain_graph=retain_graph, allow_unused=True
    )
    offset = len(wanted)
    for (_, kind, slots), kept, dy in zip(plan.native, saved, found[offset : offset + len(edges)],
                                          strict=True):
        if dy is not None:
            stash.add(_NativeW(kind, kept, slots, dy), _activations(kind, kept), (dy,))
    for param, grad in zip(asked, found[offset + len(edges) :], strict=True):
        if grad is not None:
            accumulate_grad(param, grad)
    if many:
        return list(found[:offset])
    return found[0] if input is not None else None


def uncovered_parameters(stage: nn.Module, example_input: torch.Tensor) -> list[str]:
    """Names of `stage`'s trainable parameters whose gradient B computes (not
    deferred to W), found from the graph of one forward on `example_input`."""
    with torch.enable_grad():
        x = example_input
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        out = stage(x)
    return uncovered_in(stage, [out])


def uncovered_in(stage: nn.Module, outputs: Sequence[torch.Tensor]) -> list[str]:
    """Names of `stage`'s trainable parameters whose gradient B computes, found
    from the graph its forward left in `outputs` (made with gradients enabled)."""
    roots = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    if not roots:
        return []
    plan = _analyse(roots)
    eager = {id(p) for p in plan.eager}
    return [name for name, p in stage.named_parameters() if id(p) in eager]
