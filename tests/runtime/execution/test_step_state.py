"""One step's state (`ppdsl.runtime.execution.step_state`): what it holds is
made per step, and a recompute draws what its forward drew."""

from __future__ import annotations

import torch

from ppdsl.runtime.execution.step_state import RngState, StepState


def test_each_step_starts_empty() -> None:
    """Two step states share none of their tables: what one step leaves (a
    pending value, a loss) is not seen by the next."""
    first = StepState([torch.ones(1)], None, None, measure=True)
    first.inbox[(None, 0, 1)] = [torch.ones(1)]  # type: ignore[index]
    first.losses.append(torch.ones(()))
    second = StepState(None, None, None, measure=False)
    assert not second.inbox and not second.losses and not second.saved and not second.sends
    assert first.measure and not second.measure


def test_rng_state_replays_the_forwards_draws() -> None:
    """Restored, the RNG draws what it drew when the state was taken (dropout's
    mask in R equals F's), and the stream outside goes on as if nothing ran."""
    torch.manual_seed(7)
    state = RngState(torch.device("cpu"))
    forward = torch.rand(4)
    after_forward = torch.get_rng_state()
    with state.restored():
        again = torch.rand(4)
    assert torch.equal(forward, again)
    assert torch.equal(torch.get_rng_state(), after_forward)
