"""A measured timeline: `ppdsl run --trace` writes every rank's passes as one
Chrome/Perfetto trace, and the closing summary sets the measured step time
against the simulator's makespan, on sleep-timed stages whose pass times are
known. (The <= 1.05 target is a benchmark: `python -m bench timeline`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ppdsl.compiler import compile_file
from ppdsl.costs_file import load_costs_file
from ppdsl.ir.schedule import PassKind
from ppdsl.runtime.execution.trace import Tracer, chrome_trace
from ppdsl.runtime.measure.launch import launch
from tests.paths import ROOT
from tests.trace_conformance import assert_trace_conforms

SLEEPY = str(ROOT / "examples" / "models" / "sleepy.py") + ":stages"
SLEEP = {"F": 20.0, "B": 20.0, "W": 10.0}


def test_tracer_times_slices_on_cpu() -> None:
    """A slice's duration is the time between begin and end; pass durations are kept
    only for timed steps; events carry the step."""
    tracer = Tracer(3, torch.device("cpu"))
    tracer.start()
    for step, timed in ((0, False), (1, True)):
        tracer.step, tracer.timed = step, timed
        tracer.begin()
        time.sleep(0.01)
        tracer.end("F0", "F", {"stage": 2, "microbatch": 0}, ("F", 2))
        tracer.flush()
    first, second = tracer.events
    assert first["pid"] == 3 and first["args"]["step"] == 0 and second["args"]["step"] == 1
    assert second["ts"] >= first["ts"] + first["dur"] and first["dur"] >= 10_000
    assert list(tracer.durations) == [("F", 2)] and len(tracer.durations[("F", 2)]) == 1
    trace = chrome_trace([tracer.events], ["rank 3"], {})
    assert trace["traceEvents"][0]["args"]["name"] == "rank 3"


# The makespans at d=2, m=4 under F=20, B=20, W=10 (BW=30), comm 0, in closed
# form (the zero-bubble paper's §3.1, whose ZB-H1 docs/language.md writes out):
# 1F1B runs m + d - 1 steps of F + B + W; ZB-H1 m of them, plus d - 1 of F + B - W.
CLOSED_FORM_MS = {"1f1b": (4 + 2 - 1) * 50.0, "zb_h1": 4 * 50.0 + (2 - 1) * (20 + 20 - 10)}


@pytest.mark.distributed
@pytest.mark.parametrize("stem", ["1f1b", "zb_h1"])
def test_run_trace_and_predicted_step_time(tmp_path: Path, stem: str) -> None:
    """`ppdsl run --trace --costs-from` on sleepy stages, d=2: the trace holds, per
    rank and step, exactly the rank's passes in the compiled order, each lasting at
    least its sleep; the summary's prediction is the schedule's closed-form
    makespan under the costs file (250 ms, 230 ms), and the measured step time is
    at least it and well below running the ranks one after another; `ppdsl trace`
    finds the trace conforming to the rank programs and reports it beside the
    same prediction, and `-o` writes the run's own costs (docs/runtime.md)."""
    costs = tmp_path / "sleepy.pp"
    costs.write_text(
        "schedule sleepy {\n    let profiled_stages = 2\n    cost F = 20\n    cost B = 20\n"
        "    cost W = 10\n    cost BW = 30\n    cost comm = 0\n}\n"
    )
    schedule = ROOT / "examples" / f"{stem}.pp"
    trace_path, json_dir = tmp_path / "trace.json", tmp_path / "out"
    env = dict(os.environ, PPDSL_SLEEP_MS="F=20,B=20,W=10",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "ppdsl", "run", str(schedule), "-D", "d=2", "-D", "m=4",
         "--model", SLEEPY, "--steps", "3", "--costs-from", str(costs), "--trace",
         str(trace_path), "--json", str(json_dir)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "measured/predicted" in proc.stdout and str(trace_path) in proc.stdout
    compiled = compile_file(schedule, {"d": "2", "m": "4"}, costs=load_costs_file(costs))
    trace = json.loads(trace_path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 (stages 0)", 1: "rank 1 (stages 1)"}
    for rank, order in enumerate(compiled.schedule.orders):
        for step in range(3):
            passes = sorted(
                (e for e in slices if e["pid"] == rank and e["args"]["step"] == step
                 and e["cat"] in ("F", "B", "W", "BW")),
                key=lambda e: e["ts"],
            )
            assert [e["name"] for e in passes] == [f"{p.kind.value}{p.microbatch}" for p in order]
            for e in passes:
                sleep = SLEEP["B"] + SLEEP["W"] if e["cat"] == "BW" else SLEEP[e["cat"]]
                assert e["dur"] >= sleep * 1e3 and e["ts"] >= 0, e
    assert_trace_conforms(trace_path)
    own = tmp_path / "own.pp"
    report = subprocess.run([sys.executable, "-m", "ppdsl", "trace", str(trace_path),
                             "--costs-from", str(costs), "-o", str(own)],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert report.returncode == 0, report.stderr
    # the run's own costs (`-o`): each pass at least its sleep; the kinds this
    # schedule never ran (B and W of the fused 1F1B) are the costs file's
    measured = compile_file(schedule, {"d": "2", "m": "4"}, costs=load_costs_file(own)).schedule
    ran = {"1f1b": {"F": 20, "BW": 30}, "zb_h1": {"F": 20, "B": 20, "W": 10}}[stem]
    for kind, sleep in {"F": 20, "B": 20, "W": 10, "BW": 30}.items():
        values = measured.costs.per_stage(PassKind(kind))
        assert all(sleep < v < 3 * sleep for v in values) if kind in ran else \
            values == (sleep, sleep), (kind, values)
    assert measured.costs.overhead and measured.costs.optimizer, own.read_text()
    for rank in (0, 1):  # the profile's F = 20 ms beside the measured median
        assert f"   {rank}  F            4" in report.stdout and "20.000" in report.stdout
    assert f"predicted {CLOSED_FORM_MS[stem]:.3f} ms under the schedule's costs" in report.stdout
    result = json.loads((json_dir / "rank0.json").read_text())
    assert result["predicted_step_time_ms"] == pytest.approx(CLOSED_FORM_MS[stem])
    ratio = result["median_step_time_ms"] / result["predicted_step_time_ms"]
    # sleeps cannot finish early; the ranks one after another would take
    # 2 x 4 x 50 = 400 ms (ratio 1.6 and 1.74): a loose bound, the cores are shared
    # (20 ms sleeps: the runtime's few ms per pass on a loaded core are a small share)
    assert 0.95 <= ratio <= 1.5, ratio


def _timed_slices(tracer: Tracer, slices: list[tuple[str, str, float, tuple[str, int] | None]]) -> None:
    """Record `slices` (name, category, ms, pass key) as one timed step."""
    tracer.timed = True
    for name, category, ms, key in slices:
        tracer.begin()
        time.sleep(ms / 1e3)
        tracer.end(name, category, {}, key)
    tracer.flush()


def test_summary_names_the_gap_sources(tmp_path: Path) -> None:
    """A costs file that says passes take a tenth of what they take: the run's summary
    (ppdsl/runtime/training/train.py `timing_summary`, docs/runtime.md) names the passes as
    the largest source of the gap, with the rank and both times, and says when the
    ranks outnumber the cores; under costs that match, measured/predicted stays
    under 1.10 and no gap is named."""
    from ppdsl.runtime.execution.pipeline import load_schedule
    from ppdsl.runtime.training.summary import predictions, timing_summary

    def plan_for(forward: float, backward: float) -> object:
        costs = tmp_path / f"costs{forward}.pp"
        costs.write_text(f"schedule c {{\n    cost F = {forward}\n    cost BW = {backward}\n"
                         "    cost optimizer = 1\n}\n")
        return load_schedule(ROOT / "examples" / "1f1b.pp", {"d": 2, "m": 2},
                             costs_from=costs).plan

    durations = []
    for rank in (0, 1):
        tracer = Tracer(rank, torch.device("cpu"))
        tracer.start()
        passes = [("F0", "F", 10.0, ("F", rank)), ("F1", "F", 10.0, ("F", rank)),
                  ("BW0", "BW", 20.0, ("BW", rank)), ("BW1", "BW", 20.0, ("BW", rank))]
        _timed_slices(tracer, [*passes, ("exchange", "exchange", 1.0, None),
                               ("optimizer", "optimizer", 1.0, None)])
        durations.append(tracer.durations)
    assert ("optimizer", -1) in durations[0] and ("exchange", -1) in durations[1]
    # 1F1B at d=2, m=2 under F 10, BW 20: rank 1 runs F0 BW0 F1 BW1 from 10 to 70
    # back to back, rank 0 its BW1 from 70 to 90; then the optimizer step (1 ms)
    step_ms = 10 + (10 + 20) * 2 + 20 + 1
    wrong = plan_for(1, 2)
    mine = predictions(wrong, durations, [step_ms / 1e3])  # type: ignore[arg-type]
    text = timing_summary(wrong, mine)  # type: ignore[arg-type]
    assert "the gap (more than 1.10x)" in text, text
    first = text.split("the gap")[1].splitlines()[1].strip()
    assert first.startswith("passes: rank ") and "predicted 6.0 ms" in first, text
    assert "oversubscribed" not in text or (os.cpu_count() or 1) < 2
    mine["cores"] = 1  # two ranks on one core: the summary says so
    assert "oversubscribed (2 ranks on 1 cores): " in timing_summary(wrong, mine)  # type: ignore[arg-type]
    right = plan_for(10, 20)
    mine = predictions(right, durations, [step_ms / 1e3])  # type: ignore[arg-type]
    assert mine["predicted_step_time_ms"] == step_ms
    text = timing_summary(right, mine)  # type: ignore[arg-type]
    assert mine["median_step_time_ms"] / mine["predicted_step_time_ms"] < 1.10, text
    assert "the gap" not in text


_EPOCHS = """
import json, os, sys, time
import torch
import torch.distributed as dist
from ppdsl.runtime.execution.trace import Tracer
dist.init_process_group("gloo")
rank = dist.get_rank()
tracer = Tracer(rank, torch.device("cpu"))
dist.barrier()
if rank == 1:  # a rank that leaves the barrier late (a busy core)
    time.sleep(json.loads(sys.argv[1]))
tracer.start()
dist.barrier()
tracer.begin()
tracer.end("data", "data", {}, None)
tracer.flush()
every = [None] * 2
dist.all_gather_object(every, [tracer.events[0]["ts"], tracer.shared_clock])
if rank == 0:
    print(json.dumps(every), flush=True)
dist.barrier()
# skip the teardown, where gloo's threads may end the process with "terminate
# called without an active exception" (as ppdsl.runtime.measure.gloo_worker's pipeline job does)
os._exit(0)
"""


@pytest.mark.distributed
def test_ranks_on_one_host_share_the_first_ranks_epoch() -> None:
    """Two gloo ranks on this host, the second taking its epoch 0.3 s late: it
    takes the first rank's (the host's monotonic clock), so a slice both record
    right after a common barrier starts at the same time in both (within
    50 ms), not 0.3 s apart; both say their clock is shared."""
    (ts0, shared0), (ts1, shared1) = launch(["-c", _EPOCHS], 2, 0.3, 120, "two tracers")
    assert shared0 and shared1
    assert abs(ts0 - ts1) < 50e3, (ts0, ts1)
    assert ts1 > 250e3  # times run from the first rank's epoch, before the late one's
