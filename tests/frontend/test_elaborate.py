"""Elaboration: the order form, the block form, params and -D overrides, located errors."""

from __future__ import annotations

from fractions import Fraction

import pytest

from ppdsl.diagnostics import CompileError
from ppdsl.frontend.elaborate import elaborate
from ppdsl.frontend.parse import parse
from ppdsl.ir.schedule import PassKind, format_schedule

ONE_F_ONE_B = """\
schedule one_f_one_b {
    param d = 4
    param m = 8
    backward fused
    order {
        let w = min(d - 1 - i, m)          # warm-up forwards
        for j in 0..w { F(j) }
        interleave { for j in w..m { F(j) } } with { for j in 0..m { BW(j) } }
    }
    expect peak_memory <= d * M_B
}
"""

# docs/papers.md's 1F1B order, p=4, m=8
GOLDEN_1F1B = """\
  rank 0: F0 F1 F2 F3 BW0 F4 BW1 F5 BW2 F6 BW3 F7 BW4 BW5 BW6 BW7
  rank 1: F0 F1 F2 BW0 F3 BW1 F4 BW2 F5 BW3 F6 BW4 F7 BW5 BW6 BW7
  rank 2: F0 F1 BW0 F2 BW1 F3 BW2 F4 BW3 F5 BW4 F6 BW5 F7 BW6 BW7
  rank 3: F0 BW0 F1 BW1 F2 BW2 F3 BW3 F4 BW4 F5 BW5 F6 BW6 F7 BW7
"""


def build(text: str, overrides: dict[str, str] | None = None):
    return elaborate(parse(text, "t.pp"), overrides or {})


def error_of(text: str, overrides: dict[str, str] | None = None):
    with pytest.raises(CompileError) as info:
        build(text, overrides)
    (diag,) = info.value.diagnostics
    return diag


def test_one_f_one_b_order_matches_design_golden():
    """1F1B written with interleave reproduces docs/papers.md's order for d=4 m=8 exactly."""
    text = format_schedule(build(ONE_F_ONE_B))
    assert text.endswith(GOLDEN_1F1B)
    assert "params d=4 m=8\n" in text
    assert "backward fused" in text


GPIPE = """\
schedule gpipe {
    param d = 2
    param m = 3
    backward fused
    order {
        for j in 0..m { F(j) }
        for j in 0..m { BW(j) }
    }
}
"""

LOOPED_BFS = """\
schedule looped_bfs {
    param d = 2
    param v = 2
    param m = 2
    place looped(v)
    backward fused
    order {
        for c in chunks { for j in 0..m { F(j, c) } }
        for c in reversed(chunks) { for j in reversed(0..m) { BW(j, c) } }
    }
}
"""

ZB_H1 = """\
schedule zb_h1 {
    param d = 4
    param m = 2 * d
    block period 3 {
        F at s
        B at 3*d - 2 - 2*s
        W at 3*d - 1 + s
    }
    expect makespan == 3*m + d - 1
}
"""

# docs/papers.md's ZB-H1 order, p=4, m=8
GOLDEN_ZB_H1 = """\
  rank 0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
  rank 1: F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
  rank 2: F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
  rank 3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7
"""

V_HALF = """\
schedule v_half {
    param d = 4
    param m = 8
    let g = d % 2 == 0 ? 3 : 0
    place vshape
    block period 6 {
        chunk 0: F at 2*i,          B at 6*d + g - 2 - i
        chunk 1: F at 3*d - 2 - i,  B at 3*d + g - 1 + 2*i
        W fill
    }
}
"""


def test_gpipe_order():
    """GPipe: all forwards, then all backwards, on every device."""
    text = format_schedule(build(GPIPE))
    assert text.endswith("  rank 0: F0 F1 F2 BW0 BW1 BW2\n  rank 1: F0 F1 F2 BW0 BW1 BW2\n")


def test_looped_bfs_order_names_stages():
    """Looped BFS (docs/papers.md): chunks in order, then reversed, stage named per pass."""
    schedule = build(LOOPED_BFS)
    assert schedule.placement.stage_device == (0, 1, 0, 1)
    text = format_schedule(schedule)
    assert "  rank 0: F0:s0 F1:s0 F0:s2 F1:s2 BW1:s2 BW0:s2 BW1:s0 BW0:s0\n" in text
    assert "  rank 1: F0:s1 F1:s1 F0:s3 F1:s3 BW1:s3 BW0:s3 BW1:s1 BW0:s1\n" in text


