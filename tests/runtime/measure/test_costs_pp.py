"""ppdsl/runtime/measure/costs_pp.py: a profile written as a costs file that the
compiler reads back (docs/runtime.md, "Profiling a model"; docs/language.md)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from ppdsl.costs_file import evaluate_costs, load_costs_file
from ppdsl.runtime.measure.costs_pp import fit_in_tokens, to_costs_pp, to_costs_pp_in_tokens
from ppdsl.runtime.measure.records import Profile, StepCosts
from ppdsl.semantics import pass_jitter
from tests.runtime.measure.examples import small_profile


def test_costs_file_round_trips(tmp_path: Path) -> None:
    """What `-o` writes is a costs file the compiler reads back: the same costs (ms),
    memory in units of the mean stage's M_B, and the stage count."""
    path = tmp_path / "costs.pp"
    path.write_text(to_costs_pp(small_profile()))
    costs = load_costs_file(path)
    assert costs.num_stages == 2
    c, m = evaluate_costs(costs, 2, "parallel")
    assert c.forward == (1.25, 1.25) and c.backward_input == (2.5, 2.5)
    assert c.backward_weight == (1.125, 1.125) and c.fused_backward == (3.5, 3.5) and c.comm == 0.5
    assert m.activation == (1, 1) and m.weight_retained == (0.5, 0.5)
    assert not c.models_step  # a profile without step costs: exactly the passes' model


def test_step_costs_are_written_as_costs(tmp_path: Path) -> None:
    """A profile's step costs (docs/runtime.md, "Profiling a model") come back from
    the costs file as `cost overhead`, `cost optimizer[s]` and `cost norm`."""
    path = tmp_path / "costs.pp"
    step = StepCosts(0.0625, {"F0": 1.0}, (3.5, 4.25), "adam", 0.375)
    path.write_text(to_costs_pp(replace(small_profile(), step=step)))
    c, _ = evaluate_costs(load_costs_file(path), 2, "parallel")
    assert c.overhead == (0.0625, 0.0625) and c.optimizer == (3.5, 4.25) and c.norm == 0.375


def test_pass_costs_are_the_engines_where_it_measured_every_pass(tmp_path: Path) -> None:
    """Profile = run: the pass costs written are the engine's when it timed every
    kind on every stage, and the header says so; a kind it did not time keeps
    the stage runs' costs, and the header says nothing of the engine's passes."""
    every = {f"{k}{s}": 7.0 + s for k in ("F", "B", "W", "BW") for s in range(2)}
    text = to_costs_pp(replace(small_profile(), step=StepCosts(0.0625, every, (1.0, 1.0), "adam", None)))
    assert "    cost F[s] = s == 0 ? 7 : 8\n" in text and "    cost BW[s] = s == 0 ? 7 : 8\n" in text
    assert "as `ppdsl run`'s engine ran them (every stage on one process" in text
    some = {"F0": 7.0, "F1": 8.0}
    text = to_costs_pp(replace(small_profile(), step=StepCosts(0.0625, some, (1.0, 1.0), "adam", None)))
    assert "    cost F[s] = s == 0 ? 7 : 8\n" in text and "    cost B[s] = 2.5\n" in text
    assert "engine ran them" not in text and "cost norm" not in text


def test_pass_jitter_is_the_spread_of_log_durations(tmp_path: Path) -> None:
    """`cost jitter` (docs/runtime.md, "Profiling a model"): the spread of log(duration /
    its pass's median) from its quartiles (IQR / 1.349), pooled over passes, so one
    descheduled pass does not set it; the costs file states it."""
    durations = {("F", 0): [1.0, 2.0, 4.0], ("BW", 0): [1.5, 3.0, 6.0]}
    # logs -ln 2, 0, ln 2 twice: inclusive quartiles -0.75 ln 2 and 0.75 ln 2
    assert pass_jitter(durations) == pytest.approx(1.5 * math.log(2) / 1.349)
    steady = {("F", 0): [1.9, 2.0, 2.1] * 7}
    calm = pass_jitter(steady)
    steady[("F", 0)].append(1000.0)  # one pass that waited for a core barely moves it
    assert calm > 0 and pass_jitter(steady) == pytest.approx(calm, rel=0.1)
    assert pass_jitter({("F", 0): [2.0, 2.0]}) == 0.0
    path = tmp_path / "costs.pp"
    step = StepCosts(0.0625, {"F0": 1.0}, (3.5, 4.25), "adam", 0.375, 0.25)
    path.write_text(to_costs_pp(replace(small_profile(), step=step)))
    assert "    cost jitter = 0.25\n" in path.read_text()
    assert evaluate_costs(load_costs_file(path), 2, "parallel")[0].jitter == 0.25


