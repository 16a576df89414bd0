"""`ppdsl trace TRACE.json`: a run's trace beside the simulation, and its
conformance to the proven rank programs (docs/runtime.md, "Where the time goes")."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from ppdsl.cli import main
from ppdsl.compiler import compile_file
from tests.trace_conformance import check_trace, trace_of_programs, write_trace

ROOT = Path(__file__).resolve().parents[2]
ZB_H1 = str(ROOT / "examples" / "zb_h1.pp")


@pytest.fixture(scope="module")
def compiled():  # type: ignore[no-untyped-def]
    return compile_file(ZB_H1, {"d": "2", "m": "4"})


def _passes(trace: dict, rank: int, step: int) -> list[int]:
    return [i for i, e in enumerate(trace["traceEvents"])
            if e["pid"] == rank and e["args"]["step"] == step and e["cat"] in ("F", "B", "W")]


def test_programs_own_trace_conforms_and_is_reported(tmp_path: Path, compiled) -> None:  # type: ignore[no-untyped-def]
    """A trace that runs each rank program op by op conforms, and the report lays
    out per-rank, per-kind measured durations, time outside passes and slips."""
    path = write_trace(tmp_path / "t.json", trace_of_programs(compiled, 3, ZB_H1))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["trace", str(path)]) == 0
    text = out.getvalue()
    assert "conforms to the rank programs of zb_h1 (2 ranks, 3 steps" in text
    assert "   0  F            4        1.000" in text
    assert "exchange  optimizer" in text and "passes held longest" in text
    assert "no prediction in ms" in text
    # rank 0: 12 passes of 1 ms, 5 exchanges of 0.1 ms, an optimizer step of 0.5 ms
    assert "   0    13.000    12.000      0.500      0.500      0.000      0.000" in text


def test_time_outside_passes_by_cause() -> None:
    """Gaps no slice covers are `other`, each slice's time goes to its cause, and
    the step is the slowest rank's window (docs/runtime.md, "Where the time goes")."""
    from ppdsl.analysis.trace_check import steps_of
    from ppdsl.analysis.trace_timeline import compare_timeline

    compiled = compile_file(ZB_H1, {"d": "2", "m": "4"})
    trace = trace_of_programs(compiled, 2, ZB_H1)
    for e in trace["traceEvents"]:  # rank 1's step 1 starts 2 ms late: a gap before its F0
        if e["pid"] == 1 and e["args"]["step"] == 1:
            e["ts"] += 2000.0
    trace["traceEvents"].append({"name": "data", "cat": "data", "ph": "X", "pid": 1, "tid": 0,
                                 "ts": 13200.0, "dur": 300.0, "args": {"step": 1}})
    report = compare_timeline(steps_of(trace), compiled.schedule, costs_in_ms=False)
    assert report.steps == (1,)
    assert report.outside_ms[1] == pytest.approx(
        {"exchange": 0.7, "optimizer": 0.5, "data": 0.3, "other": 1.7})
    assert report.step_ms[1] == pytest.approx(15.2) and report.measured_step_ms == pytest.approx(15.2)
    assert report.predicted_step_ms is None


def test_prediction_is_the_whole_step(tmp_path: Path) -> None:
    """Under costs with step costs (docs/language.md: overhead, optimizer, norm) the
    trace's prediction is the simulated whole step, and the re-simulation under the
    run's own pass times keeps those step costs."""
    from ppdsl.analysis.trace_check import steps_of
    from ppdsl.analysis.trace_timeline import compare_timeline
    from ppdsl.costs_file import load_costs_file

    costs = tmp_path / "costs.pp"
    costs.write_text("schedule c {\n    cost F = 1\n    cost B = 1\n    cost W = 1\n"
                     "    cost overhead = 0.25\n    cost optimizer = 2\n    cost norm = 0.5\n}\n")
    compiled = compile_file(ZB_H1, {"d": "2", "m": "4"}, costs=load_costs_file(costs))
    trace = trace_of_programs(compiled, 2, ZB_H1)
    report = compare_timeline(steps_of(trace), compiled.schedule, costs_in_ms=True)
    assert report.predicted_step_ms == compiled.timeline.step_time
    assert report.predicted_step_ms == compiled.timeline.makespan + 0.5 + 2
    # the trace's passes last 1 ms, as the costs say: the same step again
    assert report.resimulated_step_ms == pytest.approx(report.predicted_step_ms)


