"""Order-level heuristics, the zero-bubble paper's automatic scheduler
generalised to any placement (numba): an event-driven list scheduler.

Whenever a device is free it picks, among the passes whose inputs have arrived:
a B (or an F first, `b_first=0`), an F only while the memory budget and the
per-stage in-flight cap allow it (as many F as memory allows in warm-up), and
otherwise a W to fill the gap (`w_mode` 0: always; 1: only a gap at least T_W
long or when memory blocks an F; 2: a W right after its B). The W left over run
at the end. With `admission` a device admits a microbatch's first chunk only if
the F of its later chunks on this device still fit, which keeps the
multi-chunk placements from deadlocking under tight budgets. On a placement of
several lanes (DualPipe) each stage runs its lane's microbatches only, and
admission keeps room on every device for the first lane's next microbatch, so
the lanes cannot block each other down to one microbatch in flight.

The compiler makes any valid order run under blocking exchanges (it posts
receives early where needed); with `prefer_pair`, after a pass whose output goes to device b,
a device takes first the pass that consumes what b is sending back, so the two
exchanges meet as in 1F1B's steady state.
"""

from __future__ import annotations

import numba
import numpy as np

from ppdsl.semantics import PassKind

__all__ = ["list_schedule", "PARAM_NAMES"]

F, B, W = PassKind.F.code, PassKind.B.code, PassKind.W.code
INF = np.inf
EPS = 1e-9

# params[k]: what the kth integer knob means
PARAM_NAMES = (
    "b_first",
    "w_mode",
    "admission",
    "f_priority",
    "b_priority",
    "prefer_pair",
    "gated",
    "gated_stall",
)


@numba.njit(cache=True)
def _consumer(kd, s, stage_device, num_stages, need, lane_length):  # pragma: no cover - numba
    """The pass on another device that takes what pass (kd, s) hands over
    (`semantics.sends`: F's activation to F(s+1), B's gradient to B(s-1)), as
    (kind, stage); (-1, -1) when its output stays on the device or leaves its
    lane (`lane_length` consecutive stages, `semantics.same_lane`)."""
    need_kind, need_offset, need_transfer = need
    for c in range(need_kind.shape[0]):
        for slot in range(need_kind.shape[1]):
            if need_kind[c, slot] != kd or need_transfer[c, slot] < 0:
                continue
            cs = s - need_offset[c, slot]
            if cs < 0 or cs >= num_stages or cs // lane_length != s // lane_length:
                continue
            if stage_device[cs] != stage_device[s]:
                return c, cs
    return -1, -1


@numba.njit(cache=True)
def _ready(kd, s, j, dev, endt, stage_device, comm, num_stages, need, lane_length):  # pragma: no cover
    """When pass (kd, s, j) on dev could start (INF: an input is undecided):
    the latest end of the passes it needs (`semantics.NEEDS`) inside its lane,
    plus `comm[edge]` for each that ran on another device (`comm[b]`: a
    transfer between stages b and b + 1)."""
    need_kind, need_offset, _ = need
    r = 0.0
    for slot in range(need_kind.shape[1]):
        nk = need_kind[kd, slot]
        if nk < 0:
            continue
        ns = s + need_offset[kd, slot]
        if ns < 0 or ns >= num_stages or ns // lane_length != s // lane_length:
            continue
        e = endt[nk, ns, j]
        if e < 0:
            return INF
        edge = ns if ns < s else s
        r = max(r, e + (comm[edge] if stage_device[ns] != dev else 0.0))
    return r


@numba.njit(cache=True)
def _fits(admission, chunk, cur, reserved, mem_f, later, limit):  # pragma: no cover - numba
    """May an F of this chunk start? Never above the budget; with admission
    (>= 1) a first chunk also needs room for the microbatch's later chunks,
    less a slack of (admission - 1) F's."""
    if cur + mem_f > limit:
        return False
    if admission >= 1 and chunk == 0:
        return cur + reserved + mem_f + later <= limit + (admission - 1) * mem_f
    return True


@numba.njit(cache=True)
def _may_take(
    k, s, j, dev, nf, nb, admission, chunk_of, cur, reserved, mem, later, limit
):  # pragma: no cover - numba
    """Pass (k, s, j) is its stage's next of its kind (a B also needs its F done)
    and, for an F, memory admits it on `dev`."""
    nxt = (nf[s] == j) if k == F else (nb[s] == j and nf[s] > j)
    if nxt and k == F:
        nxt = _fits(
            admission, chunk_of[s], cur[dev], reserved[dev], mem[F, s], later[dev], limit[dev]
        )
    return nxt


