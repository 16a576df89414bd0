"""The B/W split (`ppdsl.runtime.execution.split`) and the memory meter, in one process:
B computes input gradients only (and, under the default ``norms="in-b"``, layer
norms' weight gradients), W the other weight gradients, together exactly what a
fused backward computes; on any thread; frozen parameters untouched; what B keeps
for W is what the meter measures; the plan found for a graph is reused only for a
graph of the same shape."""

from __future__ import annotations

import copy
import re
import threading
from fractions import Fraction

import pytest
import torch
from torch import nn

from ppdsl.ir.schedule import PassKind
from ppdsl.runtime.execution.memory import MemoryMeter, storage_bytes
from ppdsl.runtime.execution.split import (
    WStash,
    accumulate_grad,
    backward_input,
    defer,
    split_aware,
    uncovered_parameters,
)
from ppdsl.runtime.models.model import build_model
from tests.paths import ROOT

TINY = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages"


class Scale(nn.Module):
    """x * scale: a parameter no native split covers."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _norm_parameters(stage: nn.Module) -> list[str]:
    """Names of the trainable parameters of `stage`'s layer norms (B's under "in-b")."""
    return [f"{m}.{n}" if m else n for m, module in stage.named_modules()
            if isinstance(module, nn.LayerNorm)
            for n, p in module.named_parameters(recurse=False) if p.requires_grad]


def _split_then_fused(
    stage: nn.Module, inputs: torch.Tensor, *, other_thread: bool = False, norms: str = "in-b"
) -> tuple[dict[str, torch.Tensor | None], list[str], nn.Module]:
    """Run B (optionally on another thread) then W on `stage`, and a fused backward
    on a copy; returns ({name: grad after W}, names with a grad right after B, copy)."""
    reference = copy.deepcopy(stage)
    floating = inputs.is_floating_point()
    x = inputs.clone().requires_grad_(True) if floating else inputs
    out = stage(x)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    stash = WStash()  # set up here, on this thread
    found: dict[str, torch.Tensor | None] = {}

    def run_b() -> None:
        found["dx"] = backward_input(out, grad_out, x if floating else None, stash, norms=norms)

    if other_thread:
        worker = threading.Thread(target=run_b)
        worker.start()
        worker.join()
    else:
        run_b()
    after_b = [n for n, p in stage.named_parameters() if p.grad is not None]
    stash.run()
    xr = inputs.clone().requires_grad_(True) if floating else inputs
    reference(xr).backward(grad_out)
    if floating:
        assert torch.equal(found["dx"], xr.grad)
    return {n: p.grad for n, p in stage.named_parameters()}, after_b, reference


def _assert_same_grads(grads: dict[str, torch.Tensor | None], reference: nn.Module) -> None:
    for name, p in reference.named_parameters():
        if p.grad is None:
            assert grads[name] is None, name
        else:
            assert grads[name] is not None, f"{name}: no gradient after W"
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("norms", ["in-b", "deferred"])
def test_b_computes_only_input_grads_and_w_the_weight_grads(norms: str) -> None:
    """After B the input gradient equals plain autograd's and no parameter has a
    gradient but, under norms="in-b", the layer norm's; W then sets every one, equal
    to a fused backward's."""
    net = _net()
    grads, after_b, reference = _split_then_fused(net, torch.randn(5, 8), norms=norms)
    assert after_b == (["2.weight", "2.bias"] if norms == "in-b" else [])
    _assert_same_grads(grads, reference)


@pytest.mark.slow
@pytest.mark.parametrize("norms", ["in-b", "deferred"])
@pytest.mark.parametrize("stage_index", [0, 1])
def test_split_defers_every_weight_grad_from_another_thread(stage_index: int, norms: str) -> None:
    """The CPU stand-in for CUDA's autograd worker threads: the stash is set up on
    this thread and B runs on another; every weight gradient of a tiny_gpt stage
    (embeddings, linears; layer norms under norms="deferred") is still deferred to W and
    W's equal a fused backward's."""
    model = build_model(TINY, 2)
    ids, _ = model.batch(0, 2)
    inputs = ids if stage_index == 0 else model.stage(0)(ids).detach()
    stage = model.stage(stage_index)
    grads, after_b, reference = _split_then_fused(stage, inputs, other_thread=True, norms=norms)
    assert after_b == (_norm_parameters(stage) if norms == "in-b" else [])
    assert len(after_b) == (32 if stage_index == 0 else 34) or norms == "deferred"
    assert all(g is not None for g in grads.values())
    _assert_same_grads(grads, reference)


