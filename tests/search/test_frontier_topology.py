"""`search --frontier --topology` (ppdsl/topology.py, docs/language.md
"Transfers"): the breadth-first paper's point that a looped placement hides
data-parallel reductions behind compute decides the placement only when the
search knows the reductions cross a slow link."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from ppdsl.search.combined import SearchOptions
from ppdsl.search.frontier import FrontierOptions, frontier
from ppdsl.search.problem import build_problem, chunk_costs, with_topology
from ppdsl.topology import Topology, parse_topology

# d = 2 ranks x dp = 2 replicas: one replica per node on the cluster, so each
# stage's gradient all-reduce crosses the slow link; the flat view is one node
CLUSTER = parse_topology("nodes=2,gpus_per_node=2,intra_latency=0,intra_bandwidth=10000,"
                         "inter_latency=0,inter_bandwidth=100", "cluster", separator=",")
FLAT = parse_topology("nodes=1,gpus_per_node=4,intra_latency=0,intra_bandwidth=10000",
                      "flat", separator=",")
COSTS = "F=1,B=1,W=1,bytes=10000,grad_bytes=3000"


def _best_placement(topology: Topology) -> tuple[str, dict[str, float]]:
    problems = []
    for placement in ("parallel", "looped(2)"):
        problem = build_problem(devices=2, microbatches=4, placement=placement, costs=COSTS,
                                memory=None, weight_fraction="1/2")
        problem = dataclasses.replace(problem, costs=chunk_costs(
            problem.costs, problem.model_chunks_per_device))
        problems.append(with_topology(problem, topology, dp=2))
    options = FrontierOptions(
        SearchOptions(objective="makespan", evaluations=100, seed=0, exact=False, effort=0.0,
                      time_cap=None), low=Fraction(4), high=Fraction(4), max_levels=1, dp=2)
    steps = {p.placement: p.step for p in frontier(problems, options).searched}
    return min(steps, key=steps.__getitem__), steps


def test_topology_moves_the_search_to_the_looped_placement() -> None:
    """On one flat node the reductions are cheap and the parallel placement's
    fewer transfers win; with the replicas on two nodes the looped placement,
    whose first chunk's reduction runs while its second computes, wins."""
    blind, blind_steps = _best_placement(FLAT)
    aware, aware_steps = _best_placement(CLUSTER)
    assert blind == "parallel", blind_steps
    assert aware == "looped(2)", aware_steps
    # the reductions are what moved: both searches see the same transfers
    assert aware_steps["parallel"] - blind_steps["parallel"] > 20