def test_swapped_passes_fail_with_located_message(tmp_path: Path, compiled) -> None:  # type: ignore[no-untyped-def]
    """Two passes of one rank run in the other order: exit 1, naming the trace,
    rank, step and where the order differs."""
    trace = trace_of_programs(compiled, 2, ZB_H1)
    a, b = _passes(trace, 1, 1)[2:4]
    events = trace["traceEvents"]
    events[a]["ts"], events[b]["ts"] = events[b]["ts"], events[a]["ts"]
    code, _, err = check_trace(write_trace(tmp_path / "t.json", trace))
    assert code == 1
    assert f"{tmp_path / 't.json'}: rank 1, step 1: pass 3 of the step was" in err, err
    assert "the proven order runs" in err


def test_dropped_or_repeated_pass_fails(tmp_path: Path, compiled) -> None:  # type: ignore[no-untyped-def]
    """A pass that did not run, or ran twice, is a violation (exit 1)."""
    trace = trace_of_programs(compiled, 2, ZB_H1)
    dropped = trace["traceEvents"].pop(_passes(trace, 0, 0)[1])
    code, _, err = check_trace(write_trace(tmp_path / "t.json", trace))
    assert code == 1 and f"rank 0, step 0: pass {dropped['name']} (stage 0) of the program did not run" in err
    trace["traceEvents"].append(dict(dropped, args=dict(dropped["args"], step=1)))
    code, _, err = check_trace(write_trace(tmp_path / "t.json", trace))
    assert code == 1 and f"rank 0, step 1: pass {dropped['name']} (stage 0) ran 2 times" in err


def test_unproven_transfer_fails(tmp_path: Path, compiled) -> None:  # type: ignore[no-untyped-def]
    """An exchange that waits on a transfer the program does not receive fails."""
    trace = trace_of_programs(compiled, 1, ZB_H1)
    exchange = next(e for e in trace["traceEvents"] if e["pid"] == 0 and e["cat"] == "exchange")
    exchange["args"]["recvs"] = ["grad(mb 9, stage 1->0, rank 1->0)"]
    code, _, err = check_trace(write_trace(tmp_path / "t.json", trace))
    assert code == 1
    assert "rank 0, step 0: waited on grad(mb 9, stage 1->0, rank 1->0), a transfer" in err


def test_against_another_schedule_fails(tmp_path: Path, compiled) -> None:  # type: ignore[no-untyped-def]
    """Checked against 1F1B, ZB-H1's trace does not conform; against itself with
    -D it does."""
    path = write_trace(tmp_path / "t.json", trace_of_programs(compiled, 1, ZB_H1))
    code, _, err = check_trace(path, "--against", str(ROOT / "examples" / "1f1b.pp"),
                               "-D", "d=2", "-D", "m=4")
    assert code == 1 and "not in the rank's program" in err
    assert check_trace(path, "--against", ZB_H1, "-D", "d=2", "-D", "m=4")[0] == 0


@pytest.mark.parametrize("content,message", [
    (None, "cannot read the trace"),
    ("{", "is not JSON"),
    ('{"traceEvents": []}', "is no ppdsl trace"),
])
def test_bad_trace_is_a_usage_error(tmp_path: Path, content: str | None, message: str) -> None:
    """A missing, malformed or foreign trace: exit 2 with one message, no traceback."""
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    code, _, err = check_trace(path)
    assert code == 2 and message in err and "Traceback" not in err, err


ONE_RANK = """schedule two_stages_one_rank {
    param d = 1
    param m = 3
    place [0, 0]
    backward split
    order {
        for j in 0..m { F(j, 0); F(j, 1) }
        for j in 0..m { B(j, 1); W(j, 1); B(j, 0); W(j, 0) }
    }
}
"""


