"""`ppdsl.runtime.execution.memory.DevicePeak`, the CUDA peak `ppdsl run` reports, on a fake
allocator (no GPU needed): opened after zero_grad and closed when the passes end,
every step's window starts from the same state, so step 1 reads what later steps
read. Per-pass windows measure working memory without losing the step's peak;
`predicted_device_peak` (the memory model + stash gradients + parameter
gradients + working memory) predicts the peak of a real step on the CUDA
allocator's counters imitated on CPU (tests/oracles/allocator.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppdsl.backend.plan import PassKeys
from ppdsl.ir.schedule import PassKind
from ppdsl.runtime.execution.memory import DevicePeak, predicted_device_peak
from ppdsl.runtime.execution.pipeline import PipelineRunner, load_schedule
from ppdsl.runtime.models.model import build_model
from ppdsl.runtime.training.summary import with_real_mw
from tests.oracles.allocator import HostAllocator
from tests.paths import ROOT


class _Allocator:
    """Parameters P; gradients G (freed by zero_grad(set_to_none)); optimizer state
    S (made by the first optimizer step); activations A during the passes."""

    P, G, S, A = 1000, 1000, 2000, 300

    def __init__(self) -> None:
        self.now = self.P
        self.high = self.now
        self.has_state = False

    def alloc(self, n: int) -> None:
        self.now += n
        self.high = max(self.high, self.now)

    def reset(self) -> None:
        self.high = self.now


def test_every_step_measured_from_the_same_state() -> None:
    """Three steps in the training loop's order (zero_grad, open, passes with
    their gradients, close, optimizer step): each window reads A + G, the first
    step's the same as the later ones' (before, step 1 read A + G + S from a
    baseline taken before zero_grad, later steps A + S... from one with G)."""
    a = _Allocator()
    peak = DevicePeak(torch.device("cuda", 0), allocated=lambda: a.now, peak=lambda: a.high,
                      reset=a.reset)
    seen = []
    grads = False
    for _ in range(3):
        if grads:  # zero_grad(set_to_none=True)
            a.now -= a.G
            grads = False
        peak.start()
        a.alloc(a.A)  # the passes: activations, then the gradients
        a.alloc(a.G)
        grads = True
        a.now -= a.A
        peak.stop()
        seen.append(peak.bytes)
        if not a.has_state:  # the optimizer's first step makes its state
            a.alloc(a.S)
            a.has_state = True
    assert seen == [a.A + a.G] * 3


def test_pass_windows_keep_the_step_peak() -> None:
    """A pass window resets the counter; the step's window still reads the
    highest point of the step (also one reached between passes), and each
    pass's working memory is its rise above the larger of its before and after."""
    a = _Allocator()
    peak = DevicePeak(torch.device("cuda", 0), allocated=lambda: a.now, peak=lambda: a.high,
                      reset=a.reset)
    peak.start()
    with peak.pass_window(PassKind.F, 0):
        a.alloc(500)  # a transient
        a.now -= 500
        a.alloc(100)  # what F keeps
    a.alloc(700)  # between passes (a receive buffer, say), gone before the next
    a.now -= 700
    with peak.pass_window(PassKind.B, 0):
        a.alloc(50)
        a.now -= 150
    peak.stop()
    assert peak.bytes == 800
    assert peak.working == {(PassKind.F, 0): 400, (PassKind.B, 0): 50}


SOURCE = """schedule two_stages_one_rank {{
    param d = 1
    param m = 3
    place [0, 0]
    {backward}
    order {{
        for j in 0..m {{ F(j, 0); F(j, 1) }}
        for j in 0..m {{ {backs} }}
    }}
}}
"""


@pytest.mark.slow
@pytest.mark.parametrize("split", [True, False], ids=["split", "fused"])
def test_device_peak_predicted_on_imitated_allocator(one_rank, tmp_path: Path, split: bool) -> None:
    """Two stages on one rank, the second of two steps (gradients set to None
    before each, as `ppdsl run` does) under the allocator's counters imitated on
    CPU: `predicted_device_peak` is within 2% of the step's peak; split, the
    model's activations alone miss it by over 5% (working memory, stash and
    parameter gradients)."""
    backs = "B(j, 1); W(j, 1); B(j, 0); W(j, 0)" if split else "BW(j, 1); BW(j, 0)"
    path = tmp_path / "s.pp"
    path.write_text(SOURCE.format(backward="backward split" if split else "backward fused", backs=backs))
    compiled = load_schedule(path)
    model = build_model(str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages", 2)
    runner = PipelineRunner(compiled, model.stage, model.loss, device="cpu", note=lambda _: None)
    inputs, targets = model.batch(0, 6)
    runner.step(inputs, targets)  # the first step's one-off work (the probe) left out
    for p in runner.parameters():
        p.grad = None
    with HostAllocator() as h:
        peak = DevicePeak(torch.device("cpu"), allocated=h.now, peak=h.high, reset=h.reset)
        runner.engine.device_peak = peak
        peak.start()
        runner.step(inputs, targets, measure_memory=True)
        peak.stop()
    engine = runner.engine
    memory = with_real_mw(compiled.plan.memory, engine.measured_mw_ratio(),
                           engine.measured_mi_ratio())
    order = list(PassKeys(compiled.plan.orders[0].passes))
    grads = {s: sum(p.numel() * p.element_size() for p in st.parameters())
             for s, st in runner.stages.items()}
    predicted = predicted_device_peak(order, memory, engine.stage_bytes(), working=peak.working,
                                      stash_gradients=engine.meter.stash_gradient_bytes(),
                                      first_gradients=grads)
    assert peak.bytes is not None
    assert abs(predicted / peak.bytes - 1) < 0.02, (predicted, peak.bytes)
    if split:  # the W stashes' gradients and W's own work are what the model alone misses
        alone = predicted_device_peak(order, memory, engine.stage_bytes())
        assert alone / peak.bytes < 0.95, (alone, peak.bytes)
