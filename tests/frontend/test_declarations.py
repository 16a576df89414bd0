"""`ppdsl.frontend.declarations` on its own: each public function fed parsed
statements, its effect on `Declarations` and its located errors
(docs/language.md's params, placement, costs, memory, recompute, require,
expect; the defaults of docs/architecture.md's `semantics`)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from ppdsl.frontend import ast
from ppdsl.frontend.declarations import (
    MAX_PASSES,
    METRICS,
    Declarations,
    declare_cost,
    declare_memory,
    declare_param,
    declare_placement,
    declare_recompute,
    ensure_placement,
    evaluate_override,
    expectation,
    pass_kind,
    require,
)
from ppdsl.frontend.expressions import ElaborationError
from ppdsl.frontend.parse import parse
from ppdsl.ir.schedule import Placement
from ppdsl.semantics import PassKind

FILE = "decl.pp"


def _stmts(body: str) -> tuple[ast.Stmt, ...]:
    """The statements of `schedule t { body }`, one per line of `body`."""
    return parse("schedule t {\n" + body + "\n}\n", FILE).stmts


def _state(body: str = "", overrides: dict[str, str] | None = None) -> Declarations:
    """Declarations after `param d = 4`, `param m = 8` and the statements of `body`,
    each handed to its declare_* function in order (as elaborate does)."""
    state = Declarations(FILE)
    for stmt in _stmts("param d = 4\nparam m = 8\n" + body):
        _declare(stmt, state, overrides or {})
    return state


def _declare(stmt: ast.Stmt, state: Declarations, overrides: dict[str, str] | None = None) -> None:
    if isinstance(stmt, ast.Param):
        declare_param(stmt, state, overrides or {})
    elif isinstance(stmt, ast.Place):
        declare_placement(stmt, state)
    elif isinstance(stmt, ast.Cost):
        declare_cost(stmt, state)
    elif isinstance(stmt, ast.Memory):
        declare_memory(stmt, state)
    elif isinstance(stmt, ast.Recompute):
        declare_recompute(stmt, state)
    elif isinstance(stmt, ast.Let):  # as elaborate binds a let
        state.define(stmt.name, state.evaluate(stmt.value), stmt.span)
    elif isinstance(stmt, ast.Require):
        require(stmt, state)
    else:
        raise AssertionError(f"no declare function for {stmt!r}")


def _error(body: str, overrides: dict[str, str] | None = None) -> ElaborationError:
    """The error the last statement of `body` raises (the others declared first)."""
    with pytest.raises(ElaborationError) as info:
        _state(body, overrides)
    return info.value


def _at(err: ElaborationError) -> tuple[int, int] | None:
    span = err.diagnostic.span
    return None if span is None else (span.line, span.column)


def test_params_bind_in_order_and_define_refuses_builtins_and_twice() -> None:
    """`param` binds d and m in order (params list and env); a builtin name or a
    second definition is refused, naming where the first one was."""
    state = _state()
    assert state.params == [("d", 4), ("m", 8)]
    assert state.env["d"] == 4 and state.env["m"] == 8
    assert state.defined["d"] is not None and state.defined["d"].line == 2
    with pytest.raises(ElaborationError, match="already defined at 2:1"):
        state.define("d", 5, None)
    with pytest.raises(ElaborationError, match="'S' is a name the compiler binds"):
        state.define("S", 1, None)
    state.define("k", 3, None)
    assert state.env["k"] == 3 and state.defined["k"] is None
    assert "k" in state.scope() and "m" in state.scope() and "q" not in state.scope()


def test_param_default_may_use_earlier_params() -> None:
    """A param's default is an expression over the params before it."""
    assert _declare_all("param d = 3\nparam m = 2 * d + 1").env["m"] == 7


def _declare_all(text: str) -> Declarations:
    """Declarations after the statements of `text` alone (no d or m first)."""
    state = Declarations(FILE)
    for stmt in _stmts(text):
        _declare(stmt, state)
    return state


