"""`--topology` (ppdsl/topology.py, docs/language.md "Transfers"): the file
read with its units, bad lines as located errors, each edge timed over the link
between its ranks' GPUs, and data-parallel reductions as rings over their
replicas' links."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppdsl.cli import main
from ppdsl.compiler import compile_source
from ppdsl.diagnostics import CompileError
from ppdsl.ir.schedule import Costs, Placement
from ppdsl.topology import Link, Topology, load_topology, parse_topology, ring_allreduce

FILE = """# 2 nodes of 2 GPUs
nodes = 2
gpus_per_node = 2
time_unit = ms
intra_latency = 0.5
intra_bandwidth = 1000
inter_latency = 2
inter_bandwidth = 100
"""

GPIPE = """schedule t {
    param d = 4
    param m = 4
    backward fused
    cost BW = 2
    cost comm = 0.5 + bytes / 1000
    memory bytes[s] = s == 1 ? 4000 : 1000
    order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }
}
"""


def test_units_convert_to_the_costs_time_unit() -> None:
    """3us is 0.003 ms and 150GB/s is 1.5e8 bytes per ms; in seconds, 3e-6 and 1.5e11."""
    text = ("nodes = 1\ngpus_per_node = 8\nintra_latency = 3us\n"
            "intra_bandwidth = 150GB/s\n")
    in_ms = parse_topology(text, "t.topo")
    assert in_ms.intra.latency == pytest.approx(0.003)
    assert in_ms.intra.bandwidth == pytest.approx(1.5e8)
    in_s = parse_topology(text + "time_unit = s\n", "t.topo")
    assert in_s.intra.latency == pytest.approx(3e-6)
    assert in_s.intra.bandwidth == pytest.approx(1.5e11)


@pytest.mark.parametrize("text, line, column, message", [
    ("nodes = 2\ngpu_per_node = 2\n", 2, 1, "did you mean 'gpus_per_node'"),
    ("nodes = 2\nnodes = 3\n", 2, 1, "given twice (first at 1:9)"),
    ("nodes = 1\ngpus_per_node = 2\nintra_latency = 3 parsecs\nintra_bandwidth = 1\n", 3, 17,
     "'intra_latency' is a number"),
    ("nodes = 1\ngpus_per_node = 2\nintra_latency = 3\nintra_bandwidth = 0\n", 4, 19,
     "more than 0"),
    ("nodes = 2\ngpus_per_node = 2\nintra_latency = 3\nintra_bandwidth = 1\n", 1, 9,
     "state 'inter_latency'"),
    ("nodes = 0\n", 1, 9, "whole number from 1"),
    ("nodes 2\n", 1, 1, "expected `key = value`"),
])
def test_bad_lines_are_located(text: str, line: int, column: int, message: str) -> None:
    """Each bad line is an error at its line and column, saying what to write."""
    with pytest.raises(CompileError) as err:
        parse_topology(text, "t.topo")
    diagnostic = err.value.diagnostics[0]
    assert message in diagnostic.message
    assert diagnostic.span is not None
    assert (diagnostic.span.file, diagnostic.span.line, diagnostic.span.column) == (
        "t.topo", line, column)


def test_command_line_pairs_locate_the_column() -> None:
    """`--topology nodes=1,...` reads the same pairs; an error points at its column."""
    topology = load_topology("nodes=1,gpus_per_node=2,intra_latency=1,intra_bandwidth=2")
    assert topology.intra == Link(1.0, 2.0)
    with pytest.raises(CompileError) as err:
        load_topology("nodes=1,gpus_per_node=x")
    span = err.value.diagnostics[0].span
    assert span is not None and (span.file, span.column) == ("--topology", 23)


def test_edges_cross_the_node_boundary_on_its_link() -> None:
    """d = 4 on 2 nodes of 2: the edge between ranks 1 and 2 is InfiniBand
    (2 + 4000 / 100 = 42), the others NVLink (0.5 + 1000 / 1000 = 1.5)."""
    topology = parse_topology(FILE, "t.topo")
    costs = Costs.unit(4).with_bytes(0.0, [1000, 4000, 1000, 1000])
    timed = topology.apply(costs, Placement.named("parallel", 4))
    assert timed.edge_costs(4).tolist() == [1.5, 42.0, 1.5]
    # a looped placement's edges all join two ranks: 0-1 and 2-3 within a node, 1-2 across
    looped = topology.apply(Costs.unit(8).with_bytes(0.0, [1000] * 8),
                            Placement.named("looped", 4, 2))
    assert looped.edge_costs(8).tolist() == [1.5, 12.0, 1.5, 12.0, 1.5, 12.0, 1.5]


def test_simulator_uses_the_links() -> None:
    """GPipe at d = 4 over the file's links: 21 + 2 * (1.5 + 42 + 1.5) = 111,
    where the file's own `cost comm` gives 36."""
    topology = parse_topology(FILE, "t.topo")
    assert compile_source(GPIPE, "t.pp").timeline.makespan == 36
    assert compile_source(GPIPE, "t.pp", topology=topology).timeline.makespan == 111


def test_reductions_ring_over_the_replicas_links() -> None:
    """dp = 2 at d = 2 on 2 nodes of 2: each stage's replicas sit on two nodes, so
    its all-reduce runs 2 steps over InfiniBand: 2 * (2 + (800 / 2) / 100) = 12."""
    topology = parse_topology(FILE, "t.topo")
    costs = Costs.unit(2).with_bytes(0.0, (), [800, 800])
    timed = topology.apply(costs, Placement.named("parallel", 2), dp=2)
    assert timed.collective("reduce", 0) == timed.collective("reduce", 1) == 12.0
    assert ring_allreduce([Link(1, 10)] * 4, 40) == 6 * (1 + 1)
    assert ring_allreduce([Link(1, 10)], 40) == 0.0
    one_node = Topology(1, 4, Link(0.5, 1000), Link(0.5, 1000))
    assert one_node.apply(costs, Placement.named("parallel", 2), dp=2).collective(
        "reduce", 0) == 2 * (0.5 + 0.4)


def test_cli_bad_topology_is_invalid_input(capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    """`stats --topology` with a bad line exits 1 with the located error, no
    traceback; too few GPUs for d x dp is an error at the schedule."""
    schedule = tmp_path / "t.pp"
    schedule.write_text(GPIPE)
    bad = tmp_path / "bad.topo"
    bad.write_text("nodes = 2\ngpus_per_node = two\n")
    code = main(["stats", str(schedule), "--topology", str(bad)])
    _, err = capsys.readouterr()
    assert code == 1 and f"{bad}:2:17: error:" in err and "Traceback" not in err
    good = tmp_path / "good.topo"
    good.write_text(FILE)
    code = main(["stats", str(schedule), "--topology", str(good), "--dp", "2"])
    _, err = capsys.readouterr()
    assert code == 1 and "4 pipeline ranks x 2 replicas need 8" in err
    assert main(["stats", str(schedule), "--topology", str(good)]) == 0
    assert "makespan          111" in capsys.readouterr().out
