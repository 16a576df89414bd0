"""`ppdsl profile` and ppdsl/runtime/measure/profile.py: per-stage costs and memory measured
as the runtime runs the passes, written as a costs file the compiler reads; the
loop profile -> search --costs-from -> check --costs-from closed on tiny_gpt.
(Speed targets are benchmarks: `python -m bench split`.)"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from ppdsl.analysis.trace_timeline import pipeline_latency, transfer_latencies
from ppdsl.cli import main
from ppdsl.costs_file import evaluate_costs, load_costs_file
from ppdsl.runtime.measure.profile import (
    Profile,
    StageProfile,
    StageTiming,
    StepCosts,
    _engine_summary,
    measure_collectives,
    measure_receive,
    measure_stage,
    measure_transfer,
    overhead_per_pass,
    pass_jitter,
    pipeline_devices,
    to_costs_pp,
)
from tests.paths import ROOT

TINY = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages"


def _ppdsl(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """`ppdsl ARGV` in this process: `main` is what the console script calls, its
    return value the exit code (the console script itself: tests/system/test_packaging.py)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["ppdsl", *argv], code, out, err)


def test_measure_stage_measures_both_runs() -> None:
    """Every time is positive; the split's forward keeps exactly the plain forward's
    bytes; what B keeps (M_W) is between 0 and M_B."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
    x = torch.randn(64, 16)
    t = measure_stage(net, lambda: x, lambda y: y, torch.ones(64, 8), torch.device("cpu"),
                      warmup=1, repeats=3)
    assert min(t.forward_ms, t.input_ms, t.weight_ms, t.plain_forward_ms, t.fused_ms) > 0
    assert t.activation_bytes == t.plain_activation_bytes > 0
    assert 0 < t.weight_bytes < t.activation_bytes
    assert t.gradient_bytes > 0
    assert all(p.grad is None for p in net.parameters())


def test_transfer_is_measured_between_two_gloo_processes() -> None:
    """On CPU the transfer time comes from two real gloo processes (one per size)."""
    times, method = measure_transfer([4096, 1 << 20], torch.device("cpu"), repeats=3)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert "gloo" in method


def _profile(stages: int = 2) -> Profile:
    timing = StageTiming(1.25, 2.5, 1.125, 1.2, 3.5, 1000, 1000, 500, 800)
    return Profile(
        "m.py:f", stages, 2, "cpu", 1, 1, 3, "test",
        tuple(StageProfile(s, timing, 400 if s < stages - 1 else 0, 0.5 if s < stages - 1 else None, ())
              for s in range(stages)),
    )


def test_costs_file_round_trips(tmp_path: Path) -> None:
    """What `-o` writes is a costs file the compiler reads back: the same costs (ms),
    memory in units of the mean stage's M_B, and the stage count."""
    path = tmp_path / "costs.pp"
    path.write_text(to_costs_pp(_profile()))
    costs = load_costs_file(path)
    assert costs.num_stages == 2
    c, m = evaluate_costs(costs, 2, "parallel")
    assert c.forward == (1.25, 1.25) and c.backward_input == (2.5, 2.5)
    assert c.backward_weight == (1.125, 1.125) and c.fused_backward == (3.5, 3.5) and c.comm == 0.5
    assert m.activation == (1, 1) and m.weight_retained == (0.5, 0.5)
    assert not c.models_step  # a profile without step costs: exactly the passes' model


def test_step_costs_are_written_as_costs(tmp_path: Path) -> None:
    """A profile's step costs (docs/runtime.md, "Profiling a model") come back from
    the costs file as `cost overhead`, `cost optimizer[s]` and `cost norm`."""
    path = tmp_path / "costs.pp"
    step = StepCosts(0.0625, {"F0": 1.0}, (3.5, 4.25), "adam", 0.375)
    path.write_text(to_costs_pp(replace(_profile(), step=step)))
    c, _ = evaluate_costs(load_costs_file(path), 2, "parallel")
    assert c.overhead == (0.0625, 0.0625) and c.optimizer == (3.5, 4.25) and c.norm == 0.375


