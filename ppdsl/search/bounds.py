"""Lower bounds for the exact engine (docs/exact.md, "Bounds from memory and
one device at a time").

Two facts every valid schedule satisfies, derived before solving:

- **Memory precedences.** A device holds the activation of (microbatch i,
  stage s) from the start of F(i, s) to the end of W(i, s) (M_B until B ends,
  M_W until W ends). If F(j + c, s) started before a pass X(j, u) ended, every
  (i, s'') of the device with j <= i <= j + c whose F is sure to have started
  (F(i, s'') runs no later than F(j + c, s): FIFO and the forward chain) and
  whose B or W is sure not to have ended (it comes after X(i, u), which ends no
  earlier than X(j, u): FIFO) is held at that moment. When that is more than
  the budget, F(j + c, s) starts after X(j, u) ends. On a V-shape this couples
  a device's two chunks: at most budget / (M_B(a) + M_B(b)) microbatches pass
  its turn between F of chunk b and B of chunk b, which caps how many
  microbatches are in flight through the far end of the pipeline.
- **One device at a time.** Keep one device's passes and replace everything
  else by the longest paths through the dependency, FIFO and memory-precedence
  graph: a release time for each pass (from the device's first pass, F(0, s*)),
  a least distance between any two of its passes, and a tail (from a pass's
  start to the end of the device's last pass). Every valid schedule, cut down
  to that device and shifted to start at 0, is a schedule of this one-machine
  problem with its memory budget, so the one-machine optimum (or any lower
  bound CP-SAT proves on it) bounds that device's span from below.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ppdsl.ir.schedule import PassKind
from ppdsl.semantics import allocates_at_start, needs

__all__ = ["memory_precedences", "DeviceBound", "device_span_bounds"]

_F, _B, _W, _BW = PassKind.F, PassKind.B, PassKind.W, PassKind.BW

Key = tuple[PassKind, int, int]


def _reaches(kinds: Sequence[PassKind], num_stages: int) -> dict[tuple[PassKind, int], set]:
    """Within one microbatch: the (kind, stage) passes each (kind, stage)
    pass comes before, transitively (the dependency rule of `semantics.needs`)."""
    after: dict[tuple[PassKind, int], set] = {
        (k, s): set() for k in kinds for s in range(num_stages)
    }
    for k in kinds:
        for s in range(num_stages):
            for need_kind, _, need_stage in needs(k, 0, s, num_stages):
                after[(need_kind, need_stage)].add((k, s))
    closed: dict[tuple[PassKind, int], set] = {}

    def close(node):
        if node not in closed:
            out: set = set()
            for nxt in after[node]:
                out.add(nxt)
                out |= close(nxt)
            closed[node] = out
        return closed[node]

    for node in after:
        close(node)
    return closed


def memory_precedences(problem) -> list[tuple[Key, Key]]:
    """(X(j, u), F(j + c, s)) pairs: F(j + c, s) starts after X(j, u) ends in
    every schedule within the budgets (module docstring). `problem` is an
    `exact.ExactProblem`. The one-stage case (c + 1 activations of a stage
    over the budget) is among them."""
    p = problem
    if p.memory.recompute:
        return []  # F of a recomputed stage allocates less than M_B: not derived here
    S, m = p.placement.num_stages, p.num_microbatches
    kinds = p.kinds
    reach = _reaches(kinds, S)
    releasing = (_B, _W) if p.split_backward else (_BW,)
    out: list[tuple[Key, Key]] = []
    for device in range(p.num_devices):
        budget = p.budgets[device]
        if budget is None:
            continue
        stages = p.placement.chunks(device)
        for s in stages:
            for x in releasing:
                for u in range(S):
                    witness = (x, u)
                    held = 0
                    for other in stages:
                        if other != s and (_F, s) not in reach[(_F, other)]:
                            continue  # F(i, other) not sure to have started
                        back = _B if p.split_backward else _BW
                        if witness == (back, other) or (back, other) in reach[witness]:
                            held += p.memory.activation[other]
                        elif p.split_backward and (
                            witness == (_W, other) or (_W, other) in reach[witness]
                        ):
                            held += p.memory.weight_retained[other]
                    if held <= 0:
                        continue
                    c = math.floor(budget / held)  # (c + 1) * held > budget
                    if c < 1 or c >= m:
                        continue
                    for j in range(m - c):
                        out.append(((x, j, u), (_F, j + c, s)))
    return out


class DeviceBound:
    """The one-device relaxation of one device (module docstring), built from
    the problem's pass graph: releases, pairwise least distances and tails in
    integer time."""

    def __init__(
        self,
        device: int,
        keys,
        duration,
        device_of,
        edges,
        topological,
        budget_cap,
        deltas,
        first_key,
    ):
        self.device = device
        index = {key: k for k, key in enumerate(keys)}
        n = len(keys)
        own = [k for k in range(n) if device_of[k] == device]
        self.own = own
        succ: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for a, b, lag in edges:
            succ[a].append((b, int(duration[a]) + lag))
        neg = -(1 << 62)  # no path (sums of integer times stay below 2**61)
        first = index[first_key]
        self.first = first
        # longest paths from every pass of the device (and from its first
        # pass) to every pass: one sweep in topological order, a vector per pass
        column = {k: c for c, k in enumerate(own)}
        dist = np.full((n, len(own)), neg, dtype=np.int64)
        for a in topological:
            row = dist[a]
            if a in column:
                row[column[a]] = max(row[column[a]], 0)
            for b, w in succ[a]:
                np.maximum(dist[b], row + w, out=dist[b])
        self.release = {k: max(0, int(dist[k, column[first]])) for k in own}
        # tail: longest from a pass's start to the end of one of this device's passes
        tail = np.full(n, neg, dtype=np.int64)
        for a in reversed(topological):
            best = int(duration[a]) if device_of[a] == device else neg
            for b, w in succ[a]:
                if tail[b] > neg // 2 and w + tail[b] > best:
                    best = w + int(tail[b])
            tail[a] = best
        self.tail = {k: int(tail[k]) for k in own}
        self.lags: list[tuple[int, int, int]] = []
        for b in own:
            for a in own:
                gap = int(dist[b, column[a]])
                if a != b and gap > neg // 2:
                    self.lags.append((a, b, gap))
        self.duration = {k: int(duration[k]) for k in own}
        self.budget_cap = budget_cap
        self.deltas = deltas
        self.keys = keys

    def solve(self, effort: float, seed: int = 0) -> tuple[int, bool, float]:
        """(lower bound on the device's span, proven optimal, deterministic
        time spent)."""
        from ortools.sat.python import cp_model

        model = cp_model.CpModel()
        horizon = max(self.release.values()) + sum(self.duration.values()) + max(self.tail.values())
        start = {}
        for k in self.own:
            start[k] = model.new_int_var(self.release[k], max(self.release[k], horizon), f"s{k}")
        model.add(start[self.first] == 0)
        intervals = [
            model.new_fixed_size_interval_var(start[k], self.duration[k], f"i{k}") for k in self.own
        ]
        model.add_no_overlap(intervals)
        for a, b, gap in self.lags:
            model.add(start[b] >= start[a] + gap)
        if self.budget_cap is not None:
            times, changes = [], []
            for k in self.own:
                delta = self.deltas[k]
                if delta == 0:
                    continue
                kind = self.keys[k][0]
                times.append(start[k] if allocates_at_start(kind) else start[k] + self.duration[k])
                changes.append(delta)
            model.add_reservoir_constraint(times, changes, 0, self.budget_cap)
        last = model.new_int_var(0, 2 * horizon, "last")
        for k in self.own:
            model.add(last >= start[k] + self.tail[k])
        model.minimize(last)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = seed
        solver.parameters.max_deterministic_time = max(effort, 1e-3)
        status = solver.solve(model)
        det = float(solver.response_proto.deterministic_time)
        name = solver.status_name(status)
        if name == "OPTIMAL":
            return int(round(solver.objective_value)), True, det
        if name == "INFEASIBLE":
            return horizon * 2, True, det
        return int(math.ceil(solver.best_objective_bound - 1e-9)), False, det


def device_span_bounds(
    model, effort_per_device: float, seed: int = 0
) -> list[tuple[int, bool, float]]:
    """Per device of `model` (an `exact._Model`), the one-device relaxation's
    bound on its span (integer time), whether it is that relaxation's
    optimum, and the deterministic time spent."""
    p = model.problem
    keys = [pp.key for pp in model.passes]
    sd = p.placement.stage_device
    device_of = [sd[key[2]] for key in keys]
    topological = [model.index[key] for key in model.topological_keys]
    out = []
    for x in range(p.num_devices):
        budget = p.budgets[x]
        cap = None if budget is None else int(math.floor(budget * model.mscale))
        deltas = {
            k: int(p.memory.delta(keys[k][0], keys[k][2]) * model.mscale)
            for k in range(len(keys))
            if device_of[k] == x
        }
        first_key = model.passes[model.first_pass[x]].key
        bound = DeviceBound(
            x, keys, model.duration, device_of, model.edges, topological, cap, deltas, first_key
        )
        out.append(bound.solve(effort_per_device, seed))
    return out