def test_conv_and_embedding_split() -> None:
    """Conv1d, Conv2d (strided, grouped, without bias) and an Embedding with a
    padding index are split: nothing after B, a fused backward's gradients after W."""
    torch.manual_seed(0)
    conv1 = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 2, 3, bias=False))
    conv2 = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2, groups=2))
    embed = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 3, bias=False))
    for stage, x in ((conv1, torch.randn(2, 3, 9)), (conv2, torch.randn(2, 3, 9, 9)),
                     (embed, torch.tensor([[0, 1, 2], [3, 0, 5]]))):
        grads, after_b, reference = _split_then_fused(stage, x)
        assert after_b == [], stage
        _assert_same_grads(grads, reference)


@pytest.mark.parametrize("norms", ["in-b", "deferred"])
def test_frozen_parameters_get_no_gradient(norms: str) -> None:
    """LoRA-style fine-tuning: parameters with requires_grad=False get no .grad
    from B or W (issue 10); the trainable ones get a fused backward's."""
    model = build_model(TINY, 2)
    ids, _ = model.batch(0, 2)
    stage = model.stage(1)
    frozen = {"0.qkv.weight", "0.norm1.weight", "1.up.bias", "8.out.weight", "8.norm.bias"}
    for name, p in stage.named_parameters():
        p.requires_grad_(name not in frozen)
    grads, after_b, reference = _split_then_fused(stage, model.stage(0)(ids).detach(), norms=norms)
    assert after_b == (_norm_parameters(stage) if norms == "in-b" else [])
    assert "0.norm1.bias" in after_b or norms == "deferred"
    assert {n for n, g in grads.items() if g is None} == frozen
    _assert_same_grads(grads, reference)


def test_frozen_parameter_of_split_aware_function_gets_no_gradient() -> None:
    """`accumulate_grad` leaves a frozen parameter alone."""
    p = nn.Parameter(torch.ones(3), requires_grad=False)
    accumulate_grad(p, torch.ones(3))
    assert p.grad is None


def test_uncovered_parameters_are_named_and_get_their_grad_in_b() -> None:
    """A parameter outside the split (x * scale) is named before training; B gives it
    its gradient (correct, not deferred), W the rest; a linear applied to a
    non-contiguous input has its bias added separately, so that bias is named too."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 2))
    assert uncovered_parameters(net, torch.randn(5, 3)) == ["1.scale"]
    grads, after_b, reference = _split_then_fused(net, torch.randn(5, 3))
    assert after_b == ["1.scale"]
    _assert_same_grads(grads, reference)

    class Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x.transpose(0, 1))

    assert uncovered_parameters(Transposed(), torch.randn(3, 2, 4)) == ["linear.bias"]
    assert uncovered_parameters(_net(), torch.randn(5, 8)) == []


def test_shared_weight_is_split_once() -> None:
    """A weight used by two linears (tied, one of them through x @ W) gets the sum of
    both contributions in W, exactly once."""
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) + x @ self.linear.weight

    grads, after_b, reference = _split_then_fused(Tied(), torch.randn(3, 4))
    assert after_b == []
    _assert_same_grads(grads, reference)


def test_tied_linears_accumulate_both_uses() -> None:
    """Two nn.Linear sharing one weight (tied, as a head tied to an embedding can
    be): W adds both layers' contributions, as a fused backward does (a bulk
    accumulation that set each layer's would keep only the last)."""
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    grads, after_b, reference = _split_then_fused(Tied(), torch.randn(3, 4))
    assert after_b == []
    _assert_same_grads(grads, reference)


def _docs_example() -> dict:
    """The split-aware layer that docs/runtime.md shows, executed from the doc."""
    text = (ROOT / "docs" / "runtime.md").read_text()
    (code,) = re.findall(r"```python\n(# A split-aware layer.*?)```", text, flags=re.S)
    scope: dict = {}
    exec(compile(code, "docs/runtime.md", "exec"), scope)
    return scope


