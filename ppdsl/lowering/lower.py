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
from ppdsl.ir.rank import (
    RankArrays,
    RankProgram,
    index_dtype,
    narrow_dtype,
    receive_buffers_peak,
)
from ppdsl.ir.schedule import Schedule
from ppdsl.semantics import KINDS, NUM_KINDS, receives, sends

__all__ = ["lower", "lower_arrays", "receive_buffers_peak"]


def _route_table(stage_device: np.ndarray, lanes: int) -> tuple[np.ndarray, ...]:
    """The transfer rule per (kind code, stage), as rows `kind * S + stage`:
    (receives, sends, transfer code, producing stage, consuming stage); a row's
    slots are the tensors the pass takes from another device of its lane
    (`semantics.receives`, `same_lane`), then those it hands to one (`sends`),
    padded to the most slots."""
    S = len(stage_device)
    length = S // lanes
    stages = np.arange(S)
    width = max(1, max(len(receives(k)) + len(sends(k)) for k in KINDS))
    num_receives = np.zeros((NUM_KINDS, S), dtype=np.int8)
    num_sends = np.zeros((NUM_KINDS, S), dtype=np.int8)
    code = np.zeros((NUM_KINDS, S, width), dtype=np.int8)
    src = np.zeros((NUM_KINDS, S, width), dtype=narrow_dtype(stages))
    dst = np.zeros((NUM_KINDS, S, width), dtype=narrow_dtype(stages))
    for kind in KINDS:
        for incoming, count in ((True, num_receives), (False, num_sends)):
            for t, off in (receives if incoming else sends)(kind):
                other = stages + off
                ok = (other >= 0) & (other < S) & (other // length == stages // length)
                ok[ok] = stage_device[other[ok]] != stage_device[np.flatnonzero(ok)]
                s = np.flatnonzero(ok)
                slot = num_receives[kind.code, s] + num_sends[kind.code, s]
                code[kind.code, s, slot] = t.code
                src[kind.code, s, slot] = other[ok] if incoming else s
                dst[kind.code, s, slot] = s if incoming else other[ok]
                count[kind.code, s] += 1
    rows = NUM_KINDS * S
    return (
        num_receives.reshape(rows),
        num_sends.reshape(rows),
        code.reshape(rows * width),
        src.reshape(rows * width),
        dst.reshape(rows * width),
    )


def _take(values: np.ndarray, index: np.ndarray, dtype: type[np.integer]) -> np.ndarray:
    """`values[index]` as `dtype`, gathered in slices: no temporary of
    `values`' (maybe wider) type as long as `index`."""
    out = np.empty(len(index), dtype=dtype)
    step = 1 << 18
    for lo in range(0, len(index), step):
        out[lo : lo + step] = values[index[lo : lo + step]]
    return out


def lower_arrays(schedule: Schedule) -> RankArrays:
    """One program per rank, in rank order, as arrays: each pass receives what
    it needs from other ranks and sends what other ranks need from it
    (`semantics.NEEDS`: F(j, s) takes stage s-1's activation and hands its own
    to s+1; B or BW(j, s) takes stage s+1's input gradient and hands its own to
    s-1)."""
    flat = flatten(schedule)
    n = flat.size
    num_stages = len(flat.stage_device)
    num_receives, num_sends, codes, srcs, dsts = _route_table(
        flat.stage_device, schedule.placement.lanes
    )
    width = len(codes) // len(num_receives)
    # every per-pass and per-entry array is as narrow as its values allow and
    # freed once used: at d=128, m=2048 there are 1.6M passes and 2.1M entries
    small = index_dtype(max(n * (width + 2) + flat.num_devices, len(codes)))
    row = np.empty(n, dtype=small)  # the pass's row of the route table
    np.multiply(flat.kind, small(num_stages), out=row, casting="unsafe")
    np.add(row, flat.stage, out=row, casting="unsafe")
    nr = num_receives[row]
    ns = num_sends[row]
    row *= small(width)
    lengths = np.diff(flat.offsets)
    starts = flat.offsets[:-1][lengths > 0]
    last = flat.offsets[1:][lengths > 0] - 1
    # an exchange before a pass (the previous pass's sends, its receives), one after
    # a rank's last pass (its sends)
    exchange_before = nr > 0
    exchange_before[1:] |= ns[:-1] > 0
    exchange_before[starts] = nr[starts] > 0
    tail = np.zeros(n, dtype=bool)
    tail[last] = ns[last] > 0
    # a pass's global op index: its flat index plus the exchanges before it
    compute_op = np.cumsum(exchange_before, dtype=small)
    del exchange_before
    later = np.cumsum(tail, dtype=small)
    later -= tail
    compute_op += later
    del later
    compute_op += np.arange(n, dtype=small)
    # a rank's ops end one past the last pass so far, plus that pass's tail exchange
    offsets = np.zeros(len(flat.offsets), dtype=np.int64)
    ends = flat.offsets[1:]
    nonempty = ends > 0
    offsets[1:][nonempty] = compute_op[ends[nonempty] - 1] + 1 + tail[ends[nonempty] - 1]
    del tail
    op_pass = np.full(int(offsets[-1]), -1, dtype=small)
    op_pass[compute_op] = np.arange(n, dtype=small)
    # entries: per pass its receives (in the exchange before it), then its sends
    # (in the exchange after it); that is rank, op order already
    per_pass = nr + ns
    del ns
    entry_pass = np.repeat(np.arange(n, dtype=small), per_pass)
    first_entry = np.cumsum(per_pass, dtype=small)
    first_entry -= per_pass
    del per_pass
    slot = np.arange(len(entry_pass), dtype=small)  # the entry's slot in its pass's row
    slot -= first_entry[entry_pass]
    del first_entry
    is_recv = slot < nr[entry_pass]
    del nr
    slot += row[entry_pass]
    del row
    code = codes[slot]
    src = srcs[slot]
    dst = dsts[slot]
    del slot
    # a send is posted by the exchange after its pass, a receive by the one before
    where = compute_op[entry_pass]
    del compute_op
    where += 1
    where -= is_recv
    where -= is_recv
    device = flat.stage_device.astype(narrow_dtype(flat.stage_device))
    return RankArrays(
        offsets,
        op_pass,
        flat.passes,
        where,
        ~is_recv,
        code,
        _take(flat.microbatch, entry_pass, narrow_dtype(flat.microbatch)),
        src,
        dst,
        device[src],
        device[dst],
        entry_pass,
    )


def lower(schedule: Schedule) -> tuple[RankProgram, ...]:
    """`lower_arrays` as `RankProgram` objects."""
    return lower_arrays(schedule).programs()
