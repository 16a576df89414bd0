"""The memory–throughput frontier against the papers' named schedules (issue 25).

For p in {4, 8}, m in {2p, 3p}, unit costs and the zero-bubble paper's profiled
costs (T_F 18.522, T_B 18.086, T_W 9.337, comm 0.601 per 1F1B stage; a chunk of a
placement with v chunks per device runs in 1/v of them), M_W = M_B (the
controllable-memory paper's accounting: a microbatch's activations count until
its W ends):

- the frontier by bubble (`ppdsl search --frontier`, `ppdsl.search.frontier`)
  over the parallel, V-shape, looped(2) and DualPipe placements (DualPipe's
  stages are whole model stages, two lanes per device, so it holds the
  parameters twice: its memory adds `PARAMETER_MEMORY` for the second copy),
  every memory level from
  the smallest feasible to the bubble's floor (`EVALUATIONS`, `LEVELS` and
  `EFFORT` per p: at p = 4 every level, 1000 evaluations and the exact engine at
  1 deterministic unit for the lower bound; at p = 8 whole M_B steps, 200
  evaluations, no bound: the bench machine is 2 shared cores);
- the papers' named schedules, each its `examples/*.pp` compiled with -D d, -D m
  under the same costs and memory model (every compiler check runs): 1F1B,
  ZB-H1, ZB-H2, V-Min, V-Half, V-ZB, interleaved 1F1B (v = 2), looped BFS
  (v = 2), DualPipe-V, DualPipe (its overlapped F&B pairs at the same costs:
  `cost overlap = 1`, as the search's); each set against the frontier's best at
  its memory. Those
  in F, B and W passes (ZB-H1, ZB-H2, V-Min, V-Half, V-ZB) are also the search's
  candidates at every level they fit; 'found from' says where a point came from;
- at unit costs, m = 2p, the frontier by step time (makespan) with recomputation
  variants (the stages of the first d/2 and of all devices recomputed, M_I =
  M_B/16, R right before B) beside the plain parallel and V-shape placements.

`python -m bench frontier [--quick] [--write]` (`--quick`: p = 4 only; `--write`
also writes bench/results/frontier.md and the figures under
bench/results/frontier/). Every budget is work (evaluations, CP-SAT
deterministic time with one worker), so the tables are the same on every
machine; the wall-clock column is this machine's.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

from ppdsl.search.combined import SearchOptions
from ppdsl.search.figure import frontier_svg
from ppdsl.search.frontier import (
    Frontier,
    FrontierOptions,
    NamedPoint,
    compile_named,
    frontier,
    frontier_at,
)
from ppdsl.search.problem import SearchProblem, build_problem, chunk_costs
from ppdsl.semantics import format_short

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "frontier.md"
FIGURES = ROOT / "bench" / "results" / "frontier"

ZB_COSTS = "F=18.522,B=18.086,W=9.337,comm=0.601"
PLACEMENTS = ("parallel", "vshape", "looped(2)", "dualpipe")
PARAMETER_MEMORY = Fraction(1)
"""The model state of one 1F1B stage (weights, gradients, optimizer state) in M_B,
charged once more to a placement holding the parameters twice (DualPipe): an
assumption (the state equals one microbatch's activations of the stage); `ppdsl
search --frontier --parameter-memory` takes any value."""
NAMED = {
    "1F1B": "1f1b.pp",
    "ZB-H1": "zb_h1.pp",
    "ZB-H2": "zb_h2.pp",
    "V-Min": "v_min.pp",
    "V-Half": "v_half.pp",
    "V-ZB": "v_zb.pp",
    "interleaved 1F1B": "interleaved_1f1b.pp",
    "looped BFS": "looped_bfs.pp",
    "DualPipe-V": "dualpipe_v.pp",
    "DualPipe": "dualpipe.pp",
}
EVALUATIONS = {4: 1000, 8: 200}
"""Refinement and local-search evaluations per level (the block and heuristic
sweeps always run in full)."""
LEVELS = {4: 48, 8: 24}
"""At most this many memory levels per placement (p = 8: whole M_B steps)."""
EFFORT = {4: 1.0, 8: 0.0}
"""CP-SAT deterministic time per level (one worker)."""


@dataclass(frozen=True)
class Case:
    p: int
    m: int
    costs: str | None
    objective: str = "bubble"
    recompute: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        costs = "unit" if self.costs is None else "profiled"
        extra = ", recompute" if self.recompute else ""
        return f"p={self.p} m={self.m} {costs} costs, by {self.objective}{extra}"

    @property
    def slug(self) -> str:
        costs = "unit" if self.costs is None else "profiled"
        extra = "_recompute" if self.recompute else ""
        return f"p{self.p}_m{self.m}_{costs}_{self.objective}{extra}"


def _cases(quick: bool) -> list[Case]:
    """p = 4 and p = 8 in turn, m = 2p before 3p: the file is written after each case."""
    sizes = (4,) if quick else (4, 8)
    out = []
    for k in (2, 0, 3):  # m = 2p by bubble, the recompute step-time frontier, m = 3p
        for costs in (None, ZB_COSTS) if k else (None,):
            for p in sizes:
                if k:
                    out.append(Case(p, k * p, costs))
                else:
                    out.append(Case(p, 2 * p, None, "makespan", (p // 2, p)))
    return out


def _problem(case: Case, placement: str) -> SearchProblem:
    problem = build_problem(
        devices=case.p, microbatches=case.m, placement=placement, costs=case.costs,
        memory=None, weight_fraction="1",
    )
    return replace(problem, costs=chunk_costs(problem.costs, problem.model_chunks_per_device))


def _named(case: Case) -> list[NamedPoint]:
    cache: dict[str, SearchProblem] = {}

    def problem_for(spelling: str) -> SearchProblem:
        if spelling not in cache:
            cache[spelling] = _problem(case, spelling)
        return cache[spelling]

    out = []
    for name, file in NAMED.items():
        point = compile_named(ROOT / "examples" / file, problem_for, case.p, case.m,
                              parameter_memory=PARAMETER_MEMORY)
        out.append(replace(point, name=name))
    return out


def _value(x, objective: str) -> float:
    return x.makespan if objective == "makespan" else x.bubble


def _show(x: float, objective: str) -> str:
    return f"{x:g}" if objective == "makespan" else f"{x:.4f}"


def _origin(method: str) -> str:
    """Where a point's schedule came from: a named schedule given to the search as
    a candidate (then perhaps improved), or the search's own candidates."""
    for name, file in NAMED.items():
        if f"({ROOT / 'examples' / file})" in method:
            return f"{name}" + (" + search" if "then local search" in method or "CP-SAT" in method else "")
    return "search"


def _report(case: Case, result: Frontier, named: list[NamedPoint], seconds: float) -> tuple[list[str], dict]:
    obj = case.objective
    lines = [f"### {case.label}", ""]
    lines.append("| memory | bubble | makespan | lower bound | optimal | placement | parameter copies | recompute | "
                 "found from | beats every named schedule at its memory |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    beating = 0
    for p in result.points:
        fitting = [n for n in named if n.memory <= p.memory]
        best_named = min((_value(n, obj) for n in fitting), default=None)
        beats = best_named is None or _value(p, obj) < best_named - 1e-9
        beating += beats
        why = ("yes (none fits)" if best_named is None else
               f"yes ({_show(best_named, obj)})" if beats else "no")
        bound = "-" if p.bound is None else _show(p.bound, obj)
        optimal = "-" if p.bound is None else ("yes" if p.optimal else "no")
        lines.append(
            f"| {format_short(p.memory)} | {p.bubble:.4f} | {p.makespan:g} | {bound} | {optimal} | "
            f"{p.placement} | {p.copies} | {','.join(map(str, p.recompute)) or '-'} | {_origin(p.method)} | {why} |"
        )
    lines += ["", "| named schedule | placement | memory | bubble | makespan | frontier there | at or above the frontier |",
              "|---|---|---|---|---|---|---|"]
    at_or_above = 0
    for n in sorted(named, key=lambda x: (x.memory, x.name)):
        at = frontier_at(result.points, n.memory)
        ok = at is not None and _value(at, obj) <= _value(n, obj) + 1e-9
        at_or_above += ok
        there = "-" if at is None else f"{_show(_value(at, obj), obj)} ({at.placement}, {format_short(at.memory)})"
        lines.append(
            f"| {n.name} | {n.placement} | {format_short(n.memory)} | {n.bubble:.4f} | {n.makespan:g} | "
            f"{there} | {'yes' if ok else 'NO'} |"
        )
    levels = len(result.searched)
    lines += ["", f"{len(result.points)} frontier points from {levels} levels searched; "
              f"{at_or_above}/{len(named)} named schedules at or above the frontier; "
              f"{beating} points beat every named schedule at their memory; {seconds:.0f} s.", ""]
    return lines, {"named_ok": at_or_above, "named": len(named), "beating": beating}


def _run(case: Case, write: bool) -> tuple[list[str], dict]:
    placements = PLACEMENTS if not case.recompute else ("parallel", "vshape", "dualpipe")
    problems = [_problem(case, pl) for pl in placements]
    effort = 0.0 if case.recompute else EFFORT[case.p]
    options = FrontierOptions(
        SearchOptions(objective=case.objective, evaluations=EVALUATIONS[case.p], effort=effort),
        max_levels=LEVELS[case.p],
        recompute=case.recompute,
        parameter_memory=PARAMETER_MEMORY,
    )
    begin = time.monotonic()
    named = _named(case)
    result = frontier(problems, options, named=named)
    seconds = time.monotonic() - begin
    lines, counts = _report(case, result, named, seconds)
    if write:
        FIGURES.mkdir(parents=True, exist_ok=True)
        title = f"frontier, {case.label}, M_W = M_B, placements " + ", ".join(
            p.placement.spelling() for p in problems)
        (FIGURES / f"{case.slug}.svg").write_text(frontier_svg(result, named, title=title))
        lines.insert(2, f"![{case.label}](frontier/{case.slug}.svg)\n")
    return lines, counts


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    quick, write = "--quick" in argv, "--write" in argv
    begin = time.monotonic()
    out: list[str] = []
    named_ok = named_all = beating_cases = 0
    cases = _cases(quick)
    for done, case in enumerate(cases, 1):
        lines, counts = _run(case, write)
        print("\n".join(lines), flush=True)
        out += lines
        named_ok += counts["named_ok"]
        named_all += counts["named"]
        beating_cases += counts["beating"] > 0
        total = time.monotonic() - begin
        tail = (
            f"{done} of {len(cases)} cases: {named_ok}/{named_all} named schedules at or above "
            f"the frontier; {beating_cases} frontiers have points that beat every named schedule "
            "at their memory. Evaluations per level: "
            + ", ".join(f"{EVALUATIONS[p]} at p = {p}" for p in EVALUATIONS)
            + "; levels per placement at most "
            + ", ".join(f"{LEVELS[p]} at p = {p}" for p in LEVELS)
            + "; CP-SAT per level (one worker): "
            + ", ".join(f"{EFFORT[p]:g} deterministic units at p = {p}" for p in EFFORT)
            + ", none with recompute. "
            f"Total {total / 60:.1f} min on {platform.machine()} (2 cores shared with other "
            f"jobs, load 10 to 15), Python {platform.python_version()}."
        )
        if write:
            _write(out, tail)
    print(tail)


def _write(out: list[str], tail: str) -> None:
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        "# The memory–throughput frontier against the papers' named schedules\n\n"
        "Generated by `python -m bench frontier --write` (bench/bench_frontier.py; what each "
        "table means is in its docstring). Memory: peak activation per device in units of one "
        "1F1B stage's (a chunk of a v-chunk placement holds 1/v of one), M_W = M_B; a "
        f"placement holding the parameters twice (DualPipe, 'parameter copies' 2) adds "
        f"{format_short(PARAMETER_MEMORY)} M_B for its second copy (`PARAMETER_MEMORY`, an "
        "assumption). Bubble per "
        "device as the zero-bubble paper defines it; makespan in the costs' units (one 1F1B "
        "stage's pass times; a chunk's are 1/v of them). A frontier point is the best "
        "schedule found at that memory; 'lower bound' is the exact engine's at the level's "
        "budget (docs/exact.md).\n\n" + "\n".join(out) + "\n" + tail + "\n"
    )


if __name__ == "__main__":
    main()