def test_documented_split_aware_layer() -> None:
    """docs/runtime.md's own split-aware layer: its weight gradient waits for W when
    B runs on another thread, its parameter is not reported as uncovered, and a
    plain backward (no stash) computes it on the spot."""
    scope = _docs_example()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), scope["Gain"](4), nn.Linear(4, 2))
    assert uncovered_parameters(net, torch.randn(5, 3)) == []
    grads, after_b, reference = _split_then_fused(net, torch.randn(5, 3), other_thread=True)
    assert after_b == []
    _assert_same_grads(grads, reference)
    first = nn.Sequential(scope["Gain"](3), nn.Linear(3, 2))  # no input gradient wanted
    grads, after_b, reference = _split_then_fused(first, torch.randn(5, 3).detach())
    assert after_b == []
    _assert_same_grads(grads, reference)


def test_split_aware_rejects_non_functions() -> None:
    """`split_aware` decorates autograd Functions only."""
    with pytest.raises(TypeError, match="autograd.Function"):
        split_aware(nn.Linear)


def test_defer_outside_the_runtime_runs_now() -> None:
    """`defer` with a ctx that B never saw (a fused backward) runs the work at once."""
    ran = []
    defer(object(), lambda: ran.append(1))
    assert ran == [1]


@pytest.mark.parametrize("norms", ["in-b", "deferred"])
def test_meter_measures_what_b_keeps_for_w(norms: str) -> None:
    """1 M_B right after F; after B exactly what W reads: each linear's input and,
    under norms="deferred", the layer norm's input, mean and rstd (all of F's bytes but
    GELU's input); nothing after W."""
    net = _net()
    meter = MemoryMeter(net.parameters())
    x = torch.randn(64, 8, requires_grad=True)
    with meter.saving((0, 0)):
        y = net(x)
    meter.after(PassKind.F, (0, 0), Fraction(1))
    assert meter.f_bytes[(0, 0)] > 0 and meter.peak_units == 1
    stash = WStash()
    backward_input(y, torch.ones_like(y), x, stash, norms=norms)
    del y
    meter.set_stash((0, 0), stash.tensors, stash.gradients)
    meter.after(PassKind.B, (0, 0), Fraction(1))
    gelu_input = 64 * 16 * 4
    if norms == "deferred":
        assert meter.after_b[(0, 0)] == meter.f_bytes[(0, 0)] - gelu_input
    else:  # the linears' inputs: x and the layer norm's output
        assert meter.after_b[(0, 0)] == (64 * 8 + 64 * 16) * 4
    assert meter.after_b[(0, 0)] == storage_bytes(stash.tensors)
    stash.run()
    meter.set_stash((0, 0), [])
    meter.after(PassKind.W, (0, 0), Fraction(1))
    assert meter.peak_bytes == meter.f_bytes[(0, 0)]