@pytest.fixture
def one_rank(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A one-rank gloo group in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_engine_that_reorders_passes_fails_the_check(one_rank, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The engine's own trace of a step conforms; an engine whose ops have two
    passes swapped (W2 of stage 1 after B2 of stage 0, still runnable) records a
    trace the check rejects, naming where the order differs."""
    import torch

    from ppdsl.runtime.execution.pipeline import PipelineRunner, load_schedule
    from ppdsl.runtime.execution.trace import Tracer, chrome_trace, write_chrome_trace

    schedule = tmp_path / "s.pp"
    schedule.write_text(ONE_RANK)
    for swapped in (False, True):
        runner = PipelineRunner(load_schedule(schedule), lambda s: torch.nn.Linear(4, 4),
                                torch.nn.functional.mse_loss, device="cpu", note=lambda _: None)
        engine = runner.engine
        if swapped:
            ops = list(engine.ops)
            ops[-3], ops[-2] = ops[-2], ops[-3]
            engine.ops = tuple(ops)
        engine.tracer = tracer = Tracer(0, torch.device("cpu"))
        tracer.start()
        runner.step(torch.randn(6, 4), torch.randn(6, 4))
        path = tmp_path / f"trace{int(swapped)}.json"
        write_chrome_trace(path, chrome_trace([tracer.events], ["rank 0"], {"file": str(schedule)}))
        code, _, err = check_trace(path)
        assert code == int(swapped), err
    assert "rank 0, step 0: pass 16 of the step was B2 (stage 0), the proven order runs " \
           "W2 (stage 1) there" in err, err


def test_late_receives_are_timed_against_cost_recv(tmp_path: Path) -> None:
    """`cost recv` checked against a run (docs/language.md): the report times each
    receive whose send was posted before the receiver posted it, from that post to
    the end of the wait that hands over the tensor, beside the costs' `recv`;
    the run's own costs take their median (docs/runtime.md)."""
    from ppdsl.analysis.calibrate import calibrate
    from ppdsl.analysis.trace_check import steps_of
    from ppdsl.analysis.trace_timeline import compare_timeline, format_timeline
    from ppdsl.costs_file import load_costs_file

    costs = tmp_path / "costs.pp"
    costs.write_text("schedule c {\n    cost F = 1\n    cost B = 1\n    cost W = 1\n"
                     "    cost recv = 0.25\n}\n")
    compiled = compile_file(ZB_H1, {"d": "2", "m": "4"}, costs=load_costs_file(costs))
    trace = trace_of_programs(compiled, 2, ZB_H1)
    # step 1: rank 0 posts each act(mb j) 0.1-0.2 ms before rank 1 posts its receive
    # (mb 1, 2, 3), rank 1 each grad(mb j) before rank 0 (mb 1, 2): five late receives
    # of 0.1 ms (the post); rank 1 then waits 0.4 ms for act(mb 2), and rank 0 posts
    # act(mb 3) only after rank 1 posted its receive
    for e in trace["traceEvents"]:
        if e["args"]["step"] == 1 and e["pid"] == 0 and "act(mb 3, stage 0->1, rank 0->1)" in \
                e["args"].get("sends", []):
            e["ts"] = 21700.0
    trace["traceEvents"].append({
        "name": "wait", "cat": "exchange", "ph": "X", "pid": 1, "tid": 0, "ts": 18600.0,
        "dur": 400.0, "args": {"step": 1, "recvs": ["act(mb 2, stage 0->1, rank 0->1)"]}})
    report = compare_timeline(steps_of(trace), compiled.schedule, costs_in_ms=True)
    assert sorted(report.late_receives_ms) == pytest.approx([0.1, 0.1, 0.1, 0.5])
    assert report.recv_ms == 0.25
    # the run's own `cost recv` (`ppdsl trace -o`) is their median, not the mean (0.2)
    assert calibrate(steps_of(trace), compiled.schedule, False).recv_ms == pytest.approx(0.1)
    assert ("receives posted after their data was sent: 4, from posting to holding the "
            "tensor median 0.100 ms (cost recv 0.250 ms)") in format_timeline(report)


def _timeline_trace(compiled) -> dict:  # type: ignore[no-untyped-def]
    """A causal trace on one clock ("host"): each rank's passes where the
    simulator puts them (1 unit = 1 ms), each exchange posted when the rank's
    pass before it ended."""
    timeline = compiled.timeline
    events = []
    for program in compiled.programs:
        k, ts = 0, 0.0
        for op in program.ops:
            if hasattr(op, "pass_"):
                p = op.pass_
                start, end = timeline.start[program.rank][k] * 1e3, timeline.end[program.rank][k] * 1e3
                events.append({"name": f"{p.kind.value}{p.microbatch}", "cat": p.kind.value,
                               "ph": "X", "pid": program.rank, "tid": 0, "ts": start,
                               "dur": end - start,
                               "args": {"stage": p.stage, "microbatch": p.microbatch, "step": 0}})
                k, ts = k + 1, end
            elif op.sends or op.recvs:
                events.append({"name": "exchange", "cat": "exchange", "ph": "X",
                               "pid": program.rank, "tid": 0, "ts": ts, "dur": 0.0,
                               "args": {"sends": [str(t) for t in op.sends],
                                        "recvs": [str(t) for t in op.recvs], "step": 0}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": compiled.schedule.name, "file": ZB_H1,
                          "params": {str(k): v for k, v in compiled.schedule.params},
                          "costs_from": None, "clock": "host"}}


def test_a_pass_before_its_input_was_sent_fails_on_one_clock(tmp_path: Path, compiled) -> None:  # type: ignore[no-untyped-def]
    """With the ranks on one clock (`clock: host`, what `ppdsl run` writes when
    every rank shares the first rank's epoch on one host) a pass may not start
    before the rank sending its input posted it: the simulator's own timeline
    conforms; rank 1's times shifted 0.5 ms earlier do not (its first F starts
    before rank 0 sent its activation), located; with each rank on its own
    clock the same trace is not checked for it."""
    trace = _timeline_trace(compiled)
    assert check_trace(write_trace(tmp_path / "t.json", trace))[0] == 0
    for e in trace["traceEvents"]:
        if e["pid"] == 1:
            e["ts"] -= 500.0
    code, _, err = check_trace(write_trace(tmp_path / "t.json", trace))
    assert code == 1, err
    assert ("rank 1, step 0: F0 (stage 1) started 0.500 ms before rank 0 posted "
            "act(mb 0, stage 0->1, rank 0->1), which it takes") in err, err
    trace["otherData"]["clock"] = "rank"
    assert check_trace(write_trace(tmp_path / "t.json", trace))[0] == 0


def test_transfers_on_the_critical_path_are_timed_on_one_clock(tmp_path: Path) -> None:
    """On one clock the report times the transfers whose receiver was ready
    first, from the sender's pass end to the receiver's pass start, and what
    they make `cost comm`: on the simulator's own timeline under comm 0.5, 0.5;
    on clocks of their own the line is left out."""
    from ppdsl.costs_file import load_costs_file

    costs = tmp_path / "costs.pp"
    costs.write_text("schedule c {\n    cost F = 1\n    cost B = 1\n    cost W = 1\n"
                     "    cost comm = 0.5\n}\n")
    trace = _timeline_trace(compile_file(ZB_H1, {"d": "2", "m": "4"},
                                         costs=load_costs_file(costs)))

    def report() -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["trace", str(write_trace(tmp_path / "t.json", trace)),
                         "--costs-from", str(costs)]) == 0
        return out.getvalue()

    text = report()
    assert "transfers on the critical path (their receiver ready first): " in text, text
    assert ("pass start mean 0.500 ms, median 0.500 ms; as `cost comm` (less the overhead "
            "per pass) 0.500 ms (cost comm 0.500 ms)") in text, text
    trace["otherData"]["clock"] = "rank"
    assert "transfers on the critical path" not in report()


def _simulated_run(compiled, optimizer_ms: tuple[float, ...], norm_ms: float,  # type: ignore[no-untyped-def]
                   num_steps: int = 2) -> dict:
    """What a run on one clock would trace if it ran as the simulator says: each
    pass a slice of its cost, the engine's overhead after it, a wait slice
    where the rank idles for a transfer, exchanges posted as each pass ends,
    then per rank its optimizer step: all of them start the norm all-reduce when
    the last rank arrives, then step for `optimizer_ms` of the rank."""
    timeline, costs = compiled.timeline, compiled.schedule.costs
    overhead = costs.overhead[0] if costs.overhead else 0.0
    events: list[dict] = []
    origin = 0.0
    for step in range(num_steps):
        reached = {}
        for program in compiled.programs:
            rank, k = program.rank, 0
            busy = 0.0  # when the rank is free again (ms from the step's origin)
            for op in program.ops:
                if hasattr(op, "pass_"):
                    p = op.pass_
                    start, end = timeline.start[rank][k], timeline.end[rank][k]
                    if start > busy + 1e-9:
                        events.append({"name": "wait", "cat": "exchange", "ph": "X", "pid": rank,
                                       "tid": 0, "ts": (origin + busy) * 1e3,
                                       "dur": (start - busy) * 1e3, "args": {"step": step}})
                    events.append({"name": f"{p.kind.value}{p.microbatch}", "cat": p.kind.value,
                                   "ph": "X", "pid": rank, "tid": 0, "ts": (origin + start) * 1e3,
                                   "dur": (end - start - overhead) * 1e3,
                                   "args": {"stage": p.stage, "microbatch": p.microbatch,
                                            "step": step}})
                    k, busy = k + 1, end
                elif op.sends or op.recvs:
                    at = busy - overhead if k else busy
                    events.append({"name": "exchange", "cat": "exchange", "ph": "X", "pid": rank,
                                   "tid": 0, "ts": (origin + at) * 1e3, "dur": 0.0,
                                   "args": {"sends": [str(t) for t in op.sends],
                                            "recvs": [str(t) for t in op.recvs], "step": step}})
            reached[rank] = busy
        last = max(reached.values())
        for rank, at in reached.items():
            events.append({"name": "optimizer", "cat": "optimizer", "ph": "X", "pid": rank,
                           "tid": 0, "ts": (origin + at) * 1e3,
                           "dur": (last + norm_ms + optimizer_ms[rank] - at) * 1e3,
                           "args": {"step": step}})
        origin += last + norm_ms + max(optimizer_ms) + 1.0
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": compiled.schedule.name, "file": ZB_H1,
                          "params": {str(k): v for k, v in compiled.schedule.params},
                          "costs_from": "costs.pp", "clock": "host", "device": "cpu",
                          "steps": num_steps}}


