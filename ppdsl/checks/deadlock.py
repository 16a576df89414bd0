"""The lowered rank programs cannot deadlock under blocking exchanges.

Semantics (what a runtime that posts every op of an exchange with
`torch.distributed.batch_isend_irecv` and then waits for all of them does, with
no buffering assumed):

- Each rank runs its ops in order.
- A `Compute` finishes by itself: its inputs are on the rank already (an earlier
  pass of the rank, or a receive of an earlier exchange).
- At an `Exchange` the rank *posts* all its sends and receives at once, then
  waits until every one of them has completed.
- A send of transfer t completes once the receiving rank has posted the receive
  of t; a receive completes once the sending rank has posted the send of t
  (a rendezvous: neither side's op finishes before the other side posts). A
  rank has posted an op when it has reached the exchange that holds it.

So an exchange of rank r completes when every peer rank has reached the
exchange holding the matching op. The programs are deadlock-free when running
every rank this way reaches the end of every program. Without buffering is the
conservative case: a schedule that runs under rendezvous also runs when NCCL or
gloo buffer small messages.

When ranks get stuck, each stuck rank waits for at least one peer that has not
reached its matching exchange; following those waits ends in a cycle, reported
one line per wait, each at the pass that sends or receives the tensor. A send or
receive with no matching op anywhere is reported on its own.
"""

from __future__ import annotations

import numba
import numpy as np

from ppdsl.diagnostics import Diagnostic, Span
from ppdsl.ir.rank import Exchange, RankProgram, Transfer, TransferKind
from ppdsl.ir.schedule import Pass, PassKind, Schedule, format_pass

__all__ = ["check", "Wait", "stuck_waits"]


class Wait:
    """Rank `rank`, at op `op_index`, waits for `peer` to post the other side of
    `transfer`; `sending` says whether this rank is the sender."""

    __slots__ = ("rank", "op_index", "peer", "transfer", "sending")

    def __init__(self, rank: int, op_index: int, peer: int, transfer: Transfer, sending: bool):
        self.rank, self.op_index, self.peer = rank, op_index, peer
        self.transfer, self.sending = transfer, sending

    def describe(self) -> str:
        t = self.transfer
        what = f"{t.kind.value}(stage {t.src_stage}->{t.dst_stage}, mb {t.microbatch})"
        if self.sending:
            return f"rank {self.rank} waits for send {what} to rank {self.peer}"
        return f"rank {self.rank} waits for recv {what} from rank {self.peer}"


@numba.njit(cache=True)
def _run(offsets, req_offsets, req_rank, req_op):  # pragma: no cover - numba
    """Advance every rank while each requirement of its next op holds
    (`req_rank[k]` has reached global op index `req_op[k]`). Returns positions."""
    num_ranks = offsets.shape[0] - 1
    position = offsets[:-1].copy()
    moved = True
    while moved:
        moved = False
        for r in range(num_ranks):
            k = position[r]
            stop = offsets[r + 1]
            while k < stop:
                ok = True
                for q in range(req_offsets[k], req_offsets[k + 1]):
                    if position[req_rank[q]] < req_op[q]:
                        ok = False
                        break
                if not ok:
                    break
                k += 1
                moved = True
            position[r] = k
    return position


def _key(t: Transfer) -> tuple[int, int, int, bool]:
    """A cheap hashable identity for a transfer (Transfer's own hash is slow)."""
    return (t.microbatch, t.src_stage, t.dst_stage, t.kind is TransferKind.ACT)


def _index(programs: tuple[RankProgram, ...], sends_block: bool = True):
    """Global op indices, where each transfer is sent and received, and the
    requirements of each op as flat arrays."""
    offsets = [0]
    for prog in programs:
        offsets.append(offsets[-1] + len(prog.ops))
    sent: dict[tuple, tuple[int, int]] = {}  # transfer key -> (rank, global op index)
    received: dict[tuple, tuple[int, int]] = {}
    posted: list[tuple[int, int, Transfer, tuple, bool]] = []  # (rank, op, transfer, key, sending)
    duplicates: list[tuple[int, int, Transfer, bool]] = []
    for r, prog in enumerate(programs):
        base = offsets[r]
        for i, op in enumerate(prog.ops):
            if type(op) is not Exchange:
                continue
            for t in op.sends:
                key = _key(t)
                if key in sent:
                    duplicates.append((r, i, t, True))
                sent[key] = (r, base + i)
                posted.append((r, i, t, key, True))
            for t in op.recvs:
                key = _key(t)
                if key in received:
                    duplicates.append((r, i, t, False))
                received[key] = (r, base + i)
                posted.append((r, i, t, key, False))
    total = offsets[-1]
    req_rank: list[int] = []
    req_op: list[int] = []
    owner: list[int] = []  # the global op index each requirement belongs to
    unmatched: list[tuple[int, int, Transfer, bool]] = []
    # `posted` is in (rank, op) order, so the requirements of each op are contiguous
    for r, i, t, key, sending in posted:
        peer = (received if sending else sent).get(key)
        if peer is None:
            unmatched.append((r, i, t, sending))
            peer = (r, total + 1)  # never reached: the rank waits forever
        elif sending and not sends_block:
            continue
        req_rank.append(peer[0])
        req_op.append(peer[1])
        owner.append(offsets[r] + i)
    req_counts = np.bincount(np.asarray(owner, dtype=np.int64), minlength=total)
    req_offsets = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(req_counts, out=req_offsets[1:])
    return (
        np.asarray(offsets, dtype=np.int64),
        req_offsets,
        np.asarray(req_rank, dtype=np.int64),
        np.asarray(req_op, dtype=np.int64),
        sent,
        received,
        unmatched,
        duplicates,
    )


