"""Data-parallel collectives on the compiler side: `cost reduce` / `cost gather`
per stage, the communication lane beside compute (exposed vs hidden), the
model-state bytes per device, the proof that each reduction follows its stage's
last weight-gradient pass, and `show` / `stats` drawing and reporting them."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppdsl.analysis.checks import reductions
from ppdsl.analysis.collectives import comm_lanes, state_bytes
from ppdsl.analysis.simulate import SimulationError, simulate
from ppdsl.cli import main
from ppdsl.compiler import compile_file, compile_source
from ppdsl.ir.schedule import format_schedule
from tests.factories import ZB_H1, B, W, corrupt, make_schedule, parse_rows, placement, schedules

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _with(name: str, d: int, m: int, statements: str):
    text = (EXAMPLES / f"{name}.pp").read_text()
    head, brace, rest = text.partition("{")
    # the costs go after the placement (and before the order or block)
    where = rest.index("backward") if "backward" in rest else rest.index("block")
    body = rest[:where] + statements + "\n    " + rest[where:]
    return compile_source(head + brace + body, f"{name}.pp", {"d": str(d), "m": str(m)})


def _with_costs(name: str, d: int, m: int, reduce: float, gather: float = 0.0):
    return _with(name, d, m, f"cost reduce = {reduce}\n    cost gather = {gather}")


def test_costs_declared_per_stage_reach_the_ir() -> None:
    """`cost reduce[s] = ...` is per stage like pass costs; the canonical IR prints
    the collectives only when declared (unchanged golden files otherwise)."""
    compiled = _with("zb_h1", 2, 4, "cost reduce[s] = s + 1")
    costs = compiled.schedule.costs
    assert costs.collective("reduce", 0) == 1 and costs.collective("reduce", 1) == 2
    assert costs.collective("gather", 1) == 0
    assert " reduce=[1 2]" in format_schedule(compiled.schedule)
    plain = compile_file(EXAMPLES / "zb_h1.pp")
    assert "reduce" not in format_schedule(plain.schedule)


def test_unknown_cost_names_the_collectives(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A misspelt collective is a located error suggesting the right name."""
    bad = tmp_path / "bad.pp"
    bad.write_text("schedule t {\n param d = 2\n param m = 2\n place parallel\n cost reduse = 1\n"
                   " order {\n  for j in 0..m { F(j, i) }\n }\n}\n")
    assert main(["check", str(bad)]) == 1
    assert "did you mean 'reduce'" in capsys.readouterr().err


def test_one_f_one_b_reduction_is_exposed() -> None:
    """1F1B (one stage per device): the reduction starts after the device's last
    pass, so all of it is exposed; the step ends `reduce` later on that device."""
    compiled = _with_costs("1f1b", 2, 4, reduce=3)
    lanes = comm_lanes(compiled.schedule, compiled.timeline, "replicate")
    for dev in range(2):
        (c,) = lanes.lanes[dev]
        assert c.kind == "reduce" and c.start == compiled.timeline.span_end[dev]
        assert lanes.exposed[dev] == 3
    assert lanes.makespan == compiled.timeline.makespan + 3


def test_breadth_first_hides_the_later_chunk_reduction() -> None:
    """Looped BFS (d=4, m=8): the later chunk's reduction is issued when its last
    backward ends, with the earlier chunk's m backwards (16 units) still to run,
    so a reduction of 12 hides; interleaved 1F1B issues it only d backwards (8
    units) before the end, so part of it and all of the next are exposed (the
    breadth-first paper's point)."""
    bfs = _with_costs("looped_bfs", 4, 8, reduce=12)
    interleaved = _with_costs("interleaved_1f1b", 4, 8, reduce=12)
    exposed_bfs = comm_lanes(bfs.schedule, bfs.timeline).exposed
    exposed_il = comm_lanes(interleaved.schedule, interleaved.timeline).exposed
    assert max(exposed_bfs) == 12  # only the last chunk's reduction
    assert max(exposed_il) == 12 + 4


def test_shard_gathers_once_per_stage_one_ahead() -> None:
    """shard: one gather per stage, the first exposed (nothing to hide behind),
    the next issued at the previous stage's first F and hidden behind its
    forwards; one reduce per stage after its last backward."""
    compiled = _with_costs("looped_bfs", 2, 4, reduce=1, gather=2)
    lanes = comm_lanes(compiled.schedule, compiled.timeline, "shard")
    lane = lanes.lanes[0]
    assert [(c.kind, c.stage) for c in lane] == [("gather", 0), ("gather", 2), ("reduce", 2),
                                                 ("reduce", 0)]
    assert lane[0].exposed == 2 and lane[1].exposed == 0
    assert lanes.exposed[0] == 2 + 1  # the first gather and the last reduction


