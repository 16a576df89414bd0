"""What a rank's run reports when its steps are done: the optimizer's tally,
predicted against measured peak memory per rank, whether the DP replicas agree,
the measured step time against the simulator's, each rank's measurements
(`--json`) and every rank's passes as a Chrome trace (`--trace`)."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections.abc import Iterable
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from ppdsl.analysis.device_bytes import DTYPE_BYTES, OPTIMIZER_STATE, format_bytes
from ppdsl.analysis.run_gap import gap_sources, mean_costs, simulated_timeline
from ppdsl.backend.plan import PassKeys, Plan
from ppdsl.ir.schedule import Costs, MemoryModel
from ppdsl.runtime.execution.dtensor import local_tensor
from ppdsl.runtime.execution.group import gather, placement_of
from ppdsl.runtime.execution.memory import DevicePeak, predicted_device_peak
from ppdsl.runtime.execution.pipeline import PipelineRunner
from ppdsl.runtime.execution.trace import chrome_trace, write_chrome_trace
from ppdsl.runtime.training.startup import Run, say
from ppdsl.runtime.worker.cpu import peak_resident_bytes
from ppdsl.semantics import format_ratio, pass_cost

__all__ = ["summary", "memory_table", "host_memory", "host_memory_table", "HOST_COMPONENTS", "replicas_summary", "timing_summary", "plan_costs",
           "predictions", "predicted_cuda_peak", "with_real_mw", "GAP_TO_EXPLAIN"]


def _bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, in row-major order, whatever its shape (a 0-dim one too: torch
    cannot view a 0-dim tensor as bytes), layout and dtype (bool, integers)."""
    return t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 of named tensors (each name, then its bytes), in the order given: to
    compare runs and replicas."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(_bytes(t.detach()))
    return h.hexdigest()


def _parameters_digest(runner: PipelineRunner, *, whole: bool = False) -> str:
    """`_digest` of this rank's parameters in name order: a sharded one's local
    shard, or with `whole` the whole parameter (gathered over its DP group:
    collective; the same on every replica when they agree)."""
    def value(p: torch.Tensor) -> torch.Tensor:
        if whole:
            return p.full_tensor() if hasattr(p, "full_tensor") else p
        return local_tensor(p.detach())

    return _digest((name, value(p)) for name, p in runner.named_parameters())


def _dtypes(tensors: Iterable[torch.Tensor]) -> list[str]:
    """The dtypes among `tensors`, sorted, as torch names them without the prefix."""
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def replicas_summary(ranks: list[dict[str, Any]], num_ranks: int, mode: str) -> str:
    """Whether the DP replicas of each pipeline rank ended with the same parameters
    (and buffers, where the stages hold any)."""
    lines = [""]
    for pp in range(num_ranks):
        mine = [r for r in ranks if r["pp_rank"] == pp]
        same = len({r["whole_parameters_sha256"] for r in mine}) == 1
        buffers = {r.get("buffers_sha256") for r in mine}
        lines.append(
            f"pipeline rank {pp}: replicas on global ranks {', '.join(str(r['rank']) for r in mine)} "
            f"({mode}): parameters {'equal' if same else 'DIFFER'} "
            f"(sha256 {mine[0]['whole_parameters_sha256'][:12]})"
            + ("" if buffers == {None} else
               f", buffers {'equal' if len(buffers) == 1 else 'DIFFER'}")
        )
    return "\n".join(lines)


def summary(run: Run) -> None:
    """The closing lines (optimizer, memory, replicas, time), each rank's
    measurements (`--json`) and the trace (`--trace`); collective."""
    opts, plan, rank = run.opts, run.plan, run.rank
    _optimizer_line(run)
    _reorder_line(run)
    mine = _measurements(run)
    mine.update(predictions(plan, gather(run.tracer.durations), run.step_times))
    if opts.trace:
        _write_trace(run)
    everyone = gather(mine)
    if opts.json_out:
        out = Path(opts.json_out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(mine, indent=1))
    if rank == 0:
        print(memory_table(plan, everyone), flush=True)
        if all(r.get("host_bytes") for r in everyone):
            print(host_memory_table(everyone), flush=True)
        if run.dp > 1:
            print(replicas_summary(everyone, plan.num_devices, opts.dp_mode), flush=True)
        print(timing_summary(plan, mine), flush=True)
        if opts.trace:
            print(f"wrote the trace of every rank to {opts.trace} (open it in ui.perfetto.dev; "
                  f"`ppdsl trace {opts.trace}` checks it against the proof and lays it beside "
                  "the simulation, `-o own.pp` writes this run's own costs)", flush=True)