def test_run_costs_from_a_trace_are_the_costs_it_ran_under(tmp_path: Path) -> None:
    """`ppdsl trace -o COSTS.pp` (docs/runtime.md, "A run's own costs"): a trace of
    a run that went exactly as the simulator says under a costs file gives that
    file back: the passes per kind and stage, the overhead, `cost comm` from the
    transfers on the critical path, each stage's optimizer step from the moment
    the last rank reached the norm all-reduce; norm and memory from the costs
    given again."""
    from ppdsl.costs_file import load_costs_file

    costs = tmp_path / "costs.pp"
    costs.write_text(
        "schedule c {\n    let profiled_stages = 2\n    cost F[s] = s == 0 ? 1 : 1.5\n"
        "    cost B[s] = s == 0 ? 1.25 : 2\n    cost W[s] = s == 0 ? 0.5 : 0.75\n"
        "    cost comm = 0.25\n    cost overhead = 0.125\n    cost optimizer[s] = s == 0 ? 3 : 2\n"
        "    cost norm = 0.5\n    memory M_B[s] = s == 0 ? 1 : 3 / 4\n    memory M_W = 1 / 4\n}\n")
    given = load_costs_file(costs)
    compiled = compile_file(ZB_H1, {"d": "2", "m": "4"}, costs=given)
    trace = write_trace(tmp_path / "t.json", _simulated_run(compiled, (3.0, 2.0), 0.5))
    out = tmp_path / "own.pp"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main(["trace", str(trace), "--costs-from", str(costs), "-o", str(out)]) == 0
    assert f"wrote the run's own costs to {out}" in err.getvalue()
    text = out.read_text()
    assert "# from the run's costs (a trace does not show them): BW, norm, memory" in text, text
    own = compile_file(ZB_H1, {"d": "2", "m": "4"}, costs=load_costs_file(out)).schedule
    for kind in ("F", "B", "W"):
        assert getattr(own.costs, {"F": "forward", "B": "backward_input",
                                   "W": "backward_weight"}[kind]) == pytest.approx(
            getattr(compiled.schedule.costs, {"F": "forward", "B": "backward_input",
                                              "W": "backward_weight"}[kind])), kind
    assert own.costs.overhead[0] == pytest.approx(0.125)
    assert own.costs.comm == pytest.approx(0.25)
    assert own.costs.optimizer == pytest.approx((3.0, 2.0))
    assert own.costs.norm == 0.5 and own.costs.jitter == 0.0
    assert own.memory == compiled.schedule.memory
    assert own.costs.recv == 0.0  # no receive was posted after its send


