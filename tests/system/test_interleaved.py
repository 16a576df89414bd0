"""Grouped blocks. examples/interleaved_1f1b.pp is a grouped block whose elaborated per-device
order is Megatron-LM's interleaved 1F1B, pass for pass, against a generator
written here from Megatron's published rule (megatron/core/pipeline_parallel/
schedules.py, `forward_backward_pipelining_with_interleaving`):

- microbatches go through the chunks in groups of g
  (`microbatch_group_size_per_vp_stage`, default p): the k-th forward of a rank
  is entry k of a table that lists, group by group, every chunk in turn and in
  it the group's microbatches in order;
- the k-th backward is entry k of the same table with the chunk reversed;
- rank r runs (p - r - 1) * 2 + (v - 1) * g forwards first (all of them when
  that reaches m v), then one forward and one backward in turn, then the rest
  of the backwards.

Megatron asks p <= g <= m and a last group of 0 or at least p microbatches; a
grouped block needs g to divide m, which the grid keeps. torch's
ScheduleInterleaved1F1B (its own orders) is a second reference."""

from __future__ import annotations

import pytest

from ppdsl.analysis.memory import peak_memory
from ppdsl.compiler import compile_file, compile_source
from ppdsl.diagnostics import CompileError
from tests.paths import EXAMPLES

Order = list[tuple[str, int, int]]


def megatron_orders(p: int, v: int, m: int, g: int) -> list[Order]:
    """Per rank, Megatron's interleaved 1F1B as (pass, microbatch, stage) with a
    fused backward; stage = chunk * p + rank (looped placement)."""
    table = []  # (microbatch, chunk) for the k-th forward of every rank
    for first in range(0, m, g):
        group = range(first, min(first + g, m))
        table += [(j, chunk) for chunk in range(v) for j in group]
    total = m * v
    orders = []
    for rank in range(p):
        forwards = [("F", j, chunk * p + rank) for j, chunk in table]
        backwards = [("BW", j, (v - 1 - chunk) * p + rank) for j, chunk in table]
        warm_up = min((p - rank - 1) * 2 + (v - 1) * g, total)
        order = forwards[:warm_up]
        for k in range(total - warm_up):
            order += [forwards[warm_up + k], backwards[k]]
        orders.append(order + backwards[total - warm_up :])
    return orders


def _ours(d: int, v: int, m: int, g: int) -> list[Order]:
    overrides = {"d": str(d), "v": str(v), "m": str(m), "g": str(g)}
    schedule = compile_file(EXAMPLES / "interleaved_1f1b.pp", overrides).schedule
    return [[(p.kind.value, p.microbatch, p.stage) for p in order] for order in schedule.orders]


# (p, v, m, g): Megatron's default g = p, larger groups, m not a multiple of p
# (10 and 8 over 4 and 3 ranks), every forward in the warm-up (m = g = p, v = 4)
GRID = [
    (2, 2, 4, 2),
    (4, 2, 8, 4),
    (4, 3, 12, 4),
    (4, 2, 16, 8),
    (4, 2, 10, 5),
    (3, 2, 8, 4),
    (2, 3, 9, 3),
    (5, 2, 10, 5),
    (4, 4, 4, 4),
    (8, 2, 16, 8),
]


@pytest.mark.parametrize(("p", "v", "m", "g"), GRID)
def test_interleaved_1f1b_is_megatrons_order(p, v, m, g):
    """The block's order equals the Megatron generator's on every rank."""
    assert _ours(p, v, m, g) == megatron_orders(p, v, m, g)


@pytest.mark.parametrize("comm", ["1/2", "3"])
def test_still_megatrons_order_under_transfer_costs(comm):
    """With a transfer cost the warm-up/cool-down step finds nothing better to
    do: the order stays Megatron's (the file's expectations, written for no
    transfer cost, are dropped here)."""
    source = (EXAMPLES / "interleaved_1f1b.pp").read_text()
    source = "\n".join(line for line in source.splitlines() if "expect " not in line)
    source = source.replace("    backward fused\n", f"    backward fused\n    cost comm = {comm}\n")
    for p, v, m, g in [(2, 2, 4, 2), (4, 3, 8, 4), (8, 2, 16, 8)]:
        defines = {"d": str(p), "v": str(v), "m": str(m), "g": str(g)}
        schedule = compile_source(source, "interleaved_1f1b.pp", defines).schedule
        ours = [[(x.kind.value, x.microbatch, x.stage) for x in order] for order in schedule.orders]
        assert ours == megatron_orders(p, v, m, g), (comm, p, v, m, g)


def test_the_generator_is_not_trivially_equal():
    """The reference distinguishes group sizes (a check that can fail): g = 2p
    and g = p give different orders at m = 4p, and both differ from GPipe's."""
    assert megatron_orders(2, 2, 8, 4) != megatron_orders(2, 2, 8, 2)
    assert _ours(2, 2, 8, 4) != megatron_orders(2, 2, 8, 2)


