"""`cost comm` as latency + bytes / bandwidth (issue 37, docs/language.md
"Transfers"): the line in `bytes` elaborated to its latency and time per
byte, `memory bytes[s]` the tensor each stage sends on, and a plain number
meaning what it always did."""

from __future__ import annotations

import pytest

from ppdsl.compiler import compile_source
from ppdsl.diagnostics import CompileError
from ppdsl.ir.schedule import format_schedule
from tests.oracles.simulate import simulate_reference

GPIPE = "backward fused\n    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }"


def _compile(body: str):
    text = ("schedule t {\n    param d = 4\n    param m = 4\n    " + body + "\n    " + GPIPE
            + "\n}\n")
    return compile_source(text, "t.pp")


def test_comm_in_bytes_is_latency_plus_bytes_over_bandwidth() -> None:
    """`cost comm = 0.5 + bytes / 1000` with 1000, 4000, 1000 bytes on the
    edges costs 1.5, 4.5 and 1.5 per transfer."""
    costs = _compile("cost comm = 0.5 + bytes / 1000\n"
                     "    memory bytes[s] = s == 1 ? 4000 : 1000").schedule.costs
    assert (costs.comm, costs.comm_per_byte) == (0.5, 0.001)
    assert costs.edge_costs(4).tolist() == [1.5, 4.5, 1.5]
    assert costs.transfer_cost(2, 1) == 4.5  # the gradient coming back is as large


def test_simulator_times_each_edge_and_matches_the_reference() -> None:
    """GPipe at d = 4, m = 4 (F = 1, BW = 2) pays each edge once forward and
    once backward: 21 + 2 * (1.5 + 4.5 + 1.5) = 36; the reference simulator agrees."""
    compiled = _compile("cost BW = 2\n    cost comm = 0.5 + bytes / 1000\n"
                        "    memory bytes[s] = s == 1 ? 4000 : 1000")
    assert compiled.timeline.makespan == 36
    reference = simulate_reference(compiled.schedule)
    assert reference.makespan == compiled.timeline.makespan


def test_plain_number_keeps_its_meaning() -> None:
    """`cost comm = 2` costs 2 on every edge, with or without stated bytes,
    and prints as it always did (golden files unchanged)."""
    plain = _compile("cost comm = 2").schedule
    sized = _compile("cost comm = 2\n    memory bytes[s] = 1000").schedule
    assert plain.costs.edge_costs(4).tolist() == [2.0] * 3
    assert sized.costs.edge_costs(4).tolist() == [2.0] * 3
    assert " comm=2" in format_schedule(plain)
    assert "bytes" not in format_schedule(plain)
    assert _compile("cost comm = 2").timeline.makespan == _compile(
        "cost comm = 2\n    memory bytes[s] = 1000").timeline.makespan


def test_printed_ir_shows_the_line_and_the_bytes() -> None:
    """The IR text carries the time per byte and the stated bytes."""
    text = format_schedule(_compile("cost comm = 1 + bytes / 4\n"
                                    "    memory bytes[s] = 8").schedule)
    assert "comm=1+0.25*bytes bytes=8" in text


@pytest.mark.parametrize("body, message", [
    ("cost comm = 1 - bytes / 4", "latency and time per byte must be >= 0"),
    ("cost comm = bytes * bytes", "a line in 'bytes'"),
    ("memory byte[s] = 8", "did you mean 'bytes'"),
    ("memory bytes[s] = 0 - 1", "a size in bytes must be a number >= 0"),
    ("cost F = bytes", "bytes"),
])
def test_bad_transfer_costs_are_located_errors(body: str, message: str) -> None:
    """A cost that is no line in bytes, a negative part, a misspelt size and
    `bytes` outside `cost comm` are errors at the statement's line."""
    with pytest.raises(CompileError) as err:
        _compile(body)
    diagnostic = err.value.diagnostics[0]
    assert message in diagnostic.message
    assert diagnostic.span is not None and diagnostic.span.line == 4
