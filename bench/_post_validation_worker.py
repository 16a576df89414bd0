"""One rank of bench_post_validation: sleep-timed stages (examples/models/sleepy.py)
trained through the library with an optimizer whose step sleeps a set time, the
optimizer step validated sync or post; rank 0 prints {"period_ms": ...} per
case as a JSON line. Run under torchrun with the cases' JSON file."""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ppdsl.backend.plan import plan_from_schedule  # noqa: E402
from ppdsl.runtime.execution.pipeline import CompiledPipeline, PipelineRunner  # noqa: E402
from ppdsl.runtime.models.model import build_model  # noqa: E402
from ppdsl.runtime.training.optim import OptimizerStep  # noqa: E402


class SleepySGD(torch.optim.SGD):
    """SGD whose step also sleeps `sleep_ms`: a large model's optimizer step."""

    def __init__(self, params, sleep_ms: float) -> None:
        super().__init__(params, lr=1e-3)
        self.sleep_ms = sleep_ms

    def step(self, closure=None):  # type: ignore[override]
        time.sleep(self.sleep_ms / 1e3)
        return super().step(closure)


def _period_ms(case: dict) -> float:
    """Milliseconds per step of `case`, steady state, on this rank."""
    with open(case["pickle"], "rb") as f:
        schedule, programs = pickle.load(f)
    plan = plan_from_schedule(schedule, programs)
    compiled = CompiledPipeline(plan, {r: p.ops for r, p in enumerate(programs)}, plan.fingerprint)
    model = build_model(str(ROOT / "examples" / "models" / "sleepy.py") + ":stages", plan.num_stages)
    runner = PipelineRunner(compiled, model.stage, model.loss, note=lambda text: None)
    optimizer = SleepySGD(runner.parameters(), case["optimizer_ms"])
    stepper = OptimizerStep(runner, optimizer, max_norm=1e9, validation=case["validation"])
    inputs, targets = model.batch(0, 2 * plan.num_microbatches)
    inputs = inputs if runner.is_first else None
    targets = targets if runner.is_last else None
    for index in range(case["warmup"] + case["steps"]):
        if index == case["warmup"]:
            stepper.resolve()
            dist.barrier()
            start = time.perf_counter()
        optimizer.zero_grad()
        runner.step(inputs, targets)
        stepper.step()
    stepper.resolve()
    dist.barrier()
    return (time.perf_counter() - start) / case["steps"] * 1e3


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for case in cases:
        period = _period_ms(case)
        if dist.get_rank() == 0:
            print(json.dumps({"id": case["id"], "period_ms": period}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