def test_zb_h1_block_matches_design_golden():
    """The ZB-H1 block of docs/language.md repeats into docs/papers.md's order."""
    schedule = build(ZB_H1)
    assert format_schedule(schedule).endswith(GOLDEN_ZB_H1)
    block = schedule.block
    assert block is not None and block.period == 3
    f3 = next(s for s in block.slots if s.kind is PassKind.F and s.stage == 3)
    assert (f3.device, f3.start, f3.duration) == (3, 3, 1)
    assert f3.span is not None and f3.span.line == 5


def test_v_half_chunk_lines_and_w_fill():
    """`chunk K:` lines bind i and c; every stage gets its F and B slot; W is filled."""
    schedule = build(V_HALF)
    assert schedule.placement.stage_device == (0, 1, 2, 3, 3, 2, 1, 0)
    block = schedule.block
    assert block is not None
    starts = {(s.kind.value, s.stage): s.start for s in block.slots}
    assert len(starts) == 16  # F and B for 8 stages, no W slots
    assert starts[("F", 1)] == 2  # chunk 0 of device 1: 2*i
    assert starts[("F", 6)] == 3 * 4 - 2 - 1  # chunk 1 of device 1: 3d - 2 - i
    assert starts[("B", 7)] == 3 * 4 + 3 - 1  # chunk 1 of device 0
    # every pass appears once
    assert sum(len(o) for o in schedule.orders) == 3 * 8 * 8


@pytest.mark.parametrize(
    ("place", "devices"),
    [
        ("parallel", (0, 1, 2)),
        ("looped(2)", (0, 1, 2, 0, 1, 2)),
        ("vshape", (0, 1, 2, 2, 1, 0)),
        ("wave(3)", (0, 1, 2, 2, 1, 0, 0, 1, 2)),
        ("[2, 0, 1, 1]", (2, 0, 1, 1)),
    ],
)
def test_placements(place: str, devices: tuple[int, ...]):
    """Each placement kind maps stages to devices as docs/language.md says."""
    text = (
        "schedule p {\n param d = 3\n param m = 1\n place " + place + "\n backward fused\n"
        " order { for c in chunks { F(0, c) }; for c in reversed(chunks) { BW(0, c) } }\n}\n"
    )
    schedule = build(text)
    assert schedule.placement.stage_device == devices
    assert schedule.num_stages == len(devices)


def test_costs_memory_and_names():
    """Per-stage costs and memory, derived defaults BW = B + W and M_W = M_B / 2,
    T_* and M_* names usable afterwards, exact rationals kept in params."""
    text = """\
schedule c {
    param d = 3
    param m = 2
    cost F = 1.5
    cost B[s] = s == d - 1 ? 2 : 1
    memory M_B[s] = s + 1
    let t = T_F + T_BW + M_W
    order { for j in 0..m { F(j) }; for j in 0..m { B(j) }; for j in 0..m { W(j) } }
}
"""
    schedule = build(text)
    assert schedule.costs.forward == (1.5, 1.5, 1.5)
    assert schedule.costs.backward_input == (1.0, 1.0, 2.0)
    assert schedule.costs.fused_backward == (2.0, 2.0, 3.0)
    assert schedule.costs.comm == 0.0
    assert schedule.memory.activation == (1, 2, 3)
    assert schedule.memory.weight_retained == (Fraction(1, 2), 1, Fraction(3, 2))
    assert schedule.params == (("d", 3), ("m", 2), ("t", Fraction(4)))
    assert type(schedule.params[2][1]) is int


def test_overrides_apply_before_dependent_params():
    """-D d=8 changes d and every param computed from it; rationals stay exact."""
    text = ZB_H1.replace("schedule zb_h1 {", "schedule zb_h1 {\n    param r = 1/3")
    schedule = build(text, {"d": "8"})
    assert schedule.num_devices == 8 and schedule.num_microbatches == 16
    assert dict(schedule.params)["r"] == Fraction(1, 3)
    assert build(text, {"m": "d + 1"}).num_microbatches == 5


def test_expectations():
    """expect lines become Expect records with exact bounds and their text."""
    text = ONE_F_ONE_B.replace(
        "    expect peak_memory <= d * M_B\n",
        "    expect peak_memory[1] < 7/2\n    expect bubble <= (d - 1) / (3*m + d - 1)\n",
    )
    e1, e2 = build(text).expects
    assert (e1.metric, e1.op, e1.bound, e1.device, e1.text) == (
        "peak_memory",
        "<",
        Fraction(7, 2),
        1,
        "7/2",
    )
    assert (e2.metric, e2.device, e2.bound) == ("bubble", None, Fraction(1, 9))
    assert e2.span.line == 11