def test_run_costs_need_the_kinds_the_run_did_not_measure(tmp_path: Path) -> None:
    """A fused schedule's run measures no B or W: without its costs in ms, `-o`
    is a usage error (exit 2) that says what to give; with them, B and W are
    taken from them (BW as the run measured it: 2 units) and the file says so."""
    one_f_one_b = str(ROOT / "examples" / "1f1b.pp")
    compiled = compile_file(one_f_one_b, {"d": "2", "m": "4"})
    trace = _simulated_run(compiled, (1.0, 1.0), 0.0)
    trace["otherData"].update(file=one_f_one_b, costs_from=None)
    path = write_trace(tmp_path / "t.json", trace)
    out, err = tmp_path / "own.pp", io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main(["trace", str(path), "-o", str(out)]) == 2
    assert (f"{path}: the run ran no B pass and its costs are not in ms: give the costs file "
            "it ran with (or a profile's), `--costs-from FILE`") in err.getvalue(), err.getvalue()
    assert not out.exists()
    costs = tmp_path / "costs.pp"
    costs.write_text("schedule c {\n    cost F = 1\n    cost B = 0.75\n    cost W = 0.25\n}\n")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["trace", str(path), "--costs-from", str(costs), "-o", str(out)]) == 0
    text = out.read_text()
    assert "    cost B[s] = 0.75\n    cost W[s] = 0.25\n    cost BW[s] = 2\n" in text, text
    assert "# from the run's costs (a trace does not show them): B, W, memory\n" in text, text


