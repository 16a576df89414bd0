"""Order-form loops evaluated for all values at once (issue 13's elaboration by
arithmetic, `order_form._VectorLoop`), and for all devices at once (issue 41,
`order_form._DeviceLoops`), give exactly what running the loop value by value
gives: the same orders, or the same located error, on random loop
bodies of pass calls and `if`s over random integer expressions (division and
modulo by zero, rationals, out-of-range microbatches and chunks, runaway
orders and huge values included; R calls with and without stages marked
`recompute`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ppdsl.frontend.order_form as order_form
from ppdsl.diagnostics import CompileError
from ppdsl.frontend.elaborate import elaborate
from ppdsl.frontend.parse import parse

_ATOMS = ["t", "i", "d", "m", "0", "1", "2", "3", "7", "big"]


def _expr(depth: int):
    leaf = st.sampled_from(_ATOMS)
    if depth == 0:
        return leaf

    def binary(parts):
        op, a, b = parts
        return f"({a} {op} {b})"

    inner = _expr(depth - 1)
    ops = st.sampled_from(["+", "-", "*", "//", "%", "/"])
    return st.one_of(
        leaf,
        st.tuples(ops, inner, inner).map(binary),
        st.tuples(st.sampled_from(["min", "max"]), inner, inner).map(lambda p: f"{p[0]}({p[1]}, {p[2]})"),
        st.tuples(_cond(0), inner, inner).map(lambda p: f"({p[0]} ? {p[1]} : {p[2]})"),
        inner.map(lambda a: f"(-{a})"),
    )


def _cond(depth: int):
    compare = st.tuples(
        st.sampled_from(["<", "<=", "==", "!=", ">", ">="]),
        st.sampled_from(_ATOMS[:6]),
        st.sampled_from(_ATOMS[:6]),
    ).map(lambda p: f"({p[1]} {p[0]} {p[2]})")
    if depth == 0:
        return compare
    inner = _cond(depth - 1)
    return st.one_of(
        compare,
        st.tuples(st.sampled_from(["and", "or"]), inner, inner).map(lambda p: f"({p[1]} {p[0]} {p[2]})"),
        inner.map(lambda c: f"(not {c})"),
        _expr(1),  # a number as a condition
    )


def _call():
    kind = st.sampled_from(["F", "B", "W", "R"])  # R: an error where no stage recomputes
    one = st.tuples(kind, _expr(2)).map(lambda p: f"{p[0]}({p[1]})")
    two = st.tuples(kind, _expr(2), _expr(1)).map(lambda p: f"{p[0]}({p[1]}, {p[2]})")
    return st.one_of(one, two)


def _stmt(depth: int):
    if depth == 0:
        return _call()
    inner = st.lists(_stmt(depth - 1), min_size=1, max_size=3).map("; ".join)
    branch = st.tuples(_cond(1), inner, st.one_of(st.none(), inner)).map(
        lambda p: f"if {p[0]} {{ {p[1]} }}" + (f" else {{ {p[2]} }}" if p[2] else "")
    )
    return st.one_of(_call(), branch)


@st.composite
def programs(draw):
    d = draw(st.integers(1, 4))
    m = draw(st.integers(1, 40))
    place = draw(st.sampled_from(["parallel", "vshape", "looped(2)"]))
    start = draw(st.integers(-3, 5))
    stop = draw(st.integers(start, start + 60))
    big = draw(st.sampled_from([5, 2**40, 2**62]))
    body = "; ".join(draw(st.lists(_stmt(2), min_size=1, max_size=4)))
    reverse = draw(st.booleans())
    recompute = draw(st.sampled_from(["", " recompute\n", " recompute[s] = s % 2 == 0\n"]))
    rng = f"reversed({start}..{stop})" if reverse else f"{start}..{stop}"
    return (
        f"schedule r {{\n param d = {d}\n param m = {m}\n let big = {big}\n place {place}\n"
        f" backward split\n{recompute} order {{\n  for t in {rng} {{ {body} }}\n }}\n}}\n"
    )


@st.composite
def device_programs(draw):
    """Order bodies of several loops whose ranges and passes depend on the
    device `i`, their microbatches and chunks mostly in range (so that most
    elaborate, and `_DeviceLoops` lays them out)."""
    d = draw(st.integers(2, 5))
    m = draw(st.integers(1, 30))
    place, chunks = draw(st.sampled_from([("parallel", 1), ("vshape", 2), ("looped(3)", 3)]))

    def call():
        kind = draw(st.sampled_from(["F", "B", "W"]))
        micro = f"({draw(_expr(1))}) % m" if draw(st.integers(0, 9)) else draw(_expr(1))
        if chunks == 1 and draw(st.booleans()):
            return f"{kind}({micro})"
        return f"{kind}({micro}, ({draw(_expr(0))}) % {chunks})"

    loops = []
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.sampled_from(["0", "i", "d - i", "-2"]))
        end = draw(st.sampled_from(["i", "2*i + 1", "m - i", "d - i + 20", "m"]))
        body = []
        for _ in range(draw(st.integers(1, 3))):
            if draw(st.booleans()):
                body.append(f"if {draw(_cond(1))} {{ {call()} }} else {{ {call()} }}")
            else:
                body.append(call())
        loops.append(f"  for t in {start}..{end} {{ {'; '.join(body)} }}\n")
    return (
        f"schedule r {{\n param d = {d}\n param m = {m}\n let big = 5\n place {place}\n"
        f" backward split\n order {{\n{''.join(loops)} }}\n}}\n"
    )


def _elaborate(text: str, mode: str):
    """The orders or the errors, with every device at once ("devices"), one
    device at a time with vector loops ("vector"), or value by value ("values")."""
    saved = order_form._VECTOR_MIN, order_form._device_loops
    order_form._VECTOR_MIN = 10**9 if mode == "values" else 1
    if mode != "devices":
        order_form._device_loops = lambda *args: None
    try:
        return elaborate(parse(text, "r.pp"), {}).orders
    except CompileError as err:
        return [(d.message, d.span) for d in err.diagnostics]
    finally:
        order_form._VECTOR_MIN, order_form._device_loops = saved


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(programs())
def test_vector_loops_equal_value_by_value(text):
    """All devices at once == all values at once == one value at a time: orders,
    or the located error."""
    by_values = _elaborate(text, "values")
    assert _elaborate(text, "vector") == by_values
    assert _elaborate(text, "devices") == by_values


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(device_programs())
def test_device_loops_equal_value_by_value(text):
    """Several loops over every device at once == each device value by value."""
    assert _elaborate(text, "devices") == _elaborate(text, "values")


def _spy(owner, name, text, overrides):
    """What `owner.name` returned while `text` was elaborated."""
    returned = []
    original = getattr(owner, name)

    def spy(*args):
        got = original(*args)
        returned.append(got)
        return got

    setattr(owner, name, spy)
    try:
        elaborate(parse(text, "spied.pp"), overrides)
    finally:
        setattr(owner, name, original)
    return returned


def test_device_loops_are_taken():
    """ZB-V's order body runs for all devices at once (the test above compares
    something): every statement is a loop of pass calls and `if`s."""
    text = (Path(__file__).resolve().parents[2] / "examples" / "zb_v.pp").read_text()
    returned = _spy(order_form._DeviceLoops, "run", text, {"d": "4", "m": "64"})
    assert returned and all(got is not None for got in returned)


def test_vector_loop_is_taken():
    """A long loop after a `let` runs as a vector loop, one device at a time."""
    text = ("schedule s {\n param d = 2\n param m = 40\n backward fused\n order {\n"
            "  let k = 1\n  for j in 0..m { F(j) }\n  for j in 0..m { BW(m - k - j) }\n }\n}\n")
    returned = _spy(order_form._VectorLoop, "run", text, {})
    assert returned and all(returned)


def test_out_of_range_microbatch_names_its_loop():
    """A microbatch past m made by a loop names the loop and its variable's value."""
    import pytest

    from ppdsl.compiler import compile_source
    from ppdsl.diagnostics import CompileError

    text = (
        "schedule s {\n    param d = 2\n    param m = 4\n    backward fused\n    order {\n"
        "        for j in 0..m + 1 {\n            F(j)\n        }\n"
        "        for j in 0..m { BW(j) }\n    }\n}\n"
    )
    with pytest.raises(CompileError) as info:
        compile_source(text, "bound.pp")
    [error] = info.value.diagnostics
    assert error.span is not None and error.span.line == 7
    assert [(span.line if span else None, note) for span, note in error.notes] == [
        (6, "where j = 4, in this loop")
    ]
