"""The `ppdsl` command line as a user meets it: exit codes, located errors,
no tracebacks, JSON shape, colour only where asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl.cli import main

ROOT = Path(__file__).resolve().parents[1]
ZB_H1 = str(ROOT / "examples" / "zb_h1.pp")
ONE_F_ONE_B = str(ROOT / "examples" / "1f1b.pp")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_check_valid_example_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """A valid example checks with exit 0 and a one-line summary."""
    code, out, err = _run(capsys, "check", ZB_H1, "-D", "d=4", "-D", "m=8")
    assert code == 0, err
    assert "ok" in out and "makespan 27" in out


def test_missing_file_is_invalid_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A missing file is exit 1 with a message naming it, not a traceback."""
    code, _, err = _run(capsys, "check", str(tmp_path / "nope.pp"))
    assert code == 1
    assert "no such file" in err and "Traceback" not in err


def test_empty_file_is_located_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """An empty file is a located error at 1:1."""
    empty = tmp_path / "empty.pp"
    empty.write_text("\n")
    code, _, err = _run(capsys, "check", str(empty))
    assert code == 1
    assert err.startswith(f"{empty}:1:1: error: empty file")


@pytest.mark.parametrize(
    ("define", "expected"),
    [("d", 2), ("d=", 2), ("=4", 2), ("d=2\nm=3", 2), ("d x=2", 2), ("d=four", 1), ("nosuch=3", 1)],
)
def test_bad_define_is_usage_or_invalid_input(
    capsys: pytest.CaptureFixture[str], define: str, expected: int
) -> None:
    """A malformed -D is a usage error (exit 2); a well-formed one the file rejects
    (no such param, not a number) is invalid input (exit 1); both name the -D."""
    code, _, err = _run(capsys, "check", ZB_H1, "-D", define)
    assert code == expected, err
    assert "Traceback" not in err
    assert define.partition("=")[0] in err or "-D" in err


def test_unknown_command_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A misspelt subcommand is exit 2."""
    code, _, err = _run(capsys, "chek", ZB_H1)
    assert code == 2
    assert "invalid choice" in err


def test_check_json_gives_torch_actions_and_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """check --json carries per-device torch action strings, peak memory, makespan and bubble."""
    code, out, _ = _run(capsys, "check", ZB_H1, "--json", "-D", "d=4", "-D", "m=8")
    assert code == 0
    result = json.loads(out)
    assert result["valid"] is True
    sched = result["schedule"]
    assert sched["makespan"] == 27
    rank0 = sched["devices"][0]["actions"]
    assert rank0[:6] == ["0F0", "0F1", "0F2", "0F3", "0I0", "0W0"]
    assert [d["peak_memory"] for d in sched["devices"]] == sorted(
        (d["peak_memory"] for d in sched["devices"]), reverse=True
    )
    assert 0 <= sched["bubble_ratio"] < 1


def test_check_json_reports_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """check --json on an invalid file says valid: false with located diagnostics, exit 1."""
    bad = tmp_path / "bad.pp"
    bad.write_text("schedule x {\n    param d = 4\n")
    code, out, _ = _run(capsys, "check", str(bad), "--json")
    assert code == 1
    result = json.loads(out)
    assert result["valid"] is False
    assert result["diagnostics"][0]["location"]["file"] == str(bad)


def test_stats_table_has_every_device(capsys: pytest.CaptureFixture[str]) -> None:
    """stats prints makespan, bubble ratio and one row per device with its bound."""
    code, out, _ = _run(capsys, "stats", ONE_F_ONE_B, "-D", "d=4", "-D", "m=8")
    assert code == 0
    assert "bubble ratio" in out and "makespan" in out
    table, lifespans = out.split("block period T = 3: lifespans")
    rows = [ln for ln in table.splitlines() if ln.strip().split(" ")[0] in {"0", "1", "2", "3"}]
    assert len(rows) == 4
    assert "ceil(l/T)" in lifespans and "steady state" in lifespans


def test_stats_shows_receive_buffers_held_ahead(capsys: pytest.CaptureFixture[str]) -> None:
    """Receives pulled forward hold their buffers longer: stats --json says how many
    a rank holds at most (1F1B: one; looped BFS at d=8: many on its turning ranks),
    counted independently here by walking each rank's program."""
    from ppdsl.compiler import compile_file
    from ppdsl.ir.rank import Exchange

    for name, most in (("1f1b", 1), ("looped_bfs", None)):
        path = str(ROOT / "examples" / f"{name}.pp")
        code, out, _ = _run(capsys, "stats", path, "-D", "d=8", "-D", "m=32", "--json")
        assert code == 0
        peaks = [dev["receive_buffers_peak"] for dev in json.loads(out)["devices"]]
        programs = compile_file(path, {"d": "8", "m": "32"}).programs
        for prog, peak in zip(programs, peaks, strict=True):
            waiting, held = [], 0
            for op in prog.ops:
                if isinstance(op, Exchange):
                    waiting += [(t.microbatch, t.dst_stage, t.kind.value) for t in op.recvs]
                    held = max(held, len(waiting))
                else:
                    p = op.pass_
                    want = "act" if p.kind.value == "F" else "grad"
                    waiting = [w for w in waiting if w != (p.microbatch, p.stage, want)]
            assert peak == held
        if most is not None:
            assert max(peaks) == most
        else:
            assert max(peaks) > 2


