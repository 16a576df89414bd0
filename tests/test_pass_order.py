"""`PassOrder`, an order held as columns: it reads back the passes it was made
from (spans the same objects, overlapped pairs kept), equals their tuple, and a
schedule holding it flattens, prints and lowers exactly as one holding tuples."""

from __future__ import annotations

import pickle
from dataclasses import replace

from factories import schedules
from hypothesis import given, settings

from ppdsl.backend.codegen import generate
from ppdsl.ir.flat import flatten
from ppdsl.ir.schedule import PassOrder, format_schedule
from ppdsl.lowering.lower import lower_arrays


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


@settings(max_examples=60, deadline=None)
@given(schedules())
def test_a_schedule_of_columns_compiles_as_one_of_tuples(s) -> None:
    """The flat arrays, the canonical text, the rank programs and the generated
    files are the same whether the orders are tuples or `PassOrder`s."""
    columns = replace(s, orders=tuple(PassOrder.of(o) for o in s.orders))
    a, b = flatten(s), flatten(columns)
    for name in ("offsets", "kind", "microbatch", "stage", "device"):
        assert (getattr(a, name) == getattr(b, name)).all(), name
    assert (a.joined is None) == (b.joined is None)
    assert a.joined is None or (a.joined == b.joined).all()
    assert format_schedule(columns) == format_schedule(s)
    assert lower_arrays(columns).programs() == lower_arrays(s).programs()
    assert generate(columns, lower_arrays(columns)).files == generate(s, lower_arrays(s)).files


def test_vector_loops_lay_columns() -> None:
    """ZB-V's loops run as vector loops: its elaborated orders are `PassOrder`s,
    equal to the value-by-value elaboration's tuples (tests/test_order_vector)."""
    from pathlib import Path

    from ppdsl.frontend import order_form
    from ppdsl.frontend.elaborate import elaborate
    from ppdsl.frontend.parse import parse

    text = (Path(__file__).parent.parent / "examples" / "zb_v.pp").read_text()
    fast = elaborate(parse(text, "zb_v.pp"), {"d": "4", "m": "64"})
    saved = order_form._VECTOR_MIN
    order_form._VECTOR_MIN = 10**9
    try:
        slow = elaborate(parse(text, "zb_v.pp"), {"d": "4", "m": "64"})
    finally:
        order_form._VECTOR_MIN = saved
    assert all(isinstance(o, PassOrder) for o in fast.orders)
    assert all(isinstance(o, tuple) for o in slow.orders)
    assert fast.orders == slow.orders and format_schedule(fast) == format_schedule(slow)


def test_every_command_prints_the_same_for_columns_and_tuples(capsys, tmp_path, monkeypatch) -> None:
    """ZB-V at m=64 (its loops vectorized: `PassOrder`s) through check --json
    --ir --programs, show, stats (and --json, --dp), export and compile gives
    the same output as with every loop run value by value (tuples of Passes)."""
    from pathlib import Path

    from ppdsl.cli import main
    from ppdsl.frontend import order_form

    pp = str(Path(__file__).parent.parent / "examples" / "zb_v.pp")
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
