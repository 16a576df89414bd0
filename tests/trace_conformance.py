"""The conformance check every runtime test runs on the trace it writes
(`ppdsl trace TRACE.json --check-only`, docs/runtime.md), and a trace made
from the rank programs themselves, for tests that mutate one."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from ppdsl.cli import main
from ppdsl.compiler import Compiled
from ppdsl.ir.rank import Compute


def check_trace(trace: str | Path, *against: str) -> tuple[int, str, str]:
    """`ppdsl trace TRACE --check-only [against...]`: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["trace", str(trace), "--check-only", *against])
    return code, out.getvalue(), err.getvalue()


def assert_trace_conforms(trace: str | Path, *against: str) -> None:
    """Fail unless the trace conforms to the rank programs of its schedule."""
    code, out, err = check_trace(trace, *against)
    assert code == 0 and "conforms" in out, err


def trace_of_programs(compiled: Compiled, num_steps: int, file: str) -> dict[str, Any]:
    """A trace as `ppdsl run --trace` writes it of running `compiled`'s programs
    op by op, 1 ms a pass and 0.1 ms an exchange, one rank after another."""
    events: list[dict[str, Any]] = []
    for program in compiled.programs:
        ts = 0.0
        for step in range(num_steps):
            for op in program.ops:
                if isinstance(op, Compute):
                    p = op.pass_
                    events.append({"name": f"{p.kind.value}{p.microbatch}", "cat": p.kind.value,
                                   "ph": "X", "pid": program.rank, "tid": 0, "ts": ts,
                                   "dur": 1000.0,
                                   "args": {"stage": p.stage, "microbatch": p.microbatch,
                                            "step": step}})
                    ts += 1000.0
                elif op.sends or op.recvs:
                    events.append({"name": "exchange", "cat": "exchange", "ph": "X",
                                   "pid": program.rank, "tid": 0, "ts": ts, "dur": 100.0,
                                   "args": {"sends": [str(t) for t in op.sends],
                                            "recvs": [str(t) for t in op.recvs], "step": step}})
                    ts += 100.0
            events.append({"name": "optimizer", "cat": "optimizer", "ph": "X",
                           "pid": program.rank, "tid": 0, "ts": ts, "dur": 500.0,
                           "args": {"step": step}})
            ts += 500.0
    params = {str(k): v for k, v in compiled.schedule.params}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": compiled.schedule.name, "file": file, "params": params,
                          "costs_from": None}}


def write_trace(path: Path, trace: dict[str, Any]) -> Path:
    """Write `trace` as JSON at `path`; returns `path`."""
    path.write_text(json.dumps(trace))
    return path