def test_meter_counts_a_stage_with_uncovered_parameters() -> None:
    """With a parameter the split does not cover, what B keeps is still exactly what
    W reads: the covered layers' inputs, not the uncovered layer's (B used it)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), Scale(16), nn.GELU(), nn.Linear(16, 4))
    meter = MemoryMeter(net.parameters())
    x = torch.randn(64, 8, requires_grad=True)
    with meter.saving((0, 0)):
        y = net(x)
    meter.after(PassKind.F, (0, 0), Fraction(1))
    stash = WStash()
    backward_input(y, torch.ones_like(y), x, stash)
    del y
    meter.set_stash((0, 0), stash.tensors, stash.gradients)
    meter.after(PassKind.B, (0, 0), Fraction(1))
    # kept: x (first linear) and GELU's output (last linear); freed: Scale's and GELU's inputs
    assert meter.after_b[(0, 0)] == (64 * 8 + 64 * 16) * 4
    assert meter.f_bytes[(0, 0)] == (64 * 8 + 3 * 64 * 16) * 4
    assert net[1].scale.grad is not None and net[0].weight.grad is None


@pytest.mark.parametrize(("factory", "norms", "low", "high"), [
    ("stages", "in-b", 0.38, 0.48), ("stages", "deferred", 0.5, 0.62),
    ("stages_long", "in-b", 0.1, 0.17), ("stages_long", "deferred", 0.16, 0.25),
])
def test_tiny_gpt_real_mw_ratio(factory: str, norms: str, low: float, high: float) -> None:
    """Measured, not assumed: what a tiny_gpt stage keeps from B to W is about 0.43
    M_B with 16 tokens and fused attention (0.56 when W also needs the layer norms'
    inputs, norms="deferred"), about 0.14 (0.19) with 128 tokens and unfused attention
    (whose seq^2 probabilities B frees)."""
    model = build_model(TINY.replace(":stages", f":{factory}"), 4)
    stage = model.stage(1)
    x = model.stage(0)(model.batch(0, 1)[0]).detach().requires_grad_()
    meter = MemoryMeter(stage.parameters())
    with meter.saving((0, 1)):
        y = stage(x)
    meter.after(PassKind.F, (0, 1), Fraction(1))
    stash = WStash()
    backward_input(y, torch.ones_like(y), x, stash, norms=norms)
    del y
    meter.set_stash((0, 1), stash.tensors)
    meter.after(PassKind.B, (0, 1), Fraction(1))
    ratio = meter.after_b[(0, 1)] / meter.f_bytes[(0, 1)]
    assert low < ratio < high, ratio


@pytest.mark.parametrize("norms", ["in-b", "deferred"])
def test_autocast_weights_are_split(norms: str) -> None:
    """Under bf16 autocast (weights cast on their way to the matmul) every weight
    gradient (but, under norms="in-b", the layer norm's) is still deferred, and W's
    equal a fused backward's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    reference = copy.deepcopy(net)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = net(x)
        y_ref = reference(x)
    stash = WStash()
    backward_input(y, torch.ones_like(y), x, stash, norms=norms)
    after_b = [n for n, p in net.named_parameters() if p.grad is not None]
    assert after_b == (["1.weight", "1.bias"] if norms == "in-b" else [])
    stash.run()
    y_ref.backward(torch.ones_like(y_ref))
    _assert_same_grads({n: p.grad for n, p in net.named_parameters()}, reference)


def test_walk_passes_transposes_and_casts_of_activations() -> None:
    """Transposes and casts on the activation path (not only on weights) are walked
    through: the layers before them are split too."""
    torch.manual_seed(0)

    class Turns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.second = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x).t().double().float().t()
            return self.second(h)

    grads, after_b, reference = _split_then_fused(Turns(), torch.randn(5, 4))
    assert after_b == []
    assert all(g is not None for g in grads.values())
    _assert_same_grads(grads, reference)


class _Shifted(nn.Module):
    """linear(x + pos) then linear: `pos` is uncovered, and the gradient autograd
    returns for it is the very tensor that flows on to the first linear as its
    output gradient (pos of the activation's shape), or a view of it (pos flat,
    added through a view)."""

    def __init__(self, flat: bool) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.pos = nn.Parameter(torch.zeros(12 if flat else (3, 4)))
        self.second = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) + self.pos.view(3, 4))


@pytest.mark.parametrize("flat", [False, True])
def test_uncovered_gradient_never_aliases_a_stashed_one(flat: bool) -> None:
    """Two microbatches' B before their W (a zero-bubble order): the uncovered
    parameter's gradient is copied, not the tensor autograd returned, so adding the
    second microbatch's into it cannot change the first one's stashed output
    gradient (it did: the first linear's W then read a corrupted dy)."""
    torch.manual_seed(0)
    net = _Shifted(flat)
    reference = copy.deepcopy(net)
    xs = [torch.randn(3, 4) for _ in range(2)]
    gs = [torch.randn(3, 2) for _ in range(2)]
    stashes = []
    for x, g in zip(xs, gs, strict=True):
        stash = WStash()
        backward_input(net(x), g, None, stash)
        stashes.append(stash)
    assert net.pos.grad is not None and net.first.weight.grad is None
    for stash in stashes:
        stash.run()
    for x, g in zip(xs, gs, strict=True):
        reference(x).backward(g)
    _assert_same_grads({n: p.grad for n, p in net.named_parameters()}, reference)


