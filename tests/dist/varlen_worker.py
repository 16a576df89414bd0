"""Runs the variable-length cases (issue 38) of one world size in ONE process
group (started by tests/dist/harness.py): for each (family folder, schedule,
document rule), 3 SGD steps of the library's runner on documents, every transfer
at its microbatch's true shape; then rank 0 trains the whole transformers model
without a pipeline on the same documents (each document run alone) and writes
the largest parameter difference, both runs' losses, and the bytes every rank
sent beside the sum of the true sizes.

    python tests/dist/varlen_worker.py CASES.json OUTDIR      (RANK, WORLD_SIZE, ... set)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ppdsl.lengths import targets_of  # noqa: E402
from ppdsl.runtime import load_schedule  # noqa: E402
from ppdsl.runtime.execution.group import gather  # noqa: E402
from ppdsl.runtime.execution.pipeline import PipelineRunner  # noqa: E402
from ppdsl.runtime.models.hf import (  # noqa: E402
    HFOptions,
    load_causal_lm,
    pipeline_model,
    stage_tensors,
)
from ppdsl.runtime.training.reorder import agreed_order  # noqa: E402
from ppdsl.semantics import KINDS  # noqa: E402

# per-token costs for --reorder's search (a + b*tokens + c*tokens^2 per pass):
# attention's square term makes long microbatches dominate
PER_TOKEN = (0.05, 0.01, 0.0004)


def _per_token(plan):
    """The plan's schedule with every pass costing PER_TOKEN (B and W as F)."""
    schedule = plan.schedule()
    rows = [[PER_TOKEN] * plan.num_stages for _ in KINDS]
    return dataclasses.replace(schedule, costs=schedule.costs.with_tokens(rows))


def _true_bytes(plan, batches, microbatches, hidden: int) -> int:
    """What a step's transfers hold at their true shapes, over all ranks: per
    microbatch of n tokens and each stage boundary between two ranks, the hidden
    states (fp32) and positions (int64) forward, their gradient (fp32) back."""
    cross = sum(1 for s in range(plan.num_stages - 1)
                if plan.stage_device[s] != plan.stage_device[s + 1])
    n = sum(batches.lengths(microbatches))
    return cross * n * (hidden * 4 + 8 + hidden * 4)


def run_case(case: dict, rank: int) -> dict:
    schedule = load_schedule(str(ROOT / "examples" / f"{case['schedule']}.pp"),
                             {"d": dist.get_world_size(), "m": case["m"]})
    options = HFOptions(data=case["data"], max_seq_len=case.get("max_seq_len"),
                        pack=case.get("pack"))
    model = pipeline_model(case["dir"], schedule.num_stages, options)
    runner = PipelineRunner(schedule, model.stage, model.loss, tied=model.tied)
    optimizer = torch.optim.SGD(runner.parameters(), lr=case["lr"])
    batches, m = model.documents, schedule.num_microbatches
    losses, steps, true_bytes, orders = [], [], 0, []
    order_program = _per_token(schedule.plan) if case.get("reorder") else None
    hidden = int(model.hf_model.config.hidden_size)
    for step in range(case["steps"]):
        microbatches = batches.step(step, m)
        if order_program is not None:
            choice = agreed_order(order_program, batches.lengths(microbatches), None)
            microbatches = [microbatches[j] for j in choice.slots]
            orders.append([list(choice.slots), choice.seconds])
        steps.append(microbatches)
        pairs = [batches.tensors(mb) for mb in microbatches]
        optimizer.zero_grad(set_to_none=True)
        loss = runner.step([p[0] for p in pairs] if runner.is_first else None,
                           [p[1] for p in pairs] if runner.is_last else None,
                           lengths=batches.lengths(microbatches),
                           weights=batches.weights(microbatches))
        optimizer.step()
        losses.append(None if loss is None else float(loss))
        true_bytes += _true_bytes(schedule.plan, batches, microbatches, hidden)
    mine = stage_tensors(runner.stages)
    everyone = gather((mine, losses, runner.engine.sent_bytes))
    result: dict = {"rank": rank, "losses": losses, "orders": orders}
    if rank == 0:
        trained: dict[str, torch.Tensor] = {}
        for part, _, _ in everyone:
            trained.update(part)
        printed = next(ls for _, ls, _ in everyone if ls[0] is not None)
        reference, ref_losses, moved = _unpipelined(case, batches, steps)
        result.update(
            max_param_diff=max(float((trained[k] - v).abs().max()) for k, v in reference.items()),
            missing=sorted(set(reference) - set(trained)), moved=moved,
            pipeline_losses=printed, reference_losses=ref_losses,
            sent_bytes=sum(b for _, _, b in everyone), true_bytes=true_bytes)
    return result


def _unpipelined(case: dict, batches, steps) -> tuple[dict[str, torch.Tensor], list[float], float]:
    """The whole model trained by SGD on the same steps' documents, each document
    alone (positions from 0, attending only to itself): its parameters and the
    steps' losses, the mean over each step's target tokens."""
    model = load_causal_lm(case["dir"])
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"])
    losses = []
    for microbatches in steps:
        optimizer.zero_grad(set_to_none=True)
        total_targets = sum(targets_of(mb) for mb in microbatches)
        step_loss = 0.0
        for mb in microbatches:
            for piece in mb:
                ids = torch.from_numpy(batches.documents.piece(piece)).unsqueeze(0)
                logits = model(input_ids=ids, use_cache=False).logits
                loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:],
                                       reduction="sum") / total_targets
                loss.backward()
                step_loss += float(loss)
        optimizer.step()
        losses.append(step_loss)
    trained = {k: v.detach().clone() for k, v in model.named_parameters()}
    moved = max(float((trained[k] - v).abs().max()) for k, v in initial.items())
    return trained, losses, moved


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))  # a loaded machine
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