def _reorder_line(run: Run) -> None:
    """Under `--reorder`: how long choosing each step's order took (the issue's
    bound is 50 ms) and the predicted steps it chose between."""
    if not run.reorders:
        return
    took = [t for t, _, _ in run.reorders]
    given = sum(b for _, b, _ in run.reorders)
    chosen = sum(p for _, _, p in run.reorders)
    # the first call prepares the program (and compiles the search's kernel
    # once per machine): shown apart from the steps' budget
    later = took[1:] or took
    line = (f"reorder: {len(took)} steps, choose_order {sum(later) / len(later) * 1e3:.1f} ms mean, "
            f"{max(later) * 1e3:.1f} ms max (budget 50 ms; the first step's {took[0] * 1e3:.0f} ms "
            "prepares the program)")
    if given:
        line += f"; predicted {chosen:.4g} against {given:.4g} in the order given ({chosen / given:.3f})"
    say(run.rank, line)


def _optimizer_line(run: Run) -> None:
    """How many steps were clipped, skipped and rolled back (with clipping, or
    when a step was skipped)."""
    outcomes = run.stepper.outcomes
    clipped = sum(o.clipped for o in outcomes)
    skipped = sum(o.skipped for o in outcomes)
    if run.opts.clip_grad_norm is not None or skipped:
        rolled = sum(o.rolled_back for o in outcomes)
        say(run.rank, f"optimizer: {len(outcomes)} steps, {clipped} clipped, {skipped} skipped "
                      "(inf/NaN gradients)"
                      + (f"; post-validation rolled back {rolled}"
                         if run.opts.optimizer_validation == "post" else ""))


def _measurements(run: Run) -> dict[str, Any]:
    """This rank's measurements (what `--json` writes): memory predicted and
    measured, busy shares, step times, losses, digests of the parameters and
    buffers, the optimizer's steps."""
    plan, runner, meter = run.plan, run.runner, run.runner.meter
    ratios = runner.measured_mw_ratio()
    kept_ratios = runner.measured_mi_ratio()
    real_memory = with_real_mw(plan.memory, ratios, kept_ratios)
    pp_rank, device_peak, shares = run.pp_rank, run.device_peak, run.shares
    step_times = run.step_times
    buffers = [(f"stage{s}.{name}", buf) for s, module in sorted(runner.stages.items())
               for name, buf in module.named_buffers()]
    return {
        "rank": run.rank,
        "pp_rank": pp_rank,
        "replica": run.replica,
        "stages": sorted(runner.stages),
        "predicted_peak": str(plan.predicted_peak(pp_rank)),
        "predicted_peak_real_mw": str(plan.predicted_peak(pp_rank, real_memory)),
        "measured_peak": str(run.peak_units),
        "measured_peak_bytes": run.peak_bytes,
        "stash_gradient_bytes": meter.peak_gradient_bytes,
        "weight_copy_bytes": meter.peak_weight_copy_bytes,
        "cuda_peak_bytes": device_peak.bytes if device_peak is not None else None,
        "predicted_cuda_peak_bytes": (predicted_cuda_peak(plan, pp_rank, runner, real_memory, device_peak)
                                      if device_peak is not None else None),
        "working_bytes": device_peak.working_by_pass() if device_peak is not None else None,
        "stage_bytes": {str(s): b for s, b in runner.stage_bytes().items()},
        "mw_ratio": {str(s): str(r) for s, r in ratios.items()},
        "mi_ratio": {str(s): str(r) for s, r in kept_ratios.items()},
        "predicted_busy_share": plan.predicted_busy_share[pp_rank] if plan.predicted_busy_share else None,
        "measured_busy_share": sum(shares) / len(shares) if shares else None,
        "mean_step_time": sum(step_times) / len(step_times) if step_times else None,
        "step_times_ms": [t * 1e3 for t in step_times],
        "losses": {str(k + 1): v.hex() for k, v in sorted(run.losses.items())},
        "eval_losses": {str(k + 1): v.hex() for k, v in sorted(run.evals.items())},
        "parameters_sha256": _parameters_digest(runner),
        "whole_parameters_sha256": _parameters_digest(runner, whole=True) if run.dp > 1 else None,
        "buffers_sha256": _digest(buffers) if buffers else None,
        "parameter_dtypes": _dtypes(local_tensor(p.detach()) for p in runner.parameters()),
        "compute_parameter_dtypes": sorted(str(d).removeprefix("torch.")
                                           for d in runner.compute_dtypes()),
        "optimizer_state_dtypes": _dtypes(
            local_tensor(v) for state in run.optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.is_floating_point()),
        "optimizer_parameter_dtypes": _dtypes(
            local_tensor(p.detach()) for g in run.optimizer.param_groups for p in g["params"]),
        "optimizer_steps": [
            {"step": o.step + 1, "grad_norm": o.grad_norm, "clipped": o.clipped,
             "skipped": o.skipped, "rolled_back": o.rolled_back} for o in run.stepper.outcomes
        ],
        **host_memory(run),
    }