def test_state_bytes_replicate_vs_shard() -> None:
    """Per device: shard holds 1/dp of the parameters, gradients and optimizer
    state that replicate does, plus whole stages while gathered."""
    compiled = _with_costs("interleaved_1f1b", 2, 4, reduce=1, gather=1)
    s, t = compiled.schedule, compiled.timeline
    rep = state_bytes(s, t, comm_lanes(s, t, "replicate"), 8e6, 4)
    sha = state_bytes(s, t, comm_lanes(s, t, "shard"), 8e6, 4)
    assert rep.params[0] == 4e6 * 4 and sha.params[0] == 1e6 * 4
    assert rep.optimizer[0] == 4e6 * 8 and sha.optimizer[0] == 4e6 * 8 / 4
    assert rep.gathered[0] == 0 and sha.gathered[0] == 4e6 * 4  # both chunks whole at once
    assert sha.total(0) < rep.total(0)


def test_reduction_check_finds_a_missing_microbatch_and_a_late_pass() -> None:
    """The proof fails when a microbatch's W is not before the reduction point and
    when a pass writing the stage's weight gradients comes after it."""
    rows = parse_rows(ZB_H1)
    s = make_schedule(placement("parallel", 4), 8, rows)
    assert reductions.check(s, simulate(s)) == []
    # rank 0 without W7: its reduction (after W6) misses microbatch 7
    missing = [list(r) for r in rows]
    missing[0] = [x for x in missing[0] if x != (W, 7, 0)]
    found = reductions.check(make_schedule(placement("parallel", 4), 8, missing))
    assert any("would miss microbatches [7]" in d.message for d in found), found
    # rank 3's B7 moved after its last W
    late = [list(r) for r in rows]
    late[3].remove((B, 7, 3))
    late[3].append((B, 7, 3))
    found = reductions.check(make_schedule(placement("parallel", 4), 8, late))
    assert any("writes stage 3's weight gradients after its reduction" in d.message for d in found)


@settings(max_examples=150, deadline=None)
@given(schedules(), st.sampled_from(["none", "drop", "duplicate", "wrong_device", "dependency",
                                     "late", "shuffle_times"]), st.integers(0, 2**32 - 1))
def test_reduction_check_array_pass_agrees_with_the_scan(s, how, seed) -> None:
    """The array pass that clears a well-formed schedule (`reductions._clean`)
    never hides a finding: `check` equals the pass-by-pass `scan` on random
    schedules, broken ones (a pass dropped, repeated, moved to another device,
    before its F, a weight-gradient pass moved last) and timelines whose ends go
    backwards."""
    rng = random.Random(seed)
    if how in ("drop", "duplicate", "wrong_device", "dependency"):
        s = corrupt(s, how, rng).schedule
    elif how == "late":
        orders = [list(o) for o in s.orders]
        dev = rng.randrange(len(orders))
        movable = [i for i, p in enumerate(orders[dev]) if p.kind in (B, W) or p.kind.value == "BW"]
        if movable:
            p = orders[dev].pop(rng.choice(movable))
            orders[dev].append(replace(p, overlapped=False))
            s = replace(s, orders=tuple(tuple(o) for o in orders))
    try:
        t = simulate(s)
    except SimulationError:
        t = None
    if t is not None and how == "shuffle_times":
        t = replace(t, end=tuple(tuple(rng.sample(list(e), len(e))) for e in t.end))
    assert reductions.check(s, t) == reductions.scan(s, t)
    assert reductions.check(s) == reductions.scan(s)


def test_stats_and_show_report_the_lane(capsys: pytest.CaptureFixture[str]) -> None:
    """`stats --dp 2 --params N` prints the exposed communication and the state
    bytes, replicate vs shard (JSON too); `show --dp 2` draws a `dp` row under every device."""
    pp = str(EXAMPLES / "looped_bfs.pp")
    assert main(["stats", pp, "-D", "d=2", "--dp", "2", "--dp-mode", "shard", "--params", "1e6"]) == 0
    out = capsys.readouterr().out
    assert "data parallel (shard, dp 2)" in out and "model state per device" in out
    assert main(["stats", pp, "-D", "d=2", "--dp", "2", "--params", "1e6", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["data_parallel"]
    assert data["mode"] == "replicate" and data["devices"][0]["bytes"]["replicate"]["params"] == 2e6
    assert data["devices"][0]["bytes"]["shard"]["params"] == 1e6
    assert main(["show", pp, "-D", "d=2", "--dp", "2", "--color", "never", "--width", "200"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n  dp ") == 2 and "R0" in out
    assert main(["stats", pp, "--dp", "0"]) == 2
