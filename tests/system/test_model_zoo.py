"""Any module a user brings (docs/runtime.md, "Any module"): the awkward modules of
tests/dist/zoo.py trained through `ppdsl run` as a user runs it, each run's
per-step losses equal to a non-pipelined run of the same model on the same
batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist import zoo

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ZOO = str(ROOT / "tests" / "dist" / "zoo.py")
LR = 0.1
STEPS = 3
TOL = 1e-5


def _reference_losses(factory, num_stages: int, batch_size: int) -> list[float]:
    """The model's stages run one after another on one process, SGD on the whole batch."""
    model = factory(num_stages)
    stages = [model.stage(k) for k in range(num_stages)]
    params = [p for s in stages for p in s.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = model.batch(step, batch_size)
        for s in stages:
            x = s(x)
        loss = model.loss(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


# The scalar model under 1F1B, ZB-V, DualPipe-V and ZB-H1 x --dp 2 replicate is
# proven in the zoo's process group (scalar-1f1b, scalar-zb_v, scalar-dualpipe_v,
# scalar-dp2-replicate in test_zoo_parameters_and_buffers_equal_a_plain_run);
# through `ppdsl run` here: DualPipe's two pipelines (not in the zoo's worker)
# and FSDP's whole scalar with clipping. DualPipe runs once, under --dp 2
# replicate: its losses equal the plain run's only if each replica sums its two
# copies' gradients, so a run without --dp (a case here until it was found to
# prove nothing the replicated run does not) would only repeat that check.
@pytest.mark.parametrize(
    ("schedule", "dp"),
    [("zb_h1", "shard"), ("dualpipe", "replicate")],
    ids=["zb_h1-dp2-shard", "dualpipe-dp2-replicate"],
)
def test_scalar_parameter_trains_through_ppdsl_run(tmp_path: Path, schedule: str, dp: str | None) -> None:
    """A stage with a learned 0-dim parameter (`nn.Parameter(torch.tensor(0.7))`)
    completes `ppdsl run` (exit 0, no traceback) and its per-step losses equal a
    non-pipelined SGD run's under DualPipe, whose two copies of a stage sum their
    gradients; with `--dp 2` (replicate, and shard where FSDP keeps the scalar
    whole and it is all-reduced) the replicas end with equal parameters."""
    argv = [sys.executable, "-m", "ppdsl", "run", f"examples/{schedule}.pp", "-D", "d=2", "-D", "m=4",
            "--model", f"{ZOO}:scalar", "--steps", str(STEPS), "--optimizer", "sgd",
            "--lr", str(LR), "--json", str(tmp_path / "out")]
    if dp:
        argv += ["--dp", "2", "--dp-mode", dp, "--clip-grad-norm", "100"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    world = 4 if dp else 2
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(world)]
    losses = [float.fromhex(v) for _, v in sorted(ranks[0]["losses"].items(), key=lambda kv: int(kv[0]))]
    num_stages = sum(len(r["stages"]) for r in ranks[:2])
    if schedule == "dualpipe":  # two pipelines, each stage held twice
        num_stages //= 2
    want = _reference_losses(zoo.scalar, num_stages, 2 * 4 * (2 if dp else 1))
    assert len(losses) == STEPS
    for got, ref in zip(losses, want, strict=True):
        assert abs(got - ref) <= TOL * abs(ref), (losses, want)
    if dp:
        assert proc.stdout.count("parameters equal") == 2, proc.stdout


# (schedule file, -D values, data parallelism): 1F1B, ZB-H1, ZB-V and 1F1B with
# full recomputation on 4 ranks; ZB-H1 on 2 ranks x --dp 2 in both modes
CONFIGS = {
    "1f1b": ("1f1b", {"d": "4"}, None),
    "zb_h1": ("zb_h1", {"d": "4"}, None),
    "zb_v": ("zb_v", {"d": "4"}, None),
    "1f1b_recompute": ("1f1b_recompute", {"d": "4"}, None),
    "dp2-replicate": ("zb_h1", {"d": "2"}, "replicate"),
    "dp2-shard": ("zb_h1", {"d": "2"}, "shard"),
}
# the scalar model also through every other single-pipeline example, and V-shape
# placements under --dp 2 (DualPipe's two pipelines: test_scalar_parameter_trains_through_ppdsl_run)
SCALAR_CONFIGS = {
    **{name: (name, {"d": "4"}, None)
       for name in ("gpipe", "interleaved_1f1b", "interleaved_zb", "looped_bfs", "v_half",
                    "v_min", "v_zb", "zb_h2", "dualpipe_v")},
    "zb_v-dp2-replicate": ("zb_v", {"d": "2"}, "replicate"),
    "zb_v-dp2-shard": ("zb_v", {"d": "2"}, "shard"),
    "v_half-dp2-shard": ("v_half", {"d": "2"}, "shard"),
}
# tied parameters are refused in shard mode (docs/runtime.md)
CASES = [(model, config) for config in CONFIGS for model in zoo.ZOO
         if (model, config) != ("tied", "dp2-shard")] + [("scalar", c) for c in SCALAR_CONFIGS]


def _pickle(work: Path, name: str, defines: dict[str, str]) -> str:
    import pickle

    from ppdsl.compiler import compile_file

    path = work / f"{name}-d{defines['d']}.pickle"
    if not path.exists():
        compiled = compile_file(ROOT / "examples" / f"{name}.pp", defines)
        path.write_bytes(pickle.dumps((compiled.schedule, compiled.programs)))
    return str(path)


@pytest.fixture(scope="module")
def zoo_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.dist import harness

    work = tmp_path_factory.mktemp("zoo")
    cases = []
    for model, config in CASES:
        name, defines, mode = {**CONFIGS, **SCALAR_CONFIGS}[config]
        case = {"id": f"{model}-{config}", "pickle": _pickle(work, name, defines), "model": model}
        if mode:
            case.update(dp=2, mode=mode)
        cases.append(case)
    return harness.run_cases(cases, 4, work, worker="zoo_worker.py")


@pytest.mark.parametrize(("model", "config"), CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_zoo_parameters_and_buffers_equal_a_plain_run(zoo_results: dict, model: str, config: str) -> None:
    """Each zoo model after 3 SGD-momentum steps through the pipeline has, on every
    rank, the parameters AND buffers (BatchNorm's statistics, counters, integer
    and bool buffers) of a non-pipelined run over the same microbatches in order
    (floats within 1e-5 relative, the rest exactly), and the same losses."""
    per_rank = zoo_results[f"{model}-{config}"]
    errors = [r["error"] + "\n" + r.get("traceback", "") for r in per_rank if "error" in r]
    assert not errors, errors[0]
    for r in per_rank:
        bad = {name: e for name, e in r["errors"].items() if not e <= TOL}
        assert not bad, (r["rank"], bad)
        for got, want in zip(r["losses"], r["ref_losses"], strict=True):
            assert got is None or abs(got - want) <= TOL * abs(want), (r["rank"], r["losses"], r["ref_losses"])
    assert any(r["losses"][0] is not None for r in per_rank)


@pytest.mark.parametrize(("model", "config"), CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_zoo_evaluate_equals_a_plain_evaluation(zoo_results: dict, model: str, config: str) -> None:
    """`runner.evaluate` (docs/runtime.md, "Evaluation"), before the first step and
    after the last, returns on the last stage's rank the loss of a non-pipelined
    evaluation (stages in eval mode: BatchNorm's running statistics, no dropout)
    within 1e-6 relative, None elsewhere; the training around it stays exact (the
    test above)."""
    per_rank = zoo_results[f"{model}-{config}"]
    assert not [r for r in per_rank if "error" in r]
    for r in per_rank:
        if r["evals"][0] is None:
            assert r["evals"] == [None, None] and r["losses"][0] is None
            continue
        for got, want in zip(r["evals"], r["ref_evals"], strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (r["rank"], r["evals"], r["ref_evals"])


def _buffers(stages: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [b.detach().clone() for s in stages for b in s.buffers()]


def _set_buffers(stages: list[torch.nn.Module], values: list[torch.Tensor]) -> None:
    for b, v in zip([b for s in stages for b in s.buffers()], values, strict=True):
        b.data.copy_(v)


def _plain_run_evals(factory, num_stages: int, m: int, dp: int, steps: int, every: int,
                     num_batches: int) -> dict[int, float]:
    """One process, no pipeline: each replica's microbatches through the stages in
    turn (replica 0's buffers kept), one SGD step on the mean loss; after every
    `every` steps and the last, the mean eval-mode loss over `num_batches`
    evaluation batches and the replicas."""
    model = factory(num_stages)
    stages = [model.stage(k) for k in range(num_stages)]
    optimizer = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=LR)
    batch_size, per = 2 * m * dp, 2 * m

    def share_losses(inputs: torch.Tensor, targets: torch.Tensor, k: int) -> list[torch.Tensor]:
        found = []
        for j in range(m):
            rows = slice(k * per + j * (per // m), k * per + (j + 1) * (per // m))
            x = inputs[rows]
            for s in stages:
                x = s(x)
            found.append(model.loss(x, targets[rows]))
        return found

    evals = {}
    for step in range(steps):
        inputs, targets = model.batch(step, batch_size)
        start, kept, total = _buffers(stages), None, 0.0
        for k in range(dp):
            _set_buffers(stages, start)
            total = total + sum(share_losses(inputs, targets, k)) / (m * dp)
            kept = kept if k else _buffers(stages)
        _set_buffers(stages, kept)
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        if (step + 1) % every == 0 or step + 1 == steps:
            for s in stages:
                s.eval()
            with torch.no_grad():
                values = [float(sum(share_losses(*model.eval_batch(b, batch_size), k))) / m
                          for b in range(num_batches) for k in range(dp)]
            for s in stages:
                s.train()
            evals[step + 1] = sum(values) / len(values)
    return evals


# runner.evaluate itself, alone and under --dp 2 in both modes, is proven for every
# zoo model in the zoo's process group (test_zoo_evaluate_equals_a_plain_evaluation);
# here the loop's --eval-every/--eval-batches through `ppdsl run`, with the
# replicas' mean (shard: the mode whose parameters are DTensors).
@pytest.mark.parametrize("dp", ["shard"])
def test_eval_every_equals_a_plain_evaluation(tmp_path: Path, dp: str | None) -> None:
    """`ppdsl run --eval-every 2 --eval-batches 2` (docs/runtime.md, "Evaluation")
    on a BatchNorm model reports after steps 2 and 3 the validation loss of a
    non-pipelined run (eval mode: the running statistics the training left)
    within 1e-6 relative, with --dp 2 (the replicas' mean)."""
    schedule = "zb_h1" if dp else "1f1b"
    argv = [sys.executable, "-m", "ppdsl", "run", f"examples/{schedule}.pp", "-D", "d=2", "-D", "m=4",
            "--model", f"{ZOO}:norms", "--steps", "3", "--optimizer", "sgd", "--lr", str(LR),
            "--eval-every", "2", "--eval-batches", "2", "--json", str(tmp_path / "out")]
    if dp:
        argv += ["--dp", "2", "--dp-mode", dp]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("eval after step") == 2, proc.stdout
    mine = json.loads((tmp_path / "out" / "rank0.json").read_text())
    got = {int(k): float.fromhex(v) for k, v in mine["eval_losses"].items()}
    want = _plain_run_evals(zoo.norms, 2, 4, 2 if dp else 1, 3, 2, 2)
    assert sorted(got) == sorted(want) == [2, 3]
    for step, value in want.items():
        assert abs(got[step] - value) <= 1e-6 * abs(value), (got, want)


def test_eval_every_without_evaluation_data() -> None:
    """`--eval-every` with a model that has no `eval_batch` stops at start-up with
    one clear message and exit 1, no traceback (docs/runtime.md, the model protocol)."""
    argv = [sys.executable, "-m", "ppdsl", "run", "examples/1f1b.pp", "-D", "d=2", "-D", "m=4",
            "--model", f"{ZOO}:shared", "--steps", "1", "--eval-every", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--eval-every needs evaluation data" in proc.stderr and "eval_batch" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.pp")), ids=lambda p: p.stem)
def test_forward_only_programs_are_proven_for_every_example(path: Path) -> None:
    """`compile_forward` (docs/runtime.md, "Evaluation") turns every example into
    forward-only programs: each rank's F passes in the schedule's order, no B, W
    or R, every activation sent once and received once, proven deadlock-free."""
    from ppdsl.compiler import compile_file, compile_forward
    from ppdsl.ir.rank import Compute, Exchange
    from ppdsl.semantics import PassKind

    compiled = compile_file(path, {"d": "4"})
    programs = compile_forward(compiled.schedule).programs()
    for order, program in zip(compiled.schedule.orders, programs, strict=True):
        passes = [op.pass_ for op in program.ops if isinstance(op, Compute)]
        assert [p.key for p in passes] == [p.key for p in order if p.kind is PassKind.F]
    sends = [t for p in programs for op in p.ops if isinstance(op, Exchange) for t in op.sends]
    recvs = [t for p in programs for op in p.ops if isinstance(op, Exchange) for t in op.recvs]
    assert sorted(map(str, sends)) == sorted(map(str, recvs)) and len(set(map(str, sends))) == len(sends)


def test_resume_restores_buffers(tmp_path: Path) -> None:
    """A BatchNorm model stopped after step 2 and resumed from its checkpoint
    (docs/runtime.md, Checkpoints: buffers are saved with the weights) ends with
    the uninterrupted run's parameter AND buffer bytes on every rank, and the same
    losses and validation loss."""
    common = [sys.executable, "-m", "ppdsl", "run", "examples/1f1b.pp", "-D", "d=2", "-D", "m=4",
              "--model", f"{ZOO}:norms", "--steps", "4", "--optimizer", "sgd", "--momentum", "0.9",
              "--eval-every", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    # the whole run and the stopped one share nothing (own folders, own ports): they
    # run at once, the start-ups (mostly importing torch) overlapping; then the resume
    first = {
        "whole": ["--checkpoint-dir", str(tmp_path / "a"), "--json", str(tmp_path / "ja")],
        "stopped": ["--checkpoint-dir", str(tmp_path / "b"), "--stop-after", "2"],
    }
    procs = {name: subprocess.Popen(common + extra, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, extra in first.items()}
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, (name, err[-3000:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    resumed = ["--checkpoint-dir", str(tmp_path / "b"), "--resume", "--json", str(tmp_path / "jb")]
    proc = subprocess.run(common + resumed, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, ("resumed", proc.stderr[-3000:])
    for r in range(2):
        whole = json.loads((tmp_path / "ja" / f"rank{r}.json").read_text())
        resumed = json.loads((tmp_path / "jb" / f"rank{r}.json").read_text())
        assert (whole["buffers_sha256"] is not None) == (r == 0)  # BatchNorm on stage 0 only
        for key in ("parameters_sha256", "buffers_sha256", "eval_losses"):
            assert resumed[key] == whole[key], (r, key)
        assert {k: v for k, v in whole["losses"].items() if int(k) > 2} == resumed["losses"]
