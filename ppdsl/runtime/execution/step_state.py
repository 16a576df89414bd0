"""One step's state on one rank (`ppdsl.runtime.execution.engine`): made at the
step's start, dropped at its end, so that nothing of a step outlives it on the
engine. What a forward keeps for its B, a recomputed stage's F for its R (with
the RNG state it ran with), B for its W, and the values and transfers in
flight between stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ppdsl.ir.rank import Transfer, TransferKind
from ppdsl.runtime.execution.split import WStash
from ppdsl.runtime.execution.transport import PendingRecv, PendingSend

__all__ = ["Key", "Kept", "RngState", "Saved", "StepState"]


class RngState:
    """The RNG state when a recomputed stage's F starts (CPU, and this device's
    on CUDA), so that R draws what F drew."""

    def __init__(self, device: torch.device) -> None:
        self.devices = [device] if device.type == "cuda" else []
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]

    @contextlib.contextmanager
    def restored(self) -> Any:
        """Run with F's RNG state; the state outside is left as it was."""
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            for d, state in zip(self.devices, self.cuda, strict=True):
                torch.cuda.set_rng_state(state, d)
            yield


@dataclass
class Saved:
    """What a microbatch-stage's forward keeps for its B: the inputs whose
    gradients B returns, the positions among the output's differentiable leaves
    that get a gradient back (`[0]` for the loss), and the outputs B runs from
    (the scaled loss on a last stage)."""

    inputs: list[torch.Tensor]
    grad_positions: list[int]
    outputs: list[torch.Tensor]


@dataclass
class Kept:
    """What a recomputed stage's F keeps for its R: its input value, the input
    tensors that will want gradients, and the RNG state F ran with."""

    value: Any
    inputs: list[torch.Tensor]
    rng: RngState


Key = tuple[TransferKind, int, int]
"""A value between stages: (activation or gradient, microbatch, the stage that takes it)."""


@dataclass
class StepState:
    """One step's state on this rank, made at the step's start and dropped at its
    end (`Engine.step`), keyed by (microbatch, stage) or `Key`."""

    inputs: Sequence[Any] | None
    targets: Sequence[Any] | None
    loss_scale: torch.Tensor | float | None
    measure: bool
    lengths: Sequence[int] | None = None
    """Each microbatch's tokens (variable-length microbatches), or None: shapes
    are those the probe found."""
    weights: Sequence[float] | None = None
    """Each microbatch's share of the step's loss (its targets over the step's),
    or None: 1/m each."""
    inbox: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    """Values ready for the pass that takes them (handed over or received)."""
    outbox: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    """Values made, waiting for the exchange that sends them (keyed by the sender)."""
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    stash: dict[tuple[int, int], WStash] = field(default_factory=dict)
    """B's weight-gradient work, waiting for W."""
    kept: dict[tuple[int, int], Kept] = field(default_factory=dict)
    sends: list[PendingSend] = field(default_factory=list)
    """Sends in flight (their tensors kept alive until they complete)."""
    posted: dict[Transfer, list[PendingRecv]] = field(default_factory=dict)
    """Receives posted ahead of their exchange."""
    arriving: dict[Key, tuple[Transfer, list[PendingRecv]]] = field(default_factory=dict)
    """Receives of exchanges passed, waiting for the pass that takes them."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """Each microbatch's loss / m, summed once at the end: no GPU sync per pass."""
