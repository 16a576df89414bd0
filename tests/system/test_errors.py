"""Bad inputs: every tests/errors/*.pp is headed by the exact first diagnostic it must
produce; the compiler reports it, the CLI exits 1, and no traceback ever shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppdsl.cli import main
from ppdsl.compiler import compile_file
from ppdsl.diagnostics import CompileError, render

ROOT = Path(__file__).resolve().parents[2]
ERRORS = sorted((ROOT / "tests" / "errors").glob("*.pp"))
# run through the real CLI as a subprocess (slower), one of each kind of failure
CLI_CASES = (
    "unclosed_brace.pp",
    "undefined_name.pp",
    "fused_uses_w.pp",
)


def expected_line(path: Path) -> str:
    first = path.read_text(encoding="utf-8").split("\n", 1)[0]
    assert first.startswith("# expect: "), f"{path.name} must start with '# expect: '"
    return first.removeprefix("# expect: ")


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "ppdsl", "check", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_there_are_enough_error_files():
    """The error corpus covers at least 15 distinct mistakes."""
    assert len(ERRORS) >= 15


@pytest.mark.parametrize("path", ERRORS, ids=lambda p: p.stem)
def test_error_file_reports_its_diagnostic(path: Path, monkeypatch: pytest.MonkeyPatch):
    """compile_file on the file raises CompileError whose first rendered line is the
    one the file's header names."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(CompileError) as info:
        compile_file(relative(path))
    first = render(info.value.diagnostics[0]).split("\n", 1)[0]
    assert first == expected_line(path)


@pytest.mark.slow
@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_reports_error_file(name: str):
    """`ppdsl check FILE` prints the expected first line, exits 1, no traceback."""
    path = ROOT / "tests" / "errors" / name
    result = run_cli(relative(path))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.split("\n", 1)[0] == expected_line(path)


OK_SOURCE = (
    "schedule s {\n  param d = 2\n  param m = 2\n  backward fused\n"
    "  order { for j in 0..m { F(j) }; for j in 0..m { BW(j) } }\n}\n"
)


@pytest.mark.parametrize(
    ("define", "message"),
    [
        (
            "mm=3",
            "ppdsl: error: -D mm=3: no param 'mm' in this schedule; did you mean 'm'? "
            "(params: d, m)",
        ),
        (
            "m=abc",
            "ppdsl: error: -D m=abc: 'abc' is not a number (give an integer, a rational "
            "such as 3/2, or an expression over earlier params such as 2*d)",
        ),
        (
            "m=1/2",
            "ppdsl: error: -D m=1/2: m (the number of microbatches) must be a positive "
            "integer, got 1/2",
        ),
        (
            "d=0",
            "ppdsl: error: -D d=0: d (the number of devices) must be a positive integer, got 0",
        ),
        ("m=3+", "ppdsl: error: -D m=3+: not a number or an expression over earlier params"),
    ],
)
def test_cli_bad_override(define: str, message: str, tmp_path: Path, capsys):
    """A bad `-D` is reported against the command line, exit 1, no traceback."""
    source = tmp_path / "ok.pp"
    source.write_text(OK_SOURCE)
    assert main(["check", "-D", define, str(source)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert captured.err.split("\n", 1)[0] == message


def test_cli_subprocess_bad_override(tmp_path: Path):
    """The real CLI process reports an unknown `-D` param with exit 1."""
    source = tmp_path / "ok.pp"
    source.write_text(OK_SOURCE)
    result = run_cli("-D", "mm=3", str(source))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith("ppdsl: error: -D mm=3: no param 'mm' in this schedule")


def test_cli_good_override(tmp_path: Path, capsys):
    """A `-D` expression over earlier params is accepted."""
    source = tmp_path / "ok.pp"
    source.write_text(OK_SOURCE)
    assert main(["check", "-D", "m=3*d", str(source)]) == 0
    assert "6 microbatches" in capsys.readouterr().out
