"""The smaller edges of issue 14, each as a unit: torchrun's failure report names
the dead rank, a user model's import error carries its file:line, `require`
states a schedule's range, the limits are located and name their flag."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from ppdsl import limits
from ppdsl.commands.run import _describe_failures, _filter_torchrun
from ppdsl.compiler import compile_source
from ppdsl.diagnostics import CompileError
from ppdsl.frontend.ast import format_module
from ppdsl.frontend.parse import parse

_TORCHRUN_FAILURE = """rank 0: step 3 waits for rank 1
Traceback (most recent call last):
  File "/usr/lib/python3.11/site-packages/torch/distributed/run.py", line 9, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
launch.py FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)
  traceback : Signal 9 (SIGKILL) received by PID 12
============================================================
"""


def test_torchrun_report_names_the_killed_rank() -> None:
    """The box torchrun prints is dropped from the output, and the ranks it names
    (a killed one by its signal) come back for ppdsl's own last line."""
    out = io.StringIO()
    failed = _filter_torchrun(iter(_TORCHRUN_FAILURE.splitlines(keepends=True)), out)
    assert out.getvalue() == "rank 0: step 3 waits for rank 1\n"
    assert _describe_failures(failed) == "rank 0 exit code 1, rank 1 killed by SIGKILL"
    stopped = [(0, -15), (1, -9)]  # torchrun stops the survivors with SIGTERM
    assert _describe_failures(stopped) == "rank 1 killed by SIGKILL, rank 0 stopped by torchrun (SIGTERM)"


def test_model_import_error_has_file_and_line(tmp_path: Path) -> None:
    """An exception raised while importing the user's model file is reported at its line."""
    from ppdsl.runtime.models.model import ModelError, load_factory

    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n\nraise ValueError('no data')\n")
    with pytest.raises(ModelError, match=rf"failed at {bad}:3: ValueError"):
        load_factory(f"{bad}:stages")
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def f(:\n")
    with pytest.raises(ModelError, match=rf"failed at {syntax}:1"):
        load_factory(f"{syntax}:f")


_REQUIRE = """schedule r {
    param d = 2
    param m = 4
    require m >= 2*d, "this order needs two microbatches per device"
    order { for j in 0..m { F(j); B(j); W(j) } }
}
"""


def test_require_is_located_with_its_message_and_values() -> None:
    """A false `require` is an error at its line quoting the message and d, m."""
    with pytest.raises(CompileError) as info:
        compile_source(_REQUIRE, "r.pp", {"m": "3"})
    (diag,) = info.value.diagnostics
    assert diag.span is not None and (diag.span.line, diag.span.column) == (4, 5)
    assert diag.message == (
        "this order needs two microbatches per device: this schedule requires "
        "m >= 2 * d (here d = 2, m = 3)"
    )
    assert compile_source(_REQUIRE, "r.pp").schedule.num_microbatches == 4


def test_require_round_trips_through_the_printer() -> None:
    """The canonical printer writes `require` back as the parser reads it."""
    module = parse(_REQUIRE, "r.pp")
    assert parse(format_module(module), "r.pp").stmts[2].message == module.stmts[2].message
    assert 'require m >= 2 * d, "this order needs' in format_module(module)


@pytest.mark.parametrize(
    ("limit", "value", "text", "flag"),
    [
        ("passes", 100, _REQUIRE.replace("param m = 4", "param m = 40"), "--max-passes"),
        ("loop_iterations", 5, _REQUIRE, "--max-loop-iterations"),
        ("integer_bits", 8, _REQUIRE.replace("param m = 4", "param m = 4000"), "--max-integer-bits"),
        ("source_bytes", 100, _REQUIRE, "--max-source-bytes"),
        ("depth", 5, _REQUIRE, "--max-depth"),
    ],
)
def test_each_limit_is_located_and_names_its_flag(limit: str, value: int, text: str, flag: str) -> None:
    """Lowering a limit below what a small file needs refuses it, located, with the
    size and the flag; the default limits accept it."""
    compile_source(text, "r.pp")
    with limits.using(limits.Limits(**{limit: value})), pytest.raises(CompileError) as info:
        compile_source(text, "r.pp")
    (diag,) = info.value.diagnostics
    assert diag.span is not None and diag.span.file == "r.pp"
    assert flag in diag.message and f"limit is {value:,}" in diag.message


def test_long_compile_reports_its_phase(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """With progress on, a compile past the first delay prints its phase and time on
    stderr; with PPDSL_PROGRESS=0 it prints nothing."""
    import time

    monkeypatch.setattr(limits, "_PROGRESS_AFTER", 0.01)
    monkeypatch.setattr(limits, "_PROGRESS_EVERY", 0.01)
    monkeypatch.setenv("PPDSL_PROGRESS", "1")
    with limits.progress("big.pp") as phase:
        phase("elaborate")
        time.sleep(0.2)
    assert "ppdsl: big.pp: elaborate... 0 s" in capsys.readouterr().err
    monkeypatch.setenv("PPDSL_PROGRESS", "0")
    with limits.progress("big.pp") as phase:
        time.sleep(0.1)
    assert capsys.readouterr().err == ""


def test_a_long_line_is_quoted_as_a_window_around_the_caret() -> None:
    """An error deep in a very long line quotes about 120 characters around it,
    the caret still under the offending name, not the whole line."""
    from ppdsl.diagnostics import render

    ones = "+".join(["1"] * 90)
    source = f"schedule s {{\n    param d = 2\n    param m = 2\n    let x = {ones} + y + {ones}\n}}\n"
    with pytest.raises(CompileError) as info:
        compile_source(source, "long.pp")
    (diag,) = info.value.diagnostics
    _, quoted, caret = render(diag).splitlines()[:3]
    assert len(quoted) < 140 and quoted.strip().startswith("...") and quoted.endswith("...")
    assert quoted[caret.index("^")] == "y"
