"""Rows (f) and (g) of `make gpu-check` (bench/gpu_check.py), in one process:
schedules with all their stages on one rank (d=1), the same stages and the same
microbatches run three ways:

- ppdsl: the runtime's `Engine` on the compiled order (F, B, W or BW as the
  schedule says; under bf16 the forward and loss under autocast, as `ppdsl run
  --precision bf16` runs them);
- plain: each microbatch's forward through the stages and its backward, one
  after the other (the physical limit for one rank running every stage);
- torch: torch.distributed.pipelining's schedule class for the same placement at
  pp=1 (Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble), its stages the
  same modules under the same autocast.

Each is timed per step (CUDA events on CUDA, `time.perf_counter` on CPU), the
median of `--steps` after `--warmup`, the two runs compared taking turns;
gradients are zeroed between steps (no optimizer: the step is the passes), and
row (f) also reports how far ppdsl's gradients are from the plain step's. Prints one JSON object: {"f": {schedule:
{"ppdsl_ms", "plain_ms", "ratio", "gradient_error"}}, "g": {schedule: {"ppdsl_ms", "torch_ms",
"ratio", "torch_class"}}, "skipped": {what: why}}. Run as
``python -m bench._step_compare --device cpu|cuda --precision fp32|bf16``; the
model is bench/gpu_gpt.py, sized by its environment variables.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "bench" / "gpu_gpt.py") + ":stages"
ROW_F = ("interleaved_1f1b", "zb_v", "v_half", "dualpipe_v")
"""The d=1 schedules of row (f): ppdsl's step over the plain step."""
ROW_G = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "interleaved_zb": "ScheduleInterleavedZeroBubble",
         "zb_v": "ScheduleZBVZeroBubble"}
"""Row (g): ppdsl's file and torch's class for the same placement and order family."""


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _timed(steps: list[Callable[[], None]], device: torch.device, warmup: int,
           repeats: int) -> list[float]:
    """The median milliseconds of each of `steps`, run in turn (one of each,
    then again: a drift of the machine's speed lands on all of them), after
    `warmup` untimed rounds."""
    found: list[list[float]] = [[] for _ in steps]
    for at in range(warmup + repeats):
        for i, step in enumerate(steps):
            if device.type == "cuda":
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                begin.record()
                step()
                end.record()
                torch.cuda.synchronize(device)
                ms = begin.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                step()
                ms = (time.perf_counter() - t0) * 1e3
            if at >= warmup:
                found[i].append(ms)
    return [_median(f) for f in found]


def _gradient_error(a: _Stages, b: _Stages) -> float:
    """The largest relative difference between the two runs' parameter gradients
    (each left by its last step)."""
    worst = 0.0
    for ma, mb in zip(a.built, b.built, strict=True):
        for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
            assert pa.grad is not None and pb.grad is not None
            scale = float(pb.grad.float().abs().max()) or 1.0
            worst = max(worst, float((pa.grad.float() - pb.grad.float()).abs().max()) / scale)
    return worst