@pytest.mark.parametrize(
    ("text", "message", "where"),
    [
        ("param d = 2\nparam k", "param 'k' has no value; give it with -D k=...", (3, 1)),
        ("param d = 0", "d (the number of devices) must be a positive integer, got 0", (2, 11)),
        ("param d = 65537", "d (the number of devices) is 65537; ppdsl handles at most 65536", (2, 11)),
        ("param d = 2\nparam m = 3/2", "m (the number of microbatches) must be a positive integer, got 3/2", (3, 11)),
        ("param d = 2\nparam m = 1048577", "m (the number of microbatches) is 1048577; ppdsl handles at most 1048576", (3, 11)),
    ],
)
def test_param_errors_are_located(text: str, message: str, where: tuple[int, int]) -> None:
    """A param without a value, a non-positive or fractional d or m, or one above
    ppdsl's limits is an error at the value (or the statement when there is none)."""
    with pytest.raises(ElaborationError) as info:
        _declare_all(text)
    assert info.value.diagnostic.message == message
    assert _at(info.value) == where


def test_overrides_replace_defaults_and_their_errors_name_the_flag() -> None:
    """`-D name=text` replaces a default, may use earlier params, and any error in
    it starts with `-D name=text:` and has no span (it is not in the file)."""
    state = _state(overrides={"m": "3 * d"})
    assert state.env["m"] == 12
    assert state.defined["m"] is not None  # the param's line still defines it
    assert evaluate_override("x", "d + 1", state) == 5
    assert evaluate_override("x", "3/2", state) == Fraction(3, 2)
    for text, message in (
        ("abc", "-D x=abc: 'abc' is not a number (give an integer"),
        ("1 +", "-D x=1 +: not a number or an expression over earlier params"),
        ("d / 0", "-D x=d / 0: "),
    ):
        with pytest.raises(ElaborationError) as info:
            evaluate_override("x", text, state)
        assert info.value.diagnostic.message.startswith(message), info.value.diagnostic.message
        assert info.value.diagnostic.span is None
    err = _error("", overrides={"m": "0"})
    assert err.diagnostic.message == (
        "-D m=0: m (the number of microbatches) must be a positive integer, got 0"
    )


def test_named_placement_sets_stages_and_default_memory() -> None:
    """`place vshape` sets the placement, S = 2d, v = 2, M_B = 1 and M_W = 1/2 per
    stage, unit pass costs and BW = B + W; the T_*/M_* names follow."""
    state = _state("place vshape")
    assert state.placement == Placement.named("vshape", 4)
    assert state.env["S"] == 8 and state.env["v"] == 2
    assert state.memory["M_B"] == [1] * 8
    assert state.memory["M_W"] == [Fraction(1, 2)] * 8
    assert state.memory["M_I"] == [0] * 8
    assert state.costs[PassKind.F] == [1] * 8 and state.costs[PassKind.BW] == [2] * 8
    assert (state.env["T_F"], state.env["T_BW"], state.env["M_W"]) == (1, 2, Fraction(1, 2))
    assert state.env["T_comm"] == 0 and state.env["T_overlap"] == 1


def test_placement_with_chunks_and_as_a_list() -> None:
    """`looped(v)` takes its chunk count; a device list maps stage to device."""
    state = _state("place looped(3)")
    assert state.placement == Placement.named("looped", 4, 3)
    assert state.env["S"] == 12 and state.env["v"] == 3
    state = _state("place [0, 1, 2, 3, 3, 2, 1, 0]")
    assert state.placement == Placement("list", 4, (0, 1, 2, 3, 3, 2, 1, 0))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("place paralel", "unknown placement 'paralel'; did you mean 'parallel'?"),
        ("place looped", "'looped' needs the number of chunks: looped(v)"),
        ("place parallel(2)", "'parallel' takes no argument"),
        ("place [0, 1, 2, 4]", "device 4 out of range: d = 4, so devices are 0..4"),
        ("place [0, 1, 1, 0]", "device 2 holds no stage: the list must use every device 0..4"),
        ("cost F = 2\nplace parallel", "'place' must come before the costs and memory"),
    ],
)
def test_placement_errors(body: str, message: str) -> None:
    """Each way a placement goes wrong is one message naming the fix."""
    assert message in _error(body).diagnostic.message
    assert _error(body).diagnostic.span is not None


