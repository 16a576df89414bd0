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
    req_offsets = ix.requirement_offsets(np.arange(len(ix.where), dtype=np.int64))
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
    moved = _moved(arrays, receives, targets, ix.mirror)
    return moved if isinstance(programs, RankArrays) else moved.programs()  # type: ignore[return-value]


def _moved(
    arrays: RankArrays, receives: np.ndarray, targets: np.ndarray, mirror: np.ndarray
) -> RankArrays:
    """`arrays` with receive entries `receives` moved to the exchanges `targets`
    (after that exchange's own receives, in the order given) and the exchanges
    left with nothing dropped."""
    n = len(arrays.where)
    where = arrays.where.copy()
    where[receives] = targets
    sequence = np.arange(n, dtype=np.int64)
    sequence[receives] = n + np.arange(len(receives))
    order = np.lexsort((sequence, ~arrays.sending, where))
    where = where[order]
    keep = arrays.op_pass >= 0
    keep[where] = True
    new_index = np.cumsum(keep) - 1
    offsets = np.zeros_like(arrays.offsets)
    offsets[1:] = np.cumsum(keep)[arrays.offsets[1:] - 1] * (arrays.offsets[1:] > 0)
    moved = RankArrays(
        offsets,
        arrays.op_pass[keep],
        arrays.passes,
        new_index[where],
        arrays.sending[order],
        arrays.transfer[order],
        arrays.microbatch[order],
        arrays.src_stage[order],
        arrays.dst_stage[order],
        arrays.src_rank[order],
        arrays.dst_rank[order],
        arrays.entry_pass[order],
    )
    # the same transfers, reordered: the matching carries over
    new_place = np.empty(n, dtype=np.int64)
    new_place[order] = np.arange(n)
    moved.derived["exchange_index"] = ExchangeIndex(moved, new_place[mirror[order]])
    return moved
