"""`ppdsl profile`'s driver: a model's pass costs and memory measured stage by
stage, with its transfers, collectives and the step besides passes, as one
`Profile` (docs/runtime.md, "Profiling a model").

For each stage of `factory(num_stages)` on one microbatch: the stage runs of
`ppdsl.runtime.measure.stages` (T_F, T_B fused, T_I and T_W of the split, plain
F, M_B and M_W), the bytes of the tensor it sends on, and what the split leaves
to B. Then, each measured alone, the time to move those tensors to another rank
and a receive posted late (`transfers`), and with `dp` > 1 the stages'
collectives; last, the stages run through the runtime's engine as `ppdsl run`
runs them (`engine_profile`): those are the pass costs `to_costs_pp` writes
(profile = run; the stage runs stay in the report, on CPU in this thread's CPU
time, which a pass that waits, e.g. sleeps, does not spend), with the step's
costs besides passes (`StepCosts`). `precision` "bf16" or "fp16" runs every
forward under autocast, and the report records it, with the TF32 settings on
CUDA, beside the times.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ppdsl.runtime.choices import PRECISIONS
from ppdsl.runtime.execution.split import NORMS, uncovered_parameters
from ppdsl.runtime.measure.engine_profile import measure_engine, measure_pipeline, pipeline_devices
from ppdsl.runtime.measure.records import Profile, StageProfile, StageTiming, StepCosts
from ppdsl.runtime.measure.stages import (
    ChainLink,
    measure_chain,
    precision_context,
    stage_stopwatch,
    tf32_settings,
)
from ppdsl.runtime.measure.transfers import (
    measure_collectives,
    measure_norm_reduce,
    measure_receive,
    measure_transfer,
)
from ppdsl.runtime.models.model import ModelError, build_model

__all__ = ["profile_model"]

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class _Stage:
    """What the stage runs found of one stage."""

    timing: StageTiming
    boundary_bytes: int
    uncovered: tuple[str, ...]
    param_bytes: int


def profile_model(
    spec: str,
    num_stages: int,
    microbatch_size: int,
    device: torch.device,
    *,
    warmup: int = 5,
    repeats: int = 20,
    transfer: bool = True,
    progress: Progress | None = None,
    norms: str = "in-b",
    dp: int = 1,
    dp_mode: str = "replicate",
    precision: str = "fp32",
    optimizer: str | None = "adam",
    devices: int | None = None,
    seq_len: int | None = None,
) -> Profile:
    """Profile every stage of the model `spec` (FILE.py:FACTORY) cut into
    `num_stages`, on microbatches of `microbatch_size` samples. On CPU with one
    torch thread the passes are timed in this thread's CPU time (a busy machine's
    other work does not count), else in wall time. `norms`: when the split
    computes layer norms' weight gradients ("in-b" or "deferred", `split.backward_input`).
    `dp` > 1 also measures each stage's data-parallel collectives over `dp` gloo
    processes (`cost reduce`: all-reduce, or reduce-scatter with `dp_mode`
    "shard"; `cost gather`: all-gather). `precision`: fp32, or bf16/fp16 under
    autocast (as `ppdsl run --precision`). `optimizer` (sgd, adam, adamw; None:
    not measured): also measure the step besides passes (`StepCosts`: the
    engine's overhead per pass, that optimizer's step per stage and, with
    `transfer`, the norm all-reduce). `devices`: the processes the engine's
    passes are timed on (`measure_pipeline`, CPU only; 1: `measure_engine`,
    this process), as a run of that many ranks runs them; None: on CPU the
    most that divide `num_stages` without outnumbering the cores this process
    may use (`pipeline_devices`), on CUDA 1. `seq_len`: each sample's first
    `seq_len` tokens only (the model's token inputs and targets cut along
    their second dimension: `ppdsl profile --lengths`; the step besides passes
    is then not measured)."""
    _check_choices(norms, precision, seq_len, optimizer)
    watch = stage_stopwatch(device)
    stages = _stage_runs(spec, num_stages, microbatch_size, device, watch.host_clock,
                         warmup=warmup, repeats=repeats, norms=norms, precision=precision,
                         progress=progress, seq_len=seq_len)
    sizes = [s.boundary_bytes for s in stages if s.boundary_bytes]
    by_size, method, late = _transfers(sizes, device, transfer, progress)
    collectives, collective_method = _collectives([s.param_bytes for s in stages], dp, device,
                                                  progress)
    step = None
    if optimizer is not None:
        if devices is None:
            devices = 1 if device.type == "cuda" else pipeline_devices(num_stages, _usable_cores())
        step = _step_costs(spec, num_stages, microbatch_size, device, optimizer, devices,
                           transfer=transfer, precision=precision, warmup=max(warmup, 1),
                           repeats=repeats, progress=progress)
    return Profile(
        model=spec,
        num_stages=num_stages,
        microbatch_size=microbatch_size,
        device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        threads=torch.get_num_threads() if device.type == "cpu" else 0,
        warmup=warmup,
        repeats=repeats,
        transfer_method=method,
        clock=watch.clock,
        norms=norms,
        precision=precision,
        tf32=tf32_settings() if device.type == "cuda" else "n/a",
        stages=tuple(
            StageProfile(k, s.timing, s.boundary_bytes,
                         by_size.get(s.boundary_bytes) if s.boundary_bytes else None,
                         s.uncovered, s.param_bytes, _reduce_ms(collectives[k], dp_mode),
                         (collectives[k] or {}).get("all_gather"))
            for k, s in enumerate(stages)),
        dp=dp,
        dp_mode=dp_mode,
        collective_method=collective_method,
        step=step,
        recv_ms=statistics.fmean(late) if late else None,
        devices=(devices or 1) if step is not None else 1,
        seq_len=seq_len,
    )


def _check_choices(norms: str, precision: str, seq_len: int | None,
                   optimizer: str | None) -> None:
    """Raise ValueError for a choice `profile_model` does not know, or for a
    `seq_len` with an optimizer (the step's costs are the model's own length's)."""
    if seq_len is not None and optimizer is not None:
        raise ValueError("seq_len: the passes only (optimizer=None); the step's costs are "
                         "measured at the model's own length")
    if norms not in NORMS:
        raise ValueError(f"norms must be 'in-b' or 'deferred', not {norms!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be fp32, bf16 or fp16, not {precision!r}")


def _stage_runs(spec: str, num_stages: int, microbatch_size: int, device: torch.device,
                clock: Callable[[], float], *, warmup: int, repeats: int, norms: str,
                precision: str, progress: Progress | None,
                seq_len: int | None = None) -> list[_Stage]:
    """Each stage of the model measured on one microbatch of its first batch
    (`measure_chain`; `seq_len`: cut to its first tokens), what B computes of
    its weight gradients, and its parameter bytes; the stages are built one at
    a time."""
    model = build_model(spec, num_stages)
    inputs, targets = model.batch(0, microbatch_size)
    if seq_len is not None:
        inputs, targets = _first_tokens(inputs, seq_len, spec), _first_tokens(targets, seq_len, spec)
    inputs, targets = inputs.to(device), targets.to(device)

    def loss(y: torch.Tensor) -> torch.Tensor:
        return model.loss(y, targets)

    links = measure_chain(((f"stage {s}", model.stage(s)) for s in range(num_stages)), num_stages,
                          inputs, loss, device, where=f"--model {spec!r}", warmup=warmup,
                          repeats=repeats, clock=clock, norms=norms, precision=precision,
                          progress=progress)
    return [_Stage(link.timing, link.boundary_bytes, _uncovered(link, device, precision),
                   sum(p.numel() * p.element_size() for p in link.module.parameters()))
            for link in links]


def _first_tokens(tensor: Any, seq_len: int, spec: str) -> torch.Tensor:
    """A batch's samples cut to their first `seq_len` tokens (dimension 1)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        raise ModelError(f"--lengths: the batches of --model {spec!r} are not token tensors "
                         "(samples x tokens); give a model whose inputs are tokens")
    if tensor.shape[1] < seq_len:
        raise ModelError(f"--lengths: the samples of --model {spec!r} hold {tensor.shape[1]} tokens; "
                         f"measure lengths up to that, not {seq_len}")
    return tensor[:, :seq_len].contiguous()


def _uncovered(link: ChainLink, device: torch.device, precision: str) -> tuple[str, ...]:
    """The stage's parameters whose gradient B computes, read from the graph of
    a forward run as its F runs: under the precision's autocast, which a stage
    after the first needs, its input being the previous stage's low-precision
    output (a Linear outside autocast refuses a bf16 input with fp32 weights)."""
    with precision_context(device, precision):
        return tuple(uncovered_parameters(link.module, link.input))


def _transfers(sizes: list[int], device: torch.device, transfer: bool,
               progress: Progress | None) -> tuple[dict[int, float], str, list[float]]:
    """(the time to move each of `sizes` bytes to another rank, by size; how it
    was measured; on CPU, a late receive of each), or nothing with `transfer` off."""
    if not transfer:
        return {}, "not measured", []
    if progress is not None:
        progress("transfer", 1.0)
    measured, method = measure_transfer(sizes, device)
    late = measure_receive(sizes) if device.type == "cpu" else []
    return dict(zip(sizes, measured, strict=False)), method, late


def _collectives(param_bytes: list[int], dp: int, device: torch.device,
                 progress: Progress | None) -> tuple[list[dict[str, float] | None], str]:
    """With `dp` > 1, each stage's collectives over `dp` processes (by name, ms),
    and how they were measured; else none, "not measured"."""
    if dp <= 1:
        return [None] * len(param_bytes), "not measured"
    if progress is not None:
        progress("collectives", 1.0)
    found, method = measure_collectives(param_bytes, dp, device=device)
    return list(found), method


def _step_costs(spec: str, num_stages: int, microbatch_size: int, device: torch.device,
                optimizer: str, devices: int, *, transfer: bool, precision: str,
                warmup: int, repeats: int, progress: Progress | None) -> StepCosts | None:
    """The step besides passes, the stages run through the engine on `devices`
    processes (a pipeline of gloo processes, or this one); None, with a warning,
    when that fails: the stage runs worked, and their costs stand."""
    if progress is not None:
        progress("engine", 1.0)
    if device.type == "cuda" and devices > 1:
        raise ValueError(f"devices={devices}: the pipeline of processes runs on CPU; "
                         "on CUDA the engine's passes are timed on this process (1)")
    try:
        latency = None
        if devices > 1:
            overhead, engine, optimizer_ms, jitter, latency = measure_pipeline(
                spec, num_stages, microbatch_size, devices, optimizer=optimizer,
                precision=precision, warmup=warmup, repeats=repeats)
        else:
            overhead, engine, optimizer_ms, jitter = measure_engine(
                build_model(spec, num_stages), num_stages, microbatch_size, device,
                optimizer=optimizer, precision=precision, warmup=warmup, repeats=repeats)
    except Exception as exc:  # noqa: BLE001 - the stage runs worked: say so, keep them
        print(f"ppdsl profile: warning: running the stages through the engine failed "
              f"({type(exc).__name__}: {exc}); no step costs, and the pass costs are the "
              "stage runs' (--optimizer none skips this)", file=sys.stderr)
        return None
    norm = measure_norm_reduce() if transfer and num_stages > 1 else None
    return StepCosts(overhead, engine, optimizer_ms, optimizer, norm, jitter,
                     latency if transfer else None)


def _usable_cores() -> int:
    """The cores this process may run on (`taskset` narrows them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _reduce_ms(row: dict[str, float] | None, dp_mode: str) -> float | None:
    """`cost reduce` of a stage's measured collectives: the all-reduce under
    replicate, the reduce-scatter under shard."""
    if row is None:
        return None
    return row["all_reduce" if dp_mode == "replicate" else "reduce_scatter"]
