"""Shapes per microbatch (variable lengths, issue 38): what each transfer of
a step holds when its microbatches vary in tokens.

The probe (`PipelineRunner`'s first step) finds every stage's output at the
first microbatch's token count; a leaf whose dim 1 had that size carries
tokens, and in a later microbatch of n tokens it has n there
(`TokenShapes.expected`). Every rank computes the step's lengths from the same
data, so receivers know each transfer's shape without a header; nothing is
padded. The sender checks what it made before sending (`TokenShapes.check`):
a stage whose output does not keep its input's tokens stops with a
`ShapeError` naming the microbatch and both shapes, and no receiver waits for
a tensor of another size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ppdsl.ir.rank import TransferKind
from ppdsl.runtime.errors import ShapeError

__all__ = ["TokenShapes", "given_microbatches"]


@dataclass(frozen=True)
class TokenShapes:
    """The shape rule of one pipeline, from its probe."""

    probe_tokens: int | None
    """The tokens of the microbatch the stages were probed with (None: the
    shapes do not vary)."""

    def expected(self, shape: Sequence[int], tokens: int | None) -> torch.Size:
        """A probed leaf's `shape` in a microbatch of `tokens` tokens: dim 1 set
        to `tokens` where the probe had its token count there (None: as probed)."""
        shape = tuple(shape)
        if tokens is None or len(shape) < 2 or shape[1] != self.probe_tokens:
            return torch.Size(shape)
        return torch.Size((shape[0], tokens, *shape[2:]))

    def check(self, kind: TransferKind, made: Sequence[torch.Tensor], specs: dict[int, Any],
              mb: int, src: int, dst: int, tokens: int, dst_rank: int) -> None:
        """`ShapeError` when a tensor of `made` (microbatch `mb`'s activation or
        gradient from stage `src` to `dst`) is not its probed leaf's shape at
        `tokens` tokens (`specs`: every stage's output `Spec`)."""
        act = kind is TransferKind.ACT
        leaves = [x for x in specs[src if act else dst].leaves() if act or x.differentiable]
        for i, (tensor, leaf) in enumerate(zip(made, leaves, strict=True)):
            expected = self.expected(leaf.shape, tokens)
            if tensor.shape != expected:
                raise ShapeError(
                    f"microbatch {mb}: stage {src} made {'activation' if act else 'gradient'} "
                    f"tensor {i} of shape {list(tensor.shape)} for stage {dst} (rank {dst_rank}), "
                    f"which expects {list(expected)} from the step's lengths ({tokens} tokens); "
                    "a stage's output must keep its input's tokens (dim 1)")


def given_microbatches(value: Any, held: bool, m: int, what: str, rank: int) -> list[Any] | None:
    """A varying-length step's `what` (inputs or targets) as the list of its m
    microbatches where this rank `held`s them, else None; ValueError otherwise."""
    if not held:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != m:
        raise ValueError(f"rank {rank}: with lengths, step() takes the {what} as a list of the "
                         f"{m} microbatches")
    return list(value)