HOST_COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "rest")
"""What a rank's resident memory above the bare runtime is made of, in the
summary's order; `rest` is the peak less the others (the model's modules,
transfer buffers, the allocator's free blocks, the saved model's buffers)."""


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors (a sharded one's local part), each counted once."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in seen.values())


def host_memory(run: Run) -> dict[str, Any]:
    """This rank's host memory by component (`HOST_COMPONENTS`), measured: the
    parameters, gradients and optimizer state its tensors hold, the activations'
    peak (the meter's), and the rest of its peak resident memory (VmHWM, read now:
    the whole run, `--save-model` included) above the bare runtime's (read before
    the model was built); beside it the prediction, by `ppdsl.analysis.device_bytes`'
    rule for this rank's parameter count (fp32 values, the optimizer's fp32 state
    per parameter: Adam's two moments, SGD's momentum buffer). Empty where the
    resident memory cannot be read."""
    peak, bare = peak_resident_bytes(), run.bare_resident
    if peak is None or bare is None:
        return {}
    params = run.runner.parameters()
    count = sum(local_tensor(p).numel() for p in params)
    measured = {
        "parameters": _tensor_bytes(params),
        "gradients": _tensor_bytes(p.grad for p in params if p.grad is not None),
        # per-parameter state; the step counters (a 0-dim tensor each) left out
        "optimizer": _tensor_bytes(t for state in run.optimizer.state.values()
                                   for t in state.values()
                                   if isinstance(t, torch.Tensor) and t.dim() > 0),
        "activations": run.peak_bytes,
    }
    measured["rest"] = peak - bare - sum(measured.values())
    optimizer = str(run.opts.optimizer)
    values = OPTIMIZER_STATE.get(optimizer, 0) + (
        1 if optimizer == "sgd" and run.opts.momentum else 0)
    element = DTYPE_BYTES["fp32"]
    predicted = {"parameters": count * element, "gradients": count * element,
                 "optimizer": count * element * values}
    return {"host_bytes": measured, "predicted_host_bytes": predicted,
            "host_peak_above_bare": peak - bare, "host_bare": bare}


def host_memory_table(ranks: list[dict[str, Any]]) -> str:
    """Each rank's host memory by component, measured (predicted), its peak above
    the bare runtime and that peak over the rank's model state (parameters,
    gradients and optimizer state as measured)."""
    lines = ["", "host memory per rank above the bare runtime (peak resident over the whole run, "
             "the saved model included), by component: measured (predicted)"]
    for r in ranks:
        got, want = r["host_bytes"], r["predicted_host_bytes"]
        state = sum(got[k] for k in ("parameters", "gradients", "optimizer"))
        above = r["host_peak_above_bare"]
        parts = [f"{k} {format_bytes(got[k])}"
                 + (f" ({format_bytes(want[k])})" if k in want else "") for k in HOST_COMPONENTS]
        lines.append(f"  rank {r['rank']}: peak {format_bytes(above)} = "
                     + (f"{above / state:.2f}x its model state; " if state else "")
                     + ", ".join(parts))
    return "\n".join(lines)


def _write_trace(run: Run) -> None:
    """Every rank's passes as one Chrome trace at `--trace` (collective; rank 0
    writes it)."""
    opts, plan, device, world = run.opts, run.plan, run.device, run.world
    num_ranks = plan.num_devices
    events = gather(run.tracer.events)
    shared = gather(run.tracer.shared_clock)
    if run.rank != 0:
        return
    stages: list[Any] = [None] * world
    for r in range(world):
        order = plan.orders[placement_of(r, num_ranks)[1]]
        stages[r] = f"rank {r} (stage{'s' if len(order) else ''} " + ", ".join(
            str(st) for st in sorted({st for _, _, st in order})) + ")"
    write_chrome_trace(opts.trace, chrome_trace(events, stages, {
        "schedule": plan.name, "file": plan.file, "device": device.type,
        "time": "CUDA events" if device.type == "cuda" else "perf_counter",
        # "host": every rank's times on one clock (one host's perf_counter,
        # from one epoch), so a pass's start and its input's send compare
        "clock": "host" if all(shared) else "rank",
        "steps": opts.steps, "params": plan.params, "num_ranks": num_ranks, "dp": run.dp,
        "costs": plan.costs, "costs_from": plan.costs_from, "fingerprint": plan.fingerprint,
    }))


GAP_TO_EXPLAIN = 1.10
"""measured/predicted step time above which the summary names the gap's largest
sources: schedules compared by their predictions often differ by less than 10%,
so a prediction off by more cannot rank them until its gap is explained."""


def plan_costs(plan: Plan) -> Costs:
    """The costs the plan was compiled with (in ms under --costs-from), step
    costs included."""
    costs = plan.costs or {}
    in_use = Costs.of(costs.get("F", ()), costs.get("B", ()), costs.get("W", ()),
                      costs.get("BW", ()), float(costs.get("comm", 0.0)))
    return in_use.with_step_costs(costs.get("overhead", ()), costs.get("optimizer", ()),
                                  float(costs.get("norm", 0.0)), float(costs.get("jitter", 0.0))
                                  ).with_receive_cost(float(costs.get("recv", 0.0)))


def predictions(
    plan: Plan, durations: list[dict[tuple[str, int], list[float]]], step_times: list[float]
) -> dict[str, Any]:
    """Measured step time (median, ms) against the simulator's step (the makespan,
    plus the step costs the costs file declares): under the costs in use (when
    they are a profile's, in ms) and under this run's own mean pass times; and,
    under a profile's costs, the largest sources of the gap (`gap_sources`)."""
    merged: dict[tuple[str, int], list[float]] = {}
    for d in durations:
        for key, values in d.items():
            merged.setdefault(key, []).extend(values)
    measured = statistics.median(step_times) * 1e3 if step_times else None
    in_use = plan_costs(plan)
    comm = in_use.comm if plan.costs_from else 0.0
    fallback = replace(in_use, comm=comm, recv=in_use.recv if plan.costs_from else 0.0)
    resimulated = None
    sources: list[dict[str, Any]] = []
    num_ranks = plan.num_devices
    if merged and len(in_use.forward) == plan.num_stages:
        run_costs = mean_costs(merged, plan.num_stages, fallback)
        again = simulated_timeline(plan.orders, plan.stage_device, plan.num_microbatches,
                                   plan.split_backward, run_costs, plan.memory, lanes=plan.lanes)
        resimulated = float(again.step_time)
        if plan.costs_from and measured is not None:
            predicted = simulated_timeline(plan.orders, plan.stage_device, plan.num_microbatches,
                                           plan.split_backward, in_use, plan.memory,
                                           lanes=plan.lanes)
            sources = [
                {"cause": g.cause, "rank": g.rank, "measured_ms": g.measured_ms,
                 "predicted_ms": g.predicted_ms}
                for g in gap_sources(predicted, plan.orders, plan.stage_device, in_use,
                                     durations[:num_ranks], len(step_times), measured)
            ]
    predicted_step = plan.predicted_step_time if plan.predicted_step_time is not None \
        else plan.predicted_makespan
    return {
        "median_step_time_ms": measured,
        "predicted_step_time_ms": predicted_step if plan.costs_from else None,
        "predicted_makespan": plan.predicted_makespan,
        "costs_from": plan.costs_from,
        "resimulated_step_time_ms": resimulated,
        "measured_pass_ms": {f"{k}{s}": pass_cost(v) for (k, s), v in sorted(merged.items())
                             if s >= 0},
        "gap_sources": sources,
        "ranks": len(durations),
        "cores": os.cpu_count() or 1,
    }


def timing_summary(plan: Plan, mine: dict[str, Any]) -> str:
    """The closing lines on time: measured step time against the simulator and,
    when it is more than `GAP_TO_EXPLAIN` times the prediction, the largest
    sources of the gap."""
    measured = mine.get("median_step_time_ms")
    if measured is None:
        return ""
    lines = ["", f"measured step time {measured:.1f} ms (median over steps 2.., slowest rank)"]
    predicted = mine.get("predicted_step_time_ms")
    whole = plan.predicted_step_time is not None
    if predicted:
        lines.append(
            f"  predicted {predicted:.1f} ms: the simulated "
            + ("step (passes with their overhead, transfers, the norm all-reduce, the "
               "optimizer)" if whole else "makespan")
            + f" under the costs from {plan.costs_from}; measured/predicted "
            f"{measured / predicted:.3f}"
        )
    elif plan.predicted_makespan is not None:
        lines.append(
            f"  predicted makespan {plan.predicted_makespan:g} in {plan.file}'s cost units; "
            "to predict milliseconds, give --costs-from the output of `ppdsl profile -o`"
        )
    again = mine.get("resimulated_step_time_ms")
    if again:
        lines.append(
            f"  predicted {again:.1f} ms: simulated under this run's mean pass times"
            + (" and the file's other costs" if plan.costs_from else " (no transfer cost)")
            + f"; measured/predicted {measured / again:.3f}"
        )
    ranks, cores = mine.get("ranks"), mine.get("cores")
    if predicted and ranks and cores and ranks > cores:
        lines.append(f"  oversubscribed ({ranks} ranks on {cores} cores): the ranks share cores, "
                     "so their passes take longer than profiled; not a prediction check")
    sources = [g for g in mine.get("gap_sources") or () if g["measured_ms"] > g["predicted_ms"]]
    if predicted and measured / predicted > GAP_TO_EXPLAIN and sources:
        lines.append(f"  the gap (more than {GAP_TO_EXPLAIN:.2f}x), largest sources first, per "
                     "step on the rank where each exceeds its prediction most:")
        for g in sources[:4]:
            lines.append(
                f"    {g['cause']}: rank {g['rank']} {g['measured_ms']:.1f} ms, predicted "
                f"{g['predicted_ms']:.1f} ms (+{g['measured_ms'] - g['predicted_ms']:.1f} ms)"
            )
        if not whole:
            lines.append("    (the costs file has no step costs: `ppdsl profile -o` measures "
                         "overhead, optimizer and norm)")
    return "\n".join(lines)


def predicted_cuda_peak(plan: Plan, pp_rank: int, runner: PipelineRunner, memory: MemoryModel,
                         device_peak: DevicePeak, *, fresh_gradients: bool = True) -> int:
    """The CUDA peak of a step the memory model predicts, in bytes above the step's
    baseline (`memory.predicted_device_peak`): the activations with the measured
    M_B per stage (and real M_W/M_I), the W stashes' output gradients, the
    parameters' gradients where the step makes them afresh (`fresh_gradients`:
    `zero_grad(set_to_none=True)`, as here; else they are in the baseline), and
    each pass's working memory as a measured step's pass windows read it."""
    grads = {}
    if fresh_gradients:
        for s, module in runner.stages.items():
            local = [local_tensor(p) for p in module.parameters() if p.requires_grad]
            grads[s] = sum(t.numel() * t.element_size() for t in local)
    return predicted_device_peak(PassKeys(plan.orders[pp_rank].passes), memory, runner.stage_bytes(),
                                 working=device_peak.working,
                                 stash_gradients=runner.meter.stash_gradient_bytes(),
                                 first_gradients=grads)


def with_real_mw(
    memory: MemoryModel, ratios: dict[int, Fraction], kept: dict[int, Fraction] | None = None
) -> MemoryModel:
    """The file's memory model with M_W replaced by the measured M_W/M_B where
    known, and M_I of a recomputed stage by the measured M_I/M_B (`kept`)."""
    kept = kept or {}
    return MemoryModel(
        memory.activation,
        tuple(
            a * ratios[s] if s in ratios else w
            for s, (a, w) in enumerate(zip(memory.activation, memory.weight_retained, strict=True))
        ),
        tuple(
            None if i is None else (memory.activation[s] * kept[s] if s in kept else i)
            for s, i in enumerate(memory.kept_input)
        ),
    )


def memory_table(plan: Plan, ranks: list[dict[str, Any]]) -> str:
    """Predicted vs measured peak activation memory and busy share, one row per rank."""
    mb = plan.memory
    mw_file = sorted({str(w / a) for a, w in zip(mb.activation, mb.weight_retained, strict=True) if a})
    head = (
        f"{'rank':>4}  {'stages':<8} {'peak predicted':>14} {'measured':>9} {'bytes':>10}"
        f"  {'real M_W/M_B':>12} {'pred. (real M_W)':>16}  {'busy pred.':>10} {'measured':>9}"
    )
    lines = [
        "",
        "peak activation memory in the file's units (M_B of a stage = bytes one microbatch "
        "holds after its F) and compute share of the step; real M_W/M_B is the share of a "
        "microbatch's activation this model still holds between its B and its W, measured "
        "per stage (one value per stage of the rank, a/b), and pred. (real M_W) the peak "
        "predicted with it in place of the file's M_W:",
        head,
    ]
    for r in ranks:
        ratio = sorted({format_ratio(v) for v in r["mw_ratio"].values()})
        busy_p = r["predicted_busy_share"]
        busy_m = r["measured_busy_share"]
        lines.append(
            f"{r['rank']:>4}  {','.join(map(str, r['stages'])):<8} {format_ratio(r['predicted_peak']):>14}"
            f" {format_ratio(r['measured_peak']):>9} {r['measured_peak_bytes']:>10}"
            f"  {'/'.join(ratio) if ratio else '-':>12} {format_ratio(r['predicted_peak_real_mw']):>16}"
            f"  {f'{busy_p:.2f}' if busy_p is not None else '-':>10}"
            f" {f'{busy_m:.2f}' if busy_m is not None else '-':>9}"
            + (f"  cuda peak {r['cuda_peak_bytes']} B (predicted {r['predicted_cuda_peak_bytes']} B)"
               if r.get("cuda_peak_bytes") else "")
        )
    if plan.split_backward:
        real = sorted({v for r in ranks for v in r["mw_ratio"].values()}, key=Fraction)
        file_ratio = ", ".join(mw_file)
        if real and any(Fraction(v) not in {Fraction(x) for x in mw_file} for v in real):
            lines.append(
                f"note: the file's memory model has M_W/M_B = {file_ratio}; this model keeps "
                f"{', '.join(format_ratio(v) for v in real)} of a microbatch's activation from B to W "
                "(measured), so the 'pred. (real M_W)' column is the one to compare."
            )
    return "\n".join(lines)
