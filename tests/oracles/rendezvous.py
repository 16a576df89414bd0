"""The blocking-exchange executor before issue 13 (its index built from RankProgram objects), kept as the oracle of the array pass."""


from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from ppdsl.ir.rank import Exchange, RankProgram, Transfer

__all__ = ["Wait", "ExchangeIndex", "advance", "stuck_waits"]


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


class ExchangeIndex:
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
                            | t.kind.code
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
    ix = ExchangeIndex(programs)
    use = np.ones(len(ix.where), dtype=bool) if sends_block else ~ix.sending
    use[ix.unmatched] = True  # an unmatched op waits forever, send or not
    chosen = np.flatnonzero(use)
    position = ix.offsets[:-1].copy()
    req_offsets = ix.requirement_offsets(chosen)
    enabled = np.ones(len(chosen), dtype=bool)
    advance(position, ix.offsets, req_offsets, ix.peer_rank[chosen], ix.peer_op[chosen], enabled)
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


