"""`ppdsl.runtime.memory.DevicePeak`, the CUDA peak `ppdsl run` reports, on a fake
allocator (no GPU needed): opened after zero_grad and closed when the passes end,
every step's window starts from the same state, so step 1 reads what later steps
read."""

from __future__ import annotations

import torch

from ppdsl.runtime.memory import DevicePeak


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