def test_run_costs_are_means_and_keep_t_r_where_no_stage_recomputes(tmp_path: Path) -> None:
    """The run's own `cost overhead` and `cost optimizer[s]` are means over ranks and
    steps (docs/runtime.md, "A run's own costs"): one slow step moves them, as it
    moves the step; R measured on stage 0 only is written as R there and T_F on
    the stage that does not recompute."""
    from ppdsl.analysis.calibrate import Calibration, calibrate, costs_text
    from ppdsl.analysis.trace_check import steps_of
    from ppdsl.costs_file import load_costs_file
    from ppdsl.semantics import PassKind

    costs = tmp_path / "costs.pp"
    costs.write_text("schedule c {\n    cost F = 1\n    cost B = 1\n    cost W = 1\n"
                     "    cost overhead = 0.125\n    cost optimizer = 2\n}\n")
    compiled = compile_file(ZB_H1, {"d": "2", "m": "4"}, costs=load_costs_file(costs))
    trace = _simulated_run(compiled, (2.0, 2.0), 0.0, num_steps=4)
    # step 3: rank 0 idles 0.6 ms of engine work after its first pass, and its
    # optimizer step takes 0.6 ms longer
    mine = [e for e in trace["traceEvents"] if e["pid"] == 0 and e["args"]["step"] == 3]
    first_end = min(e["ts"] + e["dur"] for e in mine if e["cat"] in ("F", "B", "W"))
    for e in mine:
        e["ts"] += 600.0 if e["ts"] >= first_end else 0.0
        e["dur"] += 600.0 if e["cat"] == "optimizer" else 0.0
    found = calibrate(steps_of(trace), compiled.schedule, one_clock=False)
    passes = len(compiled.schedule.orders[0])
    # six (rank, step) windows, one of them 0.6 ms longer: the mean, not the median
    assert found.overhead_ms == pytest.approx(0.125 + 0.6 / passes / 6)
    assert found.optimizer_ms == pytest.approx((2.0 + 0.6 / 3, 2.0))
    recomputed = Calibration((1,), {**found.pass_ms, PassKind.R: (1.5, None)}, 0.125, None,
                             None, None, 0.0, True)
    assert "    cost R[s] = s == 0 ? 1.5 : 1\n" in costs_text(recomputed, compiled.schedule, False)
