"""Order-level heuristics, the zero-bubble paper's automatic scheduler
generalised to any placement (numba): an event-driven list scheduler.

Whenever a device is free it picks, among the passes whose inputs have arrived:
a B (or an F first, `b_first=0`), an F only while the memory budget and the
per-stage in-flight cap allow it (as many F as memory allows in warm-up), and
otherwise a W to fill the gap (`w_mode` 0: always; 1: only a gap at least T_W
long or when memory blocks an F; 2: a W right after its B). The W left over run
at the end. With `admission` a device admits a microbatch's first chunk only if
the F of its later chunks on this device still fit, which makes the multi-chunk
placements deadlock-free under tight budgets.

In `fixed` mode the F/B order of every device is given (a repeated building
block) and only the W are placed, by the same gap rule: the building block's
"W fill".
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["list_schedule", "PARAM_NAMES"]

F, B, W = 0, 1, 2
INF = np.inf
EPS = 1e-9

# params[k]: what the kth integer knob means
PARAM_NAMES = ("b_first", "w_mode", "admission", "f_priority", "b_priority", "fixed")


@numba.njit(cache=True)
def list_schedule(  # pragma: no cover - numba
    dev_stages,  # int64[d, v]: stage of chunk c on device dev
    stage_device,  # int64[S]
    m,
    dur,  # float[3, S]
    comm,
    mem,  # int64[3, S] memory deltas
    limit,  # int64[d]
    caps,  # int64[S] in-flight cap (F done, B not yet) per stage
    params,  # int64[6]
    noise,  # float[2, S, m] priority noise for F and B (0 for none)
    fb_kind,  # int64[d, L] fixed F/B order (fixed mode)
    fb_stage,
    fb_mb,
    fb_len,  # int64[d]
):
    """Returns (offsets, kind, microbatch, stage, ok): the per-device orders as
    flat arrays, and False when the rules deadlock under the budget."""
    d, v = dev_stages.shape
    S = stage_device.shape[0]
    b_first, w_mode, admission, f_prio, b_prio, fixed = (
        params[0], params[1], params[2], params[3], params[4], params[5]
    )
    per_dev = 3 * v * m
    out_kind = np.zeros((d, per_dev), dtype=np.int64)
    out_stage = np.zeros((d, per_dev), dtype=np.int64)
    out_mb = np.zeros((d, per_dev), dtype=np.int64)
    count = np.zeros(d, dtype=np.int64)
    endt = np.full((3, S, m), -1.0)
    nf = np.zeros(S, dtype=np.int64)
    nb = np.zeros(S, dtype=np.int64)
    nw = np.zeros(S, dtype=np.int64)
    free = np.zeros(d)
    last_end = np.zeros(d)
    cur = np.zeros(d, dtype=np.int64)
    reserved = np.zeros(d, dtype=np.int64)
    later = np.zeros(d, dtype=np.int64)  # memory of chunks 1.. of one microbatch
    for dev in range(d):
        for c in range(1, v):
            later[dev] += mem[F, dev_stages[dev, c]]
    fpos = np.zeros(d, dtype=np.int64)
    total = 3 * S * m
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
        pick_kind = -1
        pick_stage = -1
        next_ready = INF
        mem_blocked = False
        if fixed == 1:
            if fpos[dev] < fb_len[dev]:
                kd = fb_kind[dev, fpos[dev]]
                s = fb_stage[dev, fpos[dev]]
                j = fb_mb[dev, fpos[dev]]
                r = 0.0
                if kd == F:
                    if s > 0:
                        e = endt[F, s - 1, j]
                        r = INF if e < 0 else e + (comm if stage_device[s - 1] != dev else 0.0)
                else:
                    r = endt[F, s, j]
                    if r < 0:
                        r = INF
                    if s < S - 1:
                        e = endt[B, s + 1, j]
                        if e < 0:
                            r = INF
                        else:
                            r = max(r, e + (comm if stage_device[s + 1] != dev else 0.0))
                if r <= t + EPS:
                    pick_kind = kd
                    pick_stage = s
                else:
                    next_ready = r
        else:
            best_b = INF
            best_f = INF
            bs = -1
            fs = -1
            for c in range(v):
                s = dev_stages[dev, c]
                j = nb[s]
                if j < nf[s]:
                    r = endt[F, s, j]
                    if s < S - 1:
                        e = endt[B, s + 1, j]
                        r = INF if e < 0 else max(r, e + (comm if stage_device[s + 1] != dev else 0.0))
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
                if j < m:
                    r = 0.0
                    if s > 0:
                        e = endt[F, s - 1, j]
                        r = INF if e < 0 else e + (comm if stage_device[s - 1] != dev else 0.0)
                    fits = nf[s] - nb[s] < caps[s]
                    if admission == 1:
                        if c == 0:
                            fits = fits and cur[dev] + reserved[dev] + mem[F, s] + later[dev] <= limit[dev]
                    else:
                        fits = fits and cur[dev] + mem[F, s] <= limit[dev]
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
            chunk = 0
            for c in range(v):
                if dev_stages[dev, c] == s:
                    chunk = c
            if admission == 1:
                if chunk == 0:
                    reserved[dev] += later[dev]
                else:
                    reserved[dev] -= mem[F, s]
        elif pick_kind == B:
            j = nb[s]
            nb[s] += 1
        else:
            j = nw[s]
            nw[s] += 1
        if fixed == 1 and pick_kind != W:
            fpos[dev] += 1
        cur[dev] += mem[pick_kind, s]
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
            if x != dev and free[x] > end:
                free[x] = max(last_end[x], end)
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
