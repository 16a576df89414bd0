"""Runs every training-feature case of one world size in ONE process group and
writes, per case and rank, what it found as JSON (tests/system/test_pipeline_training.py asserts
on it). Each case trains through the library (`PipelineRunner`, `OptimizerStep`)
or through torch.distributed.pipelining's runtime (`torch_schedule`), and
compares with a single-process run of the same model on the same batches:

- bridge: the compiled orders under torch's `_PipelineScheduleRuntime`
  (from the action lists, or from the exported CSV through torch's `_load_csv`);
- clip / nan: global-norm clipping and a NaN injected into one rank's gradients
  at one step, with sync or post validation; the reference clips by the same
  global norm and skips that step;
- fp16 / bf16: autocast, fp16's loss scale and its one found-inf decision;
- tied: a parameter shared between stages (tied embedding and head);
- structured: dicts and tuples of tensors between stages;
- transfer: a case run with the NCCL-style ordered transport or the shared-GPU
  staged one (on CPU tensors over gloo), optionally under a stand-in for an
  NCCL behaviour (tests/dist/standins.py): sends that block until the peer's
  receive is posted, or sends whose completion is delayed.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist/train_worker.py CASES.json OUTDIR
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ppdsl.backend.plan import plan_from_schedule  # noqa: E402
from ppdsl.runtime.models.model import build_model  # noqa: E402
from ppdsl.runtime.training.optim import OptimizerStep  # noqa: E402
from ppdsl.runtime.execution.pipeline import CompiledPipeline, PipelineRunner, tie_parameters  # noqa: E402
from ppdsl.runtime.execution.structure import call_stage  # noqa: E402
from tests.dist.standins import delayed_sends, rendezvous_sends  # noqa: E402

DEVICE = torch.device("cpu")
MODELS = {
    "tiny": str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":",
    "test": str(ROOT / "tests" / "dist" / "models.py") + ":",
}


def _compiled(case: dict) -> CompiledPipeline:
    with open(case["pickle"], "rb") as f:
        schedule, programs = pickle.load(f)
    plan = plan_from_schedule(schedule, programs)
    return CompiledPipeline(plan, {r: p.ops for r, p in enumerate(programs)}, plan.fingerprint)


def _model(case: dict, num_stages: int) -> Any:
    where, _, factory = case["model"].partition(":")
    return build_model(MODELS[where] + factory, num_stages)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _optimizer(case: dict, params: list) -> torch.optim.Optimizer:
    if case.get("optimizer", "sgd") == "adam":
        return torch.optim.Adam(params, lr=case.get("lr", 1e-2), eps=1e-3)
    return torch.optim.SGD(params, lr=case.get("lr", 0.05), momentum=0.9, weight_decay=0.01)


def _poison(params: list[torch.nn.Parameter], value: float) -> None:
    """Put `value` (NaN or inf) into one element of the first gradient."""
    for p in params:
        if p.grad is not None:
            p.grad.view(-1)[0] = value
            return


def reference(case: dict, model: Any, num_stages: int, batch_size: int) -> dict:
    """Single process, no pipeline, the same optimizer and rules: per step the loss,
    the global norm, and the parameters after the last step (by stage and name)."""
    stages = {s: model.stage(s).to(DEVICE) for s in range(num_stages)}
    tie_parameters(stages, getattr(model, "tied", ()))
    params = list({id(p): p for st in stages.values() for p in st.parameters()}.values())
    opt = _optimizer(case, params)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case.get("precision", "fp32"))
    scaler = torch.amp.GradScaler("cpu") if case.get("precision") == "fp16" else None
    losses, norms, first_grads = [], [], None
    for step in range(case["steps"]):
        inputs, targets = model.batch(step, batch_size)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            x = inputs
            for s in range(num_stages):
                x = call_stage(stages[s], x)
            loss = model.loss(x, targets)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        losses.append(float(loss))
        if step == 0:
            first_grads = {(s, n): None if p.grad is None else p.grad.clone()
                           for s, st in stages.items() for n, p in st.named_parameters()}
        if step in case.get("poison_steps", ()):
            _poison([p for p in stages[case["poison_stage"]].parameters()], case["poison"])
        if scaler is not None:
            scaler.unscale_(opt)
        grads = [p.grad for p in params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        norms.append(norm)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            continue
        if not torch.isfinite(torch.tensor(norm)):
            continue  # skipped: the step is not applied
        if case.get("max_norm") is not None:
            torch.nn.utils.clip_grad_norm_(params, case["max_norm"])
        opt.step()
    return {"losses": losses, "norms": norms, "first_grads": first_grads,
            "params": {(s, n): p.detach().clone() for s, st in stages.items()
                       for n, p in st.named_parameters()},
            "scale": float(scaler.get_scale()) if scaler is not None else None}


def train_case(case: dict, rank: int, world: int) -> dict:
    """clip, nan, fp16, bf16, tied, structured: train through the library."""
    compiled = _compiled(case)
    plan = compiled.plan
    m = plan.num_microbatches
    batch_size = 2 * m
    model = _model(case, plan.num_stages)
    runner = PipelineRunner(compiled, model.stage, model.loss, device=DEVICE,
                            precision=case.get("precision", "fp32"),
                            tied=getattr(model, "tied", ()), note=lambda text: None,
                            share_gpu=case.get("transfer") == "staged",
                            transfer_mode=case.get("transfer"))
    optimizer = _optimizer(case, runner.parameters())
    stepper = OptimizerStep(runner, optimizer, max_norm=case.get("max_norm"),
                            validation=case.get("validation", "sync"))
    at = {"step": 0}
    poison_here = case.get("poison_stage") in runner.stages

    def inject() -> None:  # after this rank's passes, before the optimizer step
        if poison_here and at["step"] in case.get("poison_steps", ()):
            _poison(list(runner.stages[case["poison_stage"]].parameters()), case["poison"])

    runner.hooks.after_passes.append(inject)
    out: dict = {"case": case["id"], "rank": rank, "stages": sorted(runner.stages)}
    losses, scales = [], []
    snapshots = []
    for step in range(case["steps"]):
        at["step"] = step
        inputs = targets = None
        if runner.is_first or runner.is_last:
            inputs, targets = model.batch(step, batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = runner.step(inputs if runner.is_first else None, targets if runner.is_last else None)
        if step == 0:
            first = {(s, n): None if p.grad is None else p.grad.clone()
                     for s, st in runner.stages.items() for n, p in st.named_parameters()}
        losses.append(float(loss) if loss is not None else None)
        STEP_ENDS.append(PASSES[0])
        stepper.step()
        stepper.resolve()  # the outcome is the same either way; resolve to read it
        if runner.scaler is not None:
            scales.append(float(runner.scaler.scale))
        snapshots.append({f"{s}.{n}": p.detach().clone() for s, st in runner.stages.items()
                          for n, p in st.named_parameters()})
    ref = reference(case, model, plan.num_stages, batch_size)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"], strict=True)
                   if a is not None) if runner.is_last else 0.0
    grad_err = 0.0
    for key, g in first.items():
        if g is None:
            assert ref["first_grads"][key] is None, f"{key}: no gradient here, one in the reference"
            continue
        grad_err = max(grad_err, _rel(g, ref["first_grads"][key]))
    param_err = 0.0
    for s, st in runner.stages.items():
        for n, p in st.named_parameters():
            param_err = max(param_err, _rel(p.detach(), ref["params"][(s, n)]))
    out.update(loss_rel_err=loss_err, grad_rel_err=grad_err, param_rel_err=param_err,
               outcomes=[{"skipped": o.skipped, "clipped": o.clipped, "rolled_back": o.rolled_back,
                          "grad_norm": o.grad_norm} for o in stepper.outcomes],
               ref_norms=ref["norms"], scales=scales, ref_scale=ref["scale"])
    # a skipped step leaves every parameter as it was, bit for bit
    out["unchanged_at_skips"] = [
        all(torch.equal(snapshots[k][name], snapshots[k - 1][name]) for name in snapshots[k])
        for k, o in enumerate(stepper.outcomes) if o.skipped and k > 0
    ]
    if runner.tied:  # every owner holds the same bits
        mine = [p for group in runner.tied for s, n in group.items() if s in runner.stages
                for p in [runner.stages[s].get_parameter(n)]]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, [p.detach().clone() for p in mine[:1]])
        tied_values = [g[0] for g in gathered if g]
        out["tied_bitwise_equal"] = all(torch.equal(tied_values[0], t) for t in tied_values)
    return out


def bridge_case(case: dict, rank: int, world: int) -> dict:
    """The compiled orders under torch.distributed.pipelining's runtime: loss and
    gradients of one step against a single-process run."""
    from ppdsl.runtime.execution.torch_bridge import torch_schedule

    compiled = _compiled(case)
    plan = compiled.plan
    model = _model(case, plan.num_stages)
    modules = {s: model.stage(s) for s in compiled.stages_of(rank)}
    schedule = torch_schedule(compiled, modules, model.loss, device=DEVICE,
                              csv=case.get("csv"))
    batch_size = 2 * plan.num_microbatches
    inputs, targets = model.batch(0, batch_size)
    losses: list = []
    kwargs = {"target": targets, "losses": losses} if plan.num_stages - 1 in modules else {}
    if 0 in modules:
        schedule.step(inputs, **kwargs)
    else:
        schedule.step(**kwargs)
    ref = reference(dict(case, steps=1), model, plan.num_stages, batch_size)
    grad_err = 0.0
    for s, module in modules.items():
        for n, p in module.named_parameters():
            grad_err = max(grad_err, _rel(p.grad, ref["first_grads"][(s, n)]))
    out = {"case": case["id"], "rank": rank, "grad_rel_err": grad_err,
           "class": type(schedule).__name__}
    if losses:
        loss = float(torch.stack([x.detach() for x in losses]).mean())
        out["loss_rel_err"] = abs(loss - ref["losses"][0]) / abs(ref["losses"][0])
    return out


KINDS = {"train": train_case, "bridge": bridge_case}
SEND_WAITS: list[int] = []
"""Under the delayed-sends stand-in: the passes run when each send was waited for."""
PASSES = [0]
STEP_ENDS: list[int] = []
"""The passes run at the end of each step (in every case: cumulative)."""


def _standin(case: dict) -> Any:
    SEND_WAITS.clear()
    STEP_ENDS.clear()
    PASSES[0] = 0
    if case.get("standin") == "rendezvous":
        return rendezvous_sends()
    if case.get("standin") == "delayed":
        return delayed_sends(SEND_WAITS, PASSES)
    return contextlib.nullcontext()


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in cases:
        try:
            with _standin(case):
                result = KINDS[case["kind"]](case, rank, world)
            if case.get("standin") == "delayed":
                result.update(send_waits=list(SEND_WAITS), step_ends=list(STEP_ENDS))
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
