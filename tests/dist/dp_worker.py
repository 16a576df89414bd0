"""Runs every data-parallel x pipeline case (world 4 = dp 2 x pp 2) in ONE process
group and writes, per case and rank, what it found as JSON
(tests/runtime/execution/test_data_parallel.py asserts on it). Each case builds the ("dp", "pp")
mesh, trains 3 SGD-momentum steps through `PipelineRunner(mesh=..., dp_mode=...)`
with each replica given its half of the global batch, and compares the
parameters with a single-process, non-pipelined run on the whole batch; the
first step measures peak activation memory against the schedule's prediction.

    python -m torch.distributed.run --nproc-per-node 4 tests/dist/dp_worker.py CASES.json OUTDIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ppdsl.runtime.execution.data_parallel import dp_pp_mesh, local_tensor  # noqa: E402
from ppdsl.runtime.training.optim import OptimizerStep  # noqa: E402
from ppdsl.runtime.execution.pipeline import PipelineRunner  # noqa: E402
from ppdsl.runtime.training.summary import with_real_mw  # noqa: E402
from tests.dist.train_worker import _compiled, _model, _optimizer, _rel, reference  # noqa: E402

DEVICE = torch.device("cpu")


def dp_case(case: dict, rank: int, world: int) -> dict:
    compiled = _compiled(case)
    plan = compiled.plan
    dp = case["dp"]
    mesh = dp_pp_mesh(dp, plan.num_devices, "cpu")
    replica = mesh.get_local_rank("dp")
    per_replica = 2 * plan.num_microbatches
    model = _model(case, plan.num_stages)
    runner = PipelineRunner(compiled, model.stage, model.loss, device=DEVICE, mesh=mesh,
                            dp_mode=case["mode"], release=case.get("release", "at-b"),
                            note=lambda text: None)
    optimizer = _optimizer(case, runner.parameters())
    stepper = OptimizerStep(runner, optimizer, max_norm=case.get("max_norm"))
    # shard: at every microbatch's forward, is the stage whole already (gathered
    # once at its first F), or would FSDP gather it again? (runs before FSDP's hook)
    sharded_at_forward = [0]
    forwards = [0]

    def look(module, args) -> None:
        forwards[0] += 1
        if any(hasattr(p, "to_local") for p in module.parameters()):
            sharded_at_forward[0] += 1

    if case["mode"] == "shard":
        for module in runner.stages.values():
            module.register_forward_pre_hook(look, prepend=True)
    resharded_after_step = []
    losses = []
    for step in range(case["steps"]):
        if step == 1:  # after the first step's shape probe (which gathers by itself)
            sharded_at_forward[0] = forwards[0] = 0
        inputs, targets = model.batch(step, dp * per_replica)
        mine = slice(replica * per_replica, (replica + 1) * per_replica)
        optimizer.zero_grad(set_to_none=True)
        loss = runner.step(inputs[mine] if runner.is_first else None,
                           targets[mine] if runner.is_last else None,
                           measure_memory=step == 0)
        if step == 0:
            peak = runner.engine.meter.peak_units
            real = with_real_mw(plan.memory, runner.engine.measured_mw_ratio())
        losses.append(float(loss) if loss is not None else None)
        resharded_after_step.append(all(hasattr(p, "to_local") for p in runner.parameters()))
        stepper.step()
    ref = reference(case, model, plan.num_stages, dp * per_replica)
    param_err = 0.0
    for s, st in runner.stages.items():
        for n, p in st.named_parameters():
            want = ref["params"][(s, n)]
            if case["mode"] == "shard":  # this rank's rows of the reference
                local = local_tensor(p.detach())
                rows = -(-want.shape[0] // dp) if want.dim() else 0
                want = want[replica * rows: replica * rows + local.shape[0]] if want.dim() else want
                got = local
            else:
                got = p.detach()
            param_err = max(param_err, _rel(got, want))
    # the replicas' parameters are the same bits (replicate) / their gathered values
    digest = [float(local_tensor(p.detach()).double().sum()) for p in runner.parameters()]
    return {"case": case["id"], "rank": rank, "replica": replica, "stages": sorted(runner.stages),
            "param_rel_err": param_err, "losses": losses, "ref_losses": ref["losses"],
            "predicted_peak": str(plan.predicted_peak(runner.rank)),
            "predicted_peak_real_mw": str(plan.predicted_peak(runner.rank, real)),
            "measured_peak": str(peak),
            "digest": digest, "outcomes": [o.grad_norm for o in stepper.outcomes],
            "ref_norms": ref["norms"], "forwards": forwards[0],
            "sharded_at_forward": sharded_at_forward[0], "resharded_after_step": resharded_after_step}


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in cases:
        try:
            result = dp_case(case, rank, world)
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
