"""`ppdsl bound FILE`: the lower bound on bubble and makespan for a file's
placement, passes, costs and memory bound, and how far the file is from it."""

from __future__ import annotations

import json

from ppdsl.cli import main
from tests.paths import EXAMPLES

SOURCE = """\
schedule plain {
    param d = 2
    param m = 3
    place parallel
    backward split
    order {
        for j in 0..m { F(j) }
        for j in 0..m { B(j); W(j) }
    }
}
"""


def test_zb_h1_is_optimal_at_its_memory(capsys):
    """ZB-H1 (p=4, m=8, unit costs, its expect peak_memory <= d*M_B) reaches the
    bound on both the bubble and the makespan."""
    code = main(["bound", str(EXAMPLES / "zb_h1.pp"), "--effort", "10"])
    out = capsys.readouterr().out
    assert code == 0
    assert "bubble: this schedule 0.111111, lower bound 0.111111, optimal" in out
    assert "makespan: this schedule 27, lower bound 27, optimal" in out
    assert "expect peak_memory <= d * M_B (every device, line" in out


def test_json_carries_the_bound_and_the_memory_bound_per_device(capsys):
    """--json: 1F1B (fused backward) is optimal at its d*M_B bound, which
    applies to every device."""
    code = main(["bound", str(EXAMPLES / "1f1b.pp"), "--objective", "bubble", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bubble"]["schedule_optimal"] is True  # 1F1B is optimal for fused backward
    assert result["memory_bound"] == ["4", "4", "4", "4"]


def test_a_file_without_memory_bound_is_bounded_by_its_own_peak(tmp_path, capsys):
    """No expect peak_memory: the file's own highest peak is the bound, and the
    output says so; a better order (B/W interleaved with F) exists."""
    path = tmp_path / "plain.pp"
    path.write_text(SOURCE)
    code = main(["bound", str(path), "--objective", "makespan", "--effort", "5"])
    out = capsys.readouterr().out
    assert code == 0
    assert "bounded by this schedule's own highest peak 3" in out
    assert "makespan: this schedule 11, lower bound 10, a better schedule exists (10;" in out


def test_bad_input_exits_1(tmp_path, capsys):
    """A missing file and a negative effort are errors, not tracebacks."""
    assert main(["bound", str(tmp_path / "nope.pp")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main(["bound", str(EXAMPLES / "zb_h1.pp"), "--effort", "-1"]) == 2  # usage
    assert "--effort" in capsys.readouterr().err
