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
def _advance(position, offsets, req_offsets, req_rank, req_op, enabled):  # pragma: no cover
    """Advance every rank (from `position`, updated in place) while each enabled
    requirement of its next op holds: rank `req_rank[k]` has reached global op
    index `req_op[k]`."""
    num_ranks = offsets.shape[0] - 1
    moved = True
    while moved:
        moved = False
        for r in range(num_ranks):
            k = position[r]
            stop = offsets[r + 1]
            while k < stop:
                ok = True
                for q in range(req_offsets[k], req_offsets[k + 1]):
                    if enabled[q] and position[req_rank[q]] < req_op[q]:
                        ok = False
                        break
                if not ok:
                    break
                k += 1
                moved = True
            position[r] = k


@numba.njit(cache=True)
def _pull(
    position, offsets, req_offsets, peer_rank, req_op, enabled, sending, mirror
):  # pragma: no cover
    """The loop of `pull_receives_forward`: run the ranks; while stuck, break each
    cycle of waits at one of its sends by moving the receive to where its rank
    stands. Returns (moved receive entries, their new global op index, ok);
    ok is False on a cycle of receives only."""
    num_ranks = offsets.shape[0] - 1
    moved_entries = np.empty(len(sending), dtype=np.int64)
    moved_to = np.empty(len(sending), dtype=np.int64)
    count = 0
    waits = np.full(num_ranks, -1, dtype=np.int64)
    state = np.zeros(num_ranks, dtype=np.int64)
    walk = np.empty(num_ranks, dtype=np.int64)
    while True:
        _advance(position, offsets, req_offsets, peer_rank, req_op, enabled)
        any_wait = False
        for r in range(num_ranks):
            waits[r] = -1
            state[r] = 0
            k = position[r]
            if k >= offsets[r + 1]:
                continue
            for e in range(req_offsets[k], req_offsets[k + 1]):
                if enabled[e] and position[peer_rank[e]] < req_op[e]:
                    waits[r] = e
                    any_wait = True
                    break
        if not any_wait:
            return moved_entries[:count], moved_to[:count], True
        for first in range(num_ranks):
            if waits[first] < 0 or state[first] != 0:
                continue
            n = 0
            r = first
            while waits[r] >= 0 and state[r] == 0:
                state[r] = 1
                walk[n] = r
                n += 1
                r = peer_rank[waits[r]]
            if waits[r] >= 0 and state[r] == 1:
                start = 0
                while walk[start] != r:
                    start += 1
                sender = -1
                for x in range(start, n):
                    if sending[waits[walk[x]]]:
                        sender = walk[x]
                        break
                if sender < 0:
                    return moved_entries[:count], moved_to[:count], False
                send = waits[sender]
                receive = mirror[send]
                q = peer_rank[send]
                enabled[receive] = False  # posted where q stands; the send is posted
                req_op[send] = position[q]
                moved_entries[count] = receive
                moved_to[count] = position[q]
                count += 1
            for x in range(n):
                state[walk[x]] = 2


_ACT = TransferKind.ACT


def _match(keys: np.ndarray, against: np.ndarray, against_ids: np.ndarray) -> np.ndarray:
    """For each key, the id of the entry of `against` that holds it (-1 if none)."""
    out = np.full(len(keys), -1, dtype=np.int64)
    if len(against) == 0:
        return out
    order = np.argsort(against, kind="stable")
    sorted_keys = against[order]
    at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    found = sorted_keys[at] == keys
    out[found] = against_ids[order[at[found]]]
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
        # the mirror of a send is the receive of the same transfer, and back
        ids = np.arange(len(key), dtype=np.int64)
        mirror = np.empty(len(key), dtype=np.int64)
        mirror[is_send] = _match(key[is_send], key[~is_send], ids[~is_send])
        mirror[~is_send] = _match(key[~is_send], key[is_send], ids[is_send])
        self.mirror = mirror
        never = self.total + 1  # a global index no rank reaches: waits forever
        peer = np.where(mirror >= 0, self.where[np.maximum(mirror, 0)], never)
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

    def requirement_offsets(self, chosen: np.ndarray) -> np.ndarray:
        """CSR offsets, per global op, into the requirements `chosen` (which are
        in op order)."""
        counts = np.bincount(self.where[chosen], minlength=self.total)
        offsets = np.zeros(self.total + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return offsets

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
    position = ix.offsets[:-1].copy()
    req_offsets = ix.requirement_offsets(chosen)
    enabled = np.ones(len(chosen), dtype=bool)
    _advance(position, ix.offsets, req_offsets, ix.peer_rank[chosen], ix.peer_op[chosen], enabled)
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
    cycle; then the ranks run on. A receive moves at most once and only holds
    its buffer longer. Programs that already run, or whose transfers do not
    match up (the check reports those), come back unchanged."""
    ix = _Index(programs)
    if len(ix.unmatched) or ix.duplicates:
        return programs
    everything = np.arange(len(ix.where), dtype=np.int64)
    req_offsets = ix.requirement_offsets(everything)
    req_op = ix.peer_op.copy()
    enabled = np.ones(len(everything), dtype=bool)
    position = ix.offsets[:-1].copy()
    receives, targets, ok = _pull(
        position, ix.offsets, req_offsets, ix.peer_rank, req_op, enabled, ix.sending, ix.mirror
    )
    if not ok:
        raise ValueError(
            "ranks wait on each other's receives only: the orders break a dependency "
            "(run the dependency check first)"
        )
    moves = list(zip(receives.tolist(), targets.tolist(), strict=True))
    if not moves:
        return programs
    removed: dict[int, set[int]] = {}  # global op -> receive entries leaving it
    added: dict[int, list[int]] = {}  # global op -> receive entries joining it
    for receive, target in moves:
        removed.setdefault(int(ix.where[receive]), set()).add(receive)
        added.setdefault(target, []).append(receive)
    first_entry = np.searchsorted(ix.where, np.arange(ix.total + 1, dtype=np.int64)).tolist()
    ops = [list(prog.ops) for prog in programs]
    touched = np.asarray(sorted(set(removed) | set(added)), dtype=np.int64)
    touched_rank = np.searchsorted(ix.offsets, touched, side="right") - 1
    touched_index = touched - ix.offsets[touched_rank]
    for g, r, i in zip(
        touched.tolist(), touched_rank.tolist(), touched_index.tolist(), strict=True
    ):
        op = ops[r][i]
        gone = removed.get(g, set())
        lo, hi = first_entry[g], first_entry[g + 1]
        recvs = [ix.transfers[e] for e in range(lo, hi) if not ix.sending[e] and e not in gone]
        recvs += [ix.transfers[e] for e in added.get(g, [])]
        ops[r][i] = Exchange(op.sends, tuple(recvs))
    out = [
        RankProgram(
            prog.rank,
            tuple(op for op in rank_ops if type(op) is not Exchange or op.sends or op.recvs),
        )
        for prog, rank_ops in zip(programs, ops, strict=True)
    ]
    return tuple(out)