def test_pass_jitter_is_the_spread_of_log_durations(tmp_path: Path) -> None:
    """`cost jitter` (docs/runtime.md, "Profiling a model"): the spread of log(duration /
    its pass's median) from its quartiles (IQR / 1.349), pooled over passes, so one
    descheduled pass does not set it; the costs file states it."""
    import math

    durations = {("F", 0): [1.0, 2.0, 4.0], ("BW", 0): [1.5, 3.0, 6.0]}
    # logs -ln 2, 0, ln 2 twice: inclusive quartiles -0.75 ln 2 and 0.75 ln 2
    assert pass_jitter(durations) == pytest.approx(1.5 * math.log(2) / 1.349)
    steady = {("F", 0): [1.9, 2.0, 2.1] * 7}
    calm = pass_jitter(steady)
    steady[("F", 0)].append(1000.0)  # one pass that waited for a core barely moves it
    assert calm > 0 and pass_jitter(steady) == pytest.approx(calm, rel=0.1)
    assert pass_jitter({("F", 0): [2.0, 2.0]}) == 0.0
    path = tmp_path / "costs.pp"
    step = StepCosts(0.0625, {"F0": 1.0}, (3.5, 4.25), "adam", 0.375, 0.25)
    path.write_text(to_costs_pp(replace(_profile(), step=step)))
    assert "    cost jitter = 0.25\n" in path.read_text()
    assert evaluate_costs(load_costs_file(path), 2, "parallel")[0].jitter == 0.25


def _slice(kind: str, stage: int, mb: int, ts: float, dur: float) -> dict:
    return {"name": f"{kind}{mb}", "cat": kind, "ph": "X", "ts": ts, "dur": dur,
            "args": {"stage": stage, "microbatch": mb, "step": 3}}


def test_transfer_latency_is_taken_where_the_receiver_waited(tmp_path: Path) -> None:
    """`cost comm` from the engine's pipeline (docs/runtime.md, "Profiling a
    model"): a transfer's time from the end of the pass that made it to the
    start of the pass that takes it, where the receiver was ready first; the
    mean of both directions between two ranks, so a skew between their clocks
    cancels; less the overhead per pass the simulator charges the sender."""
    def events(skew: float) -> list[list[dict]]:
        rank0 = [_slice("F", 0, 0, 0, 1000), _slice("F", 0, 1, 1000, 1000),
                 _slice("B", 0, 0, 3700, 1000)]
        rank1 = [_slice("F", 1, 0, 1300, 1000), _slice("B", 1, 0, 2300, 1000),
                 # ready at 3300, after F1 of stage 0 ended: not on the critical path
                 _slice("F", 1, 1, 3300, 1000)]
        return [rank0, [dict(e, ts=e["ts"] + skew) for e in rank1]]

    found = transfer_latencies(events(0.0), 0.05)
    assert {k: [round(x, 6) for x in v] for k, v in found.items()} == {(0, 1): [0.3], (1, 0): [0.4]}
    assert pipeline_latency(found, 0.05) == pytest.approx(0.3)
    skewed = transfer_latencies(events(200.0), 0.05)  # rank 1's clock 0.2 ms ahead
    assert {k: [round(x, 6) for x in v] for k, v in skewed.items()} == {(0, 1): [0.5], (1, 0): [0.2]}
    assert pipeline_latency(skewed, 0.05) == pytest.approx(0.3)
    # a rank whose previous pass ends within the overhead of the sender's end is busy
    assert transfer_latencies(events(0.0), 2.5).get((1, 0)) is None
    assert pipeline_latency({}, 0.05) is None
    assert pipeline_latency({(0, 1): [0.01]}, 0.05) == 0.0  # never below 0
    path = tmp_path / "costs.pp"
    step = StepCosts(0.0625, {"F0": 1.0}, (3.5, 4.25), "adam", 0.375, 0.25, 0.75)
    path.write_text(to_costs_pp(replace(_profile(), step=step)))
    assert "    cost comm = 0.75\n" in path.read_text()
    assert "the mean time from a sender's pass end" in path.read_text()


def test_late_receive_is_measured_and_written_as_cost_recv(tmp_path: Path) -> None:
    """`cost recv` (docs/runtime.md, "Profiling a model"): a receive posted after
    its data was sent is timed between two real gloo processes, and the costs
    file states it as `cost recv`, which the compiler reads back."""
    (late,) = measure_receive([4096], repeats=3)
    assert 0 < late < 1000
    path = tmp_path / "costs.pp"
    path.write_text(to_costs_pp(replace(_profile(), recv_ms=0.375)))
    assert "    cost recv = 0.375\n" in path.read_text()
    c, _ = evaluate_costs(load_costs_file(path), 2, "parallel")
    assert c.recv == 0.375
    path.write_text(to_costs_pp(_profile()))  # not measured: not stated, 0
    assert "cost recv" not in path.read_text()
    assert evaluate_costs(load_costs_file(path), 2, "parallel")[0].recv == 0


