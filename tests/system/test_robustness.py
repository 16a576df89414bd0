"""Never a traceback, never a hang: a corpus of bad, hostile and oversized inputs,
built here, run through every command as real processes under a time and memory
cap (`resource.setrlimit`). Every case must end with its exit code (1 invalid
input, 2 usage) and a message, never `Traceback` or exit 3.

The cases share a few driver processes (each runs `ppdsl.cli.main` once per case,
with an alarm as the per-case time cap) so the corpus stays fast; a handful run as
their own `python -m ppdsl` to check the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ZB_H1 = str(EXAMPLES / "zb_h1.pp")
MEMORY_CAP = 3 << 30  # bytes of address space per process
CASE_SECONDS = 20  # a case past this is a hang

# Runs each argv of a JSON list through ppdsl's CLI in this process: an alarm per
# case, stderr captured, the exit code and output written back as JSON.
_DRIVER = textwrap.dedent(
    """
    import contextlib, io, json, resource, signal, sys
    cap, seconds = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    from ppdsl.cli import main
    class Hang(BaseException):
        pass
    def alarm(*_):
        raise Hang()
    signal.signal(signal.SIGALRM, alarm)
    results = []
    for argv in json.load(sys.stdin):
        out, err = io.StringIO(), io.StringIO()
        signal.alarm(seconds)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
        except Hang:
            code = "hang"
        except BaseException as exc:
            code = "escaped " + type(exc).__name__
        signal.alarm(0)
        results.append([code, err.getvalue()[:4000], out.getvalue()[-500:]])
    json.dump(results, sys.stdout)
    """
)


def _run_all(argvs: list[list[str]], cwd: Path) -> list[tuple[object, str, str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PPDSL_PROGRESS="0")
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(MEMORY_CAP), str(CASE_SECONDS)],
        input=json.dumps(argvs), capture_output=True, text=True, cwd=cwd, env=env,
        timeout=CASE_SECONDS * len(argvs) + 60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(r) for r in json.loads(done.stdout)]


def _pp(body: str, params: str = "param d = 2\n    param m = 4") -> str:
    return f"schedule x {{\n    {params}\n{body}\n    order {{ for j in 0..m {{ F(j); B(j); W(j) }} }}\n}}\n"


def _corpus(tmp: Path) -> list[tuple[list[str], int, str]]:
    """(argv, exit code, a piece of the message) for every hostile input."""
    def write(name: str, text: str | bytes) -> str:
        path = tmp / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
        return str(path)

    nine = "9" * 400
    files = {
        "bigint": write("bigint.pp", _pp(f"    let x = {nine}")),
        "bigloop": write("bigloop.pp", _pp("") .replace(
            "for j in 0..m { F(j); B(j); W(j) }",
            "for a in 0..10000000000000000000000000000000 { F(0) }")),
        "longline": write("longline.pp", _pp("    let x = " + "+".join(["1"] * 1_000_000))),
        "deep": write("deep.pp", _pp("    let x = " + "(" * 3000 + "1" + ")" * 3000)),
        "chain": write("chain.pp", _pp("    let x = " + "+".join(["1"] * 3000))),
        "squares": write("squares.pp", _pp("    let x0 = 3\n" + "".join(
            f"    let x{k + 1} = x{k} * x{k}\n" for k in range(30)))),
        "nested": write("nested.pp", _pp("").replace(
            "order {", "order {\n for a in 0..1000 { for b in 0..1000 { for c in 0..1000 { } } }\n")),
        "bom": write("bom.pp", "\ufeff" + (EXAMPLES / "zb_h1.pp").read_text()),
        "empty": write("empty.pp", ""),
        "binary": write("binary.pp", bytes(range(256)) * 4),
        "latin1": write("latin1.pp", "schedule caf\xe9 {}".encode("latin-1")),
        "nul": write("nul.pp", "schedule x {\x00}"),
        "memexp": write("memexp.pp", _pp(
            "    expect peak_memory <= 0\n    expect makespan == 1\n    expect bubble == 0")),
        "csv_big": write("big.csv", "0F" + "1" * 30 + "\n"),
        "csv_m": write("m.csv", "0F999999\n"),
        "csv_ok": write("ok.csv", "0F0,0I0,0W0\n"),
        "file": write("a_file", "x"),
    }
    (tmp / "a_dir").mkdir(exist_ok=True)
    under_file = str(tmp / "a_file" / "sub")
    digits = "9" * 300
    return [
        (["check", files["bigint"]], 1, "--max-integer-bits"),
        (["check", files["bigloop"]], 1, "--max-integer-bits"),
        (["check", files["longline"]], 1, "--max-source-bytes"),
        (["check", files["deep"]], 0, "ok"),  # parentheses alone add no level
        (["check", files["chain"]], 1, "--max-depth"),
        (["check", files["squares"]], 1, "--max-integer-bits"),
        (["check", files["nested"]], 1, "--max-loop-iterations"),
        (["check", files["nested"], "--max-loop-iterations", "x"], 2, "--max-loop-iterations"),
        (["check", ZB_H1, "-D", "d=65536", "-D", "m=65536"], 1, "--max-passes"),
        (["check", ZB_H1, "-D", "m=1000000"], 1, "--max-passes"),
        (["check", ZB_H1, "-D", "m=2000", "--max-passes", "10"], 1, "--max-passes"),
        (["check", files["bom"]], 0, "ok"),
        (["check", files["empty"]], 1, "empty file"),
        (["check", files["binary"]], 1, "cannot read"),
        (["check", files["latin1"]], 1, "cannot read"),
        (["check", files["nul"]], 1, "error"),
        (["check", str(tmp / "a_dir")], 1, "directory"),
        (["check", str(tmp / "missing.pp")], 1, "no such file"),
        (["check", files["memexp"]], 1, "makespan is 20"),
        (["check", ZB_H1, "-D", "d=2\nm=3"], 2, "one line"),
        (["check", ZB_H1, "-D", "x"], 2, "NAME=VALUE"),
        (["check", ZB_H1, "-D", f"d={digits}"], 1, "--max-integer-bits"),
        (["check", ZB_H1, "-D", "d=0"], 1, "positive integer"),
        (["check", str(EXAMPLES / "zb_v.pp"), "-D", "m=3"], 1, "requires m >= 2 * d - 1"),
        (["check", str(EXAMPLES / "dualpipe_v.pp"), "-D", "m=3"], 1, "m >= 2d"),
        (["compile", ZB_H1, "-o", files["file"]], 2, "not a directory"),
        (["compile", ZB_H1, "-o", under_file], 2, "is a file"),
        (["export", ZB_H1, "-o", under_file], 2, "cannot write"),
        (["export", ZB_H1, "-o", str(tmp / "a_dir")], 2, "is a directory"),
        (["show", ZB_H1, "--svg", under_file], 2, "cannot write"),
        (["show", ZB_H1, "--width", "0"], 2, "--width 0"),
        (["import", files["csv_big"]], 1, "more than 7 digits"),
        (["import", files["csv_m"]], 1, "--max-passes"),
        (["import", files["csv_ok"], "--devices", "-1"], 2, "--devices -1"),
        (["import", files["csv_ok"], "-o", str(tmp / "a_dir")], 2, "is a directory"),
        (["import", files["csv_ok"], "-o", under_file], 2, "cannot write"),
        (["search", "-d", "4", "-m", "8", "--memory", "2p", "--name", "x } schedule y {"], 2, "--name"),
        (["search", "-d", "100000", "-m", "8", "--memory", "2p"], 2, "--max-passes"),
        (["search", "-d", "4", "-m", "10000000", "--memory", "2p"], 2, "--max-passes"),
        (["search", "-d", "4", "-m", "8", "--memory", "0"], 2, "--memory 0"),
        (["search", "-d", "4", "-m", "8", "--memory", "2p", "-o", under_file], 2, "cannot write"),
        (["run", ZB_H1, "--model", "examples/models/tiny_gpt.py:stages", "--steps", "0"], 2, "--steps 0"),
        (["run", ZB_H1, "--model", "no/such.py:f"], 2, "no such file"),
        (["bound", files["bigint"]], 1, "--max-integer-bits"),
        (["stats", files["longline"]], 1, "--max-source-bytes"),
        (["compare", files["bigint"], ZB_H1], 1, "--max-integer-bits"),
    ]


@pytest.mark.slow
def test_hostile_corpus(tmp_path: Path) -> None:
    """Every hostile input ends in seconds with its exit code and message, under a
    memory cap, and no traceback."""
    corpus = _corpus(tmp_path)
    results = _run_all([argv for argv, _, _ in corpus], ROOT)
    wrong = []
    for (argv, code, piece), (got, err, out) in zip(corpus, results, strict=True):
        shown = " ".join(a if len(a) < 60 else a[:60] + "..." for a in argv)
        if got != code or "Traceback" in err or piece not in err + out:
            wrong.append(f"ppdsl {shown}: exit {got} (want {code}, {piece!r}):\n{err[-600:]}")
    assert not wrong, "\n\n".join(wrong)


@pytest.mark.slow
def test_real_entry_point_exit_codes(tmp_path: Path) -> None:
    """`python -m ppdsl` itself maps a limit to exit 1 and a bad path to exit 2."""
    big = tmp_path / "big.pp"
    big.write_text(_pp("    let x = " + "+".join(["1"] * 200_000)))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for argv, code in ((["check", str(big)], 1), (["compile", ZB_H1, "-o", str(big)], 2)):
        done = subprocess.run([sys.executable, "-m", "ppdsl", *argv], capture_output=True,
                              text=True, env=env, timeout=60)
        assert done.returncode == code, done.stderr
        assert "Traceback" not in done.stderr


_DEFINE_NAMES = st.sampled_from(["d", "m", "x", "", "d d", "m\n"])
_DEFINE_VALUES = st.one_of(
    st.integers(-10, 10).map(str),
    st.integers(10**15, 10**40).map(str),
    st.sampled_from(["", "2*d", "1/0", "d..m", "(((", "m", "1e5", "0.5", "-0", "\n", "2;3", "é"]),
    st.text(alphabet="0123456789+-*/()dm .", max_size=12),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    defines=st.lists(st.tuples(_DEFINE_NAMES, _DEFINE_VALUES), max_size=3),
    output=st.sampled_from(["new_dir", "a_file", "a_file/sub", "a_dir", "", "missing/x/y"]),
)
def test_mutated_defines_and_outputs(tmp_path: Path, defines, output: str) -> None:
    """Any -D values and output paths give exit 0, 1 or 2 with a message, never a
    traceback; a -D that is no NAME=VALUE is a usage error."""
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir(exist_ok=True)
    argv = [a for name, value in defines for a in ("-D", f"{name}={value}")]
    commands = [["check", ZB_H1, *argv], ["export", ZB_H1, *argv, "-o", str(tmp_path / output)]]
    from ppdsl.cli import main

    for command in commands:
        err = _capture(main, command)
        code, text = err
        assert code in (0, 1, 2), text
        assert "Traceback" not in text and (code == 0 or "error" in text), text


def _capture(main, argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()
