"""`ppdsl check FILE --for ...` (docs/testing.md): a family's sweep from the
command line, its located failure with the parameters that reproduce it, its
`--json`, and usage errors without tracebacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppdsl.cli import main
from tests.paths import EXAMPLES

# 1F1B whose backward moves two slots earlier only at d >= 12 with m odd: a
# family broken in one corner (the "done when")
BROKEN = """\
schedule broken {
    param d = 4
    param m = 2 * d
    require m >= d, "needs m >= d"
    place parallel
    backward fused
    block period 3 {
        F at s
        BW at 3*d - 2 - 2*s - (d >= 12 and m % 2 == 1 ? 2 : 0)
    }
}
"""


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def broken(tmp_path: Path) -> str:
    path = tmp_path / "broken.pp"
    path.write_text(BROKEN)
    return str(path)


def test_a_corner_failure_is_found_and_located(capsys, broken):
    """The family broken at d >= 12, m odd fails first at d=12, m=13, with the
    located errors of that instance and the command that reproduces it."""
    code, _, err = _run(capsys, "check", broken, "--for", "d=11..13", "--for", "m=d..4*d")
    assert code == 1
    assert f"{broken}:9:9: error:" in err and "Traceback" not in err
    assert "invalid at d=12 m=13" in err
    assert f"reproduce with: ppdsl check {broken} -D d=12 -D m=13" in err


def test_sampling_shrinks_to_the_smallest_failing_parameters(capsys, broken):
    """`--samples` over d=2..40 finds the broken corner and shrinks it to d=12, m=13."""
    code, out, _ = _run(capsys, "check", broken, "--for", "d=2..40", "--for", "m=d..4*d",
                        "--samples", "40", "--seed", "3", "--json")
    report = json.loads(out)
    assert code == 1 and report["mode"] == "sample" and report["seed"] == 3
    assert report["failure"]["params"] == {"d": 12, "m": 13}
    assert report["failure"]["diagnostics"][0]["location"]["line"] == 9


def test_json_counts_instances_and_require_skips(capsys):
    """A valid family's `--json`: every instance checked, those under its
    `require` (m < d for ZB-H1) counted as skipped."""
    code, out, _ = _run(capsys, "check", str(EXAMPLES / "zb_h1.pp"),
                        "--for", "d=2..4", "--for", "m=1..2*d", "--json")
    report = json.loads(out)
    assert code == 0 and report["valid"] and report["failure"] is None
    assert report["instances"] == report["checked"] == 4 + 6 + 8
    assert report["skipped"] == 1 + 2 + 3
    assert report["ranges"] == {"d": "2..4", "m": "1..2*d"}


def test_parallel_jobs_give_the_same_first_failure(capsys, broken):
    """`--jobs 2` reports the same first invalid instance as one process."""
    code, out, _ = _run(capsys, "check", broken, "--for", "d=11..12", "--for", "m=d..4*d",
                        "--jobs", "2", "--json")
    assert code == 1 and json.loads(out)["failure"]["params"] == {"d": 12, "m": 13}


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--for", "q=1..2"], "no param 'q'"),
     (["--for", "d=1..2", "-D", "d=3"], "-D d also sets it"),
     (["--for", "m=d..2"], "m=d..2"),
     (["--for", "d"], "expected NAME=LOW..HIGH"),
     (["--samples", "5"], "needs at least one --for"),
     (["--for", "d=1..2", "--ir"], "--ir and --programs"),
     (["--for", "d=1..1000", "--for", "m=1..1000"], "--samples N")],
)
def test_bad_ranges_are_usage_errors(capsys, argv, message):
    """A malformed or conflicting `--for` exits 2 with a message, no traceback."""
    code, _, err = _run(capsys, "check", str(EXAMPLES / "zb_h1.pp"), *argv)
    assert code == 2, err
    assert message in err and "Traceback" not in err


def test_symbolic_proves_zb_h1_for_every_d(capsys):
    """`--symbolic` proves ZB-H1 for 2 <= d <= 10000, naming what it leaves undecided."""
    code, out, _ = _run(capsys, "check", str(EXAMPLES / "zb_h1.pp"), "--for", "d=2..10000",
                        "--symbolic")
    assert code == 0
    assert "proven for 2 <= d <= 10000 and every m the file allows (m >= d)" in out
    assert "not decided symbolically: deadlock-freedom" in out


def test_symbolic_falls_back_to_enumeration_outside(capsys):
    """A file outside the symbolic check (a looped placement) is named as such, then enumerated."""
    code, out, err = _run(capsys, "check", str(EXAMPLES / "looped_bfs.pp"), "--for", "d=2..3",
                          "--for", "m=d..d+1", "--symbolic")
    assert code == 0
    assert "outside what the symbolic check decides: placement looped" in err
    assert "4 checked" in out


def test_symbolic_proves_zb_v_order_for_every_d_and_m(capsys):
    """`--symbolic` proves ZB-V's order form for 2 <= d <= 10000 over the m range and requires."""
    code, out, _ = _run(capsys, "check", str(EXAMPLES / "zb_v.pp"), "--for", "d=2..10000",
                        "--for", "m=d..4*d", "--symbolic")
    assert code == 0
    assert ("proven for 2 <= d <= 10000 and every m with m >= 2 * d - 1, d <= m <= 4 * d: "
            "each pass once, dependencies, peak_memory <= 2 * d * M_B") in out


def test_symbolic_order_counterexample_prints_the_instance_errors(capsys, tmp_path):
    """ZB-V with W before its B is refuted at a witness instance, with its located errors."""
    path = tmp_path / "zb_v_swapped.pp"
    path.write_text((EXAMPLES / "zb_v.pp").read_text()
                    .replace("B(t, 0); W(t, 0)", "W(t, 0); B(t, 0)"))
    code, _, err = _run(capsys, "check", str(path), "--for", "d=2..10000", "--symbolic")
    assert code == 1
    assert "counterexample at d=2 m=3: 22:13: W(t, 0) on device i = 1" in err
    assert f"{path}:22:" in err and "error:" in err and "Traceback" not in err


def test_symbolic_collision_prints_the_instance_errors(capsys, tmp_path):
    """A block colliding at some d is a counterexample with that instance's located errors."""
    path = tmp_path / "collide.pp"
    path.write_text(BROKEN.replace(" - (d >= 12 and m % 2 == 1 ? 2 : 0)", "")
                    .replace("3*d - 2 - 2*s", "2*d + 1 - s"))
    code, _, err = _run(capsys, "check", str(path), "--for", "d=2..50", "--for", "m=d..2*d",
                        "--symbolic")
    assert code == 1
    assert "counterexample at d=" in err and f"{path}:9:9: error:" in err


def test_a_missing_file_is_invalid_input_as_for_check(capsys, tmp_path):
    """`--for` on a missing file exits 1 naming it, like a plain check."""
    code, _, err = _run(capsys, "check", str(tmp_path / "nope.pp"), "--for", "d=1..2")
    assert code == 1 and "no such file" in err and "Traceback" not in err
