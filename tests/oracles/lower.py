"""The plain lowering before issue 13 (Python objects per pass), kept as the oracle of the array lowering (tests/lowering/test_lower.py)."""


from __future__ import annotations

from ppdsl.ir.rank import Compute, Exchange, Op, RankProgram, Transfer
from ppdsl.ir.schedule import Schedule
from ppdsl.semantics import KINDS, TransferKind, receives, sends

__all__ = ["lower", "receive_buffers_peak"]

# per (kind code, stage): the (transfer kind, producing stage, consuming stage)
# of what a pass receives, and of what it sends
_Routes = list[list[tuple[tuple[TransferKind, int, int], ...]]]


def _routes(stage_device: tuple[int, ...]) -> tuple[_Routes, _Routes]:
    """The transfer rule per (kind, stage): a tensor a pass takes from, or hands
    to, a stage on another device (`semantics.receives` / `sends`)."""
    S = len(stage_device)
    incoming: _Routes = []
    outgoing: _Routes = []
    for kind in KINDS:
        ins, outs = [], []
        for s in range(S):
            ins.append(
                tuple(
                    (t, s + off, s)
                    for t, off in receives(kind)
                    if 0 <= s + off < S and stage_device[s + off] != stage_device[s]
                )
            )
            outs.append(
                tuple(
                    (t, s, s + off)
                    for t, off in sends(kind)
                    if 0 <= s + off < S and stage_device[s + off] != stage_device[s]
                )
            )
        incoming.append(ins)
        outgoing.append(outs)
    return incoming, outgoing


def lower(schedule: Schedule) -> tuple[RankProgram, ...]:
    """One program per rank, in rank order: each pass receives what it needs
    from other ranks and sends what other ranks need from it
    (`semantics.NEEDS`: F(j, s) takes stage s-1's activation and hands its own
    to s+1; B or BW(j, s) takes stage s+1's input gradient and hands its own to
    s-1). Each transfer is built once and shared by its sender's and
    receiver's programs."""
    dev = schedule.placement.stage_device
    incoming, outgoing = _routes(dev)
    made: dict[tuple[TransferKind, int, int, int], Transfer] = {}

    def transfer(route: tuple[TransferKind, int, int], j: int) -> Transfer:
        kind, src, dst = route
        key = (kind, j, src, dst)
        t = made.get(key)
        if t is None:
            t = made[key] = Transfer(kind, j, src, dst, dev[src], dev[dst])
        return t

    programs = []
    for rank, order in enumerate(schedule.orders):
        ops: list[Op] = []
        append = ops.append
        pending: tuple[Transfer, ...] = ()  # the previous pass's sends
        for p in order:
            code, j, s = p.kind.code, p.microbatch, p.stage
            ins = incoming[code][s]
            recvs = tuple(transfer(r, j) for r in ins) if ins else ()
            if pending or recvs:
                append(Exchange(pending, recvs))
            append(Compute(p))
            outs = outgoing[code][s]
            pending = tuple(transfer(r, j) for r in outs) if outs else ()
        if pending:
            append(Exchange(pending, ()))
        programs.append(RankProgram(rank, tuple(ops)))
    return tuple(programs)


def receive_buffers_peak(program: RankProgram) -> int:
    """The most received tensors the rank holds at once before the passes that
    consume them. A receive pulled forward (`ppdsl.lowering.early_receives`) is
    held from its earlier exchange on; these are transfer buffers, not
    activations, so the memory model does not count them and `stats` shows
    them apart."""
    alive: set[tuple[TransferKind, int, int]] = set()
    peak = 0
    for op in program.ops:
        if type(op) is Exchange:
            alive.update((t.kind, t.microbatch, t.dst_stage) for t in op.recvs)
            peak = max(peak, len(alive))
        elif type(op) is Compute:
            p = op.pass_
            for t, _ in receives(p.kind):
                alive.discard((t, p.microbatch, p.stage))
    return peak