def test_ensure_placement_defaults_to_parallel_once() -> None:
    """Without `place`, the first statement that needs one gets `parallel`, once."""
    state = _state()
    assert state.placement is None
    placement = ensure_placement(state)
    assert placement == Placement.named("parallel", 4)
    assert ensure_placement(state) is placement
    assert state.env["S"] == 4


def test_costs_per_stage_and_defaults_follow_them() -> None:
    """`cost B[s] = ...` sets B per stage; BW (not given) follows B + W; a given BW
    stays; comm, overlap and a collective take their own slots."""
    state = _state("place parallel\ncost B[s] = s + 1\ncost W = 1/2\ncost comm = 3/10")
    assert state.costs[PassKind.B] == [1, 2, 3, 4]
    assert state.costs[PassKind.BW] == [Fraction(3, 2), Fraction(5, 2), Fraction(7, 2), Fraction(9, 2)]
    assert state.env["T_B"] == 1 and state.env["T_comm"] == Fraction(3, 10)
    assert {"B", "W", "comm"} <= state.explicit
    state = _state("cost BW = 5\ncost B = 2\ncost overlap = 3/4\ncost reduce[s] = s")
    assert state.costs[PassKind.BW] == [5] * 4
    assert state.overlap == Fraction(3, 4) and state.collectives["reduce"] == [0, 1, 2, 3]
    costs = state.cost_model()
    assert costs.overlap == 0.75 and costs.duration(PassKind.BW, 0) == 5.0
    assert [costs.collective("reduce", s) for s in range(4)] == [0.0, 1.0, 2.0, 3.0]
    assert state.placement == Placement.named("parallel", 4)  # cost asked for one


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("cost X = 1", "unknown cost 'X'; costs are F, B, W, BW, R"),
        ("cost Ff = 1", "unknown cost 'Ff'; did you mean 'F'?"),
        ("cost comm[s] = s", "the transfer cost 'comm' is one value, not per stage"),
        ("cost overlap[s] = 1", "'overlap' is one factor, not per stage"),
        ("cost overlap = 0", "'overlap' is the share of F + B an overlapped pair takes"),
        ("cost F[s] = 1 - s", "a cost must be a number >= 0, got -1"),
        ("cost F[d] = 1", "'d' is already defined; name the stage index something else"),
    ],
)
def test_cost_errors(body: str, message: str) -> None:
    """Each bad cost statement is a located error naming what to write."""
    err = _error(body)
    assert message in err.diagnostic.message, err.diagnostic.message
    assert _at(err) is not None and _at(err)[0] == 4


def test_memory_defaults_track_m_b_until_given() -> None:
    """M_W is M_B / 2 while not given, follows a new M_B, and stays once given;
    the memory model carries M_I only when a stage recomputes."""
    state = _state("memory M_B[s] = 2 * (s + 1)")
    assert state.memory["M_W"] == [1, 2, 3, 4]
    assert state.env["M_B"] == 2
    state = _state("memory M_W = 1/4\nmemory M_B = 4")
    assert state.memory["M_W"] == [Fraction(1, 4)] * 4
    model = state.memory_model()
    assert model.activation == (4, 4, 4, 4)
    assert model.weight_retained == (Fraction(1, 4),) * 4
    assert model.kept_input == ()
    marked = _state("memory M_I = 1/8\nrecompute[s] = s == 0").memory_model()
    assert marked.kept_input == (Fraction(1, 8), None, None, None)
    assert marked.recompute == frozenset({0})
    assert _state("memory M_I = 1/8").memory_model().kept_input == ()


def test_memory_unknown_name() -> None:
    """An unknown memory name suggests the nearest one."""
    assert "unknown memory quantity 'M_BB'; did you mean 'M_B'?" in _error("memory M_BB = 1").diagnostic.message
    assert "the memory model has M_B and M_W" in _error("memory Q = 1").diagnostic.message


def test_recompute_marks_stages() -> None:
    """`recompute` marks every stage, `recompute[s] = cond` those where cond is not
    0; without the line nothing recomputes."""
    assert _state().recompute is None and not _state().recomputes
    state = _state("recompute")
    assert state.recompute == [True] * 4 and state.recomputes
    state = _state("place vshape\nrecompute[s] = s < 2 or s == S - 1")
    assert state.recompute == [True, True, False, False, False, False, False, True]
    assert not _state("recompute = 0").recomputes


