"""`ppdsl profile` and its driver, ppdsl/runtime/measure/profile.py: per-stage costs
and memory measured as the runtime runs the passes, written as a costs file the
compiler reads; the loop profile -> search --costs-from -> check --costs-from
closed on tiny_gpt.
(Speed targets are benchmarks: `python -m bench split`.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from ppdsl.cli import main
from ppdsl.costs_file import evaluate_costs, load_costs_file
from tests.paths import ROOT

TINY = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages"


def _ppdsl(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """`ppdsl ARGV` in this process: `main` is what the console script calls, its
    return value the exit code (the console script itself: tests/system/test_packaging.py)."""
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["ppdsl", *argv], code, out, err)


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


@pytest.mark.slow
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


@pytest.mark.slow
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


_MIXED = """
import torch
from torch import nn
from ppdsl.runtime import PipelineModel

class Residual(nn.Module):  # a stage whose first layer is a Linear on float input
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Conv(nn.Module):  # a stage whose first layer is a convolution
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)

def _stage(index):  # stage 0 starts with an embedding of the token ids
    return [nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8)), Residual(), Conv(),
            nn.Linear(8, 16)][index]

def stages(n):
    return PipelineModel(
        n, _stage, lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten()),
        lambda step, b: (torch.randint(0, 16, (b, 4)), torch.randint(0, 16, (b, 4))))
"""


@pytest.mark.slow
def test_low_precision_profiles_stages_starting_with_linear_conv_and_embedding(
        tmp_path: Path) -> None:
    """`--precision bf16|fp16` profiles every model `ppdsl run --precision` trains
    (docs/runtime.md, "Profiling a model"): stages that start with an embedding,
    a Linear and a convolution on the previous stage's low-precision output are
    measured, and what the split leaves to B is read under autocast, the same
    parameters as in fp32."""
    from ppdsl.runtime.measure.profile import profile_model

    (tmp_path / "mixed.py").write_text(_MIXED)
    spec = f"{tmp_path / 'mixed.py'}:stages"
    found = {}
    for precision in ("fp32", "bf16", "fp16"):
        profile = profile_model(spec, 4, 2, torch.device("cpu"), warmup=0, repeats=1,
                                transfer=False, optimizer=None, precision=precision)
        assert profile.precision == precision
        assert all(s.timing.activation_bytes > 0 for s in profile.stages), precision
        found[precision] = [s.uncovered for s in profile.stages]
    assert found["bf16"] == found["fp16"] == found["fp32"]


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


@pytest.mark.slow
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


@pytest.mark.slow
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
