"""Receives in send order: a lowering step for a transport that matches
transfers by order (NCCL has no tags: on one communicator the n-th send from
q to r meets the n-th receive at r from q, `ppdsl.analysis.comm_rules`).

After early receives a rank may post the receive of a later-sent tensor
before that of an earlier-sent one from the same peer (a V-shape's two
chunks exchange both ways between the same ranks): under tags that is fine,
under NCCL the pair is crossed and the data swaps or the ranks hang. This
step moves each receive from q no later than the receive of anything q sent
after it, and orders an exchange's receives from q as q sends them. It only
moves receives earlier, so every pass still has its tensor; the deadlock check
then proves the result under the rules it runs on.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppdsl.ir.rank import Exchange, RankArrays, RankProgram, Transfer

__all__ = ["receives_in_send_order"]


def receives_in_send_order(programs: RankArrays) -> RankArrays:
    """`programs` with every rank's receives from each peer posted in the
    peer's send order (the same object when they already are)."""
    objects = programs.programs()
    moved = _reordered(objects)
    return programs if moved is None else RankArrays.of_programs(moved)


def _reordered(programs: Sequence[RankProgram]) -> list[RankProgram] | None:
    # the order each rank sends in, per destination
    sent: dict[tuple[int, int], list[Transfer]] = {}
    for program in programs:
        for op in program.ops:
            if isinstance(op, Exchange):
                for t in op.sends:
                    sent.setdefault((t.src_rank, t.dst_rank), []).append(t)
    changed = False
    out = []
    for program in programs:
        r = program.rank
        exchange_of: dict[Transfer, int] = {}
        for k, op in enumerate(program.ops):
            if isinstance(op, Exchange):
                for t in op.recvs:
                    exchange_of[t] = k
        rank_in_sends: dict[Transfer, int] = {}
        for (_src, dst), transfers in sent.items():
            if dst != r:
                continue
            latest = len(program.ops)
            for n in range(len(transfers) - 1, -1, -1):
                t = transfers[n]
                rank_in_sends[t] = n
                if t not in exchange_of:
                    continue  # reported by the deadlock check as unmatched
                if exchange_of[t] > latest:
                    exchange_of[t] = latest
                    changed = True
                latest = exchange_of[t]
        by_exchange: dict[int, list[Transfer]] = {}
        for t, k in exchange_of.items():
            by_exchange.setdefault(k, []).append(t)
        ops = list(program.ops)
        for k, op in enumerate(ops):
            if not isinstance(op, Exchange):
                continue
            recvs = by_exchange.get(k, [])
            # receives from one peer as the peer sends them, peers in first-posted order
            first = {t.src_rank: i for i, t in reversed(list(enumerate(op.recvs)))}
            recvs.sort(key=lambda t: (first.get(t.src_rank, len(op.recvs) + t.src_rank),
                                      rank_in_sends.get(t, 0)))
            if tuple(recvs) != op.recvs:
                changed = True
                ops[k] = Exchange(op.sends, tuple(recvs))
        out.append(RankProgram(r, tuple(ops)))
    return out if changed else None
