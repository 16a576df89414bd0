"""The B/W split (`ppdsl.runtime.split`) and the memory meter, in one process:
B computes input gradients only, W the weight gradients, together exactly what a
fused backward computes; on any thread; frozen parameters untouched; what B keeps
for W is what the meter measures."""

from __future__ import annotations

import copy
import re
import threading
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

from ppdsl.ir.schedule import PassKind
from ppdsl.runtime.memory import MemoryMeter, storage_bytes
from ppdsl.runtime.model import build_model
from ppdsl.runtime.split import (
    WStash,
    accumulate_grad,
    backward_input,
    defer,
    split_aware,
    uncovered_parameters,
)

ROOT = Path(__file__).resolve().parent.parent
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


def _split_then_fused(
    stage: nn.Module, inputs: torch.Tensor, *, other_thread: bool = False
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
        found["dx"] = backward_input(out, grad_out, x if floating else None, stash)

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


def test_b_computes_only_input_grads_and_w_the_weight_grads() -> None:
    """After B the input gradient equals plain autograd's and no parameter has a
    gradient; W then sets every one, equal to a fused backward's."""
    grads, after_b, reference = _split_then_fused(_net(), torch.randn(5, 8))
    assert after_b == []
    _assert_same_grads(grads, reference)


@pytest.mark.parametrize("stage_index", [0, 1])
def test_split_defers_every_weight_grad_from_another_thread(stage_index: int) -> None:
    """The CPU stand-in for CUDA's autograd worker threads: the stash is set up on
    this thread and B runs on another; every weight gradient of a tiny_gpt stage
    (embeddings, layer norms, linears) is still deferred to W and W's equal a fused
    backward's."""
    model = build_model(TINY, 2)
    ids, _ = model.batch(0, 2)
    inputs = ids if stage_index == 0 else model.stage(0)(ids).detach()
    grads, after_b, reference = _split_then_fused(model.stage(stage_index), inputs, other_thread=True)
    assert after_b == []
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


def test_frozen_parameters_get_no_gradient() -> None:
    """LoRA-style fine-tuning: parameters with requires_grad=False get no .grad
    from B or W (issue 10); the trainable ones get a fused backward's."""
    model = build_model(TINY, 2)
    ids, _ = model.batch(0, 2)
    stage = model.stage(1)
    frozen = {"0.qkv.weight", "0.norm1.weight", "1.up.bias", "8.out.weight", "8.norm.bias"}
    for name, p in stage.named_parameters():
        p.requires_grad_(name not in frozen)
    grads, after_b, reference = _split_then_fused(stage, model.stage(0)(ids).detach())
    assert after_b == []
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


def test_meter_measures_what_b_keeps_for_w() -> None:
    """1 M_B right after F; after B exactly what W reads (each linear's input, the
    layer norm's input, mean and rstd): all of F's bytes but GELU's input; nothing
    after W."""
    net = _net()
    meter = MemoryMeter(net.parameters())
    x = torch.randn(64, 8, requires_grad=True)
    with meter.saving((0, 0)):
        y = net(x)
    meter.after(PassKind.F, (0, 0), Fraction(1))
    assert meter.f_bytes[(0, 0)] > 0 and meter.peak_units == 1
    stash = WStash()
    backward_input(y, torch.ones_like(y), x, stash)
    del y
    meter.set_stash((0, 0), stash.tensors, stash.gradients)
    meter.after(PassKind.B, (0, 0), Fraction(1))
    gelu_input = 64 * 16 * 4
    assert meter.after_b[(0, 0)] == meter.f_bytes[(0, 0)] - gelu_input
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


@pytest.mark.parametrize(("factory", "low", "high"), [("stages", 0.4, 0.6), ("stages_long", 0.1, 0.25)])
def test_tiny_gpt_real_mw_ratio(factory: str, low: float, high: float) -> None:
    """Measured, not assumed: what a tiny_gpt stage keeps from B to W is about 0.5 M_B
    with 16 tokens and fused attention, about 0.2 with 128 tokens and unfused
    attention (whose seq^2 probabilities B frees)."""
    model = build_model(TINY.replace(":stages", f":{factory}"), 4)
    stage = model.stage(1)
    x = model.stage(0)(model.batch(0, 1)[0]).detach().requires_grad_()
    meter = MemoryMeter(stage.parameters())
    with meter.saving((0, 1)):
        y = stage(x)
    meter.after(PassKind.F, (0, 1), Fraction(1))
    stash = WStash()
    backward_input(y, torch.ones_like(y), x, stash)
    del y
    meter.set_stash((0, 1), stash.tensors)
    meter.after(PassKind.B, (0, 1), Fraction(1))
    ratio = meter.after_b[(0, 1)] / meter.f_bytes[(0, 1)]
    assert low < ratio < high, ratio


def test_autocast_weights_are_split() -> None:
    """Under bf16 autocast (weights cast on their way to the matmul) every weight
    gradient is still deferred, and W's equal a fused backward's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    reference = copy.deepcopy(net)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = net(x)
        y_ref = reference(x)
    stash = WStash()
    backward_input(y, torch.ones_like(y), x, stash)
    assert all(p.grad is None for p in net.parameters())
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
