"""The lowered rank programs run under blocking exchanges: the executor the
deadlock check and the lowering's early receives share.

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
exchange holding the matching op. The programs are `RankArrays`; `ExchangeIndex`
adds, per posted op, where its peer op is (made once per programs);
`advance` runs the ranks over them; `stuck_waits` says who waits for whom
where they stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ppdsl.ir.rank import RankArrays, RankProgram, Transfer, index_dtype, narrow_dtype
from ppdsl.jit import kernel

__all__ = ["Wait", "ExchangeIndex", "advance", "as_arrays", "stuck_waits"]


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


@kernel
def advance(position, offsets, req_offsets, req_rank, req_op, enabled):  # pragma: no cover
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


@kernel
def _match(order, key, sending, mirror, repeated):  # pragma: no cover
    """Over the entries in `order` (by key, a key's sends before its receives,
    each in entry order): per entry the first entry of the other side with its
    key (-1 if none) into `mirror`, and into `repeated` whether an earlier
    entry of its side has the key."""
    n = len(order)
    i = 0
    while i < n:
        k = key[order[i]]
        end = i + 1
        while end < n and key[order[end]] == k:
            end += 1
        first_recv = i
        while first_recv < end and sending[order[first_recv]]:
            first_recv += 1
        for x in range(i, end):
            e = order[x]
            if x < first_recv:
                mirror[e] = order[first_recv] if first_recv < end else -1
                repeated[e] = x > i
            else:
                mirror[e] = order[i] if first_recv > i else -1
                repeated[e] = x > first_recv
        i = end


def _side_order(key: np.ndarray, sending: np.ndarray) -> np.ndarray:
    """The entries sorted by key, a key's sends before its receives, each in
    entry order."""
    n = len(key)
    lo, hi = int(key.min()), int(key.max())
    if (hi - lo + 1) * 2 * n >= 2**62:
        return np.argsort(key.astype(np.int64) * 2 + ~sending, kind="stable")
    # (key, side, entry) in one int64 is unique: the fast unstable sort gives the
    # stable order
    composite = key.astype(np.int64)
    composite -= lo
    composite *= 2
    composite += ~sending
    composite *= n
    step = 1 << 18
    for start in range(0, n, step):
        composite[start : start + step] += np.arange(start, min(start + step, n))
    return np.argsort(composite)


def _mirrors(key: np.ndarray, sending: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """For each entry the first entry of the other side with the same key (-1
    if none), and the entries that repeat a key on their side (sends' repeats,
    then receives', each in entry order). One sort of (key, side)."""
    n = len(key)
    mirror = np.full(n, -1, dtype=index_dtype(n))
    if n == 0:
        return mirror, []
    repeated = np.zeros(n, dtype=bool)
    _match(_side_order(key, sending), key, sending, mirror, repeated)
    extra = np.flatnonzero(repeated)
    duplicates = extra[sending[extra]].tolist() + extra[~sending[extra]].tolist()
    return mirror, duplicates


def as_arrays(programs: RankArrays | Sequence[RankProgram]) -> RankArrays:
    """Programs as arrays (objects are converted; arrays pass through)."""
    return programs if isinstance(programs, RankArrays) else RankArrays.of_programs(programs)


class ExchangeIndex:
    """Every posted send and receive of `RankArrays` (in rank, op order) with
    where its peer op is; made once per programs (`of`)."""

    @staticmethod
    def of(programs: RankArrays) -> ExchangeIndex:
        ix = programs.derived.get("exchange_index")
        if ix is None:
            # a pass that reorders matched programs leaves their "mirror"
            mirror = programs.derived.pop("mirror", None)
            ix = programs.derived["exchange_index"] = ExchangeIndex(programs, mirror)
        return ix

    def __init__(self, programs: RankArrays, mirror: np.ndarray | None = None):
        """`mirror`, where known (the same transfers in another order), saves the
        matching; the programs then have no unmatched or duplicated op."""
        self.programs = programs
        self.offsets = programs.offsets
        self.total = programs.total
        self.where = programs.where
        self.sending = programs.sending
        # entries are in rank order: each rank's are one run
        bounds = np.searchsorted(self.where, self.offsets.astype(self.where.dtype))
        ranks = np.arange(programs.num_ranks)
        self.rank = np.repeat(ranks.astype(narrow_dtype(ranks)), np.diff(bounds))
        # the mirror of a send is the receive of the same transfer, and back
        if mirror is None:
            mirror, self.duplicates = _mirrors(programs._keys(), self.sending)
        else:
            self.duplicates = []
        self.mirror = mirror
        self.unmatched = np.flatnonzero(mirror < 0)
        self.peer_op = self.where[mirror]
        self.peer_op[self.unmatched] = self.total + 1  # a global index no rank reaches
        self.peer_rank = self.rank[mirror]
        self.peer_rank[self.unmatched] = self.rank[self.unmatched]

    def requirement_offsets(self, chosen: np.ndarray | None = None) -> np.ndarray:
        """CSR offsets, per global op, into the requirements `chosen` (which are
        in op order; all entries if None)."""
        at = self.where if chosen is None else self.where[chosen]
        offsets = np.empty(self.total + 1, dtype=index_dtype(len(at) + 1))
        step = 1 << 18  # the ops in slices: no op-sized temporary
        for lo in range(0, self.total + 1, step):
            ops = np.arange(lo, min(lo + step, self.total + 1), dtype=at.dtype)
            offsets[lo : lo + step] = np.searchsorted(at, ops)
        return offsets

    def op_index(self, e: int) -> int:
        return int(self.where[e] - self.offsets[self.rank[e]])


def stuck_waits(
    programs: RankArrays | Sequence[RankProgram], sends_block: bool = True
) -> tuple[list[list[Wait]], list[tuple], list[tuple]]:
    """(cycles of waits, unmatched ops, duplicated ops); unmatched and duplicated
    as (rank, op index, transfer, sending). All empty: no deadlock."""
    arrays = as_arrays(programs)
    ix = ExchangeIndex.of(arrays)
    chosen = None  # every entry waits
    peer_rank, peer_op = ix.peer_rank, ix.peer_op
    if not sends_block:
        use = ~ix.sending
        use[ix.unmatched] = True  # an unmatched op waits forever, send or not
        chosen = np.flatnonzero(use)
        peer_rank, peer_op = peer_rank[chosen], peer_op[chosen]
    position = ix.offsets[:-1].copy()
    req_offsets = ix.requirement_offsets(chosen)
    enabled = np.ones(len(peer_op), dtype=bool)
    advance(position, ix.offsets, req_offsets, peer_rank, peer_op, enabled)
    waits: dict[int, Wait] = {}
    for r in range(arrays.num_ranks):
        k = int(position[r])
        if k >= ix.offsets[r + 1]:
            continue
        for i in range(int(req_offsets[k]), int(req_offsets[k + 1])):
            e = i if chosen is None else int(chosen[i])
            q = int(ix.peer_rank[e])
            if ix.peer_op[e] <= ix.total and position[q] < ix.peer_op[e]:
                t = arrays.transfer_of(e)
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
            (int(ix.rank[e]), ix.op_index(e), arrays.transfer_of(e), bool(ix.sending[e]))
            for e in indices
        ]

    return cycles, described(ix.unmatched.tolist()), described(ix.duplicates)