def test_recv_and_collectives_are_stated_only_when_measured(tmp_path: Path) -> None:
    """`cost recv` is written when a late receive was measured, `cost reduce[s]` and
    `cost gather[s]` when `--dp` > 1 measured them; the compiler reads each back
    (the header names the reduction: a reduce-scatter under shard)."""
    base = small_profile()
    path = tmp_path / "costs.pp"
    path.write_text(to_costs_pp(base))
    assert "cost recv" not in path.read_text() and "cost reduce" not in path.read_text()
    assert evaluate_costs(load_costs_file(path), 2, "parallel")[0].recv == 0
    stages = tuple(replace(st, reduce_ms=0.25 * (st.stage + 1), gather_ms=0.5) for st in base.stages)
    path.write_text(to_costs_pp(replace(base, stages=stages, dp=2, dp_mode="shard", recv_ms=0.375)))
    text = path.read_text()
    assert "    cost recv = 0.375\n" in text and "cost reduce[s] = s == 0 ? 0.25 : 0.5" in text
    assert "cost reduce = reduce-scatter of a stage's gradients" in text
    c, _ = evaluate_costs(load_costs_file(path), 2, "parallel")
    assert c.recv == 0.375 and c.collective("reduce", 1) == 0.5 and c.collective("gather", 0) == 0.5


def _at_length(length: int) -> Profile:
    """small_profile measured at `length` tokens: T_F = 0.5 + 0.01*t + 1e-4*t^2
    ms, the other passes linear, M_B = 100 bytes a token, M_W half of it."""
    base = small_profile()
    forward = 0.5 + 0.01 * length + 1e-4 * length * length
    stages = tuple(replace(s, timing=replace(s.timing, forward_ms=forward,
                                             input_ms=0.02 * length, weight_ms=1 + 0.005 * length,
                                             fused_ms=1 + 0.025 * length,
                                             activation_bytes=100 * length,
                                             weight_bytes=50 * length))
                   for s in base.stages)
    return replace(base, stages=stages, seq_len=length)


def test_costs_in_tokens_round_trip(tmp_path: Path) -> None:
    """`profile --lengths` writes costs and memory in tokens that the compiler
    reads back as the measured polynomials (docs/language.md, Costs in tokens)."""
    path = tmp_path / "tokens.pp"
    path.write_text(to_costs_pp_in_tokens([_at_length(t) for t in (64, 256, 128, 512)]))
    c, m = evaluate_costs(load_costs_file(path), 2, "parallel")
    a, b, q = c.tokens[0][0]  # F on stage 0
    assert math.isclose(a, 0.5, rel_tol=1e-3) and math.isclose(b, 0.01, rel_tol=1e-3)
    assert math.isclose(q, 1e-4, rel_tol=1e-3)
    assert c.tokens[1][1] == (0.0, 0.02, 0.0)  # B: linear, no noise terms
    assert m.tokens[0][0] == (0, 100, 0) and m.tokens[1][1] == (0, 50, 0)


def test_fit_in_tokens_is_never_negative() -> None:
    """The fit keeps every term >= 0 (a cost must be >= 0 at every length):
    a falling measurement fits a constant, an exact quadratic is recovered."""
    assert fit_in_tokens([8, 16, 32], [3.0, 2.0, 1.0]) == pytest.approx((2.0, 0.0, 0.0))
    assert fit_in_tokens([1, 2, 3, 4], [6, 11, 18, 27]) == pytest.approx((3.0, 2.0, 1.0))
    assert fit_in_tokens([10, 20], [1.0, 2.0]) == pytest.approx((0.0, 0.1, 0.0))