def test_collectives_are_measured_and_written_as_costs(tmp_path: Path) -> None:
    """`--dp`: each stage's all-reduce, reduce-scatter and all-gather are timed
    among real gloo processes; the costs file states `cost reduce[s]` and `cost
    gather[s]`, which the compiler reads back per stage."""
    rows, method = measure_collectives([4096, 1 << 16], 2, repeats=1)
    assert len(rows) == 2 and "gloo" in method
    assert all(r[k] > 0 for r in rows for k in ("all_reduce", "reduce_scatter", "all_gather"))
    base = _profile()
    stages = tuple(replace(st, param_bytes=4096, reduce_ms=0.25 * (st.stage + 1), gather_ms=0.5)
                   for st in base.stages)
    path = tmp_path / "costs.pp"
    path.write_text(to_costs_pp(replace(base, stages=stages, dp=2, collective_method=method)))
    assert "cost reduce[s] = s == 0 ? 0.25 : 0.5" in path.read_text()
    c, _ = evaluate_costs(load_costs_file(path), 2, "parallel")
    assert c.collective("reduce", 1) == 0.5 and c.collective("gather", 0) == 0.5


def test_profile_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Impossible arguments are exit 2; a bad --model is exit 1 naming it."""
    assert main(["profile", "--model", TINY, "--stages", "0"]) == 2
    assert main(["profile", "--model", TINY, "--stages", "1", "--dp", "0"]) == 2
    assert main(["profile", "--model", TINY, "--stages", "4", "--devices", "3"]) == 2
    assert "--devices 3: give a number of processes that divides --stages 4" in capsys.readouterr().err
    assert main(["profile", "--model", TINY, "--stages", "1", "--devices", "0"]) == 2
    if not torch.cuda.is_available():
        assert main(["profile", "--model", TINY, "--stages", "1", "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
    assert main(["profile", "--model", "nowhere.py:f", "--stages", "1"]) == 2  # a missing file
    assert "no such file" in capsys.readouterr().err


def test_profile_of_a_failing_model_is_invalid_input(capsys: pytest.CaptureFixture[str]) -> None:
    """A model whose stages do not chain is exit 1 with the stage and the error."""
    code = main(["profile", "--model", str(ROOT / "tests" / "dist" / "bad_models.py") + ":shape_mismatch",
                 "--stages", "2", "--no-transfer", "--warmup", "0", "--repeats", "1"])
    assert code == 1
    err = capsys.readouterr().err
    assert "stage 1" in err and "Traceback" not in err


def test_norms_option_decides_what_w_keeps(capsys: pytest.CaptureFixture[str]) -> None:
    """`--norms deferred` defers the layer norms' weight gradients too: W then also keeps
    their inputs, mean and rstd (a larger M_W), and the report says which; on CPU
    with one thread the passes are timed in thread CPU time."""
    found = {}
    for norms in ("in-b", "deferred"):
        code = main(["profile", "--model", TINY, "--stages", "2", "--json", "--no-transfer",
                     "--warmup", "0", "--repeats", "1", "--norms", norms])
        assert code == 0
        report = json.loads(capsys.readouterr().out)
        assert report["norms"] == norms and report["clock"] == "thread"
        found[norms] = [s["weight_bytes"] for s in report["stages"]]
    assert all(0 < b < w for b, w in zip(found["in-b"], found["deferred"], strict=True)), found


def test_precision_option_profiles_under_autocast(capsys: pytest.CaptureFixture[str]) -> None:
    """`--precision bf16` runs the forward and loss under autocast, as `ppdsl run
    --precision bf16` trains, and the report says so: the stages' M_B (bf16
    activations, the weight copies counted apart) is below fp32's; TF32 is
    recorded (n/a on CPU)."""
    found = {}
    for precision in ("fp32", "bf16"):
        code = main(["profile", "--model", TINY, "--stages", "2", "--json", "--no-transfer",
                     "--warmup", "0", "--repeats", "1", "--precision", precision])
        assert code == 0
        report = json.loads(capsys.readouterr().out)
        assert report["precision"] == precision and report["tf32"] == "n/a"
        found[precision] = report["stages"]
    for fp32, bf16 in zip(found["fp32"], found["bf16"], strict=True):
        assert 0 < bf16["activation_bytes"] < fp32["activation_bytes"], (fp32, bf16)


def test_collectives_of_a_cuda_run_without_a_gpu_each_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA profile's `--dp 2` on a one-GPU node cannot run NCCL (a GPU per
    process): the gloo numbers it falls back to say NCCL's were not measured."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rows, method = measure_collectives([4096], 2, repeats=1, device=torch.device("cuda", 0))
    assert len(rows) == 1 and "NOT measured" in method and "gloo" in method


@pytest.mark.slow
def test_profile_search_check_loop_on_tiny_gpt(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The zero-bubble paper's loop on tiny_gpt: `ppdsl profile --json -o` reports
    T_W > 0 and M_W > 0 for every stage and split forward bytes equal to the plain
    stage's; `search --costs-from` finds a schedule under the measured costs; `check
    --costs-from` accepts it and ZB-H1."""
    monkeypatch.chdir(tmp_path)
    costs = tmp_path / "costs.pp"
    run = _ppdsl(capsys, "profile", "--model", TINY, "--stages", "2", "--json", "-o", str(costs),
                 "--warmup", "1", "--repeats", "3")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["num_stages"] == 2 and len(report["stages"]) == 2
    for stage in report["stages"]:
        assert stage["weight_ms"] > 0 and stage["weight_bytes"] > 0, stage
        assert stage["input_ms"] > 0 and stage["fused_ms"] > 0 and stage["forward_ms"] > 0
        assert stage["bytes_ratio"] == 1.0, stage
        assert 0 < stage["mw_over_mb"] < 1
    assert report["stages"][0]["transfer_ms"] > 0 and report["stages"][1]["transfer_ms"] is None
    assert "gloo" in report["transfer_method"]
    assert "let profiled_stages = 2" in costs.read_text()
    # the step besides passes (docs/language.md): the engine's overhead per pass, each
    # stage's adam step, the norm all-reduce; written as cost statements stats times
    step = report["step"]
    assert step["optimizer"] == "adam" and len(step["optimizer_ms"]) == 2
    assert all(x > 0 for x in step["optimizer_ms"]) and step["overhead_ms"] > 0
    assert step["norm_ms"] > 0 and {"F0", "F1", "B0", "W1"} <= set(step["engine_pass_ms"])
    text = costs.read_text()
    assert "cost overhead = " in text and "cost optimizer[s] = " in text and "cost norm = " in text
    assert step["jitter"] > 0 and "cost jitter = " in text
    assert report["recv_ms"] > 0 and "cost recv = " in text
    jittered = _ppdsl(capsys, "stats", str(ROOT / "examples" / "zb_h1.pp"), "-D", "d=2", "--costs-from",
                      str(costs), "--json")
    assert jittered.returncode == 0, jittered.stderr
    # without the jitter line the step is one simulated step, bounded as below
    steady = tmp_path / "steady.pp"
    steady.write_text("".join(line for line in text.splitlines(keepends=True)
                              if "cost jitter" not in line))
    run = _ppdsl(capsys, "stats", str(ROOT / "examples" / "zb_h1.pp"), "-D", "d=2", "--costs-from",
                 str(steady), "--json")
    assert run.returncode == 0, run.stderr
    stats = json.loads(run.stdout)
    assert json.loads(jittered.stdout)["makespan"] == stats["makespan"]
    # each device's passes start after its optimizer step, the norm all-reduce ends the step
    low = stats["makespan"] + step["norm_ms"] + min(step["optimizer_ms"])
    assert low - 1e-3 <= stats["step_time"] <= low - min(step["optimizer_ms"]) + max(step["optimizer_ms"]) + 1e-3
    found = tmp_path / "found.pp"
    run = _ppdsl(capsys, "search", "-d", "2", "-m", "8", "--memory", "2p", "--time", "0",
                 "--costs-from", str(costs), "-o", str(found))
    assert run.returncode == 0, run.stderr
    for target in (str(found), str(ROOT / "examples" / "zb_h1.pp")):
        run = _ppdsl(capsys, "check", target, "-D", "d=2", "--costs-from", str(costs))
        assert run.returncode == 0, run.stderr
        assert "ok: schedule" in run.stdout


