"""Lowering: insert the transfers each compute pass needs, giving one program
per rank.

A pass's inputs that live on another rank are received just before it; its
outputs that another rank needs are sent just after it. The sends after pass P
and the receives before the next pass Q on the same rank form one `Exchange`
(posted together, waited for together), as Megatron pairs send_forward with
recv_backward; that pairing is what lets neighbours in 1F1B send to each other
at the same time without blocking. Two stages on one rank (the turn of a V)
hand over locally: no transfer.

The lowering is an array pass over the flat schedule (`ppdsl.ir.flat`): the
transfer rule is tabulated once per (kind, stage) and every pass's exchanges
follow by counting, so no Python object is made per pass (`RankArrays`; the
objects only when a command asks for them).
"""

from __future__ import annotations

import numpy as np

from ppdsl.ir.flat import flatten
from ppdsl.ir.rank import RankArrays, RankProgram, receive_buffers_peak
from ppdsl.ir.schedule import Schedule
from ppdsl.semantics import KINDS, receives, sends

__all__ = ["lower", "lower_arrays", "receive_buffers_peak"]


def _route_tables(
    stage_device: np.ndarray, incoming: bool, lanes: int = 1
) -> tuple[np.ndarray, ...]:
    """The transfer rule per (kind code, stage), padded to the most routes:
    (count, transfer code, producing stage, consuming stage) of the tensors a
    pass takes from (`incoming`) or hands to another device of its lane
    (`semantics.receives` / `sends`, `same_lane`)."""
    S = len(stage_device)
    length = S // lanes
    rule = receives if incoming else sends
    width = max(1, max(len(rule(k)) for k in KINDS))
    count = np.zeros((len(KINDS), S), dtype=np.int64)
    code = np.zeros((len(KINDS), S, width), dtype=np.int64)
    src = np.zeros((len(KINDS), S, width), dtype=np.int64)
    dst = np.zeros((len(KINDS), S, width), dtype=np.int64)
    for kind in KINDS:
        for t, off in rule(kind):
            other = np.arange(S) + off
            ok = (other >= 0) & (other < S) & (other // length == np.arange(S) // length)
            ok[ok] = stage_device[other[ok]] != stage_device[np.flatnonzero(ok)]
            s = np.flatnonzero(ok)
            i = count[kind.code, s]
            code[kind.code, s, i] = t.code
            src[kind.code, s, i] = other[ok] if incoming else s
            dst[kind.code, s, i] = s if incoming else other[ok]
            count[kind.code, s] += 1
    return count, code, src, dst


def lower_arrays(schedule: Schedule) -> RankArrays:
    """One program per rank, in rank order, as arrays: each pass receives what
    it needs from other ranks and sends what other ranks need from it
    (`semantics.NEEDS`: F(j, s) takes stage s-1's activation and hands its own
    to s+1; B or BW(j, s) takes stage s+1's input gradient and hands its own to
    s-1)."""
    flat = flatten(schedule)
    n = flat.size
    dev = flat.stage_device
    lanes = schedule.placement.lanes
    in_count, in_code, in_src, in_dst = _route_tables(dev, True, lanes)
    out_count, out_code, out_src, out_dst = _route_tables(dev, False, lanes)
    kind, stage = flat.kind, flat.stage
    nr = in_count[kind, stage]
    ns = out_count[kind, stage]
    first = np.zeros(n, dtype=bool)
    last = np.zeros(n, dtype=bool)
    lengths = np.diff(flat.offsets)
    first[flat.offsets[:-1][lengths > 0]] = True
    last[flat.offsets[1:][lengths > 0] - 1] = True
    prev_sends = np.zeros(n, dtype=np.int64)
    prev_sends[1:] = ns[:-1]
    prev_sends[first] = 0
    # an exchange before a pass (the previous pass's sends, its receives), one after
    # a rank's last pass (its sends)
    exchange_before = ((prev_sends + nr) > 0).astype(np.int64)
    tail = (last & (ns > 0)).astype(np.int64)
    ops_before = np.cumsum(exchange_before) + np.cumsum(tail) - tail
    compute_op = np.arange(n, dtype=np.int64) + ops_before
    extra = np.bincount(flat.device, weights=exchange_before + tail, minlength=len(lengths))
    op_count = lengths + extra.astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(op_count, out=offsets[1:])
    op_pass = np.full(int(offsets[-1]), -1, dtype=np.int64)
    op_pass[compute_op] = np.arange(n, dtype=np.int64)
    # entries: per pass its receives (in the exchange before it), then its sends
    # (in the exchange after it); that is rank, op order already. int32: entries
    # run to millions
    small = np.int32
    per_pass = nr + ns
    entry_pass = np.repeat(np.arange(n, dtype=small), per_pass)
    first_entry = (np.cumsum(per_pass) - per_pass).astype(small)
    local = np.arange(len(entry_pass), dtype=small) - first_entry[entry_pass]
    del first_entry
    is_recv = local < nr[entry_pass]
    code = np.empty(len(entry_pass), dtype=np.int8)
    src = np.empty(len(entry_pass), dtype=small)
    dst = np.empty(len(entry_pass), dtype=small)
    for receiving, (codes, srcs, dsts) in (
        (True, (in_code, in_src, in_dst)),
        (False, (out_code, out_src, out_dst)),
    ):
        chosen = np.flatnonzero(is_recv if receiving else ~is_recv)
        p = entry_pass[chosen]
        route = local[chosen] if receiving else local[chosen] - nr[p]
        k, s = kind[p], stage[p]
        code[chosen] = codes[k, s, route]
        src[chosen] = srcs[k, s, route]
        dst[chosen] = dsts[k, s, route]
        del chosen, p, route, k, s
    del local
    where = compute_op[entry_pass].astype(small)
    where += np.where(is_recv, -1, 1).astype(small)
    return RankArrays(
        offsets,
        op_pass.astype(small),
        flat.passes,
        where,
        ~is_recv,
        code,
        flat.microbatch[entry_pass].astype(small),
        src,
        dst,
        dev[src].astype(small),
        dev[dst].astype(small),
        entry_pass,
    )


def lower(schedule: Schedule) -> tuple[RankProgram, ...]:
    """`lower_arrays` as `RankProgram` objects."""
    return lower_arrays(schedule).programs()