@pytest.mark.parametrize("norms", ["in-b", "deferred"])
def test_microbatches_accumulate_as_a_fused_backward(norms: str) -> None:
    """Three microbatches of a tiny_gpt stage, every B before any W (the bulk
    accumulation path: `_foreach_add_` into existing gradients), equal three fused
    backwards; the stage input's gradient each time too."""
    model = build_model(TINY, 2)
    stage = model.stage(1)
    reference = copy.deepcopy(stage)
    x0 = model.stage(0)(model.batch(0, 6)[0]).detach()
    targets = model.batch(0, 6)[1]
    stashes = []
    for mb in range(3):
        x = x0[2 * mb : 2 * mb + 2].clone().requires_grad_(True)
        loss = model.loss(stage(x), targets[2 * mb : 2 * mb + 2])
        stash = WStash()
        dx = backward_input(loss, None, x, stash, norms=norms)
        stashes.append(stash)
        xr = x0[2 * mb : 2 * mb + 2].clone().requires_grad_(True)
        model.loss(reference(xr), targets[2 * mb : 2 * mb + 2]).backward()
        assert torch.equal(dx, xr.grad)
    for stash in stashes:
        stash.run()
    _assert_same_grads({n: p.grad for n, p in stage.named_parameters()}, reference)


def test_plan_is_reused_for_a_graph_of_the_same_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The analysis runs once per graph shape: a second microbatch, and another
    stage of the same structure (tiny_gpt's stages 1 and 2 of 4, different
    parameters), reuse the first plan, and each stage's W fills its own
    parameters' gradients."""
    from ppdsl.runtime.execution import split

    calls = []
    real = split._analyse
    monkeypatch.setattr(split, "_analyse", lambda *a: calls.append(1) or real(*a))
    split._PLANS.clear()
    model = build_model(TINY, 4)
    stages = [model.stage(1), model.stage(2)]
    x = model.stage(0)(model.batch(0, 2)[0]).detach()
    for stage in (stages[0], stages[0], stages[1]):
        reference = copy.deepcopy(stage)
        for p in stage.parameters():
            p.grad = None
        grads, _, reference = _split_then_fused(stage, x)
        _assert_same_grads(grads, reference)
    assert len(calls) == 1


def test_plans_beyond_the_budget_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `_PLAN_BUDGET` signature entries the remembered plans are dropped (a
    model whose graphs never repeat cannot grow them without bound) and B still
    finds each graph's plan."""
    from ppdsl.runtime.execution import split

    monkeypatch.setattr(split, "_PLAN_BUDGET", 1)  # every new plan forgets the others
    split._PLANS.clear()
    monkeypatch.setattr(split, "_plan_entries", 0)
    torch.manual_seed(0)
    for net in (_net(), nn.Sequential(nn.Linear(8, 3)), _net()):
        grads, _, reference = _split_then_fused(net, torch.randn(5, 8))
        _assert_same_grads(grads, reference)
        (plans,) = split._PLANS.values()
        assert len(plans) == 1 and split._plan_entries == len(plans[0][0])