def test_order_constructs_evaluate():
    """repeat, if/else-if/else, uneven interleave, reversed ranges and lets."""
    text = """\
schedule o {
    param d = 3
    param m = 6
    backward fused
    order {
        let k = i + 1
        if i == 0 { repeat 2 { F(0) } } else if i == 1 { F(1) } else { F(2); F(3) }
        interleave { for j in reversed(0..k) { BW(j) } } with { F(5) }
    }
}
"""
    orders = [" ".join(f"{p.kind.value}{p.microbatch}" for p in o) for o in build(text).orders]
    assert orders == ["F0 F0 BW0 F5", "F1 BW1 F5 BW0", "F2 F3 BW2 F5 BW1 BW0"]


def test_passes_carry_the_span_of_their_call():
    """Every Pass of the order form points at the call that made it."""
    schedule = build(GPIPE)
    first = schedule.orders[0][0]
    assert first.span is not None and (first.span.line, first.span.column) == (6, 25)


@pytest.mark.parametrize(
    ("body", "message", "line", "column"),
    [
        ("for j in 0..m + 1 { F(j) }", "microbatch 2 out of range: m = 2, so 0..2", 6, 31),
        ("for j in 0..m { F(j, 1) }", "chunk 1 out of range: device 0 holds 1 chunk(s)", 6, 30),
        ("F(0); F(j)", "undefined name 'j'", 6, 17),
        ("for j in 0..m { let j = 1 }", "'j' is already defined here", 6, 25),
        ("let d = 1", "'d' is already defined", 6, 9),
        ("G(0)", "unknown pass 'G'", 6, 9),
        ("F(0, 0, 0)", "takes a microbatch and optionally a chunk, got 3 arguments", 6, 9),
        ("for j in 0..m/4 { F(j) }", "a range's end must be an integer, got 1/2", 6, 21),
        ("for j in m { F(j) }", "a loop needs a range such as 0..m or chunks, got 2", 6, 18),
        ("repeat 0 - 1 { F(0) }", "a repeat count must be >= 0, got -1", 6, 16),
        ("if chunks { F(0) }", "a condition is a range (0..1), not a number", 6, 12),
        ("F(s)", "undefined name 's': the stage index 's' is bound only", 6, 11),
        (
            "repeat 10000 { repeat 10000 { F(0) } }",
            "device 0's order grows past 1016 passes here, but its stages need 4",
            6,
            31,
        ),
    ],
)
def test_order_errors_are_located(body: str, message: str, line: int, column: int):
    """Mistakes in the order form are errors at the offending expression."""
    text = (
        "schedule e {\n    param d = 2\n    param m = 2\n    backward fused\n    order {\n"
        f"        {body}\n    }}\n}}\n"
    )
    diag = error_of(text)
    assert message in diag.message
    assert diag.span is not None and (diag.span.line, diag.span.column) == (line, column)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ("F at s\nW at 2", "the block places no B for stage 0"),
        ("F at s\nB at 1\nW at 2\nW fill", "W is placed explicitly and by 'W fill'"),
        ("F at s, F at 2\nB at 1\nW fill", "F is placed twice"),
        ("chunk 3: F at s\nB at 1\nW fill", "chunk 3 out of range"),
        ("F at s\nBW at 1", "this schedule's backward is split: write B and W"),
        ("F at s/0\nB at 1\nW fill", "division by zero"),
    ],
)
def test_block_errors(lines: str, message: str):
    """Mistakes in a block are located errors."""
    body = "\n".join("        " + x for x in lines.split("\n"))
    text = f"schedule b {{\n    param d = 2\n    param m = 2\n    block period 3 {{\n{body}\n    }}\n}}\n"
    diag = error_of(text)
    assert message in diag.message
    assert diag.span is not None and diag.span.file == "t.pp"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("param d = 2\nparam m = 2", "has no 'order { ... }' or 'block period T { ... }'"),
        ("param d = 2", "declares no 'param m'"),
        ("param d = 2\nparam m = 2\nparam S = 1", "'S' is a name the compiler binds"),
        ("param d = 2\nparam m = 2\ncost F = 1\nplace vshape", "'place' must come before"),
        ("param d = 2\nparam m = 2\ncost X = 1", "unknown cost 'X'"),
        ("param d = 2\nparam m = 2\ncost comm[s] = 1", "'comm' is one value"),
        ("param d = 2\nparam m = 2\nmemory M_A = 1", "unknown memory quantity 'M_A'; did you mean"),
        (
            "param d = 2\nparam m = 2\nbackward fuse",
            "unknown backward 'fuse'; did you mean 'fused'",
        ),
        ("param d = 2\nparam m = 2\ncost F = -1", "a cost must be a number >= 0, got -1"),
        ("param d = 2\nparam m = 2\nplace looped", "'looped' needs the number of chunks"),
        ("param d = 2.5\nparam m = 2", "d (the number of devices) must be a positive integer"),
        ("param d = 2\nparam m\norder { }", "param 'm' has no value; give it with -D m=..."),
    ],
)
def test_top_level_errors(text: str, message: str):
    """Mistakes in top-level statements are errors that say what to do."""
    diag = error_of("schedule t {\n" + text + "\n}\n")
    assert message in diag.message