def test_recompute_errors() -> None:
    """A second `recompute` names the first; an index without a condition asks for it."""
    err = _error("recompute\nrecompute = 1")
    assert "'recompute' is given twice (also at 4:1)" in err.diagnostic.message
    assert _at(err) == (5, 1)
    assert "`recompute[s]` needs its condition" in _error("recompute[s]").diagnostic.message


def test_require_passes_or_quotes_its_values() -> None:
    """A true `require` is silent; a false one quotes its message, the condition
    and the values of the names it uses, d and m first."""
    _state('require m >= d, "enough microbatches"')
    err = _error('let k = 3\nrequire m < d * k and k > 5, "too few"')
    assert err.diagnostic.message == (
        "too few: this schedule requires m < d * k and k > 5 (here d = 4, m = 8, k = 3)"
    )
    assert _at(err) == (5, 1)
    assert _error("require m < 0").diagnostic.message == "this schedule requires m < 0 (here m = 8)"


def test_pass_kind_checks_the_backward_form_and_recompute() -> None:
    """A pass name is a kind of the schedule's backward form; R needs `recompute`."""
    span = _stmts("param d = 1")[0].span
    assert pass_kind("F", span, split_backward=True) is PassKind.F
    assert pass_kind("W", span, split_backward=True) is PassKind.W
    assert pass_kind("BW", span, split_backward=False) is PassKind.BW
    assert pass_kind("R", span, split_backward=False, recompute=True) is PassKind.R
    for name, split, recompute, message in (
        ("X", True, False, "unknown pass 'X'; passes are F, B, W"),
        ("Fw", True, False, "unknown pass 'Fw'; did you mean 'F'?"),
        ("R", True, False, "R is the recompute pass of a stage marked `recompute`"),
        ("BW", True, False, "this schedule's backward is split: write B and W"),
        ("W", False, False, "this schedule's backward is fused: write BW, not W"),
    ):
        with pytest.raises(ElaborationError) as info:
            pass_kind(name, span, split, recompute)
        assert message in info.value.diagnostic.message, info.value.diagnostic.message
        assert info.value.diagnostic.span == span


def test_expectation_reads_metric_device_and_bound() -> None:
    """`expect` gives its metric, operator, exact bound and device; lifespan takes a
    stage; every metric in METRICS is accepted."""
    state = _state("place vshape")
    decls = [s for s in parse(
        "schedule t {\nexpect peak_memory[d - 1] <= 3/2 * M_B\nexpect lifespan[7] == 3\n"
        + "".join(f"expect {metric} >= 0\n" for metric in METRICS) + "}\n", FILE).stmts]
    first = expectation(decls[0], state, 4)
    assert (first.metric, first.op, first.bound, first.device) == ("peak_memory", "<=", Fraction(3, 2), 3)
    assert expectation(decls[1], state, 4).device == 7
    assert [expectation(d, state, 4).metric for d in decls[2:]] == list(METRICS)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("expect bubbel <= 1", "unknown metric 'bubbel'; did you mean 'bubble'?"),
        ("expect bubble[0] <= 1", "'bubble' is one value for the schedule; only peak_memory takes"),
        ("expect peak_memory[4] <= 1", "device 4 out of range: d = 4, so 0..4"),
        ("expect lifespan[8] <= 1", "stage 8 out of range: S = 8, so lifespan[0..8]"),
    ],
)
def test_expectation_errors(line: str, message: str) -> None:
    """A bad metric, device or stage in `expect` is a located error."""
    state = _state("place vshape")
    (decl,) = parse("schedule t {\n" + line + "\n}\n", FILE).stmts
    with pytest.raises(ElaborationError) as info:
        expectation(decl, state, 4)
    assert message in info.value.diagnostic.message, info.value.diagnostic.message
    assert _at(info.value) is not None and _at(info.value)[0] == 2


def test_max_passes_is_the_documented_limit() -> None:
    """MAX_PASSES is the 20 million passes an order or repeated block may make."""
    assert MAX_PASSES == 20_000_000
