"""`ppdsl import` of a compute+comm CSV (ppdsl/commands/import_csv.py): the
CSV's own transfers checked under NCCL's rules, the reported hangs of
tests/hangs/README.md rejected with their cycle of waits at the CSV's rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppdsl.cli import main
from tests.paths import ROOT

HANGS = ROOT / "tests" / "hangs"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", ["pytorch_172668", "megatron_5100"])
def test_reported_hangs_are_rejected_with_their_cycle(capsys, name):
    """Each reported hang (tests/hangs/README.md) is invalid under NCCL's rules:
    one cycle of waits naming both ranks, each wait at its CSV row and cell."""
    path = HANGS / f"{name}.csv"
    code, out, err = _run(capsys, "import", str(path))
    assert code == 1 and out == ""
    assert "Traceback" not in err
    assert err.count("error: deadlock under nccl's rules: ranks 0, 1 wait on each other") == 1
    assert f"{path}:1:" in err and f"{path}:2:" in err  # both rows
    assert "rank 0's" in err and "rank 1's" in err


def test_the_hangs_run_where_tags_match(capsys):
    """The same CSVs import under gloo's rules (tags match transfers, sends do
    not hold the host): the hangs are NCCL's."""
    for name in ("pytorch_172668", "megatron_5100"):
        code, out, err = _run(capsys, "import", "--comm-model", "gloo", str(HANGS / f"{name}.csv"))
        assert code == 0, err
        assert "schedule" in out


def test_receiving_first_where_the_ranks_cross_fixes_172668(capsys, tmp_path):
    """Posting the receive before the send wherever the two ranks' orders cross
    (Megatron's even/odd idea: five swaps, four on rank 0) lets both ranks
    finish under NCCL's rules; any one swap alone moves the cycle on."""
    text = (HANGS / "pytorch_172668.csv").read_text()
    swaps = [("0SEND_F1,2RECV_F0", "2RECV_F0,0SEND_F1"), ("2SEND_F0,2RECV_F1", "2RECV_F1,2SEND_F0"),
             ("3SEND_B0,3RECV_F1", "3RECV_F1,3SEND_B0"), ("2SEND_B0,2RECV_B1", "2RECV_B1,2SEND_B0"),
             ("2SEND_B1,0RECV_B0", "0RECV_B0,2SEND_B1")]
    fixed = text
    for old, new in swaps:
        assert old in fixed
        fixed = fixed.replace(old, new)
    path = tmp_path / "fixed.csv"
    path.write_text(fixed)
    code, _, err = _run(capsys, "import", str(path))
    assert code == 0, err
    path.write_text(text.replace(*swaps[0]))
    code, _, err = _run(capsys, "import", str(path))
    assert code == 1 and "deadlock under nccl's rules" in err


def test_a_tensor_never_received_is_a_located_error(capsys, tmp_path):
    """A forward whose input comes from another rank with no RECV_F for it is an
    error at its cell, with the action to add."""
    text = (HANGS / "pytorch_172668.csv").read_text().replace("1RECV_F0,", "", 1)
    path = tmp_path / "missing.csv"
    path.write_text(text)
    code, _, err = _run(capsys, "import", str(path))
    assert code == 1
    assert f"{path}:2:1: error: 1F0 on rank 1 takes the act of microbatch 0" in err
    assert "add 1RECV_F0 before it" in err


def test_a_bad_batch_part_is_a_located_error(capsys, tmp_path):
    """A BATCH_P2P cell holding something other than SEND/RECV actions is an
    error at its cell, not a traceback."""
    path = tmp_path / "bad.csv"
    path.write_text("0F0,(0SEND_F0;0F1)BATCH_P2P\r\n1RECV_F0,1F0\r\n")
    code, _, err = _run(capsys, "import", str(path))
    assert code == 1 and "Traceback" not in err
    assert f"{path}:1:5: error: bad part '0F1' of a BATCH_P2P cell" in err


def test_compute_only_csv_is_unchanged(capsys, tmp_path):
    """A compute-only CSV has no transfers to check: it imports as before."""
    path = tmp_path / "c.csv"
    path.write_text("0F0,0B0\r\n1F0,1B0\r\n")
    code, out, _ = _run(capsys, "import", str(path))
    assert code == 0 and "schedule" in out


def test_paths_exist():
    """The reproductions named in tests/hangs/README.md are there."""
    assert sorted(p.name for p in Path(HANGS).glob("*.csv")) == [
        "megatron_5100.csv", "pytorch_172668.csv"]
