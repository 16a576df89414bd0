"""Early receives: a lowering step that posts receives in earlier exchanges
wherever the plain lowering would deadlock under blocking exchanges
(`ppdsl.analysis.rendezvous` states the semantics).

Lowering posts each receive in the exchange just before the pass that consumes
it. That can make two ranks wait on each other even though the orders respect
every dependency (ZB-V's and the interleaved schedule's cool-downs). Each cycle
of waits then holds a rank r whose send of t waits for rank q to post the
receive of t; moving q's receive into the exchange q is stuck at cannot add a
wait (r has posted the send) and breaks the cycle. The receive's buffer is held
longer: a transfer buffer, not an activation (`receive_buffers_peak` counts
them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from ppdsl.analysis.rendezvous import ExchangeIndex, advance, as_arrays
from ppdsl.ir.rank import RankArrays, RankProgram
from ppdsl.jit import kernel

P = TypeVar("P", RankArrays, Sequence[RankProgram])

__all__ = ["pull_receives_forward"]


@kernel
def _pull(
    position: np.ndarray, offsets: np.ndarray, req_offsets: np.ndarray, peer_rank: np.ndarray,
    req_op: np.ndarray, enabled: np.ndarray, sending: np.ndarray, mirror: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, bool]:  # pragma: no cover
    """The loop of `pull_receives_forward`: run the ranks; while stuck, break each
    cycle of waits at one of its sends by moving the receive to where its rank
    stands. Returns (moved receive entries, their new global op index, ok);
    ok is False on a cycle of receives only."""
    num_ranks = offsets.shape[0] - 1
    moved_entries = np.empty(64, dtype=np.int64)  # doubled when full
    moved_to = np.empty(64, dtype=np.int64)
    count = 0
    waits = np.full(num_ranks, -1, dtype=np.int64)
    state = np.zeros(num_ranks, dtype=np.int64)
    walk = np.empty(num_ranks, dtype=np.int64)
    while True:
        advance(position, offsets, req_offsets, peer_rank, req_op, enabled)
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
                if count == len(moved_entries):
                    grown = np.empty(2 * count, dtype=np.int64)
                    grown[:count] = moved_entries
                    moved_entries = grown
                    grown = np.empty(2 * count, dtype=np.int64)
                    grown[:count] = moved_to
                    moved_to = grown
                moved_entries[count] = receive
                moved_to[count] = position[q]
                count += 1
            for x in range(n):
                state[walk[x]] = 2


def pull_receives_forward(programs: P) -> P:
    """A lowering aid: the same programs with receives moved into earlier
    exchanges until nothing deadlocks under the semantics above.

    Runs the ranks; whenever they are stuck, each cycle of waits holds a rank r
    whose send of t waits for rank q to post the receive of t (a cycle of
    receives only would mean the orders break a dependency, which the
    dependency check rules out). Moving q's receive of t into the exchange q is
    stuck at cannot add a wait, since r has posted the send, and it breaks the
    cycle; then the ranks run on. A receive moves at most once and only holds
    its buffer longer; it joins the end of its new exchange's receives, and an
    exchange left empty goes. Programs that already run, or whose transfers do
    not match up (the check reports those), come back unchanged. `programs`
    are `RankArrays` or `RankProgram` objects; the result is of the same form."""
    arrays = as_arrays(programs)
    ix = ExchangeIndex.of(arrays)
    if len(ix.unmatched) or ix.duplicates:
        return programs
    req_offsets = ix.requirement_offsets()
    req_op = ix.peer_op.copy()
    enabled = np.ones(len(ix.where), dtype=bool)
    position = ix.offsets[:-1].copy()
    receives, targets, ok = _pull(
        position, ix.offsets, req_offsets, ix.peer_rank, req_op, enabled, ix.sending, ix.mirror
    )
    if not ok:
        raise ValueError(
            "ranks wait on each other's receives only: the orders break a dependency "
            "(run the dependency check first)"
        )
    if len(receives) == 0:
        return programs
    # the index of the programs before the move is not needed again: freed before
    # the moved programs and their index are made (rebuilt if ever asked for)
    mirror = ix.mirror
    del ix, req_offsets, req_op, enabled, position
    arrays.derived.pop("exchange_index", None)
    order, where = _new_order(arrays, receives, targets)
    del receives, targets
    # the same transfers, reordered: the matching carries over
    new_place = np.empty(len(order), dtype=mirror.dtype)
    new_place[order] = np.arange(len(order), dtype=mirror.dtype)
    mirror = new_place[mirror]
    del new_place
    mirror = mirror[order]
    moved = _moved(arrays, order, where)
    del order, where
    # the index itself is made when asked for (by the deadlock check, once the
    # programs before the move are gone)
    moved.derived["mirror"] = mirror
    return moved if isinstance(programs, RankArrays) else moved.programs()  # type: ignore[return-value]


def _new_order(
    arrays: RankArrays, receives: np.ndarray, targets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The entries' order once receive entries `receives` move to the exchanges
    `targets` (after that exchange's own receives, in the order given), and
    the exchange (old global op) of each, in that order."""
    n = len(arrays.where)
    small = arrays.where.dtype
    # the moved receives by target exchange, in the order moved
    by_target = np.argsort(targets, kind="stable")
    receives, targets = receives[by_target], targets.astype(small)[by_target]
    # a moved receive goes after every staying entry of its target exchange (the
    # entries are in op order, an exchange's sends before its receives)
    after = np.searchsorted(arrays.where, targets, side="right")
    after -= np.searchsorted(np.sort(receives), after)  # among the staying entries
    stay = np.ones(n, dtype=bool)
    stay[receives] = False
    order = np.insert(np.arange(n, dtype=small)[stay], after, receives.astype(small))
    del stay
    where = arrays.where[order]
    where[after + np.arange(len(after))] = targets
    return order, where


def _moved(arrays: RankArrays, order: np.ndarray, where: np.ndarray) -> RankArrays:
    """`arrays`' entries in `order`, posted by the exchanges `where` (old global
    ops; renumbered in place), with the exchanges left with nothing dropped."""
    keep = arrays.op_pass >= 0  # the ops that stay: passes, exchanges still posting
    keep[where] = True
    new_index = np.cumsum(keep, dtype=where.dtype)
    new_index -= 1
    offsets = np.zeros_like(arrays.offsets)
    ends = arrays.offsets[1:]
    offsets[1:][ends > 0] = new_index[ends[ends > 0] - 1] + 1
    op_pass = arrays.op_pass[keep]
    del keep
    np.take(new_index, where, out=where, mode="clip")  # unbuffered: no copy of `where`
    del new_index
    moved = RankArrays(
        offsets,
        op_pass,
        arrays.passes,
        where,
        arrays.sending[order],
        arrays.transfer[order],
        arrays.microbatch[order],
        arrays.src_stage[order],
        arrays.dst_stage[order],
        arrays.src_rank[order],
        arrays.dst_rank[order],
        arrays.entry_pass[order],
    )
    return moved
