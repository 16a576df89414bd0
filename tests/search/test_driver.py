"""`ppdsl search`: budgets, the evaluator against ppdsl.analysis.simulate, the block
space, found files that compile, the command line."""

from __future__ import annotations

import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis.checks import deadlock, dependencies
from ppdsl.analysis.simulate import SimulationError, simulate
from ppdsl.cli import main
from ppdsl.compiler import compile_file
from ppdsl.ir.flat import flat_arrays
from ppdsl.ir.schedule import Schedule
from ppdsl.lowering.early_receives import pull_receives_forward
from ppdsl.lowering.lower import lower
from ppdsl.search import SearchInputError, emit_pp, references, search
from ppdsl.search.blockspace import block_orders, v_half, v_min
from ppdsl.search.driver import arrays_for, evaluate_passes
from ppdsl.search.evaluate import evaluate_orders
from ppdsl.search.problem import build_problem, parse_budget, parse_costs
from ppdsl.semantics import delta_table
from ppdsl.testing import paper_needs as oracle_needs
from tests.factories import make_schedule, one_f_one_b_orders, schedules


def _problem(d=4, m=8, place="parallel", memory="1p", costs=None, wf="1/2"):
    return build_problem(
        devices=d, microbatches=m, placement=place, costs=costs, memory=memory, weight_fraction=wf
    )


def _schedule(problem, orders) -> Schedule:
    return make_schedule(
        problem.placement,
        problem.num_microbatches,
        orders,
        costs=problem.costs,
        memory=problem.memory,
    )


def test_budgets_parse_in_1f1b_stage_units():
    """2p, 1.5p, 8 and 0.5x1f1b all mean multiples of one 1F1B stage's M_B."""
    assert parse_budget("2p", 8) == 16
    assert parse_budget("1.5p", 4) == 6
    assert parse_budget("8", 4) == 8
    assert parse_budget("0.5x1f1b", 8) == 4
    assert parse_budget("1/3x1f1b", 6) == 2
    with pytest.raises(SearchInputError, match="expected a multiple of M_B"):
        parse_budget("lots", 4)


def test_costs_parse_per_stage_and_reject_bad_values():
    """Per-stage colon lists need one value per stage; negative costs are errors."""
    costs = parse_costs("F=1:2:3:4,comm=0.5", 4)
    assert costs.forward == (1, 2, 3, 4) and costs.comm == 0.5 and costs.backward_input == (1,) * 4
    with pytest.raises(SearchInputError, match="4 stages"):
        parse_costs("F=1:2", 4)
    with pytest.raises(SearchInputError, match=">= 0"):
        parse_costs("W=-1", 4)


def test_budget_below_floor_names_the_smallest_feasible_budget():
    """Less than one microbatch per device is refused with the smallest budget."""
    with pytest.raises(SearchInputError, match="smallest feasible budget 1 M_B"):
        _problem(memory="0.5")
    with pytest.raises(SearchInputError, match="M_W is part of M_B"):
        _problem(wf="2")


@settings(max_examples=80, deadline=None)
@given(schedules(overlap=False))
def test_evaluator_equals_simulate_on_random_schedules(s):
    """The search's metrics (its evaluator over flat arrays) equal ppdsl.simulate
    on any valid schedule: random placements, split or fused backward, random
    costs and transfer times, random topological orders (no overlapped pairs:
    the search makes none); the search times transfers by `cost comm` alone
    (docs/language.md, `cost recv`), so the schedule is simulated without recv."""
    s = replace(s, costs=s.costs.with_receive_cost(0.0))
    offsets, kind, mb, st = flat_arrays(s.orders)
    mem, scale = delta_table(s.memory.activation, s.memory.weight_retained)
    metrics = evaluate_orders(
        offsets,
        kind,
        mb,
        st,
        np.asarray(s.placement.stage_device, dtype=np.int64),
        np.asarray(s.costs.durations),
        s.costs.comm,
        mem,
        s.num_microbatches,
        s.placement.lanes,
    )
    t = simulate(s)
    assert metrics.ok
    assert metrics.makespan == t.makespan
    assert metrics.bubble == pytest.approx(t.bubble_ratio, rel=1e-12, abs=1e-12)
    assert metrics.idle == pytest.approx(t.idle_fraction, rel=1e-12, abs=1e-12)
    assert tuple(Fraction(int(x), scale) for x in metrics.peak) == t.peak_memory


