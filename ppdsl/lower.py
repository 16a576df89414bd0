"""Lowering: insert the transfers each compute pass needs, giving one program
per rank.

A pass's inputs that live on another rank are received just before it; its
outputs that another rank needs are sent just after it. The sends after pass P
and the receives before the next pass Q on the same rank form one `Exchange`
(posted together, waited for together), as Megatron pairs send_forward with
recv_backward; that pairing is what lets neighbours in 1F1B send to each other
at the same time without blocking. Two stages on one rank (the turn of a V)
hand over locally: no transfer.
"""

from __future__ import annotations

from ppdsl.ir.rank import Compute, Exchange, Op, RankProgram, Transfer, TransferKind
from ppdsl.ir.schedule import Pass, PassKind, Schedule

__all__ = ["lower", "inputs_of", "outputs_of", "receive_buffers_peak"]


def inputs_of(p: Pass, schedule: Schedule) -> tuple[Transfer, ...]:
    """Transfers that must arrive on `p`'s rank before `p` can run."""
    dev = schedule.placement.stage_device
    last = schedule.num_stages - 1
    if p.kind is PassKind.F and p.stage > 0:
        src, dst = p.stage - 1, p.stage
        if dev[src] != dev[dst]:
            return (Transfer(TransferKind.ACT, p.microbatch, src, dst, dev[src], dev[dst]),)
    if p.kind in (PassKind.B, PassKind.BW) and p.stage < last:
        src, dst = p.stage + 1, p.stage
        if dev[src] != dev[dst]:
            return (Transfer(TransferKind.GRAD, p.microbatch, src, dst, dev[src], dev[dst]),)
    return ()


def outputs_of(p: Pass, schedule: Schedule) -> tuple[Transfer, ...]:
    """Transfers that `p` produces for another rank."""
    dev = schedule.placement.stage_device
    last = schedule.num_stages - 1
    if p.kind is PassKind.F and p.stage < last:
        src, dst = p.stage, p.stage + 1
        if dev[src] != dev[dst]:
            return (Transfer(TransferKind.ACT, p.microbatch, src, dst, dev[src], dev[dst]),)
    if p.kind in (PassKind.B, PassKind.BW) and p.stage > 0:
        src, dst = p.stage, p.stage - 1
        if dev[src] != dev[dst]:
            return (Transfer(TransferKind.GRAD, p.microbatch, src, dst, dev[src], dev[dst]),)
    return ()


def _lower_rank(rank: int, order: tuple[Pass, ...], schedule: Schedule) -> RankProgram:
    ops: list[Op] = []
    pending_sends: tuple[Transfer, ...] = ()
    for p in order:
        recvs = inputs_of(p, schedule)
        if pending_sends or recvs:
            ops.append(Exchange(pending_sends, recvs))
        ops.append(Compute(p))
        pending_sends = outputs_of(p, schedule)
    if pending_sends:
        ops.append(Exchange(pending_sends, ()))
    return RankProgram(rank, tuple(ops))


def lower(schedule: Schedule) -> tuple[RankProgram, ...]:
    """One program per rank, in rank order."""
    return tuple(
        _lower_rank(rank, order, schedule) for rank, order in enumerate(schedule.orders)
    )


def receive_buffers_peak(program: RankProgram) -> int:
    """The most received tensors the rank holds at once before the passes that
    consume them. A receive pulled forward (see ppdsl.checks.deadlock) is held
    from its earlier exchange on; these are transfer buffers, not activations,
    so the memory model does not count them and `stats` shows them apart."""
    alive: set[tuple[TransferKind, int, int]] = set()
    peak = 0
    for op in program.ops:
        if type(op) is Exchange:
            alive.update((t.kind, t.microbatch, t.dst_stage) for t in op.recvs)
            peak = max(peak, len(alive))
        elif type(op) is Compute:
            p = op.pass_
            if p.kind is PassKind.F:
                alive.discard((TransferKind.ACT, p.microbatch, p.stage))
            elif p.kind in (PassKind.B, PassKind.BW):
                alive.discard((TransferKind.GRAD, p.microbatch, p.stage))
    return peak
