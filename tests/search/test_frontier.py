"""`ppdsl search --frontier` (ppdsl/search/frontier.py, docs/exact.md's bound per
level): the memory levels, the Pareto frontier, its table, JSON, SVG and `.pp`
files as a user gets them."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import pytest

from ppdsl.analysis.memory import peak_memory
from ppdsl.cli import main
from ppdsl.compiler import compile_file
from ppdsl.search.combined import SearchOptions
from ppdsl.search.frontier import (
    FrontierOptions,
    compile_named,
    frontier,
    granularity,
    levels,
    named_points,
    pareto,
)
from ppdsl.search.problem import build_problem

REPO = Path(__file__).resolve().parents[2]


def _problem(d=2, m=4, place="parallel", wf="1/2"):
    return build_problem(
        devices=d, microbatches=m, placement=place, costs=None, memory=None, weight_fraction=wf
    )


def test_levels_are_the_multiples_of_the_deltas_gcd_from_the_floor_to_all_in_flight():
    """Peaks are sums of memory deltas (README's memory model), so the levels step
    by their gcd from one microbatch in flight to m in flight."""
    parallel = _problem(d=4, m=8)
    assert granularity(parallel) == Fraction(1, 2)  # F +1, B -1/2, W -1/2
    assert levels(parallel, FrontierOptions()) == [Fraction(k, 2) for k in range(2, 17)]
    vshape = _problem(d=4, m=8, place="vshape", wf="1")
    assert granularity(vshape) == Fraction(1, 2)  # a chunk is half a 1F1B stage
    assert levels(vshape, FrontierOptions())[0] == 1  # both chunks of one microbatch
    thinned = levels(parallel, FrontierOptions(max_levels=4, low=Fraction(3), high=Fraction(6)))
    assert thinned == [3, 4, 5, 6]


@pytest.mark.slow
def test_pareto_keeps_only_points_no_one_beats_at_no_more_memory():
    """A point is on the frontier when its bubble is below every point at no more memory."""
    problems = [_problem(d=2, m=4), _problem(d=2, m=4, place="vshape")]
    result = frontier(problems, FrontierOptions(SearchOptions(evaluations=50, effort=0.0)))
    searched = result.searched
    kept = pareto(searched)
    assert kept == result.points
    assert len(kept) < len(searched)  # the placements' levels dominate each other
    for p in searched:
        assert any(q.memory <= p.memory and q.bubble <= p.bubble + 1e-12 for q in kept)
    for a, b in zip(kept, kept[1:], strict=False):
        assert a.memory < b.memory and a.bubble > b.bubble


def test_frontier_proves_each_level_and_holds_the_named_schedules_at_or_above_it():
    """With --effort each point has the exact engine's bound (docs/exact.md), optimal
    where reached; 1F1B, ZB-H1, ZB-H2 sit on or above the frontier."""
    problem = _problem(d=2, m=4)
    result = frontier([problem], FrontierOptions(SearchOptions(evaluations=50, effort=5.0)))
    assert result.points[-1].bubble == 0  # ZB-H2's floor at unit costs
    for p in result.points:
        assert p.bound is not None and p.bound <= p.bubble + 1e-9
        assert p.optimal == (abs(p.bound - p.bubble) < 1e-9)
    assert all(p.optimal for p in result.points)
    for named in named_points([problem]):
        best = [p for p in result.points if p.memory <= named.memory]
        assert best and best[-1].bubble <= named.bubble + 1e-9, named.name


def test_a_named_file_compiles_under_the_frontiers_costs_and_memory():
    """looped BFS (examples/looped_bfs.pp) holds every microbatch of both chunks: m
    1F1B stages, and its bubble is the example's closed form under chunk costs 1/2."""
    problem = _problem(d=4, m=8, place="looped(2)")
    from ppdsl.commands.search_frontier import _with_chunk_costs

    problem = _with_chunk_costs(problem)
    point = compile_named(REPO / "examples/looped_bfs.pp", lambda _: problem, 4, 8)
    assert point.placement == "looped(2)" and point.name == "looped_bfs"
    assert point.memory == 8
    # (d-1)(T_F+T_BW) / (m v (T_F+T_BW) + (d-1)(T_F+T_BW)), chunk costs 1/2 each
    assert point.bubble == pytest.approx(3 / (8 * 2 + 3))
    assert point.makespan == pytest.approx((16 + 3) * 1.5)


def _run(args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "ppdsl", "search", "--frontier", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )


@pytest.mark.slow
def test_cli_frontier_writes_json_svg_and_pp_files_the_same_in_two_processes(tmp_path):
    """`ppdsl search --frontier --json --svg --pp-dir`: every point's .pp compiles with its
    peak and bubble, the SVG is one well-formed figure, and a second process writes
    the same bytes (determinism, README)."""
    outputs = []
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
    # both at once: each has a core, and sharing one would not change what they write
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda run: _run(
            ["-d", "2", "-m", "4", "--placement", "parallel,vshape", "--evaluations", "100",
             "--json", "--svg", "f.svg", "--pp-dir", "pp",
             "--named", str(REPO / "examples/zb_h1.pp")],
            tmp_path / run,
        ), ("a", "b")))
    for run, done in zip(("a", "b"), runs, strict=True):
        folder = tmp_path / run
        assert done.returncode == 0, done.stderr
        files = {p.name: p.read_bytes() for p in sorted((folder / "pp").iterdir())}
        outputs.append((done.stdout, (folder / "f.svg").read_bytes(), files))
    assert outputs[0] == outputs[1]
    points = json.loads(outputs[0][0])
    assert [set(p) for p in points] == [
        {"memory", "bubble", "makespan", "bound", "optimal", "placement", "recompute", "file",
         "activation", "copies"}
    ] * len(points)
    assert all(p["activation"] == p["memory"] and p["copies"] == 1 for p in points)
    assert [p["memory"] for p in points] == sorted({p["memory"] for p in points})
    assert all(a["bubble"] > b["bubble"] for a, b in zip(points, points[1:], strict=False))
    assert {p["placement"] for p in points} <= {"parallel", "vshape"}
    for p in points:
        compiled = compile_file(tmp_path / "a" / p["file"])
        # the .pp states M_B in 1F1B-stage units (a V-shape chunk's is 1/2)
        assert float(max(peak_memory(compiled.schedule))) == p["memory"]
        assert compiled.timeline.bubble_ratio == pytest.approx(p["bubble"], abs=1e-12)
    svg = ET.fromstring(outputs[0][1])
    circles = svg.findall("{http://www.w3.org/2000/svg}circle")
    assert len(circles) >= len(points)
    assert b"zb_h1" in outputs[0][1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory", "3"], "with --frontier give a range LO:HI"),
        (["--memory", "4:2"], "low end is above its high end"),
        (["--placement", "parallel,diagonal"], "unknown placement 'diagonal'"),
        (["-o", "x.pp"], "use --pp-dir DIR"),
        (["--levels", "0"], "--levels 0: must be >= 1"),
        (["--time", "5"], "--time caps one search"),
    ],
)
def test_cli_frontier_bad_input_is_a_clear_usage_error(args, message, capsys):
    """Bad flags under --frontier exit 2 with a message that says what to do, no traceback."""
    code = main(["search", "--frontier", "-d", "2", "-m", "4", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_cli_frontier_flags_need_frontier_and_a_plain_search_needs_memory(capsys):
    """--json/--svg/--pp-dir belong to --frontier; a plain search still needs --memory."""
    assert main(["search", "-d", "2", "-m", "4", "--memory", "2", "--json"]) == 2
    assert "go with --frontier" in capsys.readouterr().err
    assert main(["search", "-d", "2", "-m", "4"]) == 2
    assert "--memory BUDGET is required" in capsys.readouterr().err


@pytest.mark.parametrize("wf", ["1", "1/2"])
def test_recompute_variant_compiles_within_budget_and_shortens_the_step(wf):
    """Recomputing the first half of the stages (docs/language.md `recompute`: R
    right before B) fits the budget as the compiler measures it, with M_B − M_W of
    headroom for R, and at 2 M_B takes a shorter step than keeping activations."""
    from ppdsl.compiler import compile_source
    from ppdsl.search import emit_pp
    from ppdsl.search.combined import find
    from ppdsl.search.problem import with_recompute
    from ppdsl.semantics import PassKind

    plain = build_problem(devices=4, microbatches=8, placement="parallel", costs=None,
                          memory="2", weight_fraction=wf)
    options = SearchOptions(objective="makespan", evaluations=300, effort=0.0)
    variant = with_recompute(plain, frozenset({0, 1}), Fraction(1, 16))
    found = find(variant, options)
    for order in found.orders:
        for before, p in zip(order, order[1:], strict=False):
            if p.kind is PassKind.B and p.stage in (0, 1):
                assert (before.kind, before.microbatch, before.stage) == (PassKind.R, p.microbatch, p.stage)
    text = emit_pp(variant, found.orders, name="r", command="test", method=found.method,
                   bubble=found.metrics.bubble, makespan=found.metrics.makespan, peak=max(found.peak))
    compiled = compile_source(text, "r.pp")
    assert max(peak_memory(compiled.schedule)) == max(found.peak) <= 2
    assert compiled.timeline.makespan == found.metrics.makespan
    assert found.metrics.makespan < find(plain, options).metrics.makespan


@pytest.mark.slow
def test_frontier_with_recompute_reaches_below_the_plain_floor():
    """With recompute variants the frontier (by step time) has a point under the
    smallest memory any schedule keeping its activations needs."""
    problem = _problem(d=4, m=8, place="vshape", wf="1")
    options = FrontierOptions(SearchOptions(objective="makespan", evaluations=100, effort=0.0),
                              recompute=(4,))
    result = frontier([problem], options)
    first = result.points[0]
    assert first.recompute == tuple(range(8)) and first.memory < 1
    assert all(p.recompute == () for p in result.points[1:])


def test_cli_recompute_needs_the_makespan_objective(capsys):
    """--recompute under the bubble objective would hide R's cost: a usage error."""
    assert main(["search", "--frontier", "-d", "4", "-m", "8", "--recompute", "2"]) == 2
    assert "add --objective makespan" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_frontier_dp_counts_the_exposed_reduction_and_looped_bfs_hides_half(tmp_path):
    """--dp 2 with `reduce=` (docs/runtime.md's reduction lane: a stage's all-reduce
    after its last W): each point's step is its written file's makespan plus the
    reductions after its last pass; looped BFS ends its second chunk's backwards
    first and hides that reduction, ZB-H1 exposes its whole stage's."""
    from ppdsl.analysis.collectives import comm_lanes

    done = _run(
        ["-d", "4", "-m", "8", "--placement", "parallel,looped(2)", "--costs",
         "F=1,B=1,W=1,reduce=3", "--dp", "2", "--objective", "makespan", "--evaluations", "100",
         "--levels", "6", "--json", "--pp-dir", "pp",
         "--named", str(REPO / "examples/looped_bfs.pp"), "--named", str(REPO / "examples/zb_h1.pp")],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    points = json.loads(done.stdout)
    for p in points:
        compiled = compile_file(tmp_path / p["file"])
        lanes = comm_lanes(compiled.schedule, compiled.timeline)
        assert p["step"] == pytest.approx(lanes.makespan) and p["step"] > p["makespan"]
    named = {line.split("|")[1].strip(): line.split("|") for line in done.stderr.splitlines()
             if line.startswith("| looped_bfs") or line.startswith("| zb_h1")}
    assert float(named["looped_bfs"][5]) == pytest.approx(28.5 + 1.5)  # one chunk's 3/2 exposed
    assert float(named["zb_h1"][5]) == pytest.approx(27 + 3)  # the stage's whole 3


def test_cli_dp_needs_the_makespan_objective(capsys):
    """--dp compares step times: under the bubble objective it is a usage error."""
    assert main(["search", "--frontier", "-d", "4", "-m", "8", "--dp", "2"]) == 2
    assert "add --objective makespan" in capsys.readouterr().err


@pytest.mark.slow
def test_named_schedules_in_f_b_w_are_candidates_at_every_level_they_fit():
    """A named `.pp` in F, B and W passes (examples/v_half.pp) is a candidate of the
    levels it fits, so under the profiled costs (README) the frontier at V-Half's
    memory is at least V-Half, which the blocks and heuristics alone miss."""
    from ppdsl.commands.search_frontier import _with_chunk_costs

    problem = _with_chunk_costs(build_problem(
        devices=8, microbatches=16, placement="vshape", costs="F=18.522,B=18.086,W=9.337,comm=0.601",
        memory=None, weight_fraction="1"))
    v_half = compile_named(REPO / "examples/v_half.pp", lambda _: problem, 8, 16)
    assert v_half.orders is not None and v_half.memory == 5
    dualpipe = compile_named(REPO / "examples/dualpipe_v.pp", lambda _: problem, 8, 16)
    assert dualpipe.orders is None  # overlapped F&B pairs: not the search's passes
    options = FrontierOptions(SearchOptions(evaluations=0, effort=0.0), low=Fraction(5), high=Fraction(5))
    alone = frontier([problem], options)
    seeded = frontier([problem], options, named=[v_half, dualpipe])
    assert alone.points[-1].bubble > v_half.bubble + 1e-9  # the search alone: 0.2479 > 0.2397
    assert seeded.points[-1].bubble <= v_half.bubble + 1e-12


def test_dualpipe_stages_are_whole_model_stages_each_running_its_lanes_microbatches():
    """DualPipe (docs/language.md, Placement) runs two pipelines of d whole model
    stages: a stage's M_B and costs are a 1F1B stage's, one microbatch holds one
    chunk per device, and all m forwards in flight hold m/2 per chunk."""
    from ppdsl.search.frontier import top_budget
    from ppdsl.search.problem import chunk_costs, smallest_budget

    problem = build_problem(devices=4, microbatches=8, placement="dualpipe", costs="F=2",
                            memory=None, weight_fraction="1")
    assert problem.placement.lanes == 2 and problem.num_stages == 8
    assert problem.model_chunks_per_device == 1 and problem.chunks_per_device == 2
    assert problem.memory.activation == (1,) * 8
    assert chunk_costs(problem.costs, problem.model_chunks_per_device) == problem.costs
    assert smallest_budget(problem.placement, problem.memory) == 1
    assert top_budget(problem) == 8


@pytest.mark.slow
def test_cli_frontier_dualpipe_points_compile_with_their_memory_and_bubble(tmp_path):
    """`ppdsl search --frontier --placement dualpipe --parameter-memory 1/2`: every
    point's .pp file proves (`ppdsl check`) with the JSON's activation peak and
    bubble; a DualPipe point or named file holds the parameters twice, so its memory
    is its activation plus 1/2 (README, "The memory–throughput frontier")."""
    done = _run(
        ["-d", "2", "-m", "4", "--placement", "dualpipe", "--evaluations", "50",
         "--levels", "4", "--parameter-memory", "1/2", "--json", "--pp-dir", "pp",
         "--named", str(REPO / "examples/dualpipe.pp")],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    points = json.loads(done.stdout)
    assert len(points) >= 2 and {p["placement"] for p in points} == {"dualpipe"}
    for p in points:
        checked = subprocess.run([sys.executable, "-m", "ppdsl", "check", p["file"]],
                                 cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        compiled = compile_file(tmp_path / p["file"])
        assert compiled.schedule.placement.spelling() == p["placement"]
        assert float(max(peak_memory(compiled.schedule))) == p["activation"]
        assert compiled.timeline.bubble_ratio == pytest.approx(p["bubble"], abs=1e-12)
        assert p["copies"] == 2 and p["memory"] == p["activation"] + 1 / 2
    named = next(line.split("|") for line in done.stderr.splitlines() if line.startswith("| dualpipe"))
    assert named[2].strip() == "dualpipe"


def test_named_dualpipe_is_charged_its_second_copy_and_runs_its_pairs_at_the_same_costs():
    """examples/dualpipe.pp under the frontier's model: DualPipe's own table's d + 1
    activations (M_W = M_B) plus one `parameter_memory` for its second copy, and its
    overlapped F&B pairs at `cost overlap = 1` (the search overlaps nothing), so
    every device is busy m (T_F + T_B + T_W)."""
    problem = build_problem(devices=4, microbatches=8, placement="dualpipe", costs=None,
                            memory=None, weight_fraction="1")
    point = compile_named(REPO / "examples/dualpipe.pp", lambda _: problem, 4, 8,
                          parameter_memory=Fraction(3, 2))
    assert point.placement == "dualpipe" and point.memory == 5 + Fraction(3, 2)
    busy = 8 * 3
    assert point.makespan * (1 - point.bubble) == pytest.approx(busy)
