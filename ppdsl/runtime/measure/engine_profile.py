"""The stages' passes run through the runtime's own engine, timed as `ppdsl
run` times them: the pass costs `to_costs_pp` writes (profile = run) and the
step's costs besides passes (`StepCosts`: the engine's overhead per pass, each
stage's optimizer step, the passes' jitter, the transfers' latency).

`measure_pipeline` runs them on a pipeline of gloo processes, one per core, the
stages placed looped, as a CPU run of that many ranks runs them (each rank is
the `pipeline` job of `ppdsl.runtime.measure.gloo_worker`); `measure_engine`
runs every stage on this process (on CUDA, and with one core). Passes are timed
by the runtime's tracer: wall time on CPU, CUDA events on CUDA."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ppdsl.runtime.execution import autograd_access as access
from ppdsl.runtime.measure.launch import run_job
from ppdsl.runtime.measure.stages import prepare_device
from ppdsl.runtime.models.model import build_model
from ppdsl.semantics import pass_cost, pass_jitter

__all__ = ["measure_engine", "measure_pipeline", "pipeline_rank", "pipeline_devices",
           "overhead_per_pass", "engine_summary"]


_ENGINE_SCHEDULE = """\
# the model's stages on {devices} process(es), looped (stage s on rank s mod d),
# each local stage's microbatches back to back: what `ppdsl profile` runs through
# the engine to time its passes, and its work between them, as `ppdsl run` does
schedule engine_profile {{
    param d = {devices}
    param v = {chunks}
    param m = {num_microbatches}
    place looped(v)
    backward {backward}
    order {{
        for c in chunks {{ for j in 0..m {{ F(j, c) }} }}
        for c in reversed(chunks) {{ for j in 0..m {{ {backward_passes} }} }}
    }}
}}
"""


def _engine_steps(
    model: Any, folder: Path, backward: str, num_stages: int, microbatch_size: int,
    device: torch.device, warmup: int, repeats: int, num_microbatches: int, precision: str,
    devices: int, optimizer: str,
) -> tuple[list[float], dict[tuple[str, int], list[float]], dict[int, list[float]],
           list[dict[str, Any]]]:
    """(the overhead per pass of each timed step in seconds, the traced pass
    durations, per stage of this rank the optimizer step of each timed step in
    ms, the timed steps' trace events) of the engine profile in `backward`
    form, this process being one of `devices` ranks of the current process
    group. The overhead is the step's time outside its passes and its waits on
    receives (the transfers' latency, `cost comm`): posting sends and receives
    is the rank's own work between passes, and counts."""
    import torch.distributed as dist

    from ppdsl.runtime.execution.trace import Tracer

    runner, passes = _engine_runner(model, folder, backward, num_stages, device,
                                    num_microbatches, precision, devices)
    tracer = Tracer(dist.get_rank(), device)
    runner.tracer = tracer
    dist.barrier()
    tracer.start()
    inputs, targets = model.batch(0, microbatch_size * num_microbatches)
    overheads: list[float] = []
    stepped: dict[int, list[float]] = {}
    optimizers = _StageOptimizers(optimizer, device)
    for rep in range(warmup + repeats):
        for p in runner.parameters():
            p.grad = None
        tracer.timed = rep >= warmup
        tracer.step = rep
        traced = len(tracer.events)
        runner.step(inputs, targets)
        result = runner.last_result
        assert result is not None
        if rep >= warmup:
            overheads.append(overhead_per_pass(result.step_time, result.compute_time,
                                               tracer.events[traced:], passes))
        for stage, ms in optimizers.step(runner.stages).items():
            if rep >= warmup:
                stepped.setdefault(stage, []).append(ms)
        if devices > 1:  # a run's ranks meet once a step (the norm all-reduce)
            dist.barrier()
    return overheads, tracer.durations, stepped, [e for e in tracer.events
                                                  if e["args"]["step"] >= warmup]


def _engine_runner(model: Any, folder: Path, backward: str, num_stages: int,
                   device: torch.device, num_microbatches: int, precision: str,
                   devices: int) -> tuple[Any, int]:
    """The `PipelineRunner` of this rank's stages under the engine profile's
    schedule in `backward` form (written into `folder`), and its passes per step."""
    import torch.distributed as dist

    from ppdsl.runtime.execution.pipeline import PipelineRunner, load_schedule

    path = folder / f"engine_profile_{backward}.pp"
    path.write_text(_ENGINE_SCHEDULE.format(
        devices=devices, chunks=num_stages // devices, num_microbatches=num_microbatches,
        backward=backward,
        backward_passes="B(j, c); W(j, c)" if backward == "split" else "BW(j, c)"))
    schedule = load_schedule(path)
    runner = PipelineRunner(schedule, model.stage, model.loss, device=device,
                            precision=precision, note=lambda text: None)
    return runner, len(schedule.plan.orders[dist.get_rank()])


class _StageOptimizers:
    """Each stage's `optimizer` over the parameters its passes gave gradients,
    stepped with their gradient norms as `OptimizerStep` computes them, and
    timed in wall time (the device drained), as the run's trace times it.

    It is stepped after every step's passes, as a run steps it, not in a loop
    of its own: its state then comes back to a cache the passes went through,
    which slows it (1.4x on tiny_gpt, 2 cores) as it slows a run's."""

    def __init__(self, optimizer: str, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = device
        self.made: dict[int, tuple[list[torch.nn.Parameter], torch.optim.Optimizer]] = {}

    def step(self, stages: dict[int, torch.nn.Module]) -> dict[int, float]:
        """Step every stage's optimizer once: its time in ms, per stage."""
        from ppdsl.runtime.training.optim import make_optimizer

        took = {}
        for stage, module in sorted(stages.items()):
            if stage not in self.made:  # the parameters the passes gave gradients
                params = [p for p in module.parameters() if p.grad is not None]
                self.made[stage] = (params, make_optimizer(self.optimizer, params, 1e-9))
            params, opt = self.made[stage]
            t0 = time.perf_counter()
            with torch.no_grad():
                if params:
                    access.foreach_norm([p.grad for p in params], 2.0)  # type: ignore[misc]
                opt.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            took[stage] = (time.perf_counter() - t0) * 1e3
        return took


def overhead_per_pass(step_s: float, compute_s: float, events: list[dict[str, Any]],
                      passes: int) -> float:
    """The engine's work per pass in one step, in seconds: the step's time
    (`step_s`) less its passes' (`compute_s`) and less its waits on receives
    (the tracer's "wait" slices among the step's `events`, durations in
    microseconds: the transfers' latency, `cost comm`), over its `passes`.
    Posting sends and receives (the "exchange" slices) is the rank's own work
    between passes, and stays in."""
    waited = sum(e["dur"] for e in events if e["name"] == "wait") / 1e6
    return (step_s - compute_s - waited) / passes


def _engine_measure(
    model: Any, num_stages: int, microbatch_size: int, device: torch.device, devices: int,
    optimizer: str, warmup: int, repeats: int, num_microbatches: int, precision: str,
) -> tuple[list[float], dict[tuple[str, int], list[float]], dict[int, list[float]],
           list[list[dict[str, Any]]]]:
    """This rank's part of the engine profile, inside a process group of
    `devices` ranks: (the overheads per pass in seconds, the pass durations in
    ms by (kind, stage), the optimizer steps in ms per stage this rank holds,
    this rank's trace events of the timed steps, one list per backward form)."""
    import tempfile

    durations: dict[tuple[str, int], list[float]] = {}
    overheads: list[float] = []
    stepped: dict[int, list[float]] = {}
    events: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as folder:
        for backward in ("fused", "split"):
            found, traced, steps, timed = _engine_steps(
                model, Path(folder), backward, num_stages, microbatch_size, device,
                warmup, repeats, num_microbatches, precision, devices, optimizer)
            overheads += found
            events.append(timed)
            for key, values in traced.items():
                if key[1] >= 0 and not (backward == "split" and key[0] == "F"):
                    durations.setdefault(key, []).extend(values)
            for stage, times in steps.items():
                stepped.setdefault(stage, []).extend(times)
    return overheads, durations, stepped, events


def engine_summary(
    overheads: list[float], durations: dict[tuple[str, int], list[float]],
    optimizer_ms: dict[int, list[float]], num_stages: int,
) -> tuple[float, dict[str, float], tuple[float, ...], float]:
    """`measure_engine`'s answer from what the ranks measured: each cost the
    mean of its measurements (`semantics.pass_cost`: a step adds up every pass,
    every pass's overhead and its optimizer step, the slow ones included)."""
    engine = {f"{kind}{stage}": pass_cost(v) for (kind, stage), v in sorted(durations.items())}
    return (pass_cost(overheads) * 1e3, engine,
            tuple(pass_cost(optimizer_ms[s]) for s in range(num_stages)), pass_jitter(durations))


def measure_engine(
    model: Any, num_stages: int, microbatch_size: int, device: torch.device, *,
    optimizer: str = "adam", warmup: int = 2, repeats: int = 5, num_microbatches: int = 2,
    precision: str = "fp32",
) -> tuple[float, dict[str, float], tuple[float, ...], float]:
    """(engine overhead per pass in ms, the engine's mean pass times in ms by
    `KIND` + stage, the optimizer step per stage in ms, the passes' spread:
    `pass_jitter` of their durations): the model's stages run
    as `ppdsl run` runs them (`PipelineRunner` over every stage on this one
    process, in a one-process group, NCCL on CUDA and gloo on CPU; split: F, B,
    W; fused: F, BW), timed
    as the run times them (the tracer: wall time on CPU, CUDA events on CUDA);
    then each stage's `optimizer` step with its gradient norms (as
    `OptimizerStep` computes them), in wall time as the run's trace has it.
    `measure_pipeline` runs the same over several processes."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("measure_engine starts its own one-process group: call it "
                           "outside torch.distributed")
    # the backend `ppdsl run` serves this device with: NCCL for CUDA, gloo for CPU
    if device.type == "cuda":
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        overheads, durations, optimizer_ms, _ = _engine_measure(
            model, num_stages, microbatch_size, device, 1, optimizer, warmup, repeats,
            num_microbatches, precision)
    finally:
        dist.destroy_process_group()
    return engine_summary(overheads, durations, optimizer_ms, num_stages)


def pipeline_rank(spec: str, num_stages: int, microbatch_size: int, optimizer: str,
                  warmup: int, repeats: int, num_microbatches: int, precision: str) -> Any:
    """One rank of `measure_pipeline` (its process group started): this rank's
    stages through the engine, then everything the ranks measured, gathered
    (JSON: overheads, [kind, stage, durations] rows, [stage, optimizer ms list] rows,
    per backward form every rank's trace events of its timed steps)."""
    import torch.distributed as dist

    device, _ = prepare_device("cpu")
    overheads, durations, optimizer_ms, events = _engine_measure(
        build_model(spec, num_stages), num_stages, microbatch_size, device,
        dist.get_world_size(), optimizer, warmup, repeats, num_microbatches, precision)
    mine = [overheads, [[k, s, v] for (k, s), v in durations.items()],
            [[s, ms] for s, ms in optimizer_ms.items()], events]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [sum((r[0] for r in every), []), sum((r[1] for r in every), []),
            sum((r[2] for r in every), []), [[r[3][form] for r in every]
                                             for form in range(len(events))]]


def measure_pipeline(
    spec: str, num_stages: int, microbatch_size: int, devices: int, *,
    optimizer: str = "adam", warmup: int = 2, repeats: int = 5,
    num_microbatches: int | None = None, precision: str = "fp32",
) -> tuple[float, dict[str, float], tuple[float, ...], float, float | None]:
    """What `measure_engine` returns, measured as a CPU run of `devices` ranks
    sees it, and the transfers' latency in that pipeline (`pipeline_latency`):
    `devices` gloo processes on loopback (one torch thread each, freed memory
    kept, as `ppdsl run`'s ranks), the model's stages placed looped
    (stage s on rank s mod `devices`, which must divide `num_stages`), each
    rank running its stages' microbatches back to back (m = 4 x `devices` by
    default) with real transfers between ranks and a barrier between steps.
    A pass then runs with what a run's pass runs with: the other ranks' work on
    the other cores, the transfers' threads, and the idle waits on receives
    before it; the overhead counts posting transfers, not waiting on them."""
    if devices < 1 or num_stages % devices:
        raise ValueError(f"{devices} processes cannot hold {num_stages} stages looped: "
                         "give a divisor of the stage count")
    m = num_microbatches if num_microbatches is not None else 4 * devices
    overheads, rows, optimizer_rows, runs = run_job(
        "pipeline", devices,
        [spec, num_stages, microbatch_size, optimizer, warmup, repeats, m, precision],
        900, f"the engine's passes over {devices} processes")
    durations = {(k, s): v for k, s, v in rows}
    overhead, engine, optimizer_ms, jitter = engine_summary(
        overheads, durations, {s: ms for s, ms in optimizer_rows}, num_stages)
    from ppdsl.analysis.trace_timeline import pipeline_latency, transfer_latencies

    found: dict[tuple[int, int], list[float]] = {}
    for events in runs:  # the fused run, then the split run: every rank's events
        for pair, ms in transfer_latencies(events, overhead).items():
            found.setdefault(pair, []).extend(ms)
    return overhead, engine, optimizer_ms, jitter, pipeline_latency(found, overhead)


def pipeline_devices(num_stages: int, cores: int) -> int:
    """The processes `profile_model` times the engine's passes on by default on
    CPU: the most that divide `num_stages` without outnumbering `cores` (a run
    of one rank per core)."""
    return max(d for d in range(1, max(min(num_stages, cores), 1) + 1) if num_stages % d == 0)