@numba.njit(cache=True)
def list_schedule(  # pragma: no cover - numba
    dev_stages,  # int64[d, v]: stage of chunk c on device dev
    stage_device,  # int64[S]
    m,
    dur,  # float[3, S]
    comm,  # float[S - 1]: a transfer between stages b and b + 1 (`Costs.edge_costs`)
    mem,  # int64[3, S] memory deltas
    limit,  # int64[d]
    caps,  # int64[S] in-flight cap (F done, B not yet) per stage
    params,  # int64[8]
    noise,  # float[2, S, m] priority noise for F and B (0 for none)
    need_kind,  # semantics.NEED_KIND
    need_offset,  # semantics.NEED_STAGE_OFFSET
    need_transfer,  # semantics.NEED_TRANSFER
    lanes=1,  # the placement's pipelines (`semantics.LANES`: DualPipe's 2)
):
    """Returns (offsets, kind, microbatch, stage, ok): the per-device orders as
    flat arrays, and False when the rules deadlock under the budget. With
    `lanes` > 1 the stages form that many pipelines and stage s runs only the
    microbatches of its lane (`semantics.microbatch_lane`)."""
    d, v = dev_stages.shape
    S = stage_device.shape[0]
    lane_length = S // lanes
    first = np.zeros(S, dtype=np.int64)  # the lane's microbatches: first .. last - 1
    last = np.full(S, m, dtype=np.int64)
    for s in range(S):
        lane = s // lane_length
        # j goes through lane j * lanes // m: the first j with that lane, and past it
        first[s] = (lane * m + lanes - 1) // lanes
        last[s] = ((lane + 1) * m + lanes - 1) // lanes
    need = (need_kind, need_offset, need_transfer)
    b_first, w_mode, admission, f_prio, b_prio = (
        params[0],
        params[1],
        params[2],
        params[3],
        params[4],
    )
    prefer_pair = params[5]
    gated = params[6]
    gated_stall = params[7]
    per_dev = 3 * v * m
    out_kind = np.zeros((d, per_dev), dtype=np.int64)
    out_stage = np.zeros((d, per_dev), dtype=np.int64)
    out_mb = np.zeros((d, per_dev), dtype=np.int64)
    count = np.zeros(d, dtype=np.int64)
    endt = np.full((3, S, m), -1.0)
    nf = first.copy()
    nb = first.copy()
    nw = first.copy()
    free = np.zeros(d)
    last_end = np.zeros(d)
    cur = np.zeros(d, dtype=np.int64)
    reserved = np.zeros(d, dtype=np.int64)
    chunk_of = np.zeros(S, dtype=np.int64)
    later = np.zeros(d, dtype=np.int64)  # memory of chunks 1.. of one microbatch
    for dev in range(d):
        for c in range(v):
            s = dev_stages[dev, c]
            chunk_of[s] = c
            if lanes == 1 and c > 0:
                later[dev] += mem[F, s]
            elif lanes > 1 and s // lane_length == 0:
                # several lanes: admission keeps room for the first lane's next
                # microbatch on every device (`later`, until that lane's forwards
                # here are done), so the other lanes can never block it; its own
                # F are checked against the budget only (chunk_of 1)
                later[dev] += mem[F, s]
                chunk_of[s] = 1
            elif lanes > 1:
                chunk_of[s] = 0
    # the send a device still owes (its consumer undecided)
    owe_k = np.full(d, -1, dtype=np.int64)
    owe_s = np.zeros(d, dtype=np.int64)
    owe_j = np.zeros(d, dtype=np.int64)
    committed = np.zeros((3, S, m), dtype=np.bool_)
    waiting = np.zeros(d, dtype=np.bool_)  # gated: committed to pend_*, waits for its gate
    pend_k = np.zeros(d, dtype=np.int64)
    pend_s = np.zeros(d, dtype=np.int64)
    pend_j = np.zeros(d, dtype=np.int64)
    pend_t = np.zeros(d)
    total = 3 * (last - first).sum()
    done = 0
    while done < total:
        dev = -1
        t = INF
        for x in range(d):
            if free[x] < t:
                t = free[x]
                dev = x
        if dev < 0:
            break  # every device waits: the rules deadlock
        if waiting[dev]:
            # the gate opened: the receiver reached the pass our last send feeds
            waiting[dev] = False
            pk, s, j = pend_k[dev], pend_s[dev], pend_j[dev]
            owe_k[dev] = -1
            ck, cs = _consumer(pk, s, stage_device, S, need, lane_length)
            if ck >= 0:
                owe_k[dev] = ck
                owe_s[dev] = cs
                owe_j[dev] = j
            # ppdsl's timing has no rendezvous stalls: the pass runs when it
            # could have (commit time), only its place in the order is fixed late
            t0 = t if gated_stall == 1 else pend_t[dev]
            end = t0 + dur[pk, s]
            endt[pk, s, j] = end
            k = count[dev]
            out_kind[dev, k] = pk
            out_stage[dev, k] = s
            out_mb[dev, k] = j
            count[dev] = k + 1
            last_end[dev] = end
            free[dev] = end
            done += 1
            for x in range(d):
                if x != dev and not waiting[x] and free[x] > t:
                    free[x] = max(last_end[x], t)
            continue
        if owe_k[dev] >= 0 and committed[owe_k[dev], owe_s[dev], owe_j[dev]]:
            owe_k[dev] = -1
        pick_kind = -1
        pick_stage = -1
        next_ready = INF
        mem_blocked = False
        must_wait = False
        if gated == 1:
            # first the pass that the device we owe is stopped at its send for
            # (it cannot move until we take it, and we cannot until it takes
            # ours); with stalls costing time, any device stopped for us
            owed = stage_device[owe_s[dev]] if owe_k[dev] >= 0 else -1
            for y in range(-1, d if gated_stall == 1 else 0):
                x = owed if y < 0 else y
                if x < 0 or (y >= 0 and x == owed):
                    continue
                if waiting[x] and owe_k[x] >= 0 and stage_device[owe_s[x]] == dev:
                    xk, xs, xj = owe_k[x], owe_s[x], owe_j[x]
                    nxt = _may_take(
                        xk, xs, xj, dev, nf, nb, admission, chunk_of, cur, reserved, mem,
                        later, limit,
                    )
                    if nxt:
                        r = _ready(xk, xs, xj, dev, endt, stage_device, comm, S, need, lane_length)
                        if r <= t + EPS:
                            pick_kind = xk
                            pick_stage = xs
                            break
                        next_ready = min(next_ready, r)
                    if y < 0:
                        must_wait = True  # anything else would deadlock the two of us
                        break
        if gated == 1 and pick_kind < 0 and not must_wait and owe_k[dev] >= 0:
            # the device we owe is running a pass whose output comes to us: it
            # will owe us when it ends, so we take that consumer next (the two
            # exchanges meet) rather than a pass that would leave us both waiting
            b = stage_device[owe_s[dev]]
            if not waiting[b] and count[b] > 0 and last_end[b] > t:
                lk = out_kind[b, count[b] - 1]
                ls = out_stage[b, count[b] - 1]
                lj = out_mb[b, count[b] - 1]
                ck, cs = _consumer(lk, ls, stage_device, S, need, lane_length)
                if ck >= 0 and stage_device[cs] == dev and not committed[ck, cs, lj]:
                    nxt = _may_take(
                        ck, cs, lj, dev, nf, nb, admission, chunk_of, cur, reserved, mem,
                        later, limit,
                    )
                    if nxt:
                        r = _ready(ck, cs, lj, dev, endt, stage_device, comm, S, need, lane_length)
                        if r <= t + EPS:
                            pick_kind = ck
                            pick_stage = cs
                        else:
                            next_ready = min(next_ready, r)
                            must_wait = True
        if must_wait and pick_kind < 0:
            free[dev] = max(next_ready, last_end[dev]) if next_ready < INF else INF
            if free[dev] <= t:
                free[dev] = INF
            continue
        if pick_kind < 0 and owe_k[dev] >= 0 and prefer_pair == 1:
            # a pass that receives from the device we just sent to: the two
            # exchanges meet (what keeps 1F1B's steady state from deadlocking)
            b = stage_device[owe_s[dev]]
            if owe_k[b] >= 0 and stage_device[owe_s[b]] == dev:
                xk, xs, xj = owe_k[b], owe_s[b], owe_j[b]
                nxt = (nf[xs] == xj) if xk == F else (nb[xs] == xj and nf[xs] > xj)
                if nxt and xk == F:
                    nxt = _fits(
                        admission,
                        chunk_of[xs],
                        cur[dev],
                        reserved[dev],
                        mem[F, xs],
                        later[dev],
                        limit[dev],
                    )
                if nxt and _ready(xk, xs, xj, dev, endt, stage_device, comm, S, need, lane_length) <= t + EPS:
                    pick_kind = xk
                    pick_stage = xs
        if pick_kind < 0:
            best_b = INF
            best_f = INF
            bs = -1
            fs = -1
            for c in range(v):
                s = dev_stages[dev, c]
                j = nb[s]
                if j < nf[s]:
                    r = _ready(B, s, j, dev, endt, stage_device, comm, S, need, lane_length)
                    if r <= t + EPS:
                        if b_prio == 0:
                            key = j * 4.0 * S - s + noise[1, s, j]
                        else:
                            key = -s * 4.0 * m + j + noise[1, s, j]
                        if key < best_b:
                            best_b = key
                            bs = s
                    else:
                        next_ready = min(next_ready, r)
                j = nf[s]
                if j < last[s]:
                    r = _ready(F, s, j, dev, endt, stage_device, comm, S, need, lane_length)
                    fits = nf[s] - nb[s] < caps[s]
                    fits = fits and _fits(
                        admission, chunk_of[s], cur[dev], reserved[dev], mem[F, s], later[dev],
                        limit[dev],
                    )
                    if r <= t + EPS:
                        if fits:
                            if f_prio == 0:
                                key = -s * 4.0 * m + j + noise[0, s, j]
                            elif f_prio == 1:
                                key = j * 4.0 * S - s + noise[0, s, j]
                            else:
                                key = s * 4.0 * m + j + noise[0, s, j]
                            if key < best_f:
                                best_f = key
                                fs = s
                        else:
                            mem_blocked = True
                    elif fits:
                        next_ready = min(next_ready, r)
            if w_mode == 2:
                # W right after its B: run any pending W before new F/B
                for c in range(v):
                    s = dev_stages[dev, c]
                    if nw[s] < nb[s]:
                        bs = -1
                        fs = -1
                        break
            if bs >= 0 and (b_first == 1 or fs < 0):
                pick_kind = B
                pick_stage = bs
            elif fs >= 0:
                pick_kind = F
                pick_stage = fs
            if pick_kind < 0:
                # nothing F/B to run now: the oldest pending W, if the gap rule allows
                ws = -1
                oldest = INF
                for c in range(v):
                    s = dev_stages[dev, c]
                    if nw[s] < nb[s]:
                        e = endt[B, s, nw[s]]
                        if e < oldest:
                            oldest = e
                            ws = s
                if ws >= 0:
                    gap = next_ready - t
                    if w_mode != 1 or mem_blocked or gap >= dur[W, ws] - EPS or next_ready == INF:
                        pick_kind = W
                        pick_stage = ws
        if pick_kind < 0:
            free[dev] = max(next_ready, last_end[dev]) if next_ready < INF else INF
            if free[dev] <= t:
                free[dev] = INF
            continue
        s = pick_stage
        if pick_kind == F:
            j = nf[s]
            nf[s] += 1
            if lanes > 1:
                if s // lane_length == 0 and nf[s] == last[s]:
                    later[dev] -= mem[F, s]  # the first lane has no more to come here
            elif admission >= 1:
                if chunk_of[s] == 0:
                    reserved[dev] += later[dev]
                else:
                    reserved[dev] -= mem[F, s]
        elif pick_kind == B:
            j = nb[s]
            nb[s] += 1
        else:
            j = nw[s]
            nw[s] += 1
        committed[pick_kind, s, j] = True
        cur[dev] += mem[pick_kind, s]
        for x in range(d):
            if waiting[x] and owe_k[x] == pick_kind and owe_s[x] == s and owe_j[x] == j:
                free[x] = t  # its gate opens now
        if gated == 1 and owe_k[dev] >= 0 and not committed[owe_k[dev], owe_s[dev], owe_j[dev]]:
            waiting[dev] = True
            pend_k[dev] = pick_kind
            pend_s[dev] = s
            pend_j[dev] = j
            pend_t[dev] = t
            free[dev] = INF
            continue
        owe_k[dev] = -1
        ck, cs = _consumer(pick_kind, s, stage_device, S, need, lane_length)
        if ck >= 0:
            owe_k[dev] = ck
            owe_s[dev] = cs
            owe_j[dev] = j
        end = t + dur[pick_kind, s]
        endt[pick_kind, s, j] = end
        k = count[dev]
        out_kind[dev, k] = pick_kind
        out_stage[dev, k] = s
        out_mb[dev, k] = j
        count[dev] = k + 1
        last_end[dev] = end
        free[dev] = end
        done += 1
        for x in range(d):
            if x != dev and not waiting[x] and free[x] > t:
                free[x] = max(last_end[x], t)
    offsets = np.zeros(d + 1, dtype=np.int64)
    for x in range(d):
        offsets[x + 1] = offsets[x] + count[x]
    n = offsets[d]
    kind = np.zeros(n, dtype=np.int64)
    stage = np.zeros(n, dtype=np.int64)
    mb = np.zeros(n, dtype=np.int64)
    for x in range(d):
        for k in range(count[x]):
            kind[offsets[x] + k] = out_kind[x, k]
            stage[offsets[x] + k] = out_stage[x, k]
            mb[offsets[x] + k] = out_mb[x, k]
    return offsets, kind, mb, stage, done == total