class _Branchy(nn.Module):
    """Uses `gate` through a linear, or also through a product (not split) when the
    input's sum is positive: the same module, two graph shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate(x)
        if x.sum() > 0:
            h = h * self.gate.weight.sum()
        return self.out(h)


def test_a_graph_of_another_shape_gets_its_own_plan() -> None:
    """Data-dependent control flow: the second microbatch also uses gate.weight
    outside a linear, so its graph has another signature; B does not reuse the
    first plan (which would drop that use's gradient) but finds gate.weight not
    split there and computes its gradient in B. Both microbatches equal fused
    backwards."""
    torch.manual_seed(0)
    net = _Branchy()
    reference = copy.deepcopy(net)
    xs = [-torch.ones(3, 4), torch.ones(3, 4)]
    after_b = []
    stashes = []
    for x in xs:
        stash = WStash()
        y = net(x)
        backward_input(y, torch.ones_like(y), None, stash)
        after_b.append([n for n, p in net.named_parameters() if p.grad is not None])
        stashes.append(stash)
        reference(x).backward(torch.ones(3, 2))
    assert after_b == [[], ["gate.weight"]]
    for stash in stashes:
        stash.run()
    _assert_same_grads({n: p.grad for n, p in net.named_parameters()}, reference)


def test_several_outputs_and_inputs() -> None:
    """A stage taking and returning several tensors: B takes the outputs with their
    gradients (None for one that needs none) and returns the inputs' gradients as
    a list, None for an input nothing reaches."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 3), nn.Linear(4, 3)
    a, b, unused = (torch.randn(2, 4, requires_grad=True) for _ in range(3))
    outs = (first(a), second(b), torch.zeros(2))
    grads = [torch.ones(2, 3), torch.full((2, 3), 2.0), None]
    stash = WStash()
    found = backward_input(outs, grads, [a, b, unused], stash)
    assert first.weight.grad is None
    torch.testing.assert_close(found[0], first.weight.sum(0).expand(2, 4))
    torch.testing.assert_close(found[1], 2 * second.weight.sum(0).expand(2, 4))
    assert found[2] is None
    stash.run()
    torch.testing.assert_close(first.weight.grad, a.detach().sum(0).expand(3, 4))
    assert backward_input(torch.zeros(2), None, [a], WStash()) == [None]


def test_bad_arguments_get_autograds_errors() -> None:
    """What `torch.autograd.grad` rejects, B rejects with its message (the fast
    engine call is only for arguments it would accept); `norms` is in-b or deferred."""
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        backward_input(lin(x), torch.ones(3, 3), x, WStash())
    with pytest.raises(RuntimeError, match="implicitly created only for scalar"):
        backward_input(lin(x), None, x, WStash())
    with pytest.raises(ValueError, match="norms must be 'in-b' or 'deferred'"):
        backward_input(lin(x), torch.ones(2, 3), x, WStash(), norms="x")


@pytest.mark.parametrize("norms", ["in-b", "deferred"])
def test_w_records_no_graph_when_called_with_grad_mode_on(norms: str) -> None:
    """W run outside ``torch.no_grad()`` (as the profile and the GPU memory test call
    it) still records no graph: no weight gradient gets a ``grad_fn``, so nothing
    of the stash stays reachable from ``.grad`` after W (docs/architecture.md,
    `split`)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    x = torch.randn(4, 8, requires_grad=True)
    y = net(x)
    stash = WStash()
    backward_input(y, torch.randn_like(y), x, stash, norms=norms)
    del y
    assert torch.is_grad_enabled()
    stash.run()
    for name, p in net.named_parameters():
        assert p.grad is not None, name
        assert p.grad.grad_fn is None and not p.grad.requires_grad, name


def test_autocast_linears_take_the_bulk_w_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 autocast nn.Linear layers (weight and bias cast on their way in)
    are W's bulk linear group, not one Python call per node, and W's gradients
    equal a fused backward's, in the parameters' fp32."""
    import ppdsl.runtime.execution.split as split_module

    calls: list[int] = []
    bulk = split_module._linear_weight_grads
    monkeypatch.setattr(split_module, "_linear_weight_grads",
                        lambda dys, *rest: calls.append(len(dys)) or bulk(dys, *rest))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4))
    reference = copy.deepcopy(net)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = net(x)
        y_ref = reference(x)
    stash = WStash()
    backward_input(y, torch.ones_like(y), x, stash)
    stash.run()
    assert calls == [3]
    y_ref.backward(torch.ones_like(y_ref))
    for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, q.grad), name


# dynamo, tracing the compiled region, reads a non-leaf's .grad and warns (torch's own)
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compiled_regions_are_named_and_pieces_between_linears_split() -> None:
    """A torch.compile'd block is one autograd node: its parameters are named as
    not split, with what to do (docs/runtime.md, Limits); compiling only what lies
    between the linears keeps every linear split."""
    torch.manual_seed(0)
    whole = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)),
                          backend="aot_eager")
    names = uncovered_parameters(whole, torch.randn(4, 8))
    assert len(names) == 4 and all("torch.compile region" in n for n in names), names
    pieces = nn.Sequential(nn.Linear(8, 16), torch.compile(nn.GELU(), backend="aot_eager"),
                           nn.Linear(16, 4))
    assert uncovered_parameters(pieces, torch.randn(4, 8)) == []
    grads, after_b, reference = _split_then_fused(pieces, torch.randn(4, 8))
    assert after_b == []
    _assert_same_grads(grads, reference)
