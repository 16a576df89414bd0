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
the same native backward on them. What this reads of torch's internals (node
classes, saved tensors, the engine call) is in `autograd_access`.

Layer norms (`norms`). By default B computes their weight and bias gradients, as
the zero-bubble paper's implementation does (it defers only the linear layers'):
a layer norm's weight gradient is small, and on CPU its native backward computes
it in the same pass over x and dy as the input gradient, so deferring it makes W
read both again (a 4096x1024 layer norm alone: B + W = 1.3 fused backwards).
W then keeps nothing of a layer norm, which is also the paper's M_W = 32sbh.
``norms="deferred"`` defers them too (``native_layer_norm_backward`` with an output
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

The file reads top-down: the stash and the user's face, the plan (which nodes B
splits, found once per graph shape), B, W.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from operator import attrgetter, is_, is_not, itemgetter
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from ppdsl.runtime.execution import autograd_access as access
from ppdsl.runtime.execution.autograd_access import ADDMM, CONVOLUTION, EMBEDDING, LAYER_NORM, MM

__all__ = [
    "WStash",
    "backward_input",
    "split_aware",
    "defer",
    "accumulate_grad",
    "uncovered_parameters",
    "uncovered_in",
    "NORMS",
]

NORMS = ("in-b", "deferred")
"""`backward_input`'s `norms`: layer norms' weight gradients computed in B (the
default, the zero-bubble paper's choice) or deferred to W like a linear layer's."""


