"""Resumes under another layout, every case in ONE process group of 4 ranks
(started by tests/dist/harness.py), for each optimizer of CASES.json:

- `saved`: d=4 1F1B on all 4 ranks trains 2 steps and saves a checkpoint
  (`save_checkpoint`, keyed by the model's own names);
- `zbv`: ranks 0-1 load it at d=2 under ZB-V and train 2 more steps, while
  `reference`: ranks 2-3 train an uninterrupted d=2 1F1B run of 4 steps from the
  same initial weights;
- `cut`: all 4 ranks load it at d=4 under 1F1B with another cut and train 2 more.

Per case and rank it writes the losses it saw, its tensors and optimizer state
after the last step and, for a resumed case, right after loading, by the model's
own names (`OUTDIR/{optimizer}-{case}.rank{R}.pt`).

    python tests/dist/reshard_worker.py CASES.json OUTDIR      (RANK, WORLD_SIZE, ... set)
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ppdsl.runtime import load_schedule  # noqa: E402
from ppdsl.runtime.execution.pipeline import PipelineRunner  # noqa: E402
from ppdsl.runtime.models.hf import HFOptions, pipeline_model  # noqa: E402
from ppdsl.runtime.training.checkpoint import (  # noqa: E402
    load_checkpoint,
    model_names,
    save_checkpoint,
)


def _optimizer(name: str, params: list) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3)


def _build(spec: dict, schedule: str, d: int, cut: str, group: Any) -> tuple:
    plan = load_schedule(str(ROOT / "examples" / f"{schedule}.pp"), {"d": d, "m": spec["m"]})
    model = pipeline_model(spec["dir"], plan.num_stages, HFOptions(seq_len=spec["seq_len"], cut=cut))
    runner = PipelineRunner(plan, model.stage, model.loss, tied=model.tied, group=group,
                            note=lambda _: None)
    return runner, model, _optimizer(spec["optimizer"], runner.parameters())


def _train(runner: PipelineRunner, model: Any, optimizer: torch.optim.Optimizer,
           steps: range, batch: int) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = model.batch(step, batch)
        optimizer.zero_grad(set_to_none=True)
        loss = runner.step(inputs if runner.is_first else None,
                           targets if runner.is_last else None)
        optimizer.step()
        if loss is not None:
            losses.append(float(loss))
    return losses


def _snapshot(runner: PipelineRunner, optimizer: torch.optim.Optimizer) -> dict:
    """Every tensor and optimizer state of this rank by the model's names."""
    found = {}
    for name, t in model_names(runner).items():
        found[name] = t.detach().clone()
        for key, value in optimizer.state.get(t, {}).items():
            found[f"{name}/{key}"] = value.detach().clone()
    return found


def _finish(spec: dict, case: str, outdir: Path, runner: PipelineRunner,
            optimizer: torch.optim.Optimizer, losses: list[float], rank: int,
            loaded: dict | None = None) -> None:
    torch.save({"losses": losses, "tensors": _snapshot(runner, optimizer), "loaded": loaded},
               outdir / f"{spec['optimizer']}-{case}.rank{rank}.pt")


def run_spec(spec: dict, outdir: Path, rank: int, pairs: dict[int, Any]) -> None:
    checkpoint = Path(spec["checkpoint"])
    batch = spec["batch"]
    runner, model, optimizer = _build(spec, "1f1b", 4, "equal", None)
    losses = _train(runner, model, optimizer, range(2), batch)
    save_checkpoint(checkpoint, runner, optimizer, step=2)
    _finish(spec, "saved", outdir, runner, optimizer, losses, rank)

    pair = pairs[rank // 2]
    if rank < 2:
        runner, model, optimizer = _build(spec, "zb_v", 2, "equal", pair)
        assert load_checkpoint(checkpoint, runner, optimizer, process_group=pair)["step"] == 2
        loaded = _snapshot(runner, optimizer)
        losses = _train(runner, model, optimizer, range(2, 4), batch)
        _finish(spec, "zbv", outdir, runner, optimizer, losses, rank, loaded)
    else:
        runner, model, optimizer = _build(spec, "1f1b", 2, "equal", pair)
        losses = _train(runner, model, optimizer, range(4), batch)
        _finish(spec, "reference", outdir, runner, optimizer, losses, rank)
    dist.barrier()

    runner, model, optimizer = _build(spec, "1f1b", 4, spec["other_cut"], None)
    load_checkpoint(checkpoint, runner, optimizer)
    loaded = _snapshot(runner, optimizer)
    losses = _train(runner, model, optimizer, range(2, 4), batch)
    _finish(spec, "cut", outdir, runner, optimizer, losses, rank, loaded)


def main() -> int:
    specs = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    pairs = {0: dist.new_group([0, 1]), 1: dist.new_group([2, 3])}
    for spec in specs:
        try:
            run_spec(spec, outdir, rank, pairs)
            result: dict = {"rank": rank}
        except Exception as exc:
            result = {"rank": rank, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()}
        (outdir / f"{spec['id']}.rank{rank}.json").write_text(json.dumps(result, indent=1))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
