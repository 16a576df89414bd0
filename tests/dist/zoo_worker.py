"""Runs every zoo case (tests/dist/zoo.py) in ONE process group of 4 ranks and
writes, per case and rank, what it found as JSON (tests/system/test_model_zoo.py
asserts on it). A case trains a zoo model 3 SGD-momentum steps through
`PipelineRunner` (d=4, or d=2 x `--dp 2` in either mode) and compares this
rank's parameters AND buffers with a non-pipelined run on one process that
processes the same microbatches in order: each stage's forwards in microbatch
order, each pipeline rank's dropout drawn from that rank's own RNG stream in
the order its F passes run, and under data parallelism the buffers of replica 0
(the policy of `ppdsl.runtime.execution.buffers`). That run is computed by one rank per
case, in turn, and broadcast to the others.

    python tests/dist/zoo_worker.py CASES.json OUTDIR   (under 4 ranks)
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

from ppdsl.ir.schedule import PassKind  # noqa: E402
from ppdsl.runtime.execution.data_parallel import dp_pp_mesh  # noqa: E402
from ppdsl.runtime.training.optim import make_optimizer  # noqa: E402
from ppdsl.runtime.execution.pipeline import PipelineRunner, tie_parameters  # noqa: E402
from ppdsl.runtime.execution.structure import call_stage, split_microbatches  # noqa: E402
from tests.dist import zoo  # noqa: E402
from tests.dist.train_worker import _compiled, _rel  # noqa: E402

DEVICE = torch.device("cpu")
SEED = 1234
LR = 0.05
STEPS = 3
EVAL_STEP = 100


def _optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return make_optimizer("sgd", params, LR, momentum=0.9)


def forward_order(plan: Any) -> list[tuple[int, int]]:
    """Every (microbatch, stage) forward in a sequence that keeps each rank's F
    order and each microbatch's stage order."""
    pending = [[(j, s) for kind, j, s in order if PassKind(kind) is PassKind.F] for order in plan.orders]
    done: set[tuple[int, int]] = set()
    seq: list[tuple[int, int]] = []
    while any(pending):
        moved = False
        for queue in pending:
            while queue and (queue[0][1] == 0 or (queue[0][0], queue[0][1] - 1) in done):
                done.add(queue[0])
                seq.append(queue.pop(0))
                moved = True
        assert moved, "the forwards' dependencies form a cycle"
    return seq


def _state(modules: dict[int, torch.nn.Module]) -> dict[tuple[int, str], torch.Tensor]:
    return {(s, n): b.detach().clone() for s, mod in modules.items() for n, b in mod.named_buffers()}


def _restore(modules: dict[int, torch.nn.Module], state: dict[tuple[int, str], torch.Tensor]) -> None:
    for s, mod in modules.items():  # .data: the graph that saved a buffer stays valid
        for n, b in mod.named_buffers():
            b.data.copy_(state[(s, n)])


def _evaluate(model: Any, stages: dict[int, torch.nn.Module], plan: Any, dp: int,
              per_replica: int) -> list[float]:
    """Per replica: the mean loss of its share of the evaluation batch, every stage
    in eval mode, each microbatch through the stages in turn, no gradients."""
    m = plan.num_microbatches
    inputs, targets = model.batch(EVAL_STEP, dp * per_replica)
    for st in stages.values():
        st.eval()
    found = []
    with torch.no_grad():
        for k in range(dp):
            rows = slice(k * per_replica, (k + 1) * per_replica)
            xs = split_microbatches(inputs[rows] if isinstance(inputs, torch.Tensor)
                                    else tuple(t[rows] for t in inputs), m, "inputs")
            ys = split_microbatches(targets[rows], m, "targets")
            total = 0.0
            for j in range(m):
                x = xs[j]
                for s in range(plan.num_stages):
                    x = call_stage(stages[s], x)
                total += float(model.loss(x, ys[j]))
            found.append(total / m)
    for st in stages.values():
        st.train()
    return found


