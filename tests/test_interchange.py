"""torch.distributed.pipelining's action CSV, both ways: what we write torch's own
parser and validator accept; torch's own generated schedules read back, check
and simulate; bad cells are located errors; order-form .pp output."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
from hypothesis import given, settings

from ppdsl.analysis.checks import check_schedule, deadlock
from ppdsl.analysis.simulate import simulate
from ppdsl.diagnostics import CompileError
from ppdsl.interchange import (
    from_torch_csv,
    make_placement,
    placement_text,
    to_pp,
    to_torch_csv,
)
from ppdsl.lowering.early_receives import pull_receives_forward
from ppdsl.lowering.lower import lower
from tests.factories import (
    ZB_H1,
    breadth_first_orders,
    make_schedule,
    one_f_one_b_orders,
    parse_rows,
    placement,
    schedules,
)

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_load(text: str) -> dict[int, list]:
    """What torch's `_load_csv` does with the file: csv rows -> _Action.from_str."""
    reader = csv.reader(io.StringIO(text, newline=""))
    return {
        rank: [torch_schedules._Action.from_str(c) for c in row] for rank, row in enumerate(reader)
    }


def _torch_order(cls, d: int, m: int, v: int) -> dict[int, list]:
    """torch's own per-rank order for a schedule class (its _calculate_single_rank_operations),
    without building stages or process groups."""
    o = cls.__new__(cls)  # private torch API: skip, not fail, if a torch release changes it
    o.pp_group_size, o.n_local_stages, o._n_microbatches = d, v, m
    o._num_stages = o.num_stages = v * d
    o.number_of_rounds = max(1, m // d)
    o.microbatches_per_round = m // o.number_of_rounds
    style = (
        "v"
        if cls in (torch_schedules.ScheduleZBVZeroBubble, torch_schedules.ScheduleDualPipeV)
        else "loop"
    )
    o.stage_index_to_group_rank = torch_schedules.generate_stage_to_rank_mapping(
        d, v * d, style=style
    )
    try:
        return {r: o._calculate_single_rank_operations(r) for r in range(d)}
    except AttributeError as exc:
        pytest.skip(f"torch's {cls.__name__} internals changed: {exc}")


def _torch_dump(order: dict[int, list]) -> str:
    """What torch's `_dump_csv` writes."""
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in order:
        writer.writerow(order[rank])
    return out.getvalue()


def _keys(s):
    return [[p.key for p in o] for o in s.orders]


def test_torch_parser_and_validator_accept_our_csv():
    """Our 1F1B and V-shape CSVs parse with torch's _Action.from_str and pass its
    _validate_schedule, which infers the same stage -> rank map."""
    for s in (
        make_schedule(placement("parallel", 4), 8, one_f_one_b_orders(4, 8), split_backward=False),
        make_schedule(placement("vshape", 3), 4, breadth_first_orders(placement("vshape", 3), 4)),
    ):
        actions = _torch_load(to_torch_csv(s))
        mapping = torch_schedules._validate_schedule(
            actions, s.num_devices, s.num_stages, s.num_microbatches
        )
        assert tuple(mapping[k] for k in range(s.num_stages)) == s.placement.stage_device
        assert [[str(a) for a in row] for row in actions.values()] == [
            [f"{p.stage}{p.kind.torch_letter}{p.microbatch}" for p in o] for o in s.orders
        ]


def test_torch_runtime_load_csv_and_dump_csv_round_trip(tmp_path: Path):
    """torch's own _PipelineScheduleRuntime._load_csv reads our CSV (validating it and
    inferring the stage -> rank map), lowers it with its own transfers, and its
    _dump_csv output (compute_comms form) reads back as the same orders."""
    place = placement("vshape", 3)
    s = make_schedule(place, 4, breadth_first_orders(place, 4))
    runtime_cls = torch_schedules._PipelineScheduleRuntime
    runtime = runtime_cls.__new__(runtime_cls)  # no stages or process group needed to load
    runtime.pp_group_size, runtime._num_stages, runtime._n_microbatches = 3, 6, 4
    runtime._stages, runtime.pipeline_order, runtime._defer_pp_recv = [], {}, False
    ours = tmp_path / "ours.csv"
    ours.write_bytes(to_torch_csv(s).encode())
    try:
        runtime._load_csv(str(ours))
    except AttributeError as exc:
        pytest.skip(f"torch's _PipelineScheduleRuntime internals changed: {exc}")
    mapping = runtime.stage_index_to_group_rank
    assert tuple(mapping[k] for k in range(6)) == place.stage_device
    dumped = tmp_path / "torch.csv"
    runtime._dump_csv(str(dumped))  # compute_comms: with torch's SEND/RECV/UNSHARD actions
    text = dumped.read_text()
    assert "SEND_F" in text
    assert _keys(from_torch_csv(text, "torch.csv")) == _keys(s)


def test_csv_matches_torch_dump_byte_for_byte():
    """Our CSV equals what torch's _dump_csv writes for the same actions."""
    s = make_schedule(placement("parallel", 2), 2, one_f_one_b_orders(2, 2, split=True))
    assert to_torch_csv(s) == _torch_dump(_torch_load(to_torch_csv(s)))
    assert to_torch_csv(s).splitlines()[0] == "0F0,0F1,0I0,0W0,0I1,0W1"


@settings(max_examples=40, deadline=None)
@given(schedules())
def test_round_trip(s):
    """CSV -> Schedule -> CSV is the identity on orders (overlapped pairs included);
    the placement comes back."""
    text = to_torch_csv(s)
    back = from_torch_csv(
        text,
        "x.csv",
        placement=placement_text(s.placement),
        num_devices=s.num_devices,
        num_microbatches=s.num_microbatches,
    )
    assert _keys(back) == _keys(s)
    assert [[p.overlapped for p in o] for o in back.orders] == [
        [p.overlapped for p in o] for o in s.orders
    ]  # overlapped pairs travel as torch's OVERLAP_F_B cells
    assert back.placement.stage_device == s.placement.stage_device
    assert to_torch_csv(back) == text


@pytest.mark.parametrize(
    "name, v",
    [
        ("ScheduleInterleaved1F1B", 2),
        ("ScheduleInterleavedZeroBubble", 2),
        ("ScheduleZBVZeroBubble", 2),
        ("ScheduleDualPipeV", 2),
    ],
)
def test_torch_generated_schedules_read_and_check(name, v):
    """torch's own orders (d=4, m=8; idle steps and DualPipeV's OVERLAP_F_B cells
    included) read back, pass the schedule checks, and simulate."""
    cls = getattr(torch_schedules, name)
    text = _torch_dump(_torch_order(cls, 4, 8, v))
    s = from_torch_csv(text, f"{name}.csv")
    assert check_schedule(s) == []
    # torch's runtime waits for receives only; under that semantics any valid order runs
    assert deadlock.check(s, lower(s), sends_block=False) == []
    # and with receives pulled forward, also when every op of an exchange blocks
    assert deadlock.check(s, pull_receives_forward(lower(s))) == []
    t = simulate(s)
    assert t.makespan > 0
    if name == "ScheduleZBVZeroBubble":
        # ZB-V: zero bubble when T_F = T_B = T_W (the zero-bubble paper)
        assert s.placement.kind == "vshape" and t.bubble_ratio == 0.0
    if name == "ScheduleDualPipeV":
        # full backwards mixed with I/W: read as I then W; OVERLAP_F_B cells as pairs
        assert s.split_backward
        pairs = sum(p.overlapped for o in s.orders for p in o)
        assert pairs == text.count("OVERLAP_F_B") > 0


def test_bad_cells_are_located():
    """Every bad cell is an error at file:line:col, all reported together."""
    text = "0F0,0X1,0F1\n1F0, 1Q0 ,1F1\n"
    with pytest.raises(CompileError) as exc:
        from_torch_csv(text, "bad.csv")
    found = exc.value.diagnostics
    assert [(str(d.span), d.message.split(":")[0]) for d in found] == [
        ("bad.csv:1:5", "bad action '0X1'"),
        ("bad.csv:2:6", "bad action '1Q0'"),
    ]


def test_compute_comms_format_reads_the_compute_order():
    """torch's compute_comms CSV (its own lowering: UNSHARD, SEND_F, RECV_B, REDUCE_GRAD
    ...) reads as the same compute order as the compute-only one."""
    order = _torch_order(torch_schedules.ScheduleInterleaved1F1B, 4, 8, 2)
    comms = {r: torch_schedules._add_unshard_reshard(order[r]) for r in order}
    comms = {r: torch_schedules._add_reduce_grad(comms[r], 8) for r in comms}
    mapping = torch_schedules.generate_stage_to_rank_mapping(4, 8, style="loop")
    comms = torch_schedules._add_send_recv(comms, stage_to_rank=lambda s: mapping[s], num_stages=8)
    text = _torch_dump(comms)
    assert "SEND_F" in text and "UNSHARD" in text
    assert _keys(from_torch_csv(text, "c.csv")) == _keys(
        from_torch_csv(_torch_dump(order), "o.csv")
    )


def test_stage_on_two_ranks_and_placement_mismatch():
    """A stage on two ranks, or on a rank the named placement does not give it, is located."""
    with pytest.raises(CompileError) as exc:
        from_torch_csv("0F0,0B0\n0F1,0B1\n", "two.csv")
    [err] = exc.value.diagnostics
    assert (
        str(err.span) == "two.csv:2:1"
        and "stage 0 has actions on rank 1 and on rank 0" in err.message
    )
    with pytest.raises(CompileError) as exc:
        from_torch_csv("0F0,0B0\n1F0,1B0\n", "p.csv", placement="looped(2)", num_devices=1)
    assert "2 rows of actions but --devices 1" in exc.value.diagnostics[0].message
    with pytest.raises(CompileError) as exc:
        from_torch_csv("1F0,1B0\n0F0,0B0\n", "p.csv", placement="parallel")
    found = exc.value.diagnostics
    assert [str(d.span) for d in found] == ["p.csv:1:1", "p.csv:2:1"]
    assert found[0].message == (
        "stage 1 runs on rank 0 (2 actions, the first here), but placement parallel "
        "puts it on rank 1"
    )


def test_errors_from_checks_point_at_csv_cells():
    """A missing backward found by the passes check is reported; a duplicate points at its cell."""
    s = from_torch_csv("0F0,0B0,0B0\n", "dup.csv")
    [err] = check_schedule(s)
    assert str(err.span) == "dup.csv:1:9" and "runs again" in err.message


def test_placements_by_name():
    """Placement names map to the language's stage -> device maps and back."""
    assert make_placement("vshape", 3).stage_device == (0, 1, 2, 2, 1, 0)
    assert make_placement("looped(2)", 3).stage_device == (0, 1, 2, 0, 1, 2)
    assert make_placement("wave(3)", 2).stage_device == (0, 1, 1, 0, 0, 1)
    for text in ("parallel", "vshape", "looped(3)", "wave(3)"):
        assert placement_text(make_placement(text, 4)) == text
    with pytest.raises(ValueError):
        make_placement("zigzag", 4)


def test_to_pp_writes_order_form():
    """The order-form text names the placement, the backward form, and each device's passes."""
    s = make_schedule(placement("vshape", 2), 2, breadth_first_orders(placement("vshape", 2), 2))
    text = to_pp(s, source="v.csv")
    assert "    place vshape\n" in text and "    backward split\n" in text
    assert "        if i == 1 {\n            F(0); F(1); F(0, 1); F(1, 1); B(0, 1);" in text


def test_to_pp_elaborates_back():
    """What `ppdsl import` writes parses and elaborates to the same orders and
    placement (torch's ZB-V: two chunks per device, chunk syntax F(j, c))."""
    from ppdsl.frontend import elaborate, parse

    cls = torch_schedules.ScheduleZBVZeroBubble
    s = from_torch_csv(_torch_dump(_torch_order(cls, 4, 8, 2)), "zbv.csv")
    back = elaborate.elaborate(parse.parse(to_pp(s, source="zbv.csv"), "zbv.pp"), {})
    assert _keys(back) == _keys(s)
    assert back.placement.stage_device == s.placement.stage_device
    assert back.split_backward and back.num_microbatches == 8


def test_to_pp_compiles_back(tmp_path: Path):
    """A V-shape order written by to_pp compiles (all checks) to the same orders."""
    from ppdsl.compiler import compile_file

    place = placement("vshape", 3)
    s = make_schedule(place, 4, breadth_first_orders(place, 4))
    path = tmp_path / "v.pp"
    path.write_text(to_pp(s))
    assert _keys(compile_file(path).schedule) == _keys(s)


def _cli():
    from ppdsl.cli import main

    return main


def test_cli_import_check_export_round_trip(tmp_path: Path, capsys):
    """ZB-H1 as torch CSV -> `ppdsl import` -> .pp that `ppdsl check` accepts ->
    `ppdsl export` gives back the same CSV, byte for byte. The .pp states the
    order's own peak (ZB-H1's 4 M_B) as its bound, so neither step warns."""
    main = _cli()
    original = to_torch_csv(make_schedule(placement("parallel", 4), 8, parse_rows(ZB_H1)))
    csv_in = tmp_path / "zb_h1.csv"
    csv_in.write_bytes(original.encode())
    pp = tmp_path / "zb_h1.pp"
    assert main(["import", str(csv_in), "-o", str(pp)]) == 0
    assert "    expect peak_memory <= 4 * M_B\n" in pp.read_text()
    assert main(["check", str(pp)]) == 0
    assert "warning" not in capsys.readouterr().err
    out = tmp_path / "out.csv"
    assert main(["export", str(pp), "-o", str(out)]) == 0
    assert out.read_bytes().decode() == original
    capsys.readouterr()


def test_cli_import_bad_cell_is_located(tmp_path: Path, capsys):
    """A bad cell: exit 1 and `file:line:col: error:` on stderr, no traceback."""
    main = _cli()
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0B0\n1F0,1Q0\n")
    assert main(["import", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:2:5: error: bad action '1Q0'" in err
    assert "Traceback" not in err
