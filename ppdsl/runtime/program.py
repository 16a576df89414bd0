"""The vocabulary generated rank programs are written in: one call per op, so a
generated file reads like the schedule (`F(3, 0)`, `exchange(sends=..., recvs=...)`)."""

from __future__ import annotations

from ppdsl.ir.rank import Compute, Exchange, Transfer, TransferKind
from ppdsl.ir.schedule import Pass, PassKind

__all__ = ["F", "B", "W", "BW", "R", "act", "grad", "exchange"]


def F(microbatch: int, stage: int) -> Compute:
    """Forward of `microbatch` through `stage`."""
    return Compute(Pass(PassKind.F, microbatch, stage))


def B(microbatch: int, stage: int) -> Compute:
    """Input-gradient backward."""
    return Compute(Pass(PassKind.B, microbatch, stage))


def W(microbatch: int, stage: int) -> Compute:
    """Weight-gradient backward."""
    return Compute(Pass(PassKind.W, microbatch, stage))


def BW(microbatch: int, stage: int) -> Compute:
    """Fused backward."""
    return Compute(Pass(PassKind.BW, microbatch, stage))


def R(microbatch: int, stage: int) -> Compute:
    """Recompute: the forward run again on what a recomputed stage's F kept."""
    return Compute(Pass(PassKind.R, microbatch, stage))


def act(microbatch: int, src_stage: int, dst_stage: int, src_rank: int, dst_rank: int) -> Transfer:
    """A forward activation moving between ranks."""
    return Transfer(TransferKind.ACT, microbatch, src_stage, dst_stage, src_rank, dst_rank)


def grad(microbatch: int, src_stage: int, dst_stage: int, src_rank: int, dst_rank: int) -> Transfer:
    """An input gradient moving back between ranks."""
    return Transfer(TransferKind.GRAD, microbatch, src_stage, dst_stage, src_rank, dst_rank)


def exchange(sends: tuple[Transfer, ...] = (), recvs: tuple[Transfer, ...] = ()) -> Exchange:
    """Post these sends and receives together; wait for the receives."""
    return Exchange(tuple(sends), tuple(recvs))