def test_check_prints_the_ir_and_the_programs(capsys: pytest.CaptureFixture[str]) -> None:
    """check --ir prints the canonical IR (the golden file's text); --programs the
    lowered rank programs, one exchange per line."""
    code, out, _ = _run(capsys, "check", ZB_H1, "--ir", "--programs")
    assert code == 0
    golden = (ROOT / "tests" / "golden" / "examples" / "zb_h1.txt").read_text()
    assert golden in out
    programs = out[out.index("rank 0:\n"):]
    assert programs.count("exchange {") > 0 and "rank 3:" in programs
    assert "send act(mb 0, stage 0->1, rank 0->1)" in programs


def test_no_early_receives_reports_the_plain_lowerings_deadlock(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Interleaved 1F1B is valid with ppdsl's early receives; lowered plainly (each
    receive just before its pass) its cool-down deadlocks, and check says so as a
    cycle of waits, one located note per rank."""
    path = str(ROOT / "examples" / "interleaved_1f1b.pp")
    assert _run(capsys, "check", path)[0] == 0
    code, _, err = _run(capsys, "check", path, "--no-early-receives")
    assert code == 1
    assert "deadlock" in err and "Traceback" not in err
    waits = [ln for ln in err.splitlines() if " waits for " in ln]
    assert len(waits) == 4 and all("interleaved_1f1b.pp:" in ln for ln in waits)


def test_compare_puts_schedules_side_by_side(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """compare: one row per file under the same -D, V-shape figures also in 1F1B-stage
    units (halved), differing memory models pointed out; a bad file among them is a
    located error (exit 1) while the others are still compiled."""
    files = [str(ROOT / "examples" / f"{n}.pp") for n in ("zb_h1", "zb_v", "v_half")]
    code, out, err = _run(capsys, "compare", *files, "-D", "d=4", "-D", "m=8", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)["schedules"]}
    assert set(rows) == {"zb_h1", "zb_v", "v_half"}
    assert rows["zb_h1"]["makespan"] == 27 and rows["zb_h1"]["makespan_in_1f1b_stages"] == 27
    assert rows["zb_v"]["makespan_in_1f1b_stages"] == rows["zb_v"]["makespan"] / 2
    assert rows["zb_v"]["peak_memory_per_1f1b_stage"] == rows["zb_v"]["peak_memory"] / 2
    assert "different memory models" in json.loads(out)["notes"][0]
    code, out, err = _run(capsys, "compare", *files, "-D", "d=4")
    assert code == 0
    assert len([ln for ln in out.splitlines() if ln.startswith(("zb_h1 ", "zb_v ", "v_half "))]) == 3
    assert "different memory models" in err
    bad = tmp_path / "bad.pp"
    bad.write_text("schedule bad {\n  plce parallel\n}\n")
    code, out, err = _run(capsys, "compare", files[0], str(bad))
    assert code == 1 and out == ""
    assert f"{bad}:2:3: error" in err and "Traceback" not in err


def test_show_writes_an_svg_figure_to_scale(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """show --svg: a valid SVG with one bar per pass, its x and width the simulated
    start and duration to one scale, later chunks lighter; an unwritable path is a
    message and exit 1."""
    import xml.etree.ElementTree as ET

    from ppdsl.compiler import compile_file

    path = str(ROOT / "examples" / "zb_v.pp")
    out_svg = tmp_path / "zb_v.svg"
    code, _, err = _run(capsys, "show", path, "--svg", str(out_svg))
    assert code == 0 and "wrote" in err
    ns = "{http://www.w3.org/2000/svg}"
    bars = [r for r in ET.parse(out_svg).iter(f"{ns}rect") if r.get("class") == "pass"]
    compiled = compile_file(path)
    s, t = compiled.schedule, compiled.timeline
    assert len(bars) == sum(len(o) for o in s.orders)
    x0, scale = float(bars[0].get("x")), float(bars[0].get("width")) / float(t.end[0][0])
    k = 0
    for dev, order in enumerate(s.orders):
        for p, start, end in zip(order, t.start[dev], t.end[dev], strict=True):
            bar = bars[k]
            k += 1
            assert bar.get("data-pass").endswith(str(p.microbatch))
            assert abs(float(bar.get("x")) - (x0 + float(start) * scale)) < 0.01
            assert abs(float(bar.get("width")) - float(end - start) * scale) < 0.01
    assert len({b.get("fill") for b in bars}) == 6  # F, B, W in two shades
    code, _, err = _run(capsys, "show", path, "--svg", str(tmp_path / "no" / "such" / "x.svg"))
    assert code == 2 and "cannot write" in err and "Traceback" not in err  # usage: a bad path


def test_stats_json_has_memory_over_time(capsys: pytest.CaptureFixture[str]) -> None:
    """stats --json gives each device's activation memory over time, one point per
    pass in time order; its highest level is the device's peak and it ends at zero
    (on recomputed stages too: an F keeps M_I, R restores M_B)."""
    recompute = str(ROOT / "examples" / "1f1b_recompute.pp")
    for args in ((ZB_H1, "-D", "d=4", "-D", "m=8"), (recompute,)):
        code, out, _ = _run(capsys, "stats", *args, "--json")
        assert code == 0
        for dev in json.loads(out)["devices"]:
            levels = [level for _, level in dev["memory_over_time"]]
            times = [t for t, _ in dev["memory_over_time"]]
            assert max(levels) == dev["peak_memory"] and levels[-1] == 0, args
            assert len(levels) == len(dev["actions"])
            assert times == sorted(times)


def test_show_wraps_between_passes(capsys: pytest.CaptureFixture[str]) -> None:
    """A timeline wider than the terminal wraps into bands that never cut a pass's
    label in two (ZB-V's fractional pass times included)."""
    import re

    zb_v = str(ROOT / "examples" / "zb_v.pp")
    for width in (40, 61, 97):
        code, out, _ = _run(capsys, "show", zb_v, "--width", str(width))
        assert code == 0
        rows = [ln[len("rank 0 "):] for ln in out.splitlines() if ln.startswith("rank ")]
        assert len(rows) > 4  # it wrapped
        for row in rows:
            assert len(row) <= width
            for token in re.split(r"[ .]+", row):
                assert token == "" or re.fullmatch(r"[FBWfbw]\d+", token), (width, row)


def test_show_without_tty_has_no_colour(capsys: pytest.CaptureFixture[str]) -> None:
    """show to a pipe writes plain text with every device row and microbatch numbers."""
    code, out, _ = _run(capsys, "show", ONE_F_ONE_B, "-D", "d=4", "-D", "m=8", "--width", "200")
    assert code == 0
    assert "\x1b[" not in out
    rows = [ln for ln in out.splitlines() if ln.startswith("rank ")]
    assert len(rows) == 4
    assert "F7" in rows[0] and "B7" in rows[3]


def test_show_colour_always_and_no_color(capsys: pytest.CaptureFixture[str]) -> None:
    """--color always colours; NO_COLOR in the environment wins over auto."""
    code, out, _ = _run(capsys, "show", ZB_H1, "--color", "always")
    assert code == 0 and "\x1b[" in out
    os.environ["NO_COLOR"] = "1"
    try:
        code, out, _ = _run(capsys, "show", ZB_H1)
    finally:
        del os.environ["NO_COLOR"]
    assert "\x1b[" not in out


def test_show_wraps_instead_of_truncating(capsys: pytest.CaptureFixture[str]) -> None:
    """A narrow terminal gets several bands; every microbatch still appears."""
    code, out, _ = _run(capsys, "show", ONE_F_ONE_B, "-D", "d=4", "-D", "m=8", "--width", "50")
    assert code == 0
    bands = [ln for ln in out.splitlines() if ln.strip().startswith("t = ")]
    assert len(bands) > 1
    for mb in range(8):
        assert f"B{mb}" in out


def test_console_script_runs() -> None:
    """`python -m ppdsl` works as a process and returns the exit code."""
    done = subprocess.run(
        [sys.executable, "-m", "ppdsl", "check", ZB_H1], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_usage_error_from_a_command_is_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command that raises UsageError exits 2 with `ppdsl COMMAND: error: ...`;
    one that returns a code outside ExitCode is an internal error (3)."""
    from ppdsl.commands import check
    from ppdsl.commands.common import ExitCode, UsageError

    def misused(args):
        raise UsageError("--frobnicate needs a value")

    monkeypatch.setattr(check, "run", misused)
    code, _, err = _run(capsys, "check", ZB_H1)
    assert code == ExitCode.USAGE == 2
    assert "ppdsl check: error: --frobnicate needs a value" in err
    monkeypatch.setattr(check, "run", lambda args: 7)
    code, _, err = _run(capsys, "check", ZB_H1)
    assert code == ExitCode.INTERNAL and "internal error" in err