def test_unknown_override_names_the_params():
    """-D of a name that is no param lists the known params, with a suggestion."""
    diag = error_of(GPIPE, {"dd": "3"})
    assert diag.span is None
    assert (
        diag.message == "-D dd=3: no param 'dd' in this schedule; did you mean 'd'? (params: d, m)"
    )


def test_param_given_only_on_the_command_line():
    """`param m` without a default takes its value from -D."""
    text = GPIPE.replace("param m = 3", "param m")
    assert build(text, {"m": "5"}).num_microbatches == 5


def test_schedule_span_and_file():
    """The schedule carries its file and the span of its name."""
    schedule = build(GPIPE)
    assert schedule.file == "t.pp" and schedule.name == "gpipe"
    assert schedule.span is not None and schedule.span.line == 1


# --- property: the integer fast path agrees with exact evaluation ------------------

_ENV_NAMES = ("a", "b", "z", "r")


def _fast_and_exact_agree(expr, env):
    from ppdsl.frontend.expressions import ElaborationError, Scope, compile_exact, compile_expr

    scope = Scope(_ENV_NAMES)

    def outcome(fn):
        try:
            value = fn(expr, scope)(dict(env))
        except ElaborationError as exc:
            return ("error", exc.diagnostic.message)
        return (type(value), value)

    assert outcome(compile_expr) == outcome(compile_exact)


def _expressions():
    from hypothesis import strategies as st

    from ppdsl.diagnostics import Span
    from ppdsl.frontend import ast as A

    span = Span("p", 1, 1, 1, 1)
    leaves = st.one_of(
        st.sampled_from(_ENV_NAMES).map(lambda n: A.Name(n, span)),
        st.sampled_from(["0", "1", "2", "3", "0.5"]).map(lambda v: A.Number(Fraction(v), span)),
    )

    def extend(children):
        ops = ["+", "-", "*", "/", "//", "%", "==", "!=", "<", ">=", "and", "or"]
        return st.one_of(
            st.tuples(st.sampled_from(ops), children, children).map(
                lambda t: A.Binary(t[0], t[1], t[2], span)
            ),
            st.tuples(st.sampled_from(["-", "not"]), children).map(
                lambda t: A.Unary(t[0], t[1], span)
            ),
            st.tuples(children, children, children).map(lambda t: A.Cond(*t, span)),
            st.tuples(
                st.sampled_from(["min", "max", "ceil", "floor"]),
                st.lists(children, min_size=1, max_size=3),
            ).map(
                lambda t: A.Call(t[0], tuple(t[1][:1] if t[0] in ("ceil", "floor") else t[1]), span)
            ),
        )

    return st.recursive(leaves, extend, max_leaves=10)


@pytest.mark.slow
def test_fast_path_agrees_with_exact_evaluation():
    """Compiled int fast path and exact evaluation give the same value (and type) or
    the same located error, for ints, rationals, zero and ranges in the environment."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    envs = st.fixed_dictionaries(
        {
            "a": st.integers(-5, 5),
            "b": st.one_of(st.integers(-3, 3), st.just(Fraction(3, 2))),
            "z": st.just(0),
            "r": st.just(range(0, 2)),
        }
    )

    @settings(max_examples=300, deadline=None)
    @given(_expressions(), envs)
    def check(expr, env):
        _fast_and_exact_agree(expr, env)

    check()


def test_wrong_pass_kind_notes_the_backward_line():
    """B in a fused schedule notes the `backward` line, the other side of the mistake."""
    import pytest

    from ppdsl.compiler import compile_source
    from ppdsl.diagnostics import CompileError

    text = (
        "schedule s {\n    param d = 2\n    param m = 4\n    backward fused\n"
        "    block period 3 {\n        F at s\n        B at 3*d - 2 - 2*s\n    }\n}\n"
    )
    with pytest.raises(CompileError) as info:
        compile_source(text, "kind.pp")
    [error] = info.value.diagnostics
    assert error.span is not None and error.span.line == 7
    assert [(span.line if span else None, note) for span, note in error.notes] == [
        (4, "the backward form is declared here")
    ]