def test_pass_costs_are_the_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Profile = run (docs/runtime.md, "Profiling a model"): the costs file's pass
    costs are the passes as `ppdsl run`'s engine runs and times them, so stages that
    sleep 20/20/10 ms cost at least that, though they spend no CPU time (the stage
    runs' thread clock reads ~0 for them)."""
    monkeypatch.setenv("PPDSL_SLEEP_MS", "F=20,B=20,W=10")
    costs = tmp_path / "costs.pp"
    code = main(["profile", "--model", str(ROOT / "examples" / "models" / "sleepy.py") + ":stages",
                 "--stages", "1", "--no-transfer", "--warmup", "1", "--repeats", "2",
                 "-o", str(costs)])
    assert code == 0
    c, _ = evaluate_costs(load_costs_file(costs), 1, "parallel")
    for kind, sleep in (("forward", 20), ("backward_input", 20), ("backward_weight", 10),
                        ("fused_backward", 30)):
        assert all(x >= sleep for x in getattr(c, kind)), (kind, getattr(c, kind))
    assert "as `ppdsl run`'s engine ran them" in costs.read_text()


_PID_MODEL = """
import os, torch
from torch import nn
from ppdsl.runtime import PipelineModel

class Stage(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index = index
        self.lin = nn.Linear(4, 4)

    def forward(self, x):  # which process ran this stage's forward
        open(os.path.join(os.environ["PIDS"], f"{self.index}-{os.getpid()}"), "w").close()
        return self.lin(x)

def stages(n):
    return PipelineModel(n, Stage, lambda out, y: ((out - y) ** 2).mean(),
                         lambda step, b: (torch.randn(b, 4), torch.randn(b, 4)))
"""


def test_passes_are_timed_on_a_pipeline_of_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Profile in the run's conditions (docs/runtime.md, "Profiling a model"): with
    `--devices 2` the engine's passes run on two processes, neither the profile's,
    the stages placed looped (0 and 2 on one, 1 and 3 on the other), as a run of
    two ranks holds them; the report and the costs file say so."""
    model = tmp_path / "pids.py"
    model.write_text(_PID_MODEL)
    (tmp_path / "pids").mkdir()
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    costs = tmp_path / "costs.pp"
    code = main(["profile", "--model", f"{model}:stages", "--stages", "4", "--no-transfer",
                 "--warmup", "1", "--repeats", "2", "--devices", "2", "--json", "-o", str(costs)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["devices"] == 2
    assert sorted(report["step"]["engine_pass_ms"]) == sorted(
        f"{k}{s}" for k in ("F", "B", "W", "BW") for s in range(4))
    assert "a pipeline of 2 gloo processes, the stages placed looped" in costs.read_text()
    ran: dict[int, set[int]] = {}
    for f in (tmp_path / "pids").iterdir():
        stage, pid = map(int, f.name.split("-"))
        ran.setdefault(stage, set()).add(pid)
    engine = {s: pids - {os.getpid()} for s, pids in ran.items()}  # the stage runs are ours
    assert all(len(pids) == 1 for pids in engine.values()), engine
    assert engine[0] == engine[2] and engine[1] == engine[3] and engine[0] != engine[1]


def test_default_pipeline_is_one_process_per_core() -> None:
    """The default `--devices` (docs/runtime.md): the most processes that divide
    the stages without outnumbering the cores."""
    assert pipeline_devices(2, 2) == 2 and pipeline_devices(4, 2) == 2
    assert pipeline_devices(3, 2) == 1 and pipeline_devices(6, 4) == 3
    assert pipeline_devices(1, 8) == 1 and pipeline_devices(8, 1) == 1


def test_overhead_counts_posting_transfers_not_waiting_on_them() -> None:
    """`cost overhead` (docs/runtime.md, "Profiling a model"): a step's time less
    its passes and its waits on receives, over its passes; posting the
    exchanges stays in (it is the rank's work between passes)."""
    events = [{"name": "exchange", "dur": 400.0}, {"name": "F0", "dur": 2000.0},
              {"name": "wait", "dur": 3000.0}, {"name": "exchange", "dur": 400.0}]
    # 10 ms step, 2 ms of passes, 3 ms waited: 5 ms of work over 2 passes
    assert overhead_per_pass(0.010, 0.002, events, 2) == pytest.approx(0.0025)


def test_engine_step_costs_are_means_over_the_steps() -> None:
    """The profile's `cost overhead` and `cost optimizer[s]` are means over the timed
    steps (docs/runtime.md, "Profiling a model"): a step adds every pass's overhead
    and its optimizer step up, the one slow step included, as pass costs."""
    overhead, _, optimizer, _ = _engine_summary(
        [0.001, 0.001, 0.004], {("F", 0): [1.0, 1.0]}, {0: [2.0, 2.0, 5.0]}, 1)
    assert overhead == pytest.approx(2.0)  # ms; the median would read 1.0
    assert optimizer == pytest.approx((3.0,))  # the median would read 2.0
