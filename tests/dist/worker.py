"""Runs every case of one world size in ONE process group (started by torchrun from
tests/dist/harness.py) and writes, per case and rank, what it measured as JSON:
loss and gradient error against a single-process non-pipelined run of the same
model on the same batch, parameter error after several optimizer steps, and
measured vs predicted peak activation memory.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist/worker.py CASES.json OUTDIR

PPDSL_TEST_BACKEND: gloo (default, CPU), nccl (a GPU per rank), or shared (the
ranks share GPU 0 in a gloo group, transfers staged through host memory, as
`--share-gpu`; CPU tensors when there is no GPU). On CUDA a case with
"cuda_peak" also measures one more step's CUDA peak from a baseline holding the
gradients (allocated by the steps before), against the compiler's prediction in
bytes (its units times the rank's measured M_B per stage) and against
`memory.predicted_device_peak` (that, plus the W stashes' gradients and each
pass's working memory, measured in the same step by the engine's pass windows).
PPDSL_CUDA_SNAPSHOTS=DIR: that step's allocator history as torch's memory
snapshots (DIR/CASE.rankR.pickle; `python -m torch.cuda._memory_viz trace_plot`).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ppdsl.backend.plan import PassKeys, plan_from_schedule  # noqa: E402
from ppdsl.runtime.execution.memory import DevicePeak  # noqa: E402
from ppdsl.runtime.models.model import build_model  # noqa: E402
from ppdsl.runtime.execution.pipeline import CompiledPipeline, PipelineRunner  # noqa: E402
from ppdsl.runtime.training.summary import predicted_cuda_peak, with_real_mw  # noqa: E402
from tests.oracles.allocator import HostAllocator  # noqa: E402

DEVICE = torch.device("cpu")
SHARE_GPU = False
MODEL = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":"
LR = 0.05  # SGD: the parameter check stays linear in the gradients (Adam's first step is
# sign-like and would amplify rounding in near-zero gradients)


def _schedule(case: dict):
    """(schedule, programs, timeline-or-None), compiled once by the test process."""
    with open(case["pickle"], "rb") as f:
        return pickle.load(f)


def _reference(model, num_stages: int, steps: int, batch_size: int):
    """Single process, no pipeline: loss and grads of step 0, params after `steps`."""
    stages = [model.stage(s).to(DEVICE) for s in range(num_stages)]
    params = [p for st in stages for p in st.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    first = None
    for step in range(steps):
        inputs, targets = model.batch(step, batch_size)
        x, targets = inputs.to(DEVICE), targets.to(DEVICE)
        for st in stages:
            x = st(x)
        loss = model.loss(x, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            first = (
                float(loss.detach()),
                [{n: None if p.grad is None else p.grad.clone() for n, p in st.named_parameters()}
                 for st in stages],
            )
        opt.step()
    return first, [{n: p.detach().clone() for n, p in st.named_parameters()} for st in stages]


# _reference's results by (model, stages, steps, batch): many schedules of a world
# size train the same model on the same batches, and the reference run is a pure
# function of those (seeded stages and batches), so each rank runs it once
_REFERENCES: dict[tuple[str, int, int, int], tuple] = {}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_case(case: dict, rank: int, world: int, host: HostAllocator | None = None) -> dict:
    schedule, programs, timeline = _schedule(case)
    group = None
    pipelines = case.get("pipelines", 1)
    if pipelines > 1:  # the world cut into pipelines, each in its own process group
        size = world // pipelines
        groups = [dist.new_group(list(range(i * size, (i + 1) * size))) for i in range(pipelines)]
        group = groups[rank // size]
        rank, world = rank % size, size
    assert schedule.num_devices == world, (schedule.num_devices, world)
    plan = plan_from_schedule(schedule, programs, timeline)
    m, num_stages = plan.num_microbatches, plan.num_model_stages  # model stages
    batch_size = case.get("batch_per_mb", 2) * m
    spec = case.get("model") or MODEL + case.get("factory", "stages")
    model = build_model(spec, num_stages)
    compiled = CompiledPipeline(plan, {r: p.ops for r, p in enumerate(programs)}, plan.fingerprint)
    runner = PipelineRunner(compiled, model.stage, model.loss, device=DEVICE, timeout=60,
                            release=case.get("release", "at-b"), group=group,
                            note=lambda text: None, share_gpu=SHARE_GPU)
    if host is not None:
        runner.engine.device_peak = DevicePeak(DEVICE, allocated=host.now, peak=host.high,
                                               reset=host.reset)
    optimizer = torch.optim.SGD(runner.parameters(), lr=LR)
    steps = case.get("steps", 3)
    out: dict = {"case": case["id"], "rank": rank, "stages": sorted(runner.stages),
                 "pipeline": dist.get_rank() // world}

    def data(step: int):
        if not (runner.is_first or runner.is_last):  # only the ranks that use it build it
            return None, None
        inputs, targets = model.batch(step, batch_size)
        return (inputs if runner.is_first else None), (targets if runner.is_last else None)

    loss = runner.step(*data(0), measure_memory=True)
    # the loss as the ranks returning one agree on it (two under DualPipe: one per lane end)
    loss_t = torch.tensor([float(loss) if loss is not None else 0.0, float(loss is not None)],
                          dtype=torch.float64, device=DEVICE)
    dist.all_reduce(loss_t, group=group)
    loss_t[0] /= loss_t[1]
    engine = runner.engine
    out["measured_peak"] = str(engine.meter.peak_units)
    out["measured_peak_bytes"] = engine.meter.peak_bytes
    out["stash_gradient_bytes"] = engine.meter.peak_gradient_bytes
    ratios = engine.measured_mw_ratio()
    out["mw_ratio"] = {str(s): str(r) for s, r in ratios.items()}
    out["stage_bytes"] = {str(s): b for s, b in engine.stage_bytes().items()}
    out["predicted_peak"] = str(plan.predicted_peak(rank))
    kept = engine.measured_mi_ratio()
    out["mi_ratio"] = {str(s): str(r) for s, r in kept.items()}
    out["recompute"] = sorted(plan.memory.recompute)
    out["predicted_peak_real_mw"] = str(
        plan.predicted_peak(rank, with_real_mw(plan.memory, ratios, kept))
    )
    if not case.get("check_grads", True):
        return out
    key = (spec, num_stages, steps, batch_size)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(model, num_stages, steps, batch_size)
    ref_first, ref_params = _REFERENCES[key]
    ref_loss, ref_grads = ref_first
    out["loss"] = float(loss_t[0])
    out["ref_loss"] = ref_loss
    grad_err = 0.0
    frozen = 0
    for s, st in runner.stages.items():
        for n, p in st.named_parameters():
            if not p.requires_grad:  # frozen: no gradient here nor in the reference
                assert p.grad is None, f"stage {s} {n}: frozen, but got a gradient"
                assert ref_grads[plan.model_stage(s)][n] is None, f"stage {s} {n}: the reference has a gradient"
                frozen += 1
                continue
            assert p.grad is not None, f"stage {s} {n}: no gradient"
            grad_err = max(grad_err, _rel(p.grad, ref_grads[plan.model_stage(s)][n].to(p.device)))
    out["frozen_parameters"] = frozen
    out["grad_rel_err"] = grad_err
    optimizer.step()
    for step in range(1, steps):
        optimizer.zero_grad()
        runner.step(*data(step))
        optimizer.step()
    param_err = 0.0
    for s, st in runner.stages.items():
        for n, p in st.named_parameters():
            param_err = max(param_err, _rel(p.detach(),
                                                ref_params[plan.model_stage(s)][n].to(p.device)))
    out["param_rel_err"] = param_err
    out["steps"] = steps
    if case.get("cuda_peak"):
        unit = sum(engine.stage_bytes().values()) / max(len(engine.stage_bytes()), 1)
        out["predicted_peak_bytes"] = float(Fraction(out["predicted_peak_real_mw"])) * unit
        peak = engine.device_peak
        if peak is not None:  # CUDA's allocator, or its counters imitated on CPU
            optimizer.zero_grad(set_to_none=False)  # the gradients stay in the baseline
            batch = data(steps)  # made before the window, as `ppdsl run` does
            snapshots = os.environ.get("PPDSL_CUDA_SNAPSHOTS") if DEVICE.type == "cuda" else None
            if snapshots:  # every allocation of the step, with its stack (torch's memory viz)
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            peak.start()  # with each pass's working memory (its own windows)
            runner.step(*batch, measure_memory=True)
            peak.stop()
            if snapshots:
                Path(snapshots).mkdir(parents=True, exist_ok=True)
                torch.cuda.memory._dump_snapshot(str(Path(snapshots) / f"{case['id']}.rank{rank}.pickle"))
                torch.cuda.memory._record_memory_history(enabled=None)
            out["cuda_peak_bytes"] = peak.bytes
            real = with_real_mw(plan.memory, engine.measured_mw_ratio(), engine.measured_mi_ratio())
            out["predicted_cuda_peak_bytes"] = predicted_cuda_peak(plan, rank, runner, real, peak,
                                                                    fresh_gradients=False)
            out["working_bytes"] = peak.working_by_pass()
    return out


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(sys.argv[2])
    torch.set_num_threads(1)
    global DEVICE
    global SHARE_GPU
    backend = os.environ.get("PPDSL_TEST_BACKEND", "gloo")
    if backend == "nccl":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(DEVICE)
    if backend == "shared":
        SHARE_GPU, backend = True, "gloo"
        if torch.cuda.is_available():
            DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
            torch.cuda.set_device(DEVICE)
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in cases:
        try:
            if case.get("cuda_peak") and DEVICE.type == "cpu":
                # the CUDA allocator's counters imitated on CPU (tests/oracles/allocator.py)
                with HostAllocator() as host:
                    result = run_case(case, rank, world, host)
            else:
                result = run_case(case, rank, world)
        except Exception as exc:
            result = {"case": case["id"], "rank": rank, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()}
        (outdir / f"{case['id']}.rank{rank}.json").write_text(json.dumps(result, indent=1))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
