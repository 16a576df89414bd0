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
from ppdsl.ir.schedule import PassKind, Schedule

__all__ = ["lower", "receive_buffers_peak"]


def lower(schedule: Schedule) -> tuple[RankProgram, ...]:
    """One program per rank, in rank order. F(j, s) receives stage s-1's activation
    and sends its own to s+1; B or BW(j, s) receives stage s+1's input gradient and
    sends its own to s-1; only where the two stages sit on different ranks. Each
    transfer is built once and shared by its sender's and receiver's programs."""
    dev = schedule.placement.stage_device
    last = len(dev) - 1
    F, B, BW = PassKind.F, PassKind.B, PassKind.BW
    act: dict[tuple[int, int], Transfer] = {}  # (microbatch, sending stage) -> transfer
    grad: dict[tuple[int, int], Transfer] = {}

    def act_of(j: int, src: int) -> Transfer:
        t = act.get((j, src))
        if t is None:
            t = act[(j, src)] = Transfer(TransferKind.ACT, j, src, src + 1, dev[src], dev[src + 1])
        return t

    def grad_of(j: int, src: int) -> Transfer:
        t = grad.get((j, src))
        if t is None:
            t = grad[(j, src)] = Transfer(
                TransferKind.GRAD, j, src, src - 1, dev[src], dev[src - 1]
            )
        return t

    # per stage: does its F (B) receive from / send to another rank?
    f_in = [s > 0 and dev[s - 1] != dev[s] for s in range(last + 1)]
    f_out = [s < last and dev[s + 1] != dev[s] for s in range(last + 1)]
    b_in, b_out = f_out, f_in
    programs = []
    for rank, order in enumerate(schedule.orders):
        ops: list[Op] = []
        append = ops.append
        pending: tuple[Transfer, ...] = ()  # the previous pass's sends
        for p in order:
            kind, j, s = p.kind, p.microbatch, p.stage
            if kind is F:
                recvs = (act_of(j, s - 1),) if f_in[s] else ()
            elif kind is B or kind is BW:
                recvs = (grad_of(j, s + 1),) if b_in[s] else ()
            else:
                recvs = ()
            if pending or recvs:
                append(Exchange(pending, recvs))
            append(Compute(p))
            if kind is F:
                pending = (act_of(j, s),) if f_out[s] else ()
            elif kind is B or kind is BW:
                pending = (grad_of(j, s),) if b_out[s] else ()
            else:
                pending = ()
        if pending:
            append(Exchange(pending, ()))
        programs.append(RankProgram(rank, tuple(ops)))
    return tuple(programs)


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
