"""`--costs-from FILE` (ppdsl/costs_file.py): a costs file's statements replace the
schedule's cost and memory model; mistakes in it are located errors; every
command that compiles a schedule takes it, and the search takes measured costs."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from ppdsl.cli import main
from ppdsl.compiler import compile_file
from ppdsl.costs_file import evaluate_costs, load_costs_file
from ppdsl.diagnostics import CompileError
from ppdsl.ir.schedule import format_schedule

ROOT = Path(__file__).resolve().parents[1]
ZB_H1 = str(ROOT / "examples" / "zb_h1.pp")
ONE_F_ONE_B = str(ROOT / "examples" / "1f1b.pp")

COSTS = """\
# measured somewhere
schedule profile {
    let profiled_stages = 2
    cost F[s] = s == 0 ? 2 : 3
    cost B = 4
    cost W = 1.5
    cost BW = 5
    cost comm = 0.25
    memory M_B[s] = s == 0 ? 0.9 : 1.1
    memory M_W = 0.5
}
"""


def _costs(tmp_path: Path, text: str = COSTS) -> Path:
    path = tmp_path / "costs.pp"
    path.write_text(text)
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_costs_replace_the_schedules(tmp_path: Path) -> None:
    """The compiled schedule has the file's per-stage costs and memory model, and the
    orders as the schedule designs them (ZB-H1's block, W included)."""
    costs = load_costs_file(_costs(tmp_path))
    plain = compile_file(ZB_H1, {"d": "2"})
    measured = compile_file(ZB_H1, {"d": "2"}, costs=costs)
    c = measured.schedule.costs
    assert c.forward == (2.0, 3.0) and c.backward_input == (4.0, 4.0)
    assert c.backward_weight == (1.5, 1.5) and c.fused_backward == (5.0, 5.0) and c.comm == 0.25
    assert measured.schedule.memory.activation == (Fraction(9, 10), Fraction(11, 10))
    assert measured.schedule.orders == plain.schedule.orders
    assert measured.costs_from == str(_costs(tmp_path))
    assert measured.timeline.makespan > plain.timeline.makespan


def test_expectations_become_warnings(tmp_path: Path) -> None:
    """ZB-H1's `expect makespan == 3*m + d - 1` (unit costs) is a warning under the
    measured costs, naming the costs file; the check still exits 0."""
    measured = compile_file(ZB_H1, {"d": "2"}, costs=load_costs_file(_costs(tmp_path)))
    texts = [w.message for w in measured.warnings]
    assert any("makespan" in t and "costs.pp" in t for t in texts), texts
    assert all(w.severity == "warning" for w in measured.warnings)


def test_stage_count_mismatch_is_located(tmp_path: Path) -> None:
    """Costs measured for 2 stages on an 8-stage schedule: an error at the costs
    file's `let profiled_stages` line saying what to profile."""
    path = _costs(tmp_path)
    with pytest.raises(CompileError) as err:
        compile_file(str(ROOT / "examples" / "zb_v.pp"), {}, costs=load_costs_file(path))
    (diag,) = err.value.diagnostics
    assert diag.span is not None and diag.span.file == str(path) and diag.span.line == 3
    assert "measured for 2 stages" in diag.message and "--stages 8" in diag.message


@pytest.mark.parametrize(
    ("body", "line", "message"),
    [
        ("    param d = 2\n", 2, "holds only 'cost' and 'memory'"),
        ("    let profiled_stages = 1.5\n", 2, "positive whole number"),
        ("    cost X = 1\n", 2, "unknown cost 'X'"),
        ("    memory M_B = -1\n", 2, "must be a number >= 0"),
        ("    cost norm[s] = s\n", 2, "'norm' (the step's gradient-norm all-reduce) is one value"),
        ("    cost recv[s] = s\n", 2, "'recv' (the receiver's part of a transfer) is one value"),
        ("    cost recv = -1\n", 2, "must be a number >= 0"),
        ("    cost jitter[s] = s\n", 2, "'jitter' (how much a pass's duration varies run to run)"),
        ("    cost optimizer[s] = s - 1\n", 2, "must be a number >= 0"),
        ("    cost optimiser = 1\n", 2, "did you mean 'optimizer'"),
    ],
)
def test_bad_costs_file_is_located(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, line: int, message: str
) -> None:
    """A costs file with a statement that does not belong, a bad stage count, an
    unknown cost or a negative value: exit 1, located in the costs file."""
    path = _costs(tmp_path, "schedule profile {\n" + body + "}\n")
    code, _, err = _run(capsys, "check", ZB_H1, "-D", "d=2", "--costs-from", str(path))
    assert code == 1, err
    assert f"{path}:{line}:" in err and message in err and "Traceback" not in err


def test_missing_costs_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A missing --costs-from file is exit 1 naming it."""
    code, _, err = _run(capsys, "stats", ZB_H1, "--costs-from", str(tmp_path / "nope.pp"))
    assert code == 1 and "no such file" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["check", "show", "stats"])
def test_commands_take_costs_from(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    """check, show and stats accept --costs-from and report under the measured costs
    (1F1B at d=2, m=4: stage 1's F + BW, 8 each, paced by stage 0's first F (2) and
    last BW (5) with two transfers: 2 + 0.25 + 4 * 8 + 0.25 + 5 = 39.5)."""
    path = _costs(tmp_path)
    code, out, err = _run(capsys, command, ONE_F_ONE_B, "-D", "d=2", "-D", "m=4",
                          "--costs-from", str(path), *(["--json"] if command == "stats" else []))
    assert code == 0, err
    plain = compile_file(ONE_F_ONE_B, {"d": "2", "m": "4"}, costs=load_costs_file(path))
    assert plain.timeline.makespan == pytest.approx(39.5)
    if command == "check":
        assert "makespan 39.5" in out
    if command == "show":
        assert "t = 0 .. 39." in out
    if command == "stats":
        assert '"makespan": 39.5' in out


def test_compare_takes_costs_from(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """compare puts two schedules side by side under the same measured costs."""
    code, out, err = _run(capsys, "compare", ZB_H1, ONE_F_ONE_B, "-D", "d=2", "-D", "m=4",
                          "--costs-from", str(_costs(tmp_path)), "--json")
    assert code == 0, err
    assert '"makespan": 39.5' in out


def test_evaluate_for_a_placement(tmp_path: Path) -> None:
    """The search's view: the file's costs for a placement of d devices."""
    costs, memory = evaluate_costs(load_costs_file(_costs(tmp_path)), 2, "parallel")
    assert costs.forward == (2.0, 3.0) and memory.weight_retained == (Fraction(1, 2),) * 2


def test_search_takes_costs_from(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """search --costs-from writes a .pp with the file's costs and memory that checks,
    with and without the same --costs-from; with --costs too it is a usage error."""
    path = _costs(tmp_path)
    out_pp = tmp_path / "found.pp"
    code, _, err = _run(capsys, "search", "-d", "2", "-m", "4", "--memory", "2p", "--time", "0",
                        "--costs-from", str(path), "-o", str(out_pp))
    assert code == 0, err
    text = out_pp.read_text()
    assert "cost F[s] = s == 0 ? 2 : 3" in text and "memory M_B[s] = s == 0 ? 0.9 : 1.1" in text
    assert "expect peak_memory <= 4" in text  # 2p: 4 1F1B stages, each 1 unit here (sum 2, d=2)
    for extra in ([], ["--costs-from", str(path)]):
        code, _, err = _run(capsys, "check", str(out_pp), *extra)
        assert code == 0 and "warning" not in err, err
    code, _, err = _run(capsys, "search", "-d", "2", "-m", "4", "--memory", "2p",
                        "--costs-from", str(path), "--costs", "F=1")
    assert code == 2 and "drop --costs" in err


STEP_COSTS = COSTS.replace("}\n", """\
    cost overhead[s] = s == 0 ? 0.5 : 0.25
    cost optimizer[s] = s == 0 ? 3 : 2
    cost norm = 0.75
}
""")


def test_step_costs_time_the_whole_step(tmp_path: Path) -> None:
    """`cost overhead/optimizer/norm` (docs/language.md, costs of the whole step): every
    pass holds its device for its cost plus its stage's overhead, and the step runs
    from one norm all-reduce to the next, each device's passes after its optimizer step."""
    plain = compile_file(ONE_F_ONE_B, {"d": "2"}, costs=load_costs_file(_costs(tmp_path)))
    path = tmp_path / "step.pp"
    path.write_text(STEP_COSTS)
    whole = compile_file(ONE_F_ONE_B, {"d": "2"}, costs=load_costs_file(path))
    c = whole.schedule.costs
    assert c.overhead == (0.5, 0.25) and c.optimizer == (3.0, 2.0) and c.norm == 0.75
    # each of device 0's 2m passes runs 0.5 longer, device 1's 0.25: the makespan grows
    m = whole.schedule.num_microbatches
    assert whole.timeline.busy[0] == plain.timeline.busy[0] + 2 * m * 0.5
    assert whole.timeline.busy[1] == plain.timeline.busy[1] + 2 * m * 0.25
    assert whole.timeline.makespan > plain.timeline.makespan
    assert whole.timeline.step_time == whole.timeline.makespan + 0.75 + 3.0
    # each device's passes start after its own optimizer step (docs/language.md): at
    # m=2 under unit costs, device 1 starts at 10 and device 0's backwards wait for it:
    # F0 F1 on device 0 by 2, device 1 F0 BW0 F1 BW1 over 10..16, device 0 BW1 16..18
    path.write_text("schedule c {\n    cost optimizer[s] = s == 0 ? 0 : 10\n}\n")
    late = compile_file(ONE_F_ONE_B, {"d": "2", "m": "2"}, costs=load_costs_file(path))
    assert late.timeline.makespan == 9 and late.timeline.step_time == 18
    # without step costs, the step is the makespan and the plan says nothing new
    assert plain.timeline.step_time == plain.timeline.makespan
    assert not plain.schedule.costs.models_step