def stuck_waits(
    programs: tuple[RankProgram, ...], sends_block: bool = True
) -> tuple[list[list[Wait]], list[tuple], list[tuple]]:
    """(cycles of waits, unmatched ops, duplicated ops). All empty: no deadlock."""
    index = _index(programs, sends_block)
    offsets, req_offsets, req_rank, req_op, sent, received, unmatched, duplicates = index
    position = _run(offsets, req_offsets, req_rank, req_op)
    waits: dict[int, Wait] = {}
    for r, prog in enumerate(programs):
        k = int(position[r])
        if k >= offsets[r + 1]:
            continue
        i = k - int(offsets[r])
        op = prog.ops[i]
        assert type(op) is Exchange
        for group, other, sending in ((op.sends, received, True), (op.recvs, sent, False)):
            if sending and not sends_block:
                continue
            for t in group:
                peer = other.get(_key(t))
                if peer is not None and position[peer[0]] < peer[1]:
                    waits.setdefault(r, Wait(r, i, peer[0], t, sending))
    cycles: list[list[Wait]] = []
    state: dict[int, int] = {}
    for first in sorted(waits):
        walk: list[int] = []
        r = first
        while r in waits and r not in state:
            state[r] = 1
            walk.append(r)
            r = waits[r].peer
        if r in waits and state.get(r) == 1:
            cycles.append([waits[x] for x in walk[walk.index(r) :]])
        for x in walk:
            state[x] = 2
    return cycles, unmatched, duplicates


def _pass_spans(schedule: Schedule) -> dict[tuple[PassKind, int, int], Span | None]:
    return {p.key: p.span for order in schedule.orders for p in order}


def _span_of(
    t: Transfer, sending: bool, schedule: Schedule, spans: dict
) -> tuple[Span | None, str]:
    """The pass that produces (sending) or consumes (receiving) the tensor."""
    stage = t.src_stage if sending else t.dst_stage
    if t.kind is TransferKind.ACT:
        kind = PassKind.F
    else:
        kind = PassKind.B if schedule.split_backward else PassKind.BW
    key = (kind, t.microbatch, stage)
    return spans.get(key), format_pass(Pass(kind, t.microbatch, stage), True)


def check(
    schedule: Schedule, programs: tuple[RankProgram, ...], *, sends_block: bool = True
) -> list[Diagnostic]:
    """Deadlock cycles (one error each, one note per wait), unmatched and
    duplicated transfers.

    `sends_block=False` models a runtime that waits at an exchange for its
    receives only and lets its sends finish in the background (collected at the
    end of the step): then only receives wait. The default is the strict
    semantics above (NCCL's batch_isend_irecv coalesces a batch into one wait)."""
    cycles, unmatched, duplicates = stuck_waits(programs, sends_block)
    if not (cycles or unmatched or duplicates):
        return []
    spans = _pass_spans(schedule)
    found: list[Diagnostic] = []
    for r, _i, t, sending in unmatched:
        span, name = _span_of(t, sending, schedule, spans)
        side = "send" if sending else "receive"
        other = "receive" if sending else "send"
        found.append(
            Diagnostic(
                "error",
                f"rank {r} posts a {side} of {t} for {name} but no rank posts the matching "
                f"{other}: the rank would wait forever (a lowering bug; please report it)",
                span,
            )
        )
    for r, _i, t, sending in duplicates:
        span, name = _span_of(t, sending, schedule, spans)
        found.append(
            Diagnostic(
                "error",
                f"rank {r} {'sends' if sending else 'receives'} {t} twice "
                "(a lowering bug; please report it)",
                span,
            )
        )
    for cycle in cycles:
        notes = []
        for w in cycle:
            span, name = _span_of(w.transfer, w.sending, schedule, spans)
            notes.append((span, f"{w.describe()} (for {name})"))
        ranks = ", ".join(str(w.rank) for w in cycle)
        found.append(
            Diagnostic(
                "error",
                f"the rank programs deadlock: ranks {ranks} wait on each other in a cycle under "
                "blocking send/recv (each exchange is posted together and waited for together); "
                "reorder the passes so one of these transfers is posted earlier:",
                notes[0][0],
                tuple(notes),
            )
        )
    return found