def torch_orders(cls_name: str, p: int, v: int, m: int) -> tuple[list[Order], int]:
    """torch.distributed.pipelining's interleaved schedule `cls_name` per rank
    (computed without a process group), a full backward as BW, and the
    microbatches per round it chose (its group size)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    kind = schedules._ComputationType
    obj = object.__new__(getattr(schedules, cls_name))
    obj.pp_group_size, obj._n_microbatches, obj.n_local_stages = p, m, v
    obj.number_of_rounds = max(1, m // p)  # as its __init__ computes them
    obj.microbatches_per_round = m // obj.number_of_rounds
    letters = {
        kind.FORWARD: "F",
        kind.FULL_BACKWARD: "BW",
        kind.BACKWARD_INPUT: "B",
        kind.BACKWARD_WEIGHT: "W",
    }
    orders = [
        [
            (letters[a.computation_type], a.microbatch_index, a.stage_index)
            for a in obj._calculate_single_rank_operations(rank)
            if a is not None
        ]
        for rank in range(p)
    ]
    return orders, obj.microbatches_per_round


# (p, v, m): m a multiple of p, and m = 6 over 4 ranks (one round of 6), m = 10
# over 4 (two rounds of 5), m = 8 over 3 (two rounds of 4)
@pytest.mark.parametrize(
    ("p", "v", "m"),
    [(1, 2, 3), (2, 2, 4), (2, 3, 6), (3, 2, 9), (4, 2, 8), (4, 3, 12), (8, 2, 16),
     (4, 2, 6), (4, 2, 10), (3, 3, 8)],
)
@pytest.mark.parametrize(
    ("name", "cls_name"),
    [
        ("interleaved_zb", "ScheduleInterleavedZeroBubble"),
        ("interleaved_1f1b", "ScheduleInterleaved1F1B"),
    ],
)
def test_orders_equal_torchs(name, cls_name, p, v, m):
    """interleaved_zb.pp and interleaved_1f1b.pp, with g = torch's microbatches per
    round, give torch's ScheduleInterleavedZeroBubble / ScheduleInterleaved1F1B
    orders on every rank, pass for pass (for interleaved 1F1B a second reference
    beside the generator above)."""
    expected, group = torch_orders(cls_name, p, v, m)
    overrides = {"d": str(p), "v": str(v), "m": str(m), "g": str(group)}
    schedule = compile_file(EXAMPLES / f"{name}.pp", overrides).schedule
    ours = [[(x.kind.value, x.microbatch, x.stage) for x in order] for order in schedule.orders]
    assert ours == expected


@pytest.mark.parametrize(("p", "v", "m", "g"), [(4, 2, 8, 4), (3, 3, 8, 4), (2, 2, 9, 3)])
def test_interleaved_zb_against_interleaved_1f1b(p, v, m, g):
    """interleaved_zb.pp keeps Megatron's forward order; against interleaved 1F1B
    at the same (p, v, m, g) and unit costs its makespan is 2(p-1) shorter (ZB-H1's
    bubble saves 2 T_W per hop) and device 0 holds p - 1 fewer chunk activations."""
    overrides = {"d": str(p), "v": str(v), "m": str(m), "g": str(g)}
    zb = compile_file(EXAMPLES / "interleaved_zb.pp", overrides)
    one = compile_file(EXAMPLES / "interleaved_1f1b.pp", overrides)
    forwards = [
        [(x.kind.value, x.microbatch, x.stage) for x in order if x.kind.value == "F"]
        for order in zb.schedule.orders
    ]
    assert forwards == [[x for x in o if x[0] == "F"] for o in megatron_orders(p, v, m, g)]
    assert zb.timeline.makespan == one.timeline.makespan - 2 * (p - 1)
    assert peak_memory(zb.schedule)[0] == peak_memory(one.schedule)[0] - (p - 1)


def test_a_group_size_that_does_not_divide_m_is_located():
    """m = 10 in groups of 4: the example's `require` says so first; without it,
    the block itself gives an error at the group size, saying what to do."""
    path = EXAMPLES / "interleaved_1f1b.pp"
    with pytest.raises(CompileError) as err:
        compile_file(path, {"m": "10"})
    [diag] = err.value.diagnostics
    assert diag.message.startswith("Megatron's interleaved order needs g >= d and m a multiple of g")
    assert diag.span is not None and diag.span.line == 18
    text = path.read_text().splitlines(keepends=True)
    assert text[17].lstrip().startswith("require ")
    without_require = "".join(text[:17] + ["\n"] + text[18:])
    with pytest.raises(CompileError) as err:
        compile_source(without_require, "interleaved.pp", {"m": "10"})
    [diag] = err.value.diagnostics
    assert diag.message.startswith("the group size 4 does not divide m = 10")
    assert diag.span is not None and diag.span.line == 21 and text[20][diag.span.column - 1] == "g"


@pytest.mark.parametrize(
    ("header", "at", "message"),
    [
        ("group 0 every 3", "0 every", "the group size must be > 0, got 0"),
        ("group 3/2 every 3", "3/2", "the group size must be an integer, got 3/2"),
        ("group 2 every 0", "0 {", "the spacing of a group's microbatches must be > 0, got 0"),
        ("group 2 every -1/2", "-1/2", "the spacing of a group's microbatches must be > 0, got -1/2"),
    ],
)
def test_group_misuse_is_a_located_error(header, at, message):
    """Each mistake in `group G every U` is one error at the offending expression."""
    line = f"    block period 12 {header} {{"
    source = (
        "schedule s {\n    param d = 2\n    param m = 4\n"
        f"{line}\n        F at i\n        BW at 6 + 2 * (1 - i)\n    }}\n}}\n"
    )
    with pytest.raises(CompileError) as err:
        compile_source(source, "s.pp")
    [diag] = err.value.diagnostics
    assert diag.message == message
    assert (diag.span.line, diag.span.column) == (4, line.index(at) + 1)