class _Autocast(nn.Module):
    """A stage run under autocast (torch's pipelining stages take a module)."""

    def __init__(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.module, self.device_type, self.dtype = module, device.type, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype is None:
            return self.module(x)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(x)


def _zero(modules: list[nn.Module]) -> None:
    for module in modules:
        module.zero_grad(set_to_none=True)


def _ppdsl_step(name: str, model: Any, microbatches: int, device: torch.device,
                dtype: torch.dtype | None, xs: list[torch.Tensor], ys: list[torch.Tensor],
                ) -> Callable[[], None]:
    from ppdsl.runtime.execution.engine import Engine
    from ppdsl.runtime.execution.group import LaneEnds
    from ppdsl.runtime.execution.pipeline import load_schedule
    from ppdsl.runtime.execution.structure import flatten

    compiled = load_schedule(ROOT / "examples" / f"{name}.pp", {"d": 1, "m": microbatches})
    plan = compiled.plan
    stages = {s: model[s] for s in range(len(plan.stage_device))}
    engine = Engine(0, compiled.ops[0], plan.stage_device, microbatches, plan.memory, stages,
                    model.loss, device, lane_ends=LaneEnds.of(plan), autocast_dtype=dtype)
    specs, x = {}, xs[0]
    with torch.no_grad(), engine.autocast():
        for s in sorted(stages):
            x = stages[s](x)
            specs[s] = flatten(x)[1]
    engine.set_specs(specs)
    modules = list(stages.values())

    def step() -> None:
        _zero(modules)
        engine.step(xs, ys)
    return step


def _plain_step(model: Any, num_stages: int, device: torch.device, dtype: torch.dtype | None,
                xs: list[torch.Tensor], ys: list[torch.Tensor]) -> Callable[[], None]:
    modules = [model[s] for s in range(num_stages)]

    def step() -> None:
        _zero(modules)
        for x, y in zip(xs, ys, strict=True):
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                for module in modules:
                    x = module(x)
                loss = model.loss(x, y) / len(xs)
            loss.backward()
    return step


def _torch_step(cls_name: str, model: Any, microbatches: int, device: torch.device,
                dtype: torch.dtype | None, xs: list[torch.Tensor], ys: list[torch.Tensor],
                ) -> Callable[[], None]:
    import torch.distributed.pipelining as pipelining

    modules = [model[s] for s in range(2)]
    stages = [pipelining.PipelineStage(_Autocast(m, device, dtype), s, 2, device)
              for s, m in enumerate(modules)]
    schedule = getattr(pipelining, cls_name)(stages, microbatches, loss_fn=model.loss)
    batch_x, batch_y = torch.cat(xs), torch.cat(ys)

    def step() -> None:
        _zero(modules)
        schedule.step(batch_x, target=batch_y)
    return step


class _Stages:
    """The model's stages, built once on the device; `copy()` gives each of the
    three runs its own modules (their gradients apart)."""

    def __init__(self, model: Any, num_stages: int, device: torch.device) -> None:
        self.loss = model.loss
        self.built = [model.stage(s).to(device) for s in range(num_stages)]

    def copy(self) -> _Stages:
        other = copy.copy(self)
        other.built = [copy.deepcopy(m) for m in self.built]
        return other

    def __getitem__(self, stage: int) -> nn.Module:
        return self.built[stage]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._step_compare")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    if device.type == "cpu":
        torch.set_num_threads(1)
    from ppdsl.runtime.models.model import build_model

    model = build_model(GPT, 2)
    base = _Stages(model, 2, device)
    inputs, targets = model.batch(0, args.microbatches)
    xs = [x.to(device) for x in inputs.split(1)]
    ys = [y.to(device) for y in targets.split(1)]
    found: dict[str, Any] = {"f": {}, "g": {}, "skipped": {}}
    timing = {"device": device, "warmup": args.warmup, "repeats": args.steps}
    with tempfile.TemporaryDirectory(prefix="step-compare-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(tmp) / "store"), 1),
                                rank=0, world_size=1)
        try:
            for name in ROW_F:
                ours, plain = base.copy(), base.copy()
                try:
                    step = _ppdsl_step(name, ours, args.microbatches, device, dtype, xs, ys)
                except Exception as exc:  # a file that does not hold at d=1 is named, not run
                    first = str(exc).strip().splitlines()[0]
                    found["skipped"][f"(f) {name}"] = first.split("error: ", 1)[-1][:200]
                    continue
                ms, plain_ms = _timed([step, _plain_step(plain, 2, device, dtype, xs, ys)], **timing)
                found["f"][name] = {"ppdsl_ms": ms, "plain_ms": plain_ms, "ratio": ms / plain_ms,
                                    "gradient_error": _gradient_error(ours, plain)}
            for name, cls_name in ROW_G.items():
                step = _ppdsl_step(name, base.copy(), args.microbatches, device, dtype, xs, ys)
                try:
                    theirs = _torch_step(cls_name, base.copy(), args.microbatches, device, dtype,
                                         xs, ys)
                    ms, torch_ms = _timed([step, theirs], **timing)
                except Exception as exc:  # torch's class refuses this size or placement
                    found["skipped"][f"(g) {cls_name}"] = f"{type(exc).__name__}: {exc}"[:200]
                    continue
                found["g"][name] = {"ppdsl_ms": ms, "torch_ms": torch_ms, "ratio": ms / torch_ms,
                                    "torch_class": cls_name}
        finally:
            dist.destroy_process_group()
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