def reference(model: Any, plan: Any, dp: int, per_replica: int) -> dict:
    """One process, no pipeline: per step each replica's microbatches through the
    stages in `forward_order`, the mean loss over all of them, one SGD step; the
    losses per step and replica."""
    num_stages, m = plan.num_stages, plan.num_microbatches
    stages = {s: model.stage(s) for s in range(num_stages)}
    tie_parameters(stages, getattr(model, "tied", ()))
    optimizer = _optimizer(list({id(p): p for st in stages.values() for p in st.parameters()}.values()))
    order = forward_order(plan)
    torch.manual_seed(SEED)
    start_rng = torch.get_rng_state()
    rng = {(k, r): start_rng.clone() for k in range(dp) for r in range(plan.num_devices)}
    losses = []
    evals = [_evaluate(model, stages, plan, dp, per_replica)]
    for step in range(STEPS):
        inputs, targets = model.batch(step, dp * per_replica)
        total: Any = 0.0
        shares: list[float] = []
        start = _state(stages)
        kept = start
        for k in range(dp):
            _restore(stages, start)
            rows = slice(k * per_replica, (k + 1) * per_replica)
            xs = split_microbatches(inputs[rows] if isinstance(inputs, torch.Tensor)
                                    else tuple(t[rows] for t in inputs), m, "inputs")
            ys = split_microbatches(targets[rows], m, "targets")
            acts: dict[tuple[int, int], Any] = {}
            for j, s in order:
                torch.set_rng_state(rng[(k, plan.stage_device[s])])
                acts[(j, s)] = call_stage(stages[s], xs[j] if s == 0 else acts[(j, s - 1)])
                rng[(k, plan.stage_device[s])] = torch.get_rng_state()
            share = sum(model.loss(acts[(j, num_stages - 1)], ys[j]) for j in range(m)) / m
            total = total + share / dp
            shares.append(float(share.detach()))
            if k == 0:
                kept = _state(stages)
        _restore(stages, kept)
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        losses.append(shares)
    evals.append(_evaluate(model, stages, plan, dp, per_replica))
    return {"losses": losses, "evals": evals,
            "params": {(s, n): p.detach().clone() for s, st in stages.items() for n, p in st.named_parameters()},
            "buffers": _state(stages)}


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.dtype != want.dtype or got.shape != want.shape:
        return float("inf")
    if not got.is_floating_point():
        return 0.0 if torch.equal(got, want) else float("inf")
    return _rel(got, want)


def shared_reference(case: dict, owner: int) -> dict | str:
    """The case's `reference`, run once, on rank `owner`, and sent to every rank
    (it is the same on each: seeded stages, batches and RNG streams); the error
    as a string if it failed there. Every rank calls this before anything of the
    case that may raise, so the broadcast always pairs up."""
    found: list[Any] = [None]
    if dist.get_rank() == owner:
        try:
            plan = _compiled(case).plan
            model = getattr(zoo, case["model"])(plan.num_stages)
            found = [reference(model, plan, case.get("dp", 1), 4 * plan.num_microbatches)]
        except Exception as exc:
            found = [f"reference: {type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(found, src=owner)
    return found[0]


def zoo_case(case: dict, rank: int, ref: dict | str) -> dict:
    if isinstance(ref, str):
        raise RuntimeError(ref)
    compiled = _compiled(case)
    plan = compiled.plan
    dp = case.get("dp", 1)
    mesh = dp_pp_mesh(dp, plan.num_devices, "cpu") if dp > 1 else None
    replica = mesh.get_local_rank("dp") if mesh is not None else 0
    per_replica = 4 * plan.num_microbatches  # BatchNorm on 4 samples, not 2
    model = getattr(zoo, case["model"])(plan.num_stages)
    runner = PipelineRunner(compiled, model.stage, model.loss, device=DEVICE, mesh=mesh,
                            dp_mode=case.get("mode", "replicate"), tied=getattr(model, "tied", ()),
                            note=lambda text: None)
    optimizer = _optimizer(runner.parameters())
    rows = slice(replica * per_replica, (replica + 1) * per_replica)

    def evaluate() -> float | None:
        inputs, targets = model.batch(EVAL_STEP, dp * per_replica)
        mine = inputs[rows] if isinstance(inputs, torch.Tensor) else tuple(t[rows] for t in inputs)
        loss = runner.evaluate(mine if runner.is_first else None,
                               targets[rows] if runner.is_last else None)
        return float(loss) if loss is not None else None

    evals = [evaluate()]  # before the first step (the probe runs here), and after the last
    torch.manual_seed(SEED)
    losses = []
    for step in range(STEPS):
        inputs, targets = model.batch(step, dp * per_replica)
        mine = inputs[rows] if isinstance(inputs, torch.Tensor) else tuple(t[rows] for t in inputs)
        optimizer.zero_grad(set_to_none=True)
        loss = runner.step(mine if runner.is_first else None,
                           targets[rows] if runner.is_last else None, measure_memory=step == 0)
        losses.append(float(loss) if loss is not None else None)
        optimizer.step()
    evals.append(evaluate())
    errors = {}
    for s, st in sorted(runner.stages.items()):
        for n, p in st.named_parameters():
            errors[f"stage{s}.{n}"] = _error(_whole(p.detach()), ref["params"][(s, n)])
        for n, b in st.named_buffers():
            errors[f"stage{s}.{n} (buffer)"] = _error(b, ref["buffers"][(s, n)])
    return {"case": case["id"], "rank": rank, "replica": replica, "errors": errors,
            "losses": losses, "ref_losses": [each[replica] for each in ref["losses"]],
            "evals": evals, "ref_evals": [each[replica] for each in ref["evals"]]}


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    for index, case in enumerate(cases):
        ref = shared_reference(case, owner=index % dist.get_world_size())
        try:
            result = zoo_case(case, rank, ref)
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
