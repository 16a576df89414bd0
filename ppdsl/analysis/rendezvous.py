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

import numba
import numpy as np

from ppdsl.ir.rank import RankArrays, RankProgram, Transfer

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


@numba.njit(cache=True)
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
            ix = programs.derived["exchange_index"] = ExchangeIndex(programs)
        return ix

    def __init__(self, programs: RankArrays):
        self.programs = programs
        self.offsets = programs.offsets
        self.total = programs.total
        self.where = programs.where
        self.sending = programs.sending
        key = programs._keys()
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
    programs: RankArrays | Sequence[RankProgram], sends_block: bool = True
) -> tuple[list[list[Wait]], list[tuple], list[tuple]]:
    """(cycles of waits, unmatched ops, duplicated ops); unmatched and duplicated
    as (rank, op index, transfer, sending). All empty: no deadlock."""
    arrays = as_arrays(programs)
    ix = ExchangeIndex.of(arrays)
    use = np.ones(len(ix.where), dtype=bool) if sends_block else ~ix.sending
    use[ix.unmatched] = True  # an unmatched op waits forever, send or not
    chosen = np.flatnonzero(use)
    position = ix.offsets[:-1].copy()
    req_offsets = ix.requirement_offsets(chosen)
    enabled = np.ones(len(chosen), dtype=bool)
    advance(position, ix.offsets, req_offsets, ix.peer_rank[chosen], ix.peer_op[chosen], enabled)
    waits: dict[int, Wait] = {}
    for r in range(arrays.num_ranks):
        k = int(position[r])
        if k >= ix.offsets[r + 1]:
            continue
        lo, hi = np.searchsorted(ix.where[chosen], [k, k + 1])
        for e in chosen[lo:hi].tolist():
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
            (int(ix.rank[e]), ix.op_index(e), arrays.transfer_of(e), bool(ix.sending[e])) for e in indices
        ]

    return cycles, described(ix.unmatched.tolist()), described(ix.duplicates)


