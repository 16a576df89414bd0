"""One rank of bench_dp: dp 2 x pp 2 with sleep-timed stages
(examples/models/sleepy.py, each with a `bulk` parameter of PPDSL_SLEEP_PARAMS
floats), trained through the library in replicate or shard mode. First it times
the collectives on a stage's bytes over its DP group; then per case, rank 0
prints a JSON line: the step time and, per rank, the time it waited for its
collectives (the exposed communication), steady state. Run under torchrun."""

from __future__ import annotations

import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ppdsl.backend.plan import plan_from_schedule  # noqa: E402
from ppdsl.runtime.execution.data_parallel import dp_pp_mesh  # noqa: E402
from ppdsl.runtime.execution.pipeline import CompiledPipeline, PipelineRunner  # noqa: E402
from ppdsl.runtime.models.model import build_model  # noqa: E402


def _time_collectives(mesh, numel: int, repeats: int = 7) -> dict[str, float]:
    """Median ms of an all-reduce, a reduce-scatter and an all-gather of `numel`
    floats (a stage's bytes) over this rank's DP group, while every DP group runs
    its own at once (as in the run)."""
    group = mesh["dp"].get_group()
    size = dist.get_world_size(group)
    whole = torch.ones(numel)
    part = torch.ones(numel // size)
    found: dict[str, list[float]] = {"reduce": [], "reduce_scatter": [], "gather": []}
    for _ in range(repeats):
        for name, call in (("reduce", lambda: dist.all_reduce(whole, group=group)),
                           ("reduce_scatter", lambda: dist.reduce_scatter_tensor(part, whole, group=group)),
                           ("gather", lambda: dist.all_gather_into_tensor(whole, part, group=group))):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            found[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in found.items()}


def _case(case: dict, mesh) -> dict:
    with open(case["pickle"], "rb") as f:
        schedule, programs = pickle.load(f)
    plan = plan_from_schedule(schedule, programs)
    compiled = CompiledPipeline(plan, {r: p.ops for r, p in enumerate(programs)}, plan.fingerprint)
    os.environ["PPDSL_SLEEP_MS"] = case["sleep"]
    os.environ["PPDSL_SLEEP_PARAMS"] = str(case["bulk"])
    model = build_model(str(ROOT / "examples" / "models" / "sleepy.py") + ":stages", plan.num_stages)
    runner = PipelineRunner(compiled, model.stage, model.loss, mesh=mesh, dp_mode=case["mode"],
                            note=lambda text: None)
    dp = runner.data_parallel
    assert dp is not None
    zeros = {}

    def fill(params: list[torch.Tensor]) -> None:  # the bulk's gradient, as a real W would leave
        for p in params:
            if p.numel() == case["bulk"]:
                p.grad = zeros.setdefault(p.numel(), torch.zeros(p.numel()))

    dp.on_gather.append(fill)
    optimizer = torch.optim.SGD(runner.parameters(), lr=1e-3)
    inputs, targets = model.batch(0, 2 * plan.num_microbatches)
    times, waits = [], []
    for step in range(case["warmup"] + case["steps"]):
        if case["mode"] == "replicate":
            fill([p for p in runner.parameters()])
        dist.barrier()
        before = dp.wait_time
        t0 = time.perf_counter()
        runner.step(inputs if runner.is_first else None, targets if runner.is_last else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        if step >= case["warmup"]:
            times.append(elapsed * 1e3)
            waits.append((dp.wait_time - before) * 1e3)
    mine = torch.tensor([statistics.median(times), statistics.median(waits)])
    every = [torch.zeros(2) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {"id": case["id"], "step_ms": max(float(t[0]) for t in every),
            "exposed_ms": [float(t[1]) for t in every]}


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = dp_pp_mesh(2, 2, "cpu")
    collectives = {str(n): _time_collectives(mesh, n) for n in sorted({c["bulk"] for c in cases})}
    if dist.get_rank() == 0:
        print(json.dumps({"collectives": collectives}), flush=True)
    for case in cases:
        row = _case(case, mesh)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
