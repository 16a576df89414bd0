"""`PassOrder`, the one form of an elaborated order: it reads back the passes it
was made from (spans the same objects, overlapped pairs kept), equals their
tuple, and every schedule holds its orders as `PassOrder`s however they were
made (docs/architecture.md, "At scale")."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
from hypothesis import given, settings

from ppdsl.ir.schedule import Pass, PassKind, PassOrder, format_schedule
from ppdsl.testing import schedules


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_columns_read_back_the_passes(s) -> None:
    """Every order: same passes in order, spans identical objects, equal and
    hashing like the tuple, slices and negative indices, pickled and joined."""
    for order in s.orders:
        columns = PassOrder.of(order)
        assert tuple(columns) == tuple(order) and columns == tuple(order) and tuple(order) == columns
        assert all(a.span is b.span for a, b in zip(columns, order, strict=True))
        assert hash(columns) == hash(tuple(order)) and len(columns) == len(order)
        if order:
            assert columns[-1] == order[-1] and columns[1:] == tuple(order)[1:]
        assert pickle.loads(pickle.dumps(columns)) == columns
    joined = PassOrder.join(s.orders)
    assert tuple(joined) == tuple(p for order in s.orders for p in order)


@settings(max_examples=30, deadline=None)
@given(schedules())
def test_a_schedule_holds_columns_however_its_orders_are_given(s) -> None:
    """Orders given as Pass tuples (the factories'), or replaced by lists of
    Passes, are held as `PassOrder`s equal to what was given; columns given are
    kept as the same objects."""
    assert all(type(o) is PassOrder for o in s.orders)
    given_passes = [list(o) for o in s.orders]
    again = replace(s, orders=tuple(given_passes))
    assert all(type(o) is PassOrder for o in again.orders)
    assert again.orders == tuple(map(tuple, given_passes)) and again == s
    kept = replace(s, orders=s.orders)
    assert all(a is b for a, b in zip(kept.orders, s.orders, strict=True))


def test_an_order_holds_ints_only() -> None:
    """A pass whose microbatch or stage is not an int is refused where its order
    is made (codegen writes them into programs as code)."""
    from fractions import Fraction

    with pytest.raises(TypeError, match=r"ints, got Fraction Fraction\(1, 2\)"):
        PassOrder.of([Pass(PassKind.F, 0, 0), Pass(PassKind.F, Fraction(1, 2), 0)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ints, got bool"):
        PassOrder.of([Pass(PassKind.F, 0, True)])


def test_vector_loops_lay_columns() -> None:
    """ZB-V's loops run as vector loops (columns laid at once), equal to the
    value-by-value elaboration's orders (tests/frontend/test_order_form.py)."""
    from pathlib import Path

    from ppdsl.frontend import order_form
    from ppdsl.frontend.elaborate import elaborate
    from ppdsl.frontend.parse import parse

    text = (Path(__file__).resolve().parents[2] / "examples" / "zb_v.pp").read_text()
    fast = elaborate(parse(text, "zb_v.pp"), {"d": "4", "m": "64"})
    saved = order_form._VECTOR_MIN
    order_form._VECTOR_MIN = 10**9
    try:
        slow = elaborate(parse(text, "zb_v.pp"), {"d": "4", "m": "64"})
    finally:
        order_form._VECTOR_MIN = saved
    assert fast.orders == slow.orders and format_schedule(fast) == format_schedule(slow)


def test_every_command_prints_the_same_for_columns_and_tuples(capsys, tmp_path, monkeypatch) -> None:
    """ZB-V at m=64 (its loops vectorized: `PassOrder`s) through check --json
    --ir --programs, show, stats (and --json, --dp), export and compile gives
    the same output as with every loop run value by value (tuples of Passes)."""
    from pathlib import Path

    from ppdsl.cli import main
    from ppdsl.frontend import order_form

    pp = str(Path(__file__).resolve().parents[2] / "examples" / "zb_v.pp")
    size = ["-D", "d=4", "-D", "m=64"]
    commands = [["check", "--json", "--ir", "--programs"], ["show"], ["stats"], ["stats", "--json"],
                ["stats", "--dp", "2", "--params", "1e6"], ["export", "-o", "OUT/z.csv"],
                ["compile", "-o", "OUT/gen"]]

    def outputs(name: str) -> list[str]:
        out = tmp_path / name
        out.mkdir()
        texts = []
        for command in commands:
            argv = [a.replace("OUT", str(out)) for a in command]
            assert main([argv[0], pp, *size, *argv[1:]]) == 0
            texts.append(capsys.readouterr().out.replace(str(out), "OUT"))
        texts += [p.read_text() for p in sorted(out.rglob("*")) if p.is_file()]
        return texts

    columns = outputs("columns")
    monkeypatch.setattr(order_form, "_VECTOR_MIN", 10**9)
    assert outputs("tuples") == columns
