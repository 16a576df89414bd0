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

from dataclasses import dataclass

import numba
import numpy as np

from ppdsl.diagnostics import Diagnostic, Span
from ppdsl.ir.rank import Exchange, RankProgram, Transfer, TransferKind
from ppdsl.ir.schedule import Pass, PassKind, Schedule, format_pass

__all__ = ["check", "Wait", "stuck_waits", "pull_receives_forward"]


@dataclass(frozen=True, slots=True)
class Wait:
    """Rank `rank`, at op `op_index`, waits for `peer` to post the other side of
    `transfer`; `sending` says whether this rank is the sender."""

    rank: int
    op_index: int
    peer: int
    transfer: Transfer
    sending: bool

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


_ACT = TransferKind.ACT


def _match(
    keys: np.ndarray, against: np.ndarray, against_op: np.ndarray, missing: int
) -> np.ndarray:
    """For each key, the global op index where `against` holds it (`missing` if none)."""
    order = np.argsort(against, kind="stable")
    sorted_keys = against[order]
    at = np.searchsorted(sorted_keys, keys)
    at_clipped = np.minimum(at, max(len(sorted_keys) - 1, 0))
    found = (
        (at < len(sorted_keys)) & (sorted_keys[at_clipped] == keys)
        if len(sorted_keys)
        else (np.zeros(len(keys), dtype=bool))
    )
    out = np.full(len(keys), missing, dtype=np.int64)
    if len(sorted_keys):
        out[found] = against_op[order[at_clipped[found]]]
    return out


class _Index:
    """Every posted send and receive as flat arrays (in rank, op order): its
    transfer, the global op index holding it, and where its peer op is."""

    def __init__(self, programs: tuple[RankProgram, ...]):
        offsets = [0]
        for prog in programs:
            offsets.append(offsets[-1] + len(prog.ops))
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.total = offsets[-1]
        transfers: list[Transfer] = []
        keys: list[int] = []
        where: list[int] = []
        sending: list[bool] = []
        for r, prog in enumerate(programs):
            base = offsets[r]
            for i, op in enumerate(prog.ops):
                if type(op) is not Exchange:
                    continue
                for group, flag in ((op.sends, True), (op.recvs, False)):
                    for t in group:
                        transfers.append(t)
                        # a transfer's identity as one integer (Transfer's hash is slow)
                        keys.append(
                            (t.microbatch << 42)
                            | (t.src_stage << 22)
                            | (t.dst_stage << 2)
                            | (t.kind is _ACT)
                        )
                        where.append(base + i)
                        sending.append(flag)
        self.transfers = transfers
        key = np.asarray(keys, dtype=np.int64)
        self.where = np.asarray(where, dtype=np.int64)
        self.sending = np.asarray(sending, dtype=bool)
        self.rank = np.searchsorted(self.offsets, self.where, side="right") - 1
        is_send = self.sending
        # the peer op of a send is the receive of the same transfer, and back
        peer = np.empty(len(key), dtype=np.int64)
        never = self.total + 1  # a global index no rank reaches: waits forever
        peer[is_send] = _match(key[is_send], key[~is_send], self.where[~is_send], never)
        peer[~is_send] = _match(key[~is_send], key[is_send], self.where[is_send], never)
        self.peer_op = peer
        self.peer_rank = np.where(
            peer == never, self.rank, np.searchsorted(self.offsets, peer, side="right") - 1
        )
        self.unmatched = np.flatnonzero(peer == never)
        self.duplicates: list[int] = []
        for flag in (True, False):
            chosen = np.flatnonzero(self.sending == flag)
            _, first, counts = np.unique(key[chosen], return_index=True, return_counts=True)
            if np.any(counts > 1):
                seen = np.zeros(len(chosen), dtype=bool)
                seen[first] = True
                self.duplicates += chosen[~seen].tolist()

    def op_index(self, e: int) -> int:
        return int(self.where[e] - self.offsets[self.rank[e]])


