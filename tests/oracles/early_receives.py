"""Early receives before issue 13 (on RankProgram objects), kept as the oracle of the array pass."""


from __future__ import annotations

import numba
import numpy as np

from ppdsl.ir.rank import Exchange, RankProgram
from tests.oracles.rendezvous import ExchangeIndex, advance

__all__ = ["pull_receives_forward"]


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
    ix = ExchangeIndex(programs)
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