def test_stats_prints_the_step_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`ppdsl stats --costs-from` with step costs prints the simulated step time
    (and `--json` its `step_time`); without them neither appears."""
    path = tmp_path / "step.pp"
    path.write_text(STEP_COSTS)
    code, out, _ = _run(capsys, "stats", ONE_F_ONE_B, "-D", "d=2", "--costs-from", str(path))
    assert code == 0 and "step time" in out
    code, out, _ = _run(capsys, "stats", ONE_F_ONE_B, "-D", "d=2", "--costs-from",
                        str(_costs(tmp_path)))
    assert code == 0 and "step time" not in out
    code, out, _ = _run(capsys, "stats", ONE_F_ONE_B, "-D", "d=2", "--json", "--costs-from",
                        str(path))
    assert code == 0 and '"step_time"' in out


def test_receive_cost_is_paid_by_the_receiver(tmp_path: Path) -> None:
    """`cost recv` (docs/language.md): a pass that needs another device's pass starts
    `comm` after that pass ends and no earlier than `recv` after its own device is
    free, so a receive whose data arrived early still costs its receiver `recv`."""
    path = tmp_path / "recv.pp"
    # 1F1B, d=2, m=2: device 0 F0 F1 BW0 BW1, device 1 F0 BW0 F1 BW1
    path.write_text("schedule c {\n    cost F = 1\n    cost BW = 2\n    cost comm = 1\n}\n")
    plain = compile_file(ONE_F_ONE_B, {"d": "2", "m": "2"}, costs=load_costs_file(path))
    assert plain.timeline.start == ((0, 1, 6, 9), (2, 3, 5, 6))
    path.write_text("schedule c {\n    cost F = 1\n    cost BW = 2\n    cost comm = 1\n"
                    "    cost recv = 2\n}\n")
    paid = compile_file(ONE_F_ONE_B, {"d": "2", "m": "2"}, costs=load_costs_file(path))
    assert paid.schedule.costs.recv == 2.0
    # device 1's F1: its activation came at 3, the device was free at 5: starts at 5 + 2;
    # device 0's BW1: the gradient comes at 10 + 1, later than 8 + 2: comm decides
    assert paid.timeline.start == ((0, 1, 6, 11), (2, 3, 7, 8))
    assert paid.timeline.makespan == 13
    assert " recv=2" in format_schedule(paid.schedule)  # the IR's text carries it
    assert " recv=" not in format_schedule(plain.schedule)


def test_jitter_makes_the_step_the_median_of_draws(tmp_path: Path) -> None:
    """`cost jitter` (docs/language.md, costs of the whole step): the step time is the
    median of seeded draws of every pass's duration, so the same file predicts the
    same step; a rank running late holds up the other, so on 1F1B the step grows with
    the spread, while the makespan and bubble stay those of the costs."""
    path = tmp_path / "jitter.pp"
    steps, makespans = [], []
    for jitter in ("0", "0.1", "0.4"):
        path.write_text("schedule c {\n    cost F = 2\n    cost BW = 4\n    cost comm = 1\n"
                        f"    cost optimizer = 1\n    cost jitter = {jitter}\n}}\n")
        compiled = compile_file(ONE_F_ONE_B, {"d": "2", "m": "8"}, costs=load_costs_file(path))
        again = compile_file(ONE_F_ONE_B, {"d": "2", "m": "8"}, costs=load_costs_file(path))
        assert compiled.timeline.step_time == again.timeline.step_time  # seeded
        steps.append(compiled.timeline.step_time)
        makespans.append(compiled.timeline.makespan)
    assert steps[0] == makespans[0] + 1  # no jitter: the passes after the optimizer step
    assert steps[0] < steps[1] < steps[2]
    assert makespans[0] == makespans[1] == makespans[2]
