"""Make found orders run under blocking send/recv (numba).

ppdsl lowers each order into exchanges: the sends after a pass and the receives
before the next one are posted together and waited for together, and a send
completes only once its receiver has posted the receive (`ppdsl.checks.deadlock`).
An order that times well with asynchronous transfers can still deadlock there:
rank r sends x to b and only later receives y from b, while b sends y and only
later receives x.

`make_rendezvous_safe` runs the ranks under those rules; whenever they are stuck,
a rank r waits at a send for b to reach the pass that consumes it, and that pass
is moved forward in b's order to where b stands (when b's own earlier passes
allow it). The rendezvous then completes and the ranks run on. Orders that
already run come back unchanged.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["make_rendezvous_safe"]

F, B, W = 0, 1, 2


@numba.njit(cache=True)
def _where(offsets, kind, mb, stage, num_stages, m):  # pragma: no cover - numba
    """index[kind, stage, microbatch] -> position in its device's order."""
    index = np.full((3, num_stages, m), -1, dtype=np.int64)
    for dev in range(offsets.shape[0] - 1):
        for k in range(offsets[dev], offsets[dev + 1]):
            index[kind[k], stage[k], mb[k]] = k - offsets[dev]
    return index


@numba.njit(cache=True)
def _consumer(kd, s, stage_device, num_stages):  # pragma: no cover - numba
    """(kind, stage) of the pass on another device that takes kd/s's output;
    kind -1 when there is none."""
    if kd == F and s < num_stages - 1 and stage_device[s + 1] != stage_device[s]:
        return F, s + 1
    if kd == B and s > 0 and stage_device[s - 1] != stage_device[s]:
        return B, s - 1
    return -1, -1


@numba.njit(cache=True)
def _producer(kd, s, stage_device, num_stages):  # pragma: no cover - numba
    if kd == F and s > 0 and stage_device[s - 1] != stage_device[s]:
        return F, s - 1
    if kd == B and s < num_stages - 1 and stage_device[s + 1] != stage_device[s]:
        return B, s + 1
    return -1, -1


@numba.njit(cache=True)
def make_rendezvous_safe(
    offsets, kind, mb, stage, stage_device, m, start
):  # pragma: no cover - numba
    """Returns (kind, microbatch, stage, ok, moves): the orders (copies),
    whether they now run to the end, and how many passes were moved. `start`
    (per flat pass, its start time in the orders as given) picks, among the
    passes that could be moved, the one that starts earliest."""
    kind = kind.copy()
    mb = mb.copy()
    stage = stage.copy()
    num_stages = stage_device.shape[0]
    d = offsets.shape[0] - 1
    index = _where(offsets, kind, mb, stage, num_stages, m)
    start_of = np.zeros((3, num_stages, m))
    for g in range(kind.shape[0]):
        start_of[kind[g], stage[g], mb[g]] = start[g]
    position = np.zeros(d, dtype=np.int64)
    moves = 0
    max_moves = 4 * kind.shape[0]
    while True:
        moved = True
        while moved:
            moved = False
            for r in range(d):
                n = offsets[r + 1] - offsets[r]
                while position[r] < n:
                    k = position[r]
                    g = offsets[r] + k
                    ok = True
                    pk, ps = _producer(kind[g], stage[g], stage_device, num_stages)
                    if pk >= 0:
                        a = stage_device[ps]
                        if position[a] <= index[pk, ps, mb[g]]:
                            ok = False
                    if ok and k > 0:
                        ck, cs = _consumer(kind[g - 1], stage[g - 1], stage_device, num_stages)
                        if ck >= 0:
                            b = stage_device[cs]
                            if position[b] < index[ck, cs, mb[g - 1]]:
                                ok = False
                    if not ok:
                        break
                    position[r] = k + 1
                    moved = True
        done = True
        for r in range(d):
            if position[r] < offsets[r + 1] - offsets[r]:
                done = False
        if done:
            return kind, mb, stage, True, moves
        # stuck: pull a consumer forward to where its rank stands
        best_t = np.inf
        best_b = -1
        best_kind = -1
        best_stage = -1
        best_j = -1
        for r in range(d):
            k = position[r]
            if k >= offsets[r + 1] - offsets[r] or k == 0:
                continue
            g = offsets[r] + k - 1
            ck, cs = _consumer(kind[g], stage[g], stage_device, num_stages)
            if ck < 0:
                continue
            b = stage_device[cs]
            j = mb[g]
            at = index[ck, cs, j]
            here = position[b]
            if at <= here:
                continue
            # never push back a pass whose sender stands right after sending it
            # (that rendezvous is met now; breaking it could cycle)
            hk, hs = kind[offsets[b] + here], stage[offsets[b] + here]
            pk, ps = _producer(hk, hs, stage_device, num_stages)
            if pk >= 0:
                a = stage_device[ps]
                if position[a] == index[pk, ps, mb[offsets[b] + here]] + 1:
                    continue
            # the moved pass's own-device inputs must already be behind `here`
            if ck == F:
                if cs > 0 and stage_device[cs - 1] == b and index[F, cs - 1, j] >= here:
                    continue
            else:
                if index[F, cs, j] >= here:
                    continue
                if (
                    cs < num_stages - 1
                    and stage_device[cs + 1] == b
                    and index[B, cs + 1, j] >= here
                ):
                    continue
            if start_of[ck, cs, j] < best_t:
                best_t = start_of[ck, cs, j]
                best_b = b
                best_kind = ck
                best_stage = cs
                best_j = j
        if best_b < 0:
            return kind, mb, stage, False, moves
        b, ck, cs, j = best_b, best_kind, best_stage, best_j
        at = index[ck, cs, j]
        here = position[b]
        base = offsets[b]
        for x in range(base + at, base + here, -1):
            kind[x] = kind[x - 1]
            mb[x] = mb[x - 1]
            stage[x] = stage[x - 1]
            index[kind[x], stage[x], mb[x]] = x - base
        kind[base + here] = ck
        mb[base + here] = j
        stage[base + here] = cs
        index[ck, cs, j] = here
        moves += 1
        if moves > max_moves:
            return kind, mb, stage, False, moves
