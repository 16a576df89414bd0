"""Runs `--model hf:DIR` cases of one world size in ONE process group (started by
tests/dist/harness.py): for each (family folder, schedule), 3 optimizer steps of
the library's runner on `ppdsl.runtime.models.hf`'s stages, the trained model saved with
`HFPipelineModel.save`; per case and rank it writes the measured vs predicted peak
activation memory.

    python tests/dist/hf_worker.py CASES.json OUTDIR      (RANK, WORLD_SIZE, ... set)
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

from ppdsl.runtime import load_schedule  # noqa: E402
from ppdsl.runtime.models.hf import HFOptions, pipeline_model  # noqa: E402
from ppdsl.runtime.execution.pipeline import PipelineRunner  # noqa: E402
from ppdsl.runtime.training.summary import with_real_mw  # noqa: E402


def run_case(case: dict, rank: int) -> dict:
    schedule = load_schedule(str(ROOT / "examples" / f"{case['schedule']}.pp"),
                             {"d": dist.get_world_size(), "m": case["m"]})
    model = pipeline_model(case["dir"], schedule.num_stages,
                           HFOptions(seq_len=case["seq_len"], data=case["data"]))
    runner = PipelineRunner(schedule, model.stage, model.loss, tied=model.tied)
    optimizer = torch.optim.SGD(runner.parameters(), lr=case["lr"], momentum=0.9)
    losses = []
    for step in range(case["steps"]):
        inputs, targets = model.batch(step, case["batch"])
        optimizer.zero_grad(set_to_none=True)
        loss = runner.step(inputs if runner.is_first else None,
                           targets if runner.is_last else None, measure_memory=step == 0)
        optimizer.step()
        losses.append(None if loss is None else float(loss))
    model.save(case["out"], runner)
    engine, plan = runner.engine, schedule.plan
    real = with_real_mw(plan.memory, engine.measured_mw_ratio(), engine.measured_mi_ratio())
    return {"rank": rank, "losses": losses, "tied": [dict(t) for t in model.tied],
            "measured_peak": str(engine.meter.peak_units),
            "predicted_peak_real_mw": str(plan.predicted_peak(rank, real))}


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    for case in cases:
        try:
            result = run_case(case, rank)
        except Exception as exc:
            result = {"rank": rank, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()}
        (outdir / f"{case['id']}.rank{rank}.json").write_text(json.dumps(result, indent=1))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
