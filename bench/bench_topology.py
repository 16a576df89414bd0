"""Placements searched with and without the cluster's topology (issue 37, "Time
per edge"; the breadth-first paper, Lamy-Poirier 2023: a looped placement run
breadth-first ends most of a device's stages' backwards early, so their
data-parallel gradient reductions run behind the remaining compute).

The cluster: 2 nodes x 8 GPUs, NVLink inside a node (3 us, 150 GB/s) and one
400 Gb/s InfiniBand port per GPU across nodes (10 us, 50 GB/s):
bench/topology/cluster.topo. Pipeline d = 8 inside each node, dp = 2 replicas,
one per node (world rank = replica * 8 + rank), so every stage's gradient
all-reduce crosses InfiniBand. The topology-blind search sees the same 16 GPUs
as one flat NVLink domain (bench/topology/flat.topo: what one `cost comm` and
one `cost reduce` per stage state when nobody says which links a transfer
takes).

The model (stated, per 1F1B stage of d = 8): F = B = W = 18 ms (a 7B model's
stage at 4,096 tokens per microbatch on an H100), its output activation
4,096 x 4,096 bf16 = 32 MiB, its gradients 1.75 GB (875M bf16 parameters); a
looped(2) chunk runs half of each, and reduces half the bytes. m = 16.

Both searches (`ppdsl search --frontier --placement parallel,looped(2) --dp 2
--objective makespan`, the search's API here) run at the same memory levels;
each picks, per level, the placement with the smallest predicted step. Each
pick's step is then predicted again on the real cluster: the blind pick's
orders re-timed over the cluster's links.

`python -m bench topology [--write]` (`--write`: bench/results/topology.md).
Budgets are evaluations, so the tables repeat on every machine.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

from ppdsl.analysis.collectives import comm_lanes
from ppdsl.analysis.simulate import simulate
from ppdsl.search.combined import SearchOptions, exact_problem
from ppdsl.search.frontier import FrontierOptions, FrontierPoint, frontier
from ppdsl.search.problem import SearchProblem, build_problem, chunk_costs, with_topology
from ppdsl.topology import Topology, load_topology

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "topology.md"
CLUSTER = ROOT / "bench" / "topology" / "cluster.topo"
FLAT = ROOT / "bench" / "topology" / "flat.topo"
DEVICES, MICROBATCHES, DP = 8, 16, 2
COSTS = "F=18,B=18,W=18,bytes=33554432,grad_bytes=1750000000"
PLACEMENTS = ("parallel", "looped(2)")
LEVELS = (Fraction(8), Fraction(16))
"""Peak activation per device, in M_B (8: 1F1B's p·M_B; 16: every forward of
a parallel placement's first stage in flight, where both reach their floor)."""
EVALUATIONS = 300


def _problem(placement: str, topology: Topology) -> SearchProblem:
    problem = build_problem(devices=DEVICES, microbatches=MICROBATCHES, placement=placement,
                            costs=COSTS, memory=None, weight_fraction="1/2")
    problem = replace(problem, costs=chunk_costs(problem.costs, problem.model_chunks_per_device))
    return with_topology(problem, topology, DP)


def _step_on(problem: SearchProblem, point: FrontierPoint) -> tuple[float, float]:
    """(step, exposed reduction) of `point`'s orders timed under `problem`'s costs."""
    schedule = exact_problem(problem).schedule(point.outcome.orders)
    lanes = comm_lanes(schedule, simulate(schedule))
    return lanes.makespan, max(lanes.exposed)


def _search(topology: Topology, level: Fraction) -> dict[str, FrontierPoint]:
    """Per placement, the searched point at `level`."""
    problems = [_problem(p, topology) for p in PLACEMENTS]
    options = FrontierOptions(
        SearchOptions(objective="makespan", evaluations=EVALUATIONS, seed=0, exact=False,
                      effort=0.0, time_cap=None),
        low=level, high=level, max_levels=1, dp=DP)
    result = frontier(problems, options)
    best: dict[str, FrontierPoint] = {}
    for point in result.searched:
        if point.budget <= level and (point.placement not in best
                                      or point.step < best[point.placement].step):
            best[point.placement] = point
    return best


def main() -> None:
    cluster, flat = load_topology(str(CLUSTER)), load_topology(str(FLAT))
    lines = [
        f"Cluster: {cluster.describe()}. Blind: {flat.describe()}.",
        f"d = {DEVICES}, m = {MICROBATCHES}, dp = {DP}, costs per 1F1B stage {COSTS} "
        f"(ms, bytes); {EVALUATIONS} evaluations per level and placement; objective: step time.",
        "",
        "| memory (M_B) | search | placement | its predicted step (ms) | exposed reduction | "
        "step on the cluster (ms) | exposed on the cluster | picked |",
        "|---|---|---|---|---|---|---|---|",
    ]
    started = time.perf_counter()
    picks: list[tuple[Fraction, str, str]] = []
    for level in LEVELS:
        real = {p: _problem(p, cluster) for p in PLACEMENTS}
        for name, topology in (("topology-blind", flat), ("with the topology", cluster)):
            found = _search(topology, level)
            pick = min(found, key=lambda p: found[p].step)
            picks.append((level, name, pick))
            for placement, point in found.items():
                on_cluster, exposed = _step_on(real[placement], point)
                lines.append(
                    f"| {level} | {name} | {placement} | {point.step:.2f} | {point.exposed:.2f} "
                    f"| {on_cluster:.2f} | {exposed:.2f} | {'**yes**' if placement == pick else ''} |")
    lines.append("")
    for level in LEVELS:
        blind = next(p for lv, n, p in picks if lv == level and n == "topology-blind")
        aware = next(p for lv, n, p in picks if lv == level and n == "with the topology")
        verdict = "a different placement" if blind != aware else "the same placement"
        lines.append(f"- memory {level}: blind picks {blind}, with the topology {aware}: {verdict}.")
    lines.append(f"\nwall: {time.perf_counter() - started:.0f} s on this machine (2 shared cores, "
                 "under nice)")
    text = "\n".join(lines) + "\n"
    print(text)
    if "--write" in sys.argv:
        RESULTS.write_text(_header() + text, encoding="utf-8")


def _header() -> str:
    return ("# Placement with and without the topology (issue 37)\n\n"
            "Written by `python -m bench topology --write` (bench/bench_topology.py, whose "
            "docstring states the cluster, the model and the method).\n\n")


if __name__ == "__main__":
    main()
