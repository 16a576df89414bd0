"""The rank-program IR: per rank, the compute passes plus the transfers they
need, in the order the rank performs them.

Lowering (`ppdsl.lowering.lower`) builds it from the schedule IR; the deadlock check,
codegen and the runtime consume it. Communication is grouped: an `Exchange` is
one batch of point-to-point operations that the rank posts together and waits
for together (torch.distributed.batch_isend_irecv), the way Megatron's
send_forward_recv_backward pairs a send with a receive so neighbours do not
block on each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppdsl.ir.schedule import Pass, format_pass
from ppdsl.semantics import TransferKind

__all__ = [
    "TransferKind",
    "Transfer",
    "Compute",
    "Exchange",
    "Op",
    "RankProgram",
    "format_rank_programs",
]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One tensor moving between ranks: produced by `src_stage` on `src_rank`,
    consumed by `dst_stage` on `dst_rank`, for `microbatch`."""

    kind: TransferKind
    microbatch: int
    src_stage: int
    dst_stage: int
    src_rank: int
    dst_rank: int

    def __str__(self) -> str:
        return (
            f"{self.kind.value}(mb {self.microbatch}, stage {self.src_stage}->{self.dst_stage},"
            f" rank {self.src_rank}->{self.dst_rank})"
        )


@dataclass(frozen=True, slots=True)
class Compute:
    """Run one compute pass."""

    pass_: Pass


@dataclass(frozen=True, slots=True)
class Exchange:
    """Post these sends and receives together, then wait for all of them."""

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


Op = Compute | Exchange


@dataclass(frozen=True)
class RankProgram:
    """What one rank does, in order."""

    rank: int
    ops: tuple[Op, ...]


def format_rank_programs(programs: tuple[RankProgram, ...], multi_stage: bool = True) -> str:
    """Canonical text: one line per op, `send`/`recv` lines inside an exchange."""
    lines: list[str] = []
    for prog in programs:
        lines.append(f"rank {prog.rank}:")
        for op in prog.ops:
            if isinstance(op, Compute):
                lines.append(f"  {format_pass(op.pass_, multi_stage)}")
            else:
                parts = [f"send {t}" for t in op.sends] + [f"recv {t}" for t in op.recvs]
                lines.append("  exchange { " + "; ".join(parts) + " }")
    return "\n".join(lines) + "\n"
