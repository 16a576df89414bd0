"""`ppdsl fix` and the fixes `ppdsl check` offers, as a user meets them (issue 40)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppdsl.cli import main
from tests.paths import EXAMPLES

ORIGINAL = (EXAMPLES / "1f1b.pp").read_text(encoding="utf-8")
MOVED = ORIGINAL.replace("BW at 3*d - 2 - 2*s", "BW at 3*d - 1 - 2*s")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_fix_writes_the_valid_file_and_prints_the_diff(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`ppdsl fix FILE -o OUT` writes the fixed file, prints the diff, exits 0,
    and leaves FILE as it was."""
    source, out = tmp_path / "moved.pp", tmp_path / "fixed.pp"
    source.write_text(MOVED)
    code, diff, err = _run(capsys, "fix", str(source), "-o", str(out))
    assert code == 0, err
    assert out.read_text() == ORIGINAL
    assert source.read_text() == MOVED
    assert "-        BW at 3*d - 1 - 2*s\n+        BW at 3*d - 2 - 2*s\n" in diff
    assert _run(capsys, "check", str(out))[0] == 0


def test_fix_without_a_fix_exits_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A file no candidate edit repairs is left alone: its errors are printed, exit 1."""
    source = tmp_path / "dropped.pp"
    text = ORIGINAL.replace("        F at s\n", "")
    source.write_text(text)
    code, diff, err = _run(capsys, "fix", str(source))
    assert code == 1
    assert diff == "" and source.read_text() == text
    assert "no proven fix left" in err and "Traceback" not in err


def test_text_and_json_carry_the_same_notes_and_fixes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`check` and `check --json` give each error the same notes (with their lines)
    and the same fixes; `--no-fixes` drops the fixes."""
    source = tmp_path / "moved.pp"
    source.write_text(MOVED)
    code, _, text = _run(capsys, "check", str(source))
    assert code == 1
    code, out, _ = _run(capsys, "check", "--json", str(source))
    assert code == 1
    diagnostics = json.loads(out)["diagnostics"]
    assert diagnostics and diagnostics[0]["fixes"]
    for d in diagnostics:
        for note in d["notes"]:
            where = note["location"]
            line = f"  {where['file']}:{where['line']}: {note['message']}" if where else note["message"]
            assert line in text.split("\n")
        for fix in d["fixes"]:
            assert f"  help: {fix['description']}" in text.split("\n")
            for edit in fix["edits"]:
                assert set(edit) == {"line", "column", "end_line", "end_column", "text"}
                assert f"{source}:{edit['line']}: " in text
    code, out, _ = _run(capsys, "check", "--json", "--no-fixes", str(source))
    assert not any(d["fixes"] for d in json.loads(out)["diagnostics"])


def test_fix_of_a_missing_file_is_invalid_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`ppdsl fix` on no file says so and exits 1, as `ppdsl check` does."""
    code, _, err = _run(capsys, "fix", str(tmp_path / "nope.pp"))
    assert code == 1
    assert "no such file" in err and "Traceback" not in err