def stuck_waits(
    programs: tuple[RankProgram, ...], sends_block: bool = True
) -> tuple[list[list[Wait]], list[tuple], list[tuple]]:
    """(cycles of waits, unmatched ops, duplicated ops); unmatched and duplicated
    as (rank, op index, transfer, sending). All empty: no deadlock."""
    ix = _Index(programs)
    use = np.ones(len(ix.where), dtype=bool) if sends_block else ~ix.sending
    use[ix.unmatched] = True  # an unmatched op waits forever, send or not
    chosen = np.flatnonzero(use)
    counts = np.bincount(ix.where[chosen], minlength=ix.total)
    req_offsets = np.zeros(ix.total + 1, dtype=np.int64)
    np.cumsum(counts, out=req_offsets[1:])
    position = _run(ix.offsets, req_offsets, ix.peer_rank[chosen], ix.peer_op[chosen])
    waits: dict[int, Wait] = {}
    for r in range(len(programs)):
        k = int(position[r])
        if k >= ix.offsets[r + 1]:
            continue
        lo, hi = np.searchsorted(ix.where[chosen], [k, k + 1])
        for e in chosen[lo:hi].tolist():
            q = int(ix.peer_rank[e])
            if ix.peer_op[e] <= ix.total and position[q] < ix.peer_op[e]:
                t = ix.transfers[e]
                waits[r] = Wait(r, ix.op_index(e), q, t, bool(ix.sending[e]))
                break
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

    def described(indices) -> list[tuple]:
        return [
            (int(ix.rank[e]), ix.op_index(e), ix.transfers[e], bool(ix.sending[e])) for e in indices
        ]

    return cycles, described(ix.unmatched.tolist()), described(ix.duplicates)


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
            role = "output of" if w.sending else "input of"
            notes.append((span, f"{w.describe()} ({role} {name})"))
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


def pull_receives_forward(programs: tuple[RankProgram, ...]) -> tuple[RankProgram, ...]:
    """A lowering aid: the same programs with receives moved into earlier
    exchanges until nothing deadlocks under the semantics above.

    Runs the ranks; whenever they are stuck, each cycle of waits holds a rank r
    whose send of t waits for rank q to post the receive of t (a cycle of
    receives only would mean the orders break a dependency, which the
    dependency check rules out). Moving q's receive of t into the exchange q is
    stuck at cannot add a wait, since r has posted the send, and it breaks the
    cycle. Repeat until every rank finishes. A receive posted earlier only holds
    its buffer longer. Programs that already run come back unchanged."""
    ops: list[list] = [list(p.ops) for p in programs]
    sent: dict[tuple, tuple[int, int]] = {}
    received: dict[tuple, tuple[int, int]] = {}
    for r, rank_ops in enumerate(ops):
        for i, op in enumerate(rank_ops):
            if type(op) is Exchange:
                for t in op.sends:
                    sent[_transfer_key(t)] = (r, i)
                for t in op.recvs:
                    received[_transfer_key(t)] = (r, i)
    position = [0] * len(ops)

    def blocker(r: int) -> tuple[int, Transfer, bool] | None:
        """The first unmet requirement of rank r's current op: (peer, transfer, sending)."""
        op = ops[r][position[r]]
        if type(op) is not Exchange:
            return None
        for group, other, sending in ((op.sends, received, True), (op.recvs, sent, False)):
            for t in group:
                peer = other.get(_transfer_key(t))
                if peer is None:
                    raise ValueError(f"rank {r}: {t} has no matching op; lower the programs again")
                if position[peer[0]] < peer[1]:
                    return peer[0], t, sending
        return None

    changed = False
    while True:
        moved = True
        while moved:
            moved = False
            for r in range(len(ops)):
                while position[r] < len(ops[r]) and blocker(r) is None:
                    position[r] += 1
                    moved = True
        stuck = {r: blocker(r) for r in range(len(ops)) if position[r] < len(ops[r])}
        if not stuck:
            break
        waits = {r: b for r, b in stuck.items() if b is not None}
        # follow the waits from each stuck rank to the cycle it ends in
        state: dict[int, int] = {}
        for first in sorted(waits):
            walk: list[int] = []
            r = first
            while r in waits and r not in state:
                state[r] = 1
                walk.append(r)
                r = waits[r][0]
            if r in waits and state.get(r) == 1:
                cycle = walk[walk.index(r) :]
                sender = next((x for x in cycle if waits[x][2]), None)
                if sender is None:
                    raise ValueError(
                        f"ranks {cycle} wait on each other's receives only: the orders "
                        "break a dependency (run the dependency check first)"
                    )
                q, t, _ = waits[sender]
                key = _transfer_key(t)
                _, src = received[key]
                dst = position[q]
                old, new = ops[q][src], ops[q][dst]
                ops[q][src] = Exchange(old.sends, tuple(x for x in old.recvs if x != t))
                ops[q][dst] = Exchange(new.sends, (*new.recvs, t))
                received[key] = (q, dst)
                changed = True
            for x in walk:
                state[x] = 2
    if not changed:
        return programs
    return tuple(
        RankProgram(
            prog.rank,
            tuple(op for op in rank_ops if type(op) is not Exchange or op.sends or op.recvs),
        )
        for prog, rank_ops in zip(programs, ops, strict=True)
    )


def _transfer_key(t: Transfer) -> tuple[int, int, int, bool]:
    return (t.microbatch, t.src_stage, t.dst_stage, t.kind is TransferKind.ACT)
