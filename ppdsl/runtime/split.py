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
matmul with a parameter), embedding, convolution and native layer norm. It then
runs ONE autograd call asking for the stage input's gradient and, as extra
outputs, the gradient arriving at each of those nodes (a ``GradientEdge``
capture). The autograd engine computes only what that needs, so the nodes run
with their weight outputs masked off (addmm without its weight matmul,
``convolution_backward`` with an output mask, embedding not at all). The captured
dy and the tensors the node saved (addmm's ``mat1``, convolution's input,
embedding's indices) go into the microbatch's `WStash`; W runs the weight half of
the same native backward on them.

Layer norms (`norms`). By default B computes their weight and bias gradients, as
the zero-bubble paper's implementation does (it defers only the linear layers'):
a layer norm's weight gradient is small, and on CPU its native backward computes
it in the same pass over x and dy as the input gradient, so deferring it makes W
read both again (a 4096x1024 layer norm alone: B + W = 1.3 fused backwards).
W then keeps nothing of a layer norm, which is also the paper's M_W = 32sbh.
``norms="w"`` defers them too (``native_layer_norm_backward`` with an output
mask in B, its weight half in W, which keeps the norm's input, mean and rstd).

What it costs. The walk touches every node once (Python, about 0.4 us a node);
the analysis of what to split runs once per graph *shape*: a stage's graph has the
same signature every microbatch (`_walk`), and the plan found for it is reused,
checked node for node. B reads what W needs and W runs the linear layers' weight
gradients in bulk (C-level ``map`` over the layers, one ``_foreach_add_`` to
accumulate), so that B + W costs about what the fused backward does
(``python -m bench split``).

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

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from operator import attrgetter, is_, is_not, itemgetter
from typing import Any, TypeVar

import torch
from torch import nn

from ppdsl.runtime import autograd_access as access
from ppdsl.runtime.autograd_access import ADDMM, CONVOLUTION, EMBEDDING, LAYER_NORM, MM

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
        """W: run the deferred work in order, then free everything. It runs under
        ``torch.no_grad()`` whoever calls it: the stashed layer inputs come from
        autograd's saved tensors and require grad, so with grad mode on each
        weight gradient would get a ``grad_fn`` keeping the stash alive."""
        with torch.no_grad():  # weight gradients are values, not graphs
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
    _accumulate([param], [grad if grad.is_contiguous() else grad.contiguous()])


def _accumulate(params: list[torch.Tensor], grads: list[torch.Tensor], copy: bool = False) -> None:
    """The one place gradients go into `.grad`, as autograd's AccumulateGrad puts
    them: taken where none is (the first microbatch), else added, in one
    ``_foreach_add_`` when every parameter has one. Each parameter appears once.
    `copy`: a first gradient is copied, in the parameter's layout (as
    AccumulateGrad does when it cannot take the tensor), not taken: it may be the
    very tensor, or a view of one, that flows on to other nodes (an uncovered
    parameter's gradient from autograd, e.g. a stashed output gradient)."""
    found = list(map(_GRAD, params))
    if not copy:
        if all(map(is_, found, repeat(None))):
            deque(map(setattr, params, repeat("grad"), grads), maxlen=0)
            return
        if all(map(is_not, found, repeat(None))):
            access.foreach_add_(found, grads)
            return
    for param, had, grad in zip(params, found, grads, strict=True):
        if had is not None:
            had.add_(grad)
        elif copy:
            param.grad = torch.empty_like(param).copy_(grad)
        else:
            param.grad = grad


def _with_gradient(params: list[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters that got a gradient (not None), and those gradients."""
    if all(map(is_not, grads, repeat(None))):
        return params, list(grads)  # type: ignore[arg-type]
    kept = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
    return [p for p, _ in kept], [g for _, g in kept]


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

# For each native kind, the input slots that may lead to a parameter W can compute.
_PARAM_SLOTS = {ADDMM: (0, 2), MM: (1,), LAYER_NORM: (1, 2), EMBEDDING: (0,), CONVOLUTION: (1, 2)}


_PLAIN, _USER = -1, -2
_ROLES: dict[type, int] = {}


def _roles(k: access.NodeClasses) -> dict[type, int]:
    """Node class -> role: a native kind (>= 0), a split-aware Function, or plain."""
    if not _ROLES:
        _ROLES.update(k.native)
    return _ROLES


def _role_of(t: type) -> int:
    return _USER if access.is_split_aware(t) else _PLAIN


# --- walking the graph, once per graph shape ---------------------------------------


def _walk(roots: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Every node reachable from `roots` (the outputs' nodes), accumulators
    included, in the order first reached; and the graph's signature: the number of
    roots, then for each node in that order its class, the position of each of its
    next functions (-1 for none) and, for an embedding, its `sparse` flag (whether
    W has its formula). Two graphs with equal signatures are the same graph up to
    node identity (same classes, same edges, the same nodes shared), so what
    `_analyse` found for one holds for the other, position for position. Costs
    what touching every node once costs."""
    k = access.node_classes()
    acc_type, emb_type = k.accumulate, k.embedding
    order = list(dict.fromkeys(roots))
    index: dict[Any, int] = {node: at for at, node in enumerate(order)}
    index[None] = -1  # an input that needs no gradient
    signature: list[Any] = [len(order)]
    emit, reach, find = signature.append, order.append, index.get
    for node in order:  # grows while we go: a breadth-first walk
        t = type(node)
        emit(t)
        if t is acc_type:
            continue
        if t is emb_type:
            emit(bool(access.embedding_is_sparse(node)))
        for child, _ in node.next_functions:
            at = find(child)
            if at is None:
                at = index[child] = len(order)
                reach(child)
            emit(at)
    return order, signature


def _gather(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """seq -> (seq[p] for p in positions), in one C call."""
    if not positions:
        return lambda seq: ()
    if len(positions) == 1:
        (only,) = positions
        return lambda seq: (seq[only],)
    return itemgetter(*positions)


_VARIABLE = attrgetter("variable")  # an accumulator's parameter
_GRAD = attrgetter("grad")
_SHAPE = attrgetter("shape")


@dataclass(frozen=True)
class _Linears:
    """Linear layers' nodes of one form: ``addmm(bias, x, weight.t())`` (nn.Linear,
    F.linear), the same without a deferred bias, or ``mm(x, weight.t())`` (a
    linear without bias). W's formula is the same: dW = dy^T x, db = dy summed
    over rows."""

    count: int
    nodes: Callable[[Sequence[Any]], tuple[Any, ...]]
    """Gathers the nodes from `_walk`'s list."""
    weights: Callable[[Sequence[Any]], tuple[Any, ...]]
    """Gathers their weights' accumulators."""
    biases: Callable[[Sequence[Any]], tuple[Any, ...]] | None
    """Gathers their biases' accumulators (None: no bias W computes)."""
    input_of: Callable[[Any], torch.Tensor]
    """Reads the node's saved input x."""
    scalars_of: Callable[[Any], tuple[Any, Any]] | None
    """Reads addmm's (alpha, beta); W's short formula needs both 1."""
    distinct: bool
    """No parameter appears twice among their weights and biases (tied layers do):
    W may then accumulate them all in one go."""
    cast: bool = False
    """The weights (and biases) reach the layers through a cast (autocast's copy
    in bf16/fp16): W computes their gradients in that precision, as autograd's
    addmm backward does, and casts them to the parameters' dtype, as autograd's
    cast backward does."""


@dataclass(frozen=True)
class _Plan:
    """What B does with a graph of one signature, by node position (`_walk`)."""

    linear: tuple[_Linears, ...]
    """nn.Linear's nodes, the common case, which B and W handle in bulk."""
    native: tuple[tuple[int, int, tuple[tuple[int, bool, bool, int], ...]], ...]
    """Other native nodes with a deferred slot: (position, kind, ((slot,
    transposed, cast, accumulator position), ...))."""
    user: tuple[int, ...]
    """Nodes of split-aware Functions."""
    eager: tuple[int, ...]
    """Accumulators of parameters the split does not cover: B computes their
    gradient."""
    norms: Callable[[Sequence[Any]], tuple[Any, ...]]
    """Gathers the accumulators of layer norms' weights and biases that B computes
    (``norms="b"``): every use is a layer norm's, whose backward returns a fresh
    tensor."""
    forced: tuple[int, ...]
    """Accumulators B asks for besides: split-aware Functions' parameters (which
    makes the Function's node run even where no input gradient passes through it;
    its backward defers what it defers and returns the rest, None when all of it),
    and parameters a layer norm shares with another use under ``norms="b"``."""


# Plans by (norms, signature length), then signature. A stage's graph has the same
# shape every microbatch, so after its first B each later one walks the graph once
# (to read its signature) and skips the analysis. Plans hold classes and positions
# only (no node, tensor or parameter): a plan never keeps a model alive.
_PLANS: dict[tuple[bool, int], list[tuple[list[Any], _Plan]]] = {}
# Signature entries remembered in all (8 bytes each; about 3 per graph node): past
# this, all are forgotten (a model whose graphs never repeat) and found again.
_PLAN_BUDGET = 1 << 22
_plan_entries = 0


def _plan_for(roots: Sequence[Any], defer_norms: bool) -> tuple[list[Any], _Plan]:
    """The nodes of the graph behind `roots` and what B does with them (from the
    plan of an earlier graph of the same signature when there is one)."""
    global _plan_entries
    order, signature = _walk(roots)
    key = (defer_norms, len(signature))
    known = _PLANS.get(key)
    if known is not None:
        for other, plan in known:
            if other == signature:
                return order, plan
    plan = _analyse(order, defer_norms)
    if _plan_entries + len(signature) > _PLAN_BUDGET:
        _PLANS.clear()
        _plan_entries = 0
    _PLANS.setdefault(key, []).append((signature, plan))
    _plan_entries += len(signature)
    return order, plan


def _claim_slots(
    node: Any, kind: int, k: access.NodeClasses, claimed: dict[Any, set[tuple[int, int]]], uses: list,
) -> None:
    """Claim, edge by edge, the paths from a native node's parameter slots to the
    parameters (through at most one transpose and one cast) where W has the
    formula."""
    transpose, to_copy, acc_type = k.transpose, k.to_copy, k.accumulate
    nexts = node.next_functions
    count = len(nexts)
    for slot in _PARAM_SLOTS[kind]:
        if slot >= count:
            continue
        child = nexts[slot][0]
        if child is None:
            continue
        ct = type(child)
        if ct is acc_type:  # the common case: the parameter itself (a bias, a norm's weight)
            if kind == EMBEDDING and access.embedding_is_sparse(node):
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
        if ct is not acc_type or (transposed and (kind not in (ADDMM, MM) or slot == 0)) or (
            kind == EMBEDDING and access.embedding_is_sparse(node)
        ):
            continue  # not a formula W has: no claim
        for target, edge in path:
            claimed.setdefault(target, set()).add(edge)
        uses.append((node, kind, slot, transposed, cast, child))


def _analyse(order: list[Any], defer_norms: bool) -> _Plan:
    """Find, over the nodes `_walk` listed, what B splits. A parameter is split
    when every edge into its accumulator, and into each transpose or cast on the
    way, is claimed by a path from a native node's parameter slot (or by a
    split-aware Function). Unless `defer_norms`, a parameter that a layer norm
    uses gets its gradient in B."""
    k = access.node_classes()
    acc_type = k.accumulate
    adapters = {k.transpose, k.to_copy}
    leafish = adapters | {acc_type}
    position = {node: at for at, node in enumerate(order)}
    edges_in: dict[Any, int] = {}  # accumulators and adapters: edges into them
    claimed: dict[Any, set[tuple[int, int]]] = {}  # ... those claimed: (id(parent), slot)
    uses: list[tuple[Any, int, int, bool, bool, Any]] = []  # node, kind, slot, T, C, acc
    user: list[Any] = []
    user_accs: list[Any] = []
    roles = _roles(k)
    for node in order:
        t = type(node)
        if t is acc_type:
            continue
        role = roles.get(t)
        if role is None:
            role = roles[t] = _role_of(t)
        nexts = node.next_functions
        if role >= 0:
            _claim_slots(node, role, k, claimed, uses)
        elif role == _USER:
            user.append(node)
            for slot, (child, _) in enumerate(nexts):
                if child is not None and type(child) is acc_type:
                    claimed.setdefault(child, set()).add((id(node), slot))
                    user_accs.append(child)
        for child, _ in nexts:
            if child is not None and type(child) in leafish:
                edges_in[child] = edges_in.get(child, 0) + 1
    bad: set[Any] = set()
    for node, count in edges_in.items():
        if len(claimed.get(node, ())) < count and node not in bad:
            # Some use of it is not split: so is nothing it leads to.
            while node is not None:
                bad.add(node)
                node = node.next_functions[0][0] if type(node) in adapters else None
    user_set = set(user_accs)
    in_b: dict[Any, bool] = {}  # layer norms' parameters B computes: {accumulator: only norms use it}
    if not defer_norms:
        for _node, kind, _slot, _t, _c, acc in uses:
            if kind == LAYER_NORM:
                in_b[acc] = True
        for _node, kind, _slot, _t, _c, acc in uses:
            if kind != LAYER_NORM and acc in in_b:
                in_b[acc] = False
    eager: list[int] = []
    norms: list[int] = []
    forced: list[int] = []
    covered: set[Any] = set()
    for node in order:  # accumulators in the order first reached: stable results
        if type(node) is not acc_type:
            continue
        if node in bad:
            eager.append(position[node])
        elif node in user_set or in_b.get(node) is False:
            forced.append(position[node])
        elif node in in_b:
            norms.append(position[node])
        else:
            covered.add(node)
    by_node: dict[Any, list[tuple[int, bool, bool, int]]] = {}
    kinds: dict[Any, int] = {}
    for node, kind, slot, transposed, cast, acc in uses:
        if acc in covered:
            if node not in by_node:
                by_node[node] = []
                kinds[node] = kind
            by_node[node].append((slot, transposed, cast, position[acc]))
    linear: dict[tuple[int, bool, bool], list[tuple[int, int, int]]] = {}
    native: list[tuple[int, int, tuple[tuple[int, bool, bool, int], ...]]] = []
    for node, found in by_node.items():
        kind = kinds[node]
        slots = {slot: (transposed, cast, acc) for slot, transposed, cast, acc in found}
        weight = slots.get(2 if kind == ADDMM else 1)
        bias = slots.get(0) if kind == ADDMM else None
        # nn.Linear's form, its weight and bias cast alike (autocast casts both, or neither)
        if (kind in (ADDMM, MM) and len(slots) == (2 if bias is not None else 1)
                and weight is not None and weight[0]
                and (bias is None or bias[:2] == (False, weight[1]))):
            linear.setdefault((kind, bias is not None, weight[1]), []).append(
                (position[node], weight[2], bias[2] if bias is not None else -1)
            )
        else:
            native.append((position[node], kind, tuple(found)))
    groups = tuple(
        _Linears(
            len(members),
            _gather([m[0] for m in members]),
            _gather([m[1] for m in members]),
            _gather([m[2] for m in members]) if with_bias else None,
            access.linear_input[kind],
            access.addmm_scalars if kind == ADDMM else None,
            # positions of the parameters' accumulators: one per parameter
            len({m[1] for m in members} | {m[2] for m in members if with_bias})
            == len(members) * (2 if with_bias else 1),
            cast,
        )
        for (kind, with_bias, cast), members in linear.items()
    )
    return _Plan(groups, tuple(native), tuple(position[n] for n in user),
                 tuple(eager), _gather(norms), tuple(forced))


# --- W ---------------------------------------------------------------------------------


def _weight_grads(
    kind: int, saved: Any, slots: list[tuple[int, bool, bool, torch.Tensor]],
    dy: torch.Tensor,
) -> None:
    """W for one native node: the weight half of its backward, into `.grad`."""
    if kind in (ADDMM, MM):
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
            _accumulate([param], [g])  # it requires grad (it has an accumulator); g is fresh
        return
    if kind == LAYER_NORM:
        mask = [False, any(s[0] == 1 for s in slots), any(s[0] == 2 for s in slots)]
        found = access.layer_norm_backward(dy, saved, mask)
    elif kind == EMBEDDING:
        found = (None, access.embedding_backward(dy, saved))
    else:
        mask = [False, any(s[0] == 1 for s in slots), any(s[0] == 2 for s in slots)]
        found = access.convolution_backward(dy, saved, mask)
    for slot, _transposed, _cast, param in slots:
        g = found[slot] if kind != EMBEDDING else found[1]
        if g.shape != param.shape:  # a broadcast `self` reduced, as autograd's sum_to does
            g = g.sum_to_size(param.shape)
        accumulate_grad(param, g)


def _linear_weight_grads(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, cast: bool = False) -> None:
    """W for nn.Linear's addmm (alpha = beta = 1): dW = dy^T x, as autograd's
    addmm backward and its transpose compute it, and the bias's gradient dy
    summed over the rows; into `.grad` (`cast`: in the parameters' dtype)."""
    g = dy.t().mm(x)
    if cast:
        g = g.to(weight.dtype)
    _accumulate([weight], [g])
    if bias is None:
        return
    g = dy.sum(0)
    if g.shape != bias.shape:  # a bias broadcast otherwise than over rows
        g = dy.sum_to_size(bias.shape)
        if g is dy:
            g = dy.clone()  # .grad must not alias the stashed output gradient
    if cast:
        g = g.to(bias.dtype)
    _accumulate([bias], [g])


def _linears_weight_grads(dys: Sequence[Any], xs: Sequence[torch.Tensor],
                          weights: list[torch.Tensor], biases: list[torch.Tensor] | None,
                          cast: bool = False) -> None:
    """`_linear_weight_grads` for many layers at once: the same ops, called from C
    (``map``) rather than a Python loop, and the gradients accumulated in bulk."""
    grads = list(map(torch.mm, map(torch.t, dys), xs))
    _accumulate(weights, _in_dtypes(grads, weights) if cast else grads)
    if biases is None:
        return
    sums = list(map(torch.sum, dys, repeat(0)))
    if list(map(_SHAPE, sums)) != list(map(_SHAPE, biases)):  # some bias broadcast otherwise
        for at, (dy, bias) in enumerate(zip(dys, biases, strict=True)):
            if sums[at].shape != bias.shape:
                g = dy.sum_to_size(bias.shape)
                sums[at] = dy.clone() if g is dy else g
    _accumulate(biases, _in_dtypes(sums, biases) if cast else sums)


def _in_dtypes(grads: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient in its parameter's dtype (autocast's cast, undone)."""
    return list(map(torch.Tensor.to, grads, map(attrgetter("dtype"), params)))


# --- B ---------------------------------------------------------------------------------


def backward_input(
    output: torch.Tensor | Sequence[torch.Tensor],
    grad_output: torch.Tensor | None | Sequence[torch.Tensor | None],
    input: torch.Tensor | Sequence[torch.Tensor] | None,
    stash: WStash,
    *,
    retain_graph: bool = False,
    norms: str = "b",
) -> Any:
    """B: backpropagate `grad_output` from `output`; return the gradient of `input`
    and leave every split parameter's weight-gradient work in `stash`. Parameters
    the split does not cover get their gradient now.

    `output` and `grad_output` are a tensor and its gradient (None for a scalar
    loss), or sequences of them (a stage returning several tensors); `input` is
    None (returns None), a tensor (returns its gradient) or a sequence (returns a
    list, None for an input nothing reaches). `norms`: when layer norms' weight and
    bias gradients are computed: "b" (here, as the zero-bubble paper's
    implementation does; W keeps nothing of a layer norm) or "w" (deferred to W
    like a linear layer's; W keeps the norm's input, mean and rstd)."""
    if norms not in ("b", "w"):
        raise ValueError(f"norms must be 'b' or 'w', not {norms!r}")
    outputs = [output] if isinstance(output, torch.Tensor) else list(output)
    given: list[torch.Tensor | None]
    if grad_output is None:
        given = [None] * len(outputs)
    elif isinstance(grad_output, torch.Tensor):
        given = [grad_output]
    else:
        given = list(grad_output)
    if len(given) != len(outputs):
        raise ValueError(f"backward_input: {len(outputs)} outputs but {len(given)} gradients")
    pairs = list(zip(outputs, given, strict=True))
    many = input is not None and not isinstance(input, torch.Tensor)
    wanted: list[torch.Tensor] = (
        [] if input is None else [input] if isinstance(input, torch.Tensor) else list(input)
    )
    pairs = [(out, grad) for out, grad in pairs if out.requires_grad]
    if not pairs:
        return [None] * len(wanted) if many else None
    roots = [out.grad_fn for out, _ in pairs if out.grad_fn is not None]
    order, plan = _plan_for(roots, norms == "w")
    # What W needs from each node, read now (B frees it), in bulk: C calls over lists.
    linear = [(group, group.nodes(order)) for group in plan.linear]
    inputs_of = [list(map(group.input_of, nodes)) for group, nodes in linear]
    scalars = [list(map(group.scalars_of, nodes)) if group.scalars_of is not None else None
               for group, nodes in linear]
    native = [order[at] for at, _, _ in plan.native]
    saved = [access.read_saved(node, kind, any(slot == 2 for slot, *_ in slots))
             for node, (_, kind, slots) in zip(native, plan.native, strict=True)]
    for at in plan.user:
        setattr(order[at], _STASH_ATTR, stash)
    eager = [order[at].variable for at in plan.forced + plan.eager]
    if wanted:
        asked = {id(t) for t in wanted}
        eager = [p for p in eager if id(p) not in asked]  # a stage input: asked as such
    in_b = list(map(_VARIABLE, plan.norms(order)))
    edges: list[Any] = []
    for _, nodes in linear:
        edges.extend(map(access.gradient_edge, nodes))
    edges.extend(map(access.gradient_edge, native))
    found = access.engine_grad([out for out, _ in pairs], [grad for _, grad in pairs],
                  wanted + edges + in_b + eager, retain_graph)
    at = len(wanted)
    work, tensors, gradients = stash.work, stash.tensors, stash.gradients
    for (group, _), xs, pairs_ab in zip(linear, inputs_of, scalars, strict=True):
        dys = found[at : at + group.count]
        at += group.count
        weights = list(map(_VARIABLE, group.weights(order)))
        biases: list[Any] = (list(map(_VARIABLE, group.biases(order))) if group.biases is not None
                             else [None] * group.count)
        # (not `None in dys`: that compares tensors with ==, a Python call each)
        if group.distinct and all(map(is_not, dys, repeat(None))) and (
            pairs_ab is None or pairs_ab.count((1, 1)) == group.count
        ):
            work.append(partial(_linears_weight_grads, dys, xs, weights,
                                biases if group.biases is not None else None, group.cast))
            tensors.extend(xs)
            gradients.extend(dys)  # type: ignore[arg-type]
            continue
        for dy, x, weight, bias, ab in zip(dys, xs, weights, biases, pairs_ab or repeat((1, 1)),
                                           strict=False):
            if dy is None:
                continue
            if ab == (1, 1):
                work.append(partial(_linear_weight_grads, dy, x, weight, bias, group.cast))
            else:
                targets = [(2, True, group.cast, weight)]
                if bias is not None:
                    targets.append((0, False, group.cast, bias))
                work.append(partial(_weight_grads, ADDMM, access.AddmmSaved(x, *ab), targets, dy))
            tensors.append(x)
            gradients.append(dy)
    for (_, kind, slots), kept, dy in zip(plan.native, saved, found[at : at + len(native)],
                                          strict=True):
        if dy is not None:
            found_targets = [(slot, tr, cast, order[acc].variable) for slot, tr, cast, acc in slots]
            work.append(partial(_weight_grads, kind, kept, found_targets, dy))
            tensors.extend(kept.activations())
            gradients.append(dy)
    at += len(native)
    # Layer norms' gradients are fresh from their backward (or a sum); uncovered
    # parameters' may flow on elsewhere, so the first is copied.
    _accumulate(*_with_gradient(in_b, found[at : at + len(in_b)]))
    _accumulate(*_with_gradient(eager, found[at + len(in_b) :]), copy=True)
    if many:
        return list(found[: len(wanted)])
    return found[0] if wanted else None


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
    """Names of `stage`'s trainable parameters whose gradient B computes (the
    split does not cover them; layer norms' under ``norms="b"`` are covered: B
    computes them by choice), found from the graph its forward left in `outputs`
    (made with gradients enabled)."""
    roots = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    if not roots:
        return []
    order, plan = _plan_for(roots, True)
    eager = {id(order[at].variable) for at in plan.eager}
    compiled = _compiled_parameters(order)
    return [name + (_COMPILED_HINT if id(p) in compiled else "")
            for name, p in stage.named_parameters() if id(p) in eager]


_COMPILED_HINT = (" (inside a torch.compile region, one autograd node the split cannot "
                  "look into: keep the linears eager and compile what lies between them)")


def _compiled_parameters(order: Sequence[Any]) -> set[int]:
    """Ids of the parameters a torch.compile'd region takes directly (its backward
    is one node, ``CompiledFunctionBackward``, whose inputs include them)."""
    acc_type = access.node_classes().accumulate
    found: set[int] = set()
    for node in order:
        if access.is_compiled_region(type(node)):
            found.update(id(_VARIABLE(child)) for child, _ in node.next_functions
                         if child is not None and type(child) is acc_type)
    return found