@settings(max_examples=80, deadline=None)
@given(schedules(), st.integers(0, 2**32 - 1))
def test_evaluator_refuses_a_pass_before_one_it_needs(s, seed):
    """Moving a pass right before a pass it needs on its own device (W before
    its B, B before its F, ...; the needs written in the test's oracle) makes
    the orders wait on each other: the evaluator says not ok, the simulator
    refuses them and the dependency check reports a cycle."""
    rng = random.Random(seed)
    moves = []
    for dev, order in enumerate(s.orders):
        where = {p.key: k for k, p in enumerate(order)}
        for k, p in enumerate(order):
            for q in oracle_needs(p.kind, p.microbatch, p.stage, s.num_stages, s.split_backward):
                if q in where:
                    moves.append((dev, k, where[q]))
    if not moves:  # d = 1 and m = 1 with S = 1 still has F before its backward
        return
    dev, k, before = rng.choice(moves)
    order = list(s.orders[dev])
    order.insert(before, order.pop(k))
    bad = replace(s, orders=s.orders[:dev] + (tuple(order),) + s.orders[dev + 1 :])
    offsets, kind, mb, stage = flat_arrays(bad.orders)
    mem, _ = delta_table(s.memory.activation, s.memory.weight_retained)
    stage_device = np.asarray(s.placement.stage_device, dtype=np.int64)
    durations = np.asarray(s.costs.durations)
    metrics = evaluate_orders(
        offsets, kind, mb, stage, stage_device, durations, s.costs.comm, mem, s.num_microbatches
    )
    assert not metrics.ok
    with pytest.raises(SimulationError):
        simulate(bad)
    assert dependencies.check(bad)


def test_evaluator_matches_ppdsl_simulate():
    """The search's numba evaluator gives ppdsl.analysis.simulate's bubble, makespan, peak."""
    problem = _problem(d=4, m=8, costs="F=3,B=4,W=2,comm=0.5")
    orders = one_f_one_b_orders(4, 8, split=True)
    schedule = _schedule(problem, orders)
    timeline = simulate(schedule)
    metrics = evaluate_passes(problem, arrays_for(problem), schedule.orders)
    assert metrics.bubble == pytest.approx(timeline.bubble_ratio, abs=1e-12)
    assert metrics.makespan == pytest.approx(timeline.makespan, abs=1e-9)
    scale = arrays_for(problem).scale
    assert tuple(Fraction(int(x), scale) for x in metrics.peak) == timeline.peak_memory


def test_paper_blocks_have_the_papers_memory():
    """V-Min and V-Half, repeated with W in free slots, hold (d+4)//3 and (d+2)//2."""
    for d in (4, 6, 8):
        problem = _problem(d=d, m=3 * d, place="vshape", memory="1x1f1b", wf="1")
        found = {r.name: r for r in references(problem)}
        assert found["V-Min"].peak == (d + 4) // 3
        assert found["V-Half"].peak == (d + 2) // 2
        assert block_orders(problem.placement, v_min(d), 3 * d) is not None
        assert block_orders(problem.placement, v_half(d), 3 * d) is not None


@pytest.mark.slow
def test_vshape_at_1f1b_memory_reaches_v_zb_zero_bubble():
    """Unit costs, V-shape, 1F1B's memory (M_W = M_B): the search's blocks include
    V-ZB's, and with the paper's warm-up/cool-down step it has no bubble."""
    for d in (4, 8):
        problem = _problem(d=d, m=3 * d, place="vshape", memory=str(d), wf="1")
        result = search(problem, evaluations=2000)
        assert result.best.metrics.bubble == 0, result.best.method
        assert max(result.peak_memory()) <= d
        assert "tightened" in result.best.method


def test_search_matches_zb_h1_at_1f1b_memory():
    """Unit costs, p M_B: the search finds ZB-H1's bubble (p-1)/(3m+p-1)."""
    problem = _problem(d=4, m=12, memory="1p", wf="1")
    result = search(problem, evaluations=2000)
    assert result.best.metrics.bubble <= 3 / 39 + 1e-9
    assert max(result.peak_memory()) <= 4


@pytest.mark.slow
def test_found_orders_compile_deadlock_free_and_within_budget():
    """Every found schedule passes ppdsl's deadlock check under blocking sends
    (the compiler's lowering: receives pulled forward where needed)."""
    for place, memory in (("parallel", "2p"), ("vshape", "0.5x1f1b"), ("looped(2)", "1p")):
        problem = _problem(d=4, m=8, place=place, memory=memory, costs="F=3,B=4,W=2,comm=0.3")
        result = search(problem, evaluations=2000)
        schedule = _schedule(problem, result.best.orders())
        assert deadlock.check(schedule, pull_receives_forward(lower(schedule))) == []
        assert max(result.peak_memory()) <= problem.budget