class WStash:
    """The weight-gradient work a B left for its W.

    `tensors` are the layer inputs it holds (counted as the microbatch's retained
    activation, M_W); `gradients` are the layer output gradients (gradient buffers,
    not activations, so outside the memory model: the meter reports their bytes
    apart). `graph` is set when the runtime keeps the whole autograd graph of the
    microbatch-stage until W (`--release at-w`): every saved activation stays alive
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


# --- user layers ---------------------------------------------------------------------

_FunctionType = TypeVar("_FunctionType", bound=type)
_STASH_ATTR = "_ppdsl_w_stash"
_SPLIT_AWARE = "_ppdsl_split_aware"


def split_aware(function: _FunctionType) -> _FunctionType:
    """Mark a ``torch.autograd.Function`` whose backward hands its weight gradient
    to `defer`. Its parameters count as split (pass them to ``apply`` so autograd
    records them); B gives each of its nodes the microbatch's stash."""
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise TypeError("split_aware decorates a torch.autograd.Function subclass")
    setattr(function, _SPLIT_AWARE, True)
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


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` into `param.grad` as autograd would (nothing for a frozen
    parameter, one that does not require grad)."""
    if not param.requires_grad:
        return
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    _accumulate([param], [grad if grad.is_contiguous() else grad.contiguous()])


# --- the plan: which nodes B splits, found once per graph shape ----------------------

# For each native kind, the input slots that may lead to a parameter W can compute.
_PARAM_SLOTS = {ADDMM: (0, 2), MM: (1,), LAYER_NORM: (1, 2), EMBEDDING: (0,), CONVOLUTION: (1, 2)}
# A node's role: a native kind (>= 0, `autograd_access`), a split-aware Function, or
# plain autograd; by class, found once per class.
_PLAIN, _USER = -1, -2
_ROLES: dict[type, int] = {}

_VARIABLE = attrgetter("variable")  # an accumulator's parameter
_GRAD = attrgetter("grad")
_SHAPE = attrgetter("shape")


class _Slot(NamedTuple):
    """A parameter input of a native node whose gradient W computes."""

    slot: int
    """The node's input (addmm: 0 the bias, 2 the weight; layer norm, convolution:
    1 the weight, 2 the bias; mm: 1; embedding: 0)."""
    transposed: bool
    """The parameter reaches the slot transposed (nn.Linear's ``weight.t()``)."""
    cast: bool
    """... through a cast (autocast's copy in bf16/fp16)."""
    accumulator: int
    """The parameter's accumulator, by position in `_walk`'s list."""


class _Native(NamedTuple):
    """A native node B splits other than a plain linear layer's."""

    position: int
    kind: int
    slots: tuple[_Slot, ...]


class _Target(NamedTuple):
    """W's `_Slot`, with the parameter itself."""

    slot: int
    transposed: bool
    cast: bool
    param: torch.Tensor


class _Use(NamedTuple):
    """A claimed path from a native node's parameter slot to an accumulator."""

    node: Any
    kind: int
    slot: int
    transposed: bool
    cast: bool
    accumulator: Any


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
    native: tuple[_Native, ...]
    """Other native nodes with a deferred slot."""
    user: tuple[int, ...]
    """Nodes of split-aware Functions."""
    eager: tuple[int, ...]
    """Accumulators of parameters the split does not cover: B computes their
    gradient."""
    norms: Callable[[Sequence[Any]], tuple[Any, ...]]
    """Gathers the accumulators of layer norms' weights and biases that B computes
    (``norms="in-b"``): every use is a layer norm's, whose backward returns a fresh
    tensor."""
    forced: tuple[int, ...]
    """Accumulators B asks for besides: split-aware Functions' parameters (which
    makes the Function's node run even where no input gradient passes through it;
    its backward defers what it defers and returns the rest, None when all of it),
    and parameters a layer norm shares with another use under ``norms="in-b"``."""


class _Known(NamedTuple):
    """A plan, with the signature of the graph it was found for."""

    signature: list[Any]
    plan: _Plan


# Plans by (norms, signature length), then signature. A stage's graph has the same
# shape every microbatch, so after its first B each later one walks the graph once
# (to read its signature) and skips the analysis. Plans hold classes and positions
# only (no node, tensor or parameter): a plan never keeps a model alive.
_PLANS: dict[tuple[bool, int], list[_Known]] = {}
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
    for known in _PLANS.get(key, ()):
        if known.signature == signature:
            return order, known.plan
    plan = _analyse(order, defer_norms)
    if _plan_entries + len(signature) > _PLAN_BUDGET:
        _PLANS.clear()
        _plan_entries = 0
    _PLANS.setdefault(key, []).append(_Known(signature, plan))
    _plan_entries += len(signature)
    return order, plan


def _walk(roots: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Every node reachable from `roots` (the outputs' nodes), accumulators
    included, in the order first reached; and the graph's signature: the number of
    roots, then for each node in that order its class, the position of each of its
    next functions (-1 for none) and, for an embedding, its `sparse` flag (whether
    W has its formula). Two graphs with equal signatures are the same graph up to
    node identity (same classes, same edges, the same nodes shared), so what
    `_analyse` found for one holds for the other, position for position. Costs
    what touching every node once costs."""
    classes = access.node_classes()
    acc_type, emb_type = classes.accumulate, classes.embedding
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


def _role(node_class: type, classes: access.NodeClasses) -> int:
    """`node_class`'s role (`_ROLES`)."""
    role = _ROLES.get(node_class)
    if role is None:
        function = access.function_of(node_class)
        role = classes.native.get(node_class, _USER if getattr(function, _SPLIT_AWARE, False)
                                  else _PLAIN)
        _ROLES[node_class] = role
    return role


def _claim_slots(node: Any, kind: int, classes: access.NodeClasses,
                 claimed: dict[Any, set[tuple[int, int]]], uses: list[_Use]) -> None:
    """Claim, edge by edge, the paths from a native node's parameter slots to the
    parameters (through at most one transpose and one cast) where W has the
    formula."""
    transpose, to_copy, acc_type = classes.transpose, classes.to_copy, classes.accumulate
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
            uses.append(_Use(node, kind, slot, False, False, child))
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
        uses.append(_Use(node, kind, slot, transposed, cast, child))


def _analyse(order: list[Any], defer_norms: bool) -> _Plan:
    """Find, over the nodes `_walk` listed, what B splits. A parameter is split
    when every edge into its accumulator, and into each transpose or cast on the
    way, is claimed by a path from a native node's parameter slot (or by a
    split-aware Function). Unless `defer_norms`, a parameter that a layer norm
    uses gets its gradient in B."""
    # Over 80 lines, and split.py over 600, on purpose (the exceptions
    # tests/system/test_sizes.py allows): one analysis in four phases (count and
    # claim the edges, spread "not split" down the adapters, sort the
    # accumulators, group the linears), each reading the tables the one before
    # filled (position, edges_in, claimed, uses, bad, in_b); cut into functions,
    # each would take and return those tables, and the rule would read in pieces.
    classes = access.node_classes()
    acc_type = classes.accumulate
    adapters = {classes.transpose, classes.to_copy}
    leafish = adapters | {acc_type}
    position = {node: at for at, node in enumerate(order)}
    edges_in: dict[Any, int] = {}  # accumulators and adapters: edges into them
    claimed: dict[Any, set[tuple[int, int]]] = {}  # ... those claimed: (id(parent), slot)
    uses: list[_Use] = []
    user: list[Any] = []
    user_accs: list[Any] = []
    for node in order:
        t = type(node)
        if t is acc_type:
            continue
        role = _role(t, classes)
        nexts = node.next_functions
        if role >= 0:
            _claim_slots(node, role, classes, claimed, uses)
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
        for use in uses:
            if use.kind == LAYER_NORM:
                in_b[use.accumulator] = True
        for use in uses:
            if use.kind != LAYER_NORM and use.accumulator in in_b:
                in_b[use.accumulator] = False
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
    by_node: dict[Any, list[_Slot]] = {}
    kinds: dict[Any, int] = {}
    for use in uses:
        if use.accumulator in covered:
            if use.node not in by_node:
                by_node[use.node] = []
                kinds[use.node] = use.kind
            by_node[use.node].append(_Slot(use.slot, use.transposed, use.cast,
                                           position[use.accumulator]))
    # nn.Linear's form (weight transposed; weight and bias cast alike, as autocast
    # casts both or neither), by (kind, with a bias, cast): [(node, weight, bias)]
    linear: dict[tuple[int, bool, bool], list[tuple[int, int, int]]] = {}
    native: list[_Native] = []
    for node, found in by_node.items():
        kind = kinds[node]
        slots = {s.slot: s for s in found}
        weight = slots.get(2 if kind == ADDMM else 1)
        bias = slots.get(0) if kind == ADDMM else None
        if (kind in (ADDMM, MM) and len(slots) == (2 if bias is not None else 1)
                and weight is not None and weight.transposed
                and (bias is None or (not bias.transposed and bias.cast == weight.cast))):
            linear.setdefault((kind, bias is not None, weight.cast), []).append(
                (position[node], weight.accumulator, bias.accumulator if bias is not None else -1)
            )
        else:
            native.append(_Native(position[node], kind, tuple(found)))
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


def _gather(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """seq -> (seq[p] for p in positions), in one C call."""
    if not positions:
        return lambda seq: ()
    if len(positions) == 1:
        (only,) = positions
        return lambda seq: (seq[only],)
    return itemgetter(*positions)


# --- B ---------------------------------------------------------------------------------


def backward_input(
    output: torch.Tensor | Sequence[torch.Tensor],
    grad_output: torch.Tensor | None | Sequence[torch.Tensor | None],
    input: torch.Tensor | Sequence[torch.Tensor] | None,
    stash: WStash,
    *,
    retain_graph: bool = False,
    norms: str = "in-b",
) -> Any:
    """B: backpropagate `grad_output` from `output`; return the gradient of `input`
    and leave every split parameter's weight-gradient work in `stash`. Parameters
    the split does not cover get their gradient now.

    `output` and `grad_output` are a tensor and its gradient (None for a scalar
    loss), or sequences of them (a stage returning several tensors); `input` is
    None (returns None), a tensor (returns its gradient) or a sequence (returns a
    list, None for an input nothing reaches). `norms`: when layer norms' weight and
    bias gradients are computed: "in-b" (here, as the zero-bubble paper's
    implementation does; W keeps nothing of a layer norm) or "deferred" (to W,
    like a linear layer's; W keeps the norm's input, mean and rstd)."""
    if norms not in NORMS:
        raise ValueError(f"norms must be 'in-b' or 'deferred', not {norms!r}")
    pairs, wanted = _as_lists(output, grad_output, input)
    many = input is not None and not isinstance(input, torch.Tensor)
    if not pairs:
        return [None] * len(wanted) if many else None
    roots = [out.grad_fn for out, _ in pairs if out.grad_fn is not None]
    order, plan = _plan_for(roots, norms == "deferred")
    # What W needs from each node, read now (B frees it), in bulk: C calls over lists.
    linear = [(group, group.nodes(order)) for group in plan.linear]
    inputs_of = [list(map(group.input_of, nodes)) for group, nodes in linear]
    scalars = [list(map(group.scalars_of, nodes)) if group.scalars_of is not None else None
               for group, nodes in linear]
    native = [order[n.position] for n in plan.native]
    saved = [access.read_saved(node, n.kind, any(s.slot == 2 for s in n.slots))
             for node, n in zip(native, plan.native, strict=True)]
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
    # The one autograd call: the inputs' gradients, and dy at each split node.
    found = access.engine_grad([out for out, _ in pairs], [grad for _, grad in pairs],
                               wanted + edges + in_b + eager, retain_graph)
    at = len(wanted)
    for (group, _), xs, alpha_beta in zip(linear, inputs_of, scalars, strict=True):
        _stash_linears(group, order, xs, alpha_beta, found[at : at + group.count], stash)
        at += group.count
    for n, kept, dy in zip(plan.native, saved, found[at : at + len(native)], strict=True):
        if dy is not None:
            targets = [_Target(s.slot, s.transposed, s.cast, order[s.accumulator].variable)
                       for s in n.slots]
            stash.add(partial(_native_weight_grads, n.kind, kept, targets, dy),
                      kept.activations(), (dy,))
    at += len(native)
    # Layer norms' gradients are fresh from their backward (or a sum); uncovered
    # parameters' may flow on elsewhere, so the first is copied.
    _accumulate(*_with_gradient(in_b, found[at : at + len(in_b)]))
    _accumulate(*_with_gradient(eager, found[at + len(in_b) :]), copy=True)
    if many:
        return list(found[: len(wanted)])
    return found[0] if wanted else None


def _as_lists(
    output: torch.Tensor | Sequence[torch.Tensor],
    grad_output: torch.Tensor | None | Sequence[torch.Tensor | None],
    input: torch.Tensor | Sequence[torch.Tensor] | None,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], list[torch.Tensor]]:
    """`backward_input`'s arguments as lists: the (output, gradient) pairs autograd
    reaches, and the inputs whose gradients are asked for."""
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
    wanted: list[torch.Tensor] = (
        [] if input is None else [input] if isinstance(input, torch.Tensor) else list(input)
    )
    return [(out, grad) for out, grad in zip(outputs, given, strict=True) if out.requires_grad], wanted


def _stash_linears(group: _Linears, order: list[Any], xs: list[torch.Tensor],
                   alpha_beta: list[tuple[Any, Any]] | None,
                   dys: Sequence[torch.Tensor | None], stash: WStash) -> None:
    """Leave W's work for one group of linear layers in `stash`: in bulk when the
    layers share no parameter, all got a gradient and are plain ``x W^T + b``
    (alpha = beta = 1); else layer by layer."""
    weights = list(map(_VARIABLE, group.weights(order)))
    biases = list(map(_VARIABLE, group.biases(order))) if group.biases is not None else None
    # (not `None in dys`: that compares tensors with ==, a Python call each)
    if group.distinct and all(map(is_not, dys, repeat(None))) and (
        alpha_beta is None or alpha_beta.count((1, 1)) == group.count
    ):
        present: list[torch.Tensor] = list(dys)  # type: ignore[arg-type]
        stash.add(partial(_linear_weight_grads, present, xs, weights, biases, group.cast),
                  xs, present)
        return
    for at, (dy, x, weight) in enumerate(zip(dys, xs, weights, strict=True)):
        if dy is None:
            continue
        bias = biases[at] if biases is not None else None
        ab = alpha_beta[at] if alpha_beta is not None else (1, 1)
        if ab == (1, 1):
            work = partial(_linear_weight_grads, [dy], [x], [weight],
                           [bias] if bias is not None else None, group.cast)
        else:
            targets = [_Target(2, True, group.cast, weight)]
            if bias is not None:
                targets.append(_Target(0, False, group.cast, bias))
            work = partial(_native_weight_grads, ADDMM, access.AddmmSaved(x, *ab), targets, dy)
        stash.add(work, (x,), (dy,))


# --- W ---------------------------------------------------------------------------------


def _linear_weight_grads(dys: Sequence[torch.Tensor], xs: Sequence[torch.Tensor],
                         weights: list[torch.Tensor], biases: list[torch.Tensor] | None,
                         cast: bool = False) -> None:
    """W for linear layers (addmm with alpha = beta = 1, or mm): dW = dy^T x, as
    autograd's addmm backward and its transpose compute it, and the bias's
    gradient dy summed over the rows; into `.grad` (`cast`: in the parameters'
    dtype). The ops are called from C (``map``) over the layers, not from a
    Python loop."""
    grads = list(map(torch.mm, map(torch.t, dys), xs))
    _accumulate(weights, _in_dtypes(grads, weights) if cast else grads)
    if biases is None:
        return
    sums = list(map(torch.sum, dys, repeat(0)))
    if list(map(_SHAPE, sums)) != list(map(_SHAPE, biases)):  # some bias broadcast otherwise
        for at, (dy, bias) in enumerate(zip(dys, biases, strict=True)):
            if sums[at].shape != bias.shape:
                g = dy.sum_to_size(bias.shape)
                sums[at] = dy.clone() if g is dy else g  # .grad must not alias the stashed dy
    _accumulate(biases, _in_dtypes(sums, biases) if cast else sums)


def _native_weight_grads(kind: int, saved: Any, targets: list[_Target], dy: torch.Tensor) -> None:
    """W for one native node: the weight half of its backward, into `.grad`."""
    if kind in (ADDMM, MM):
        x, alpha, beta = saved
        for slot, transposed, cast, param in targets:
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
    found: Any  # (d input, d weight, d bias), those asked for
    if kind == EMBEDDING:
        found = (None, access.embedding_backward(dy, saved))
    else:
        mask = [False, any(t.slot == 1 for t in targets), any(t.slot == 2 for t in targets)]
        backward = access.layer_norm_backward if kind == LAYER_NORM else access.convolution_backward
        found = backward(dy, saved, mask)
    for target in targets:
        g = found[1] if kind == EMBEDDING else found[target.slot]
        if g.shape != target.param.shape:  # a broadcast `self` reduced, as autograd's sum_to does
            g = g.sum_to_size(target.param.shape)
        accumulate_grad(target.param, g)


def _in_dtypes(grads: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient in its parameter's dtype (autocast's cast, undone)."""
    return list(map(torch.Tensor.to, grads, map(attrgetter("dtype"), params)))


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


# --- what the split does not cover -----------------------------------------------------


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
    split does not cover them; layer norms' under ``norms="in-b"`` are covered: B
    computes them by choice), found from the graph its forward left in `outputs`
    (made with gradients enabled)."""
    roots = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    if not roots:
        return []
    order, plan = _plan_for(roots, True)
    eager = {id(order[at].variable) for at in plan.eager}
    acc_type = access.node_classes().accumulate
    compiled = {id(_VARIABLE(child)) for node in order if access.is_compiled_region(type(node))
                for child, _ in node.next_functions
                if child is not None and type(child) is acc_type}
    return [name + (_COMPILED_HINT if id(p) in compiled else "")
            for name, p in stage.named_parameters() if id(p) in eager]


_COMPILED_HINT = (" (inside a torch.compile region, one autograd node the split cannot "
                  "look into: keep the linears eager and compile what lies between them)")
