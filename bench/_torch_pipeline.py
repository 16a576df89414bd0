"""One rank of the torch.distributed.pipelining side of bench_runtime: the same
tiny_gpt stages, the same microbatches, torch's own schedule. Rank 0 prints
{"mean_step_time": seconds} as its last line. Run under torchrun."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ppdsl.runtime.models.model import build_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=["1f1b", "zbv", "interleaved"], required=True)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, d = dist.get_rank(), dist.get_world_size()
    if args.schedule == "1f1b":
        stage_ids, num_stages, cls = [rank], d, Schedule1F1B
    elif args.schedule == "zbv":
        stage_ids, num_stages, cls = [rank, 2 * d - 1 - rank], 2 * d, ScheduleZBVZeroBubble
    else:
        stage_ids, num_stages, cls = [rank, rank + d], 2 * d, ScheduleInterleaved1F1B
    model = build_model(str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages", num_stages)
    modules = {s: model.stage(s) for s in stage_ids}
    stages = [PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in stage_ids]
    params = [p for mod in modules.values() for p in mod.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    sched = cls(stages[0], args.microbatches, loss_fn=model.loss) if len(stages) == 1 else \
        cls(stages, args.microbatches, loss_fn=model.loss)
    times = []
    for step in range(args.steps):
        x, y = model.batch(step, 2 * args.microbatches)
        kwargs = {}
        if num_stages - 1 in stage_ids:
            kwargs["target"] = y
        dist.barrier()
        t0 = time.perf_counter()
        if 0 in stage_ids:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step > 0:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"mean_step_time": sum(times) / len(times)}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