def test_found_file_compiles_and_its_timeline_is_the_searchs(tmp_path):
    """search -> .pp -> compile_file: same orders, same bubble, expects hold."""
    problem = _problem(d=4, m=8, place="vshape", memory="0.5x1f1b", costs="F=3,B=4,W=2,comm=0.5")
    result = search(problem, evaluations=2000)
    best = result.best
    text = emit_pp(
        problem,
        best.orders(),
        name="found",
        command="ppdsl search test",
        method=best.method,
        bubble=best.metrics.bubble,
        makespan=best.metrics.makespan,
        peak=max(result.peak_memory()),
    )
    path = tmp_path / "found.pp"
    path.write_text(text)
    compiled = compile_file(path)
    keys = tuple(tuple(p.key for p in o) for o in compiled.schedule.orders)
    assert keys == tuple(tuple(p.key for p in o) for o in best.orders())
    assert compiled.timeline.bubble_ratio == pytest.approx(best.metrics.bubble, abs=1e-12)
    assert {e.metric for e in compiled.schedule.expects} == {"peak_memory", "bubble", "makespan"}
    assert text.startswith("# Found by: ppdsl search test")


@pytest.mark.slow
def test_cli_writes_a_checkable_file_and_no_progress_in_pipes(tmp_path, capsys):
    """The command writes found.pp, prints the summary, and no bar when piped."""
    out = tmp_path / "found.pp"
    code = main(["search", "-d", "4", "-m", "8", "--memory", "2p", "-o", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    assert "bubble" in captured.out and "peak memory per device" in captured.out
    assert "\r" not in captured.err
    assert main(["check", str(out)]) == 0


def test_cli_bad_budget_is_a_clear_error(capsys):
    """A budget below one microbatch is a usage error (exit 2) that says what is feasible."""
    code = main(["search", "-d", "4", "-m", "8", "--memory", "0.2p"])
    assert code == 2
    assert "smallest feasible budget 1 M_B" in capsys.readouterr().err


@pytest.mark.slow
def test_d8_vshape_beats_v_half_at_its_memory():
    """d=8, m=24, unit costs, V-Half's memory: bubble no worse than V-Half's."""
    problem = _problem(d=8, m=24, place="vshape", memory="5", wf="1")
    ref = {r.name: r for r in references(problem)}["V-Half"]
    result = search(problem, evaluations=10000)
    assert result.best.metrics.bubble <= ref.bubble + 1e-12
    assert max(result.peak_memory()) <= ref.peak
    assert np.all(result.best.metrics.peak <= result.arrays.limit)


def _run_search(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ppdsl", "search", *args], capture_output=True, text=True
    )


@pytest.mark.slow
def test_same_arguments_and_seed_write_the_same_file_in_two_processes(tmp_path):
    """Budgets are work, not seconds: two processes running the same search
    (heuristics, then CP-SAT stopped by its deterministic budget before its
    proof) write byte-identical .pp files."""
    args = ["-d", "4", "-m", "8", "--memory", "3", "--placement", "vshape",
            "--weight-memory", "1", "--evaluations", "3000", "--effort", "1", "--seed", "3"]
    first, second = tmp_path / "a.pp", tmp_path / "b.pp"
    # both at once: each has a core, and sharing one would not change what they write
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda out: _run_search([*args, "-o", str(out)]), (first, second)))
    for done in runs:
        assert done.returncode == 0, done.stderr
    text = first.read_text()
    assert "Exact engine (CP-SAT" in text
    assert text.replace(str(first), "X") == second.read_text().replace(str(second), "X")


@pytest.mark.slow
def test_heuristic_search_is_deterministic_in_its_seed():
    """The refinement and the local search draw every choice from the seed."""
    problem = _problem(d=4, m=8, place="vshape", memory="0.5x1f1b", costs="F=3,B=4,W=2,comm=0.3")
    a = search(problem, evaluations=3000, seed=5)
    b = search(problem, evaluations=3000, seed=5)
    assert a.best.orders() == b.best.orders() and a.tried == b.tried
    assert not a.capped


def test_exact_search_proves_zb_h1_optimal_and_says_so(tmp_path, capsys):
    """--exact at p=4, m=8, p M_B: the summary and the file say the bubble is
    optimal; the file compiles with its expects."""
    out = tmp_path / "found.pp"
    code = main(["search", "-d", "4", "-m", "8", "--memory", "1p", "--exact",
                 "--evaluations", "1000", "-o", str(out)])
    assert code == 0
    summary = capsys.readouterr().out
    assert "bubble 0.111111 is optimal" in summary
    assert "is optimal (lower bound reached)" in out.read_text()
    assert main(["check", str(out)]) == 0


def test_makespan_objective_and_time_cap_are_reported(tmp_path, capsys):
    """--objective makespan bounds the makespan; a --time cap that bites says
    the result depends on the machine."""
    out = tmp_path / "found.pp"
    code = main(["search", "-d", "4", "-m", "8", "--memory", "1p", "--objective", "makespan",
                 "--exact", "--evaluations", "1000", "-o", str(out)])
    assert code == 0
    assert "makespan 27 (cost units) is optimal" in capsys.readouterr().out
    code = main(["search", "-d", "4", "-m", "8", "--memory", "1p", "--time", "0",
                 "--evaluations", "100000", "-o", str(out)])
    assert code == 0
    assert "depends on the machine" in capsys.readouterr().out
    assert "depends on the machine" in out.read_text()


