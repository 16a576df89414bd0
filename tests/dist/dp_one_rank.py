"""One process, the ("dp", "pp") mesh of size 1 x 1 on DEVICE (cpu/gloo or
cuda/nccl): ZB-H1 at d=1 trained 3 SGD steps plainly and in each data-parallel
mode; prints one JSON line with each mode's largest relative difference from the
plain run's parameters (tests/system/test_gpu.py runs it on one GPU: FSDP2's
gathers and reduce-scatters on NCCL and CUDA streams).

    torchrun --nproc-per-node 1 tests/dist/dp_one_rank.py cuda
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ppdsl.runtime.execution.data_parallel import dp_pp_mesh, local_tensor  # noqa: E402
from ppdsl.runtime.models.model import build_model  # noqa: E402
from ppdsl.runtime.execution.pipeline import PipelineRunner, load_schedule  # noqa: E402


def train(device: torch.device, mesh, mode: str | None) -> list[torch.Tensor]:
    schedule = load_schedule(ROOT / "examples" / "zb_h1.pp", {"d": 1, "m": 4})
    model = build_model(str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages", 1)
    kwargs = {"mesh": mesh, "dp_mode": mode} if mode is not None else {}
    runner = PipelineRunner(schedule, model.stage, model.loss, device=device,
                            note=lambda text: None, **kwargs)
    optimizer = torch.optim.SGD(runner.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        inputs, targets = model.batch(step, 8)
        optimizer.zero_grad(set_to_none=True)
        runner.step(inputs, targets)
        optimizer.step()
    return [local_tensor(p.detach()).double().cpu() for p in runner.parameters()]


def main() -> int:
    device = torch.device(sys.argv[1], 0) if sys.argv[1] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    mesh = dp_pp_mesh(1, 1, device.type)
    plain = train(device, None, None)
    found = {}
    for mode in ("replicate", "shard"):
        got = train(device, mesh, mode)
        found[mode] = max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                          for a, b in zip(got, plain, strict=True))
    print(json.dumps(found), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