def test_bad_budgets_are_clear_errors(capsys):
    """Negative --evaluations, --effort or --time are usage errors (exit 2) with a message."""
    for flag, value in (("--evaluations", "-1"), ("--effort", "-2"), ("--time", "-1")):
        assert main(["search", "-d", "4", "-m", "8", "--memory", "1p", flag, value]) == 2
        assert f"{flag} {value}" in capsys.readouterr().err


def test_search_reaches_the_authors_v_half_at_its_memory():
    """V-shape, unit costs, M_W = M_B, (p+2)//2: the search reaches the authors'
    V-Half (0.0649 at p=4, m=12; their zbv_greedy.py)."""
    problem = _problem(d=4, m=12, place="vshape", memory="3", wf="1")
    result = search(problem, evaluations=500)
    assert round(result.best.metrics.bubble, 4) <= 0.0649
    assert max(result.peak_memory()) <= 3


@pytest.mark.slow
def test_search_reaches_the_authors_adaptive_v_min_at_its_memory():
    """p=8, m=16, V-Min's memory (p+4)//3 = 4: the two-offset blocks with the
    warm-up/cool-down step reach the authors' adaptive V-Min (0.1933,
    v_auto_schedule.py); the plain V-Min block gives 0.2195."""
    problem = _problem(d=8, m=16, place="vshape", memory="4", wf="1")
    result = search(problem, evaluations=500)
    assert round(result.best.metrics.bubble, 4) <= 0.1933
    assert max(result.peak_memory()) <= 4


def test_progress_bar_shows_the_exact_engines_incumbent_and_bound():
    """The bar's solver line names the best value found and the proven bound."""
    import io

    from ppdsl.search.progress import ProgressBar

    stream = io.StringIO()
    bar = ProgressBar(True, stream)
    bar.solver(Fraction(1, 9), Fraction(1, 10), 0.5)
    bar.close()
    assert "exact: best 0.11111, bound 0.1" in stream.getvalue()


def test_cli_progress_draws_the_solver_line(tmp_path, capsys):
    """--progress: the exact engine's incumbent and bound appear on stderr."""
    out = tmp_path / "found.pp"
    code = main(["search", "-d", "4", "-m", "8", "--memory", "1p", "--exact",
                 "--evaluations", "500", "--progress", "-o", str(out)])
    assert code == 0
    assert "exact: best 0.11111, bound 0.11111" in capsys.readouterr().err


def test_cli_search_on_dualpipe_writes_a_file_whose_lanes_hold_their_own_microbatches(tmp_path, capsys):
    """`ppdsl search --placement dualpipe` (README's command table): the written file
    proves with the measured peak, each stage runs only its lane's microbatches
    (docs/language.md, `dualpipe`), and the summary says why the exact engine
    did not run even under --exact."""
    out = tmp_path / "dp.pp"
    code = main(["search", "-d", "4", "-m", "8", "--memory", "3", "--placement", "dualpipe",
                 "--exact", "--evaluations", "40", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "not one of DualPipe's lanes" in printed
    compiled = compile_file(out)
    schedule = compiled.schedule
    assert schedule.placement.lanes == 2
    for order in schedule.orders:
        for p in order:
            assert schedule.placement.lane_of_stage(p.stage) == schedule.placement.microbatch_lane(p.microbatch, 8)
    from ppdsl.analysis.memory import peak_memory

    line = next(x for x in printed.splitlines() if x.startswith("peak memory per device"))
    printed_peaks = tuple(Fraction(x) for x in line.split(":")[1].split("(")[0].split())
    assert printed_peaks == tuple(peak_memory(schedule)) and max(printed_peaks) <= 3


@pytest.mark.slow
def test_span_bound_flag_proves_the_v_half_bound(capsys):
    """--span-bound at p=4, m=8, V-Half's memory (V-shape, M_W = M_B): the
    summary's lower bound is the proven optimum 5/53 (bench/results/exact.md);
    a negative value is a usage error (docs/exact.md)."""
    code = main(["search", "-d", "4", "-m", "8", "--placement", "vshape", "--memory", "3",
                 "--weight-memory", "1", "--exact", "--effort", "2", "--span-bound", "2",
                 "--evaluations", "200"])
    assert code == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "lower bound 0.0943396" in text or "0.0943396 is optimal" in text
    assert main(["search", "-d", "4", "-m", "8", "--span-bound", "-1"]) == 2
