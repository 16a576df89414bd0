"""Measuring a model's pass costs and memory, stage by stage (`ppdsl profile`).

For each stage of `factory(num_stages)` on one microbatch: the forward (T_F), the
fused backward (T_B, what a BW pass runs: plain autograd), the split backward's
two halves (T_I, what a B pass runs; T_W, what a W pass runs), the bytes one
microbatch keeps after its F (M_B) and after its B (M_W), both measured by the
runtime's own meter, the bytes of the tensor the stage sends on and the time to
move it to another rank. Each timed quantity is the median of `repeats` runs
after `warmup` untimed ones; the plain run (F then fused backward) and the split
run (F, B, W) alternate so that drift on a busy machine hits both alike.

The split's forward is the plain module's forward (`ppdsl.runtime.execution.split`), so
the profile times the forward of each run separately and reports both: their
ratio is the split's cost in F, as (T_I + T_W) / T_B is its cost in the backward.

On CUDA each pass is timed by CUDA events recorded around it on the current
stream (the GPU's own time; the queue is drained before each pass), not by a
CPU clock, which would time kernel launches only. `precision` "bf16" or "fp16"
runs the forward (and loss) under autocast, as `ppdsl run --precision` does,
and the report records it, with the TF32 settings, beside the times.

`measure_pipeline` then runs the stages' passes through the runtime's own engine
(`PipelineRunner`) on a pipeline of gloo processes, one per core (on CUDA, and
with one core, `measure_engine`: every stage on this process), and times them
as `ppdsl run` does (wall time on CPU, CUDA events on CUDA): those are the pass costs
`to_costs_pp` writes when measured (profile = run; the stage runs above stay in
the report, in this thread's CPU time on one CPU thread, which a pass that
waits, e.g. sleeps, does not spend), with the engine's overhead per pass, each
stage's optimizer step and the norm all-reduce (`StepCosts`).

`to_costs_pp` writes the measured costs (milliseconds) and memory (in units of
the mean stage's M_B) as `cost` and `memory` statements of the language, for
`--costs-from`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from ppdsl import __version__
from ppdsl.costs_file import PROFILED_STAGES
from ppdsl.ir.schedule import PassKind
from ppdsl.runtime.execution import autograd_access as access
from ppdsl.runtime.execution.memory import MemoryMeter
from ppdsl.runtime.execution.precision import autocast_dtype
from ppdsl.runtime.execution.split import NORMS, WStash, backward_input, uncovered_parameters
from ppdsl.runtime.models.model import ModelError, build_model
from ppdsl.runtime.worker.cpu import keep_freed_memory
from ppdsl.semantics import cost_decimal, pass_cost, pass_jitter, per_stage_text

__all__ = [
    "StageProfile",
    "Profile",
    "StageTiming",
    "StepCosts",
    "measure_stage",
    "measure_engine",
    "measure_pipeline",
    "pipeline_devices",
    "overhead_per_pass",
    "measure_norm_reduce",
    "pass_jitter",
    "measure_transfer",
    "measure_receive",
    "profile_model",
    "to_costs_pp",
    "prepare_device",
]



@dataclass(frozen=True)
class StageTiming:
    """One stage measured on one microbatch (times in milliseconds, medians)."""

    forward_ms: float
    """T_F: the forward as a split schedule's F runs it."""
    input_ms: float
    """T_I: the B pass (input gradient; weight-gradient work deferred)."""
    weight_ms: float
    """T_W: the W pass (the deferred weight-gradient work)."""
    plain_forward_ms: float
    """The plain stage's forward, timed in the run of the fused backward."""
    fused_ms: float
    """T_B (fused): the plain stage's backward, what a BW pass runs."""
    activation_bytes: int
    """M_B: bytes one microbatch keeps after its F (the runtime's meter)."""
    plain_activation_bytes: int
    """The same after the plain run's forward."""
    weight_bytes: int
    """M_W: bytes it still keeps after its B (what W reads)."""
    gradient_bytes: int
    """Output gradients the W stash holds (gradient buffers, outside M_W)."""

    @property
    def forward_ratio(self) -> float:
        """Split forward time / plain forward time."""
        return self.forward_ms / self.plain_forward_ms

    @property
    def backward_ratio(self) -> float:
        """(T_I + T_W) / T_B (fused)."""
        return (self.input_ms + self.weight_ms) / self.fused_ms

    @property
    def bytes_ratio(self) -> float:
        """Split M_B / plain M_B."""
        return self.activation_bytes / max(self.plain_activation_bytes, 1)


@dataclass(frozen=True)
class StageProfile:
    """A stage's timing, what it sends on, and what the split leaves out."""

    stage: int
    timing: StageTiming
    boundary_bytes: int
    """Bytes of the activation the stage sends to the next (0 for the last)."""
    transfer_ms: float | None
    """Measured time to move that tensor to another rank (None for the last stage)."""
    uncovered: tuple[str, ...]
    """Parameters whose gradient B computes (the split does not cover them)."""
    param_bytes: int = 0
    """Bytes of the stage's parameters (what data parallelism reduces and gathers)."""
    reduce_ms: float | None = None
    """`--dp`: measured reduction of the stage's gradients over dp ranks (all-reduce,
    or reduce-scatter under shard), else None."""
    gather_ms: float | None = None
    """`--dp`: measured all-gather of the stage's parameters over dp ranks."""


@dataclass(frozen=True)
class StepCosts:
    """The costs of a training step besides its passes and transfers (ms):
    `cost overhead`, `cost optimizer[s]`, `cost norm` (`semantics.STEP_COSTS`)."""

    overhead_ms: float
    """The runtime's own work per pass: the stages' passes run through the
    engine (`PipelineRunner`, `Profile.devices` processes), its step time less
    the time inside passes and waiting on receives, over the passes (posting
    transfers counts); the mean over the timed steps (`semantics.pass_cost`)."""
    engine_pass_ms: dict[str, float]
    """The mean pass time as the engine ran it (`semantics.pass_cost`), per
    `KIND` + stage (`F0`), timed as `ppdsl run` times passes (wall time on CPU, CUDA events on CUDA): the pass
    costs `to_costs_pp` writes (profile = run)."""
    optimizer_ms: tuple[float, ...]
    """Per stage, the optimizer step of its parameters (with their norms), the
    mean over the timed steps."""
    optimizer: str
    """The optimizer timed (`ppdsl run --optimizer`'s choices)."""
    norm_ms: float | None
    """The gradient-norm all-reduce between two gloo processes (None: not
    measured, e.g. --no-transfer)."""
    jitter: float = 0.0
    """`cost jitter`: how much the engine's passes varied from one run of a pass
    to the next, the spread of log(duration / that pass's median) from its
    quartiles, pooled over every pass kind and stage (`pass_jitter`)."""
    latency_ms: float | None = None
    """`cost comm` as the pipeline of processes saw it (`pipeline_latency`);
    None: not measured (one process, or --no-transfer)."""


@dataclass(frozen=True)
class Profile:
    """What `ppdsl profile` measured."""

    model: str
    num_stages: int
    microbatch_size: int
    device: str
    threads: int
    warmup: int
    repeats: int
    transfer_method: str
    stages: tuple[StageProfile, ...]
    torch_version: str = field(default_factory=lambda: torch.__version__)
    clock: str = "wall"
    """What the pass times count: "wall" time, or "thread" CPU time (CPU, one
    torch thread: the passes' own work, not time other processes took)."""
    norms: str = "in-b"
    """When the split computes layer norms' weight gradients: "in-b" or "deferred"
    (`split.backward_input`)."""
    dp: int = 1
    """Data-parallel ranks the collectives were measured over (1: not measured)."""
    dp_mode: str = "replicate"
    """What `cost reduce` stands for: an all-reduce (replicate) or a reduce-scatter (shard)."""
    collective_method: str = "not measured"
    """How the collectives were measured."""
    precision: str = "fp32"
    """fp32, or bf16/fp16: the forward and loss ran under autocast."""
    tf32: str = "n/a"
    """On CUDA, whether float32 matmuls and convolutions may use TF32 (they
    change fp32 times several-fold): torch's settings when measured."""
    step: StepCosts | None = None
    """What a training step spends besides passes and transfers (None: not
    measured)."""
    devices: int = 1
    """The processes the engine's passes were timed on (`measure_pipeline`):
    1, this one with every stage; more, a pipeline of that many gloo ranks
    with the stages placed looped, as a run of that many ranks runs them."""
    recv_ms: float | None = None
    """`cost recv`, the receiver's own part of a transfer: a receive posted after
    its data was sent, from posting to holding the tensor, between two gloo
    processes (`measure_receive`; the mean over the stage boundaries; None: not
    measured, e.g. on CUDA or with --no-transfer)."""

    def memory_unit_bytes(self) -> float:
        """Bytes of one memory unit of the costs file: the mean stage's M_B."""
        return statistics.fmean(s.timing.activation_bytes for s in self.stages) or 1.0

    def comm_ms(self) -> float:
        """The one transfer cost of the language: the transfers' latency in the
        engine's pipeline of processes when measured (`StepCosts.latency_ms`),
        else the mean of the measured boundaries."""
        if self.step is not None and self.step.latency_ms is not None:
            return self.step.latency_ms
        return self.boundary_ms()

    def boundary_ms(self) -> float:
        """The transfer measured alone (`transfer_method`), the mean of the
        stage boundaries (0: not measured)."""
        found = [s.transfer_ms for s in self.stages if s.transfer_ms is not None]
        return statistics.fmean(found) if found else 0.0

    def to_json(self) -> dict[str, Any]:
        """Everything measured, per stage, with the derived ratios."""
        stages = []
        for s in self.stages:
            t = s.timing
            stages.append({
                "stage": s.stage,
                **asdict(t),
                "mw_over_mb": t.weight_bytes / max(t.activation_bytes, 1),
                "forward_ratio": t.forward_ratio,
                "backward_ratio": t.backward_ratio,
                "bytes_ratio": t.bytes_ratio,
                "split_overhead": (t.forward_ms + t.input_ms + t.weight_ms)
                / (t.plain_forward_ms + t.fused_ms) - 1.0,
                "boundary_bytes": s.boundary_bytes,
                "transfer_ms": s.transfer_ms,
                "param_bytes": s.param_bytes,
                "reduce_ms": s.reduce_ms,
                "gather_ms": s.gather_ms,
                "uncovered_parameters": list(s.uncovered),
            })
        return {
            "ppdsl_version": __version__,
            "model": self.model,
            "num_stages": self.num_stages,
            "microbatch_size": self.microbatch_size,
            "device": self.device,
            "threads": self.threads,
            "torch_version": self.torch_version,
            "warmup": self.warmup,
            "repeats": self.repeats,
            "clock": self.clock,
            "precision": self.precision,
            "tf32": self.tf32,
            "norms": self.norms,
            "transfer_method": self.transfer_method,
            "comm_ms": self.comm_ms(),
            "recv_ms": self.recv_ms,
            "devices": self.devices,
            "dp": self.dp,
            "dp_mode": self.dp_mode,
            "collective_method": self.collective_method,
            "memory_unit_bytes": self.memory_unit_bytes(),
            "step": asdict(self.step) if self.step is not None else None,
            "stages": stages,
        }

    def table(self) -> str:
        """The human-readable report."""
        head = (
            f"{'stage':>5} {'T_F':>8} {'T_B':>8} {'T_I':>8} {'T_W':>8} {'plain F':>8}"
            f" {'M_B':>11} {'M_W':>11} {'M_W/M_B':>7} {'F x':>6} {'I+W/B':>6}"
            f" {'bytes x':>7} {'send':>10} {'xfer':>7}"
        )
        clock = {"thread": "this thread's CPU time", "cuda-events": "CUDA events"}.get(
            self.clock, "wall time")
        where = (f"{self.device} ({self.threads} thread{'s' if self.threads != 1 else ''})"
                 if self.threads else f"{self.device} (TF32: {self.tf32})")
        lines = [
            f"{self.model}: {self.num_stages} stages, microbatch {self.microbatch_size}, "
            f"{where}, {self.precision}, "
            f"median of {self.repeats} after {self.warmup} warm-up; times in ms ({clock}), "
            f"memory in bytes; layer norms' weight gradients in {_norms_pass(self.norms)}",
            head,
        ]
        for s in self.stages:
            t = s.timing
            lines.append(
                f"{s.stage:>5} {t.forward_ms:8.3f} {t.fused_ms:8.3f} {t.input_ms:8.3f}"
                f" {t.weight_ms:8.3f} {t.plain_forward_ms:8.3f} {t.activation_bytes:>11}"
                f" {t.weight_bytes:>11} {t.weight_bytes / max(t.activation_bytes, 1):7.3f}"
                f" {t.forward_ratio:6.3f} {t.backward_ratio:6.3f} {t.bytes_ratio:7.3f}"
                f" {s.boundary_bytes:>10}"
                f" {s.transfer_ms if s.transfer_ms is not None else float('nan'):7.3f}"
            )
        lines.append(
            "T_F: forward; T_B: fused backward (BW); T_I, T_W: the split's B and W; plain F: "
            "the plain stage's forward; F x = T_F / plain F; I+W/B = (T_I + T_W) / T_B; "
            "bytes x = M_B / plain M_B"
        )
        lines.append(f"transfer: {self.transfer_method}")
        if self.recv_ms is not None:
            lines.append(f"receive posted after its data was sent (cost recv): "
                         f"{self.recv_ms:.3f} ms")
        if self.dp > 1:
            reduce = "all-reduce" if self.dp_mode == "replicate" else "reduce-scatter"
            for s in self.stages:
                lines.append(
                    f"stage {s.stage}: {s.param_bytes} parameter bytes: {reduce} "
                    f"{s.reduce_ms if s.reduce_ms is not None else float('nan'):.3f} ms, all-gather "
                    f"{s.gather_ms if s.gather_ms is not None else float('nan'):.3f} ms over {self.dp} ranks")
            lines.append(f"collectives: {self.collective_method}")
        if self.step is not None:
            st = self.step
            engine = "  ".join(f"{k} {v:.3f}" for k, v in st.engine_pass_ms.items())
            lines.append(
                f"step besides passes: engine overhead {st.overhead_ms:.3f} ms per pass; "
                f"{st.optimizer} step " + ", ".join(f"{x:.3f}" for x in st.optimizer_ms)
                + " ms per stage; norm all-reduce "
                + (f"{st.norm_ms:.3f} ms" if st.norm_ms is not None else "not measured")
                + f"; passes' jitter {st.jitter:.3f} (IQR / 1.349 of log(duration / median))")
            lines.append(f"passes as the engine ran them (wall ms, mean): {engine}; "
                         + _engine_where(self.devices))
            if st.latency_ms is not None:
                lines.append(f"transfers in that pipeline: {st.latency_ms:.3f} ms from a sender's "
                             "pass (with the overhead) to the start of the receiver's, when it "
                             f"waited (cost comm; {self.boundary_ms():.3f} ms measured alone)")
        for s in self.stages:
            if s.uncovered:
                lines.append(
                    f"note: stage {s.stage}: not split (gradient during B): {', '.join(s.uncovered)}"
                )
        return "\n".join(lines) + "\n"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Stopwatch:
    """Marks in a run of passes: on CUDA events recorded on the current stream
    (their intervals are the GPU's time, read once the run is synchronised),
    elsewhere readings of `clock`."""

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        self.cuda = device.type == "cuda"
        self.clock = clock

    def mark(self) -> Any:
        """A point in the run."""
        if not self.cuda:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks (on CUDA, after a synchronize)."""
        if not self.cuda:
            return float(end - start)
        return float(start.elapsed_time(end)) / 1e3


def _precision_context(device: torch.device, precision: str) -> Any:
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def tf32_settings() -> str:
    """torch's TF32 switches, as the profile records them."""
    return (f"matmul {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}, "
            f"cudnn {'on' if torch.backends.cudnn.allow_tf32 else 'off'}, "
            f"float32 matmul precision {torch.get_float32_matmul_precision()}")


def measure_stage(
    stage: torch.nn.Module,
    make_input: Callable[[], torch.Tensor],
    finish: Callable[[torch.Tensor], torch.Tensor],
    grad_output: torch.Tensor | None,
    device: torch.device,
    *,
    warmup: int = 5,
    repeats: int = 20,
    progress: Callable[[float], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    norms: str = "in-b",
    precision: str = "fp32",
) -> StageTiming:
    """Time and measure one stage. `make_input()` gives a fresh input (made to
    require grad when floating, as the runtime does for stages after the first);
    `finish(output)` is what the pass ends with (the loss on the last stage, the
    output itself elsewhere); `grad_output` is the gradient arriving from the next
    stage (None on the last, whose loss is a scalar). `clock` reads the time:
    wall time by default; ``time.thread_time`` counts only this thread's CPU time
    (on a CPU shared with other work, with torch on one thread). `norms` is
    `split.backward_input`'s: when layer norms' weight gradients are computed.
    `precision`: "bf16"/"fp16" run the forward and `finish` under autocast. On
    CUDA the passes are timed by CUDA events (`clock` unused)."""
    params = list(stage.parameters())
    watch = _Stopwatch(device, clock)

    def fresh() -> tuple[torch.Tensor, torch.Tensor | None]:
        x = make_input()
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
            return x, x
        return x, None

    def timed(split_backward: bool) -> list[float]:
        """Seconds of each pass of one microbatch: F, BW (plain) or F, B, W (split)."""
        for p in params:
            p.grad = None
        x, wanted = fresh()
        last = PassKind.W if split_backward else PassKind.BW
        _sync(device)
        marks = [watch.mark()]
        for kind, _ in _one_microbatch(stage, x, wanted, finish, grad_output, device,
                                       split_backward=split_backward, norms=norms,
                                       precision=precision):
            if kind is last:  # recorded behind the pass's work, which is then drained
                marks.append(watch.mark())
                _sync(device)
            else:
                _sync(device)
                marks.append(watch.mark())
        return [watch.seconds(a, b) for a, b in zip(marks, marks[1:], strict=False)]

    plain_f: list[float] = []
    plain_b: list[float] = []
    split_f: list[float] = []
    split_i: list[float] = []
    split_w: list[float] = []
    total = warmup + repeats
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # a collection inside one timed pass would land on one side only
    try:
        for rep in range(total):
            # Alternate which run goes first: caches and clock drift hit both alike.
            if rep % 2 == 0:
                pf, pb = timed(split_backward=False)
                sf, si, sw = timed(split_backward=True)
            else:
                sf, si, sw = timed(split_backward=True)
                pf, pb = timed(split_backward=False)
            if rep >= warmup:
                plain_f.append(pf)
                plain_b.append(pb)
                split_f.append(sf)
                split_i.append(si)
                split_w.append(sw)
            if progress is not None:
                progress((rep + 1) / (total + 1))
    finally:
        if enabled:
            gc.enable()
    for p in params:
        p.grad = None
    plain_bytes, _, _ = _memory(stage, fresh, finish, grad_output, split_backward=False,
                                precision=precision)
    f_bytes, w_bytes, g_bytes = _memory(stage, fresh, finish, grad_output, split_backward=True,
                                        norms=norms, precision=precision)
    if progress is not None:
        progress(1.0)

    def ms(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3

    return StageTiming(
        forward_ms=ms(split_f),
        input_ms=ms(split_i),
        weight_ms=ms(split_w),
        plain_forward_ms=ms(plain_f),
        fused_ms=ms(plain_b),
        activation_bytes=f_bytes,
        plain_activation_bytes=plain_bytes,
        weight_bytes=w_bytes,
        gradient_bytes=g_bytes,
    )


def _memory(
    stage: torch.nn.Module,
    fresh: Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
    finish: Callable[[torch.Tensor], torch.Tensor],
    grad_output: torch.Tensor | None,
    *,
    split_backward: bool,
    norms: str = "in-b",
    precision: str = "fp32",
) -> tuple[int, int, int]:
    """(bytes after F, bytes after B, stash gradient bytes), by the runtime's meter
    (under autocast the weights' low-precision copies are not activations: the
    meter counts them apart)."""
    meter = MemoryMeter(stage.parameters())
    key = (0, 0)
    x, wanted = fresh()
    for kind, stash in _one_microbatch(stage, x, wanted, finish, grad_output, x.device,
                                       split_backward=split_backward, norms=norms,
                                       precision=precision, saving=meter.saving(key)):
        if kind is PassKind.F:
            meter.after(PassKind.F, key, Fraction(1))
        elif kind is PassKind.B:
            assert stash is not None
            meter.set_stash(key, stash.tensors, stash.gradients)
            meter.after(PassKind.B, key, Fraction(1))
    for p in stage.parameters():
        p.grad = None
    if not split_backward:
        return meter.f_bytes[key], 0, 0
    return meter.f_bytes[key], meter.after_b[key], meter.peak_gradient_bytes


def _one_microbatch(
    stage: torch.nn.Module,
    x: torch.Tensor,
    wanted: torch.Tensor | None,
    finish: Callable[[torch.Tensor], torch.Tensor],
    grad_output: torch.Tensor | None,
    device: torch.device,
    *,
    split_backward: bool,
    norms: str,
    precision: str,
    saving: contextlib.AbstractContextManager[Any] | None = None,
) -> Iterator[tuple[PassKind, WStash | None]]:
    """One microbatch through `stage` as the runtime's passes run it: F (under
    `saving`, e.g. the meter's hooks, and the precision's autocast), then the
    fused backward BW, or B (`split.backward_input` into a W stash) and W (the
    stash run). Yields (kind, the stash once B has filled it) after each pass, so
    that the caller times or measures it there; the graph goes with its pass."""
    with saving if saving is not None else contextlib.nullcontext(), \
            _precision_context(device, precision):
        out = finish(stage(x))
    yield PassKind.F, None
    if not split_backward:
        torch.autograd.backward(out, grad_output)
        del out
        yield PassKind.BW, None
        return
    stash = WStash()
    backward_input(out, grad_output, wanted, stash, norms=norms)
    del out
    yield PassKind.B, stash
    stash.run()
    yield PassKind.W, stash


# --- transfers -------------------------------------------------------------------


def measure_transfer(
    sizes: list[int], device: torch.device, *, repeats: int = 20
) -> tuple[list[float], str]:
    """Median one-way time (ms) to move a tensor of each size in bytes to another
    rank, and what was measured. CPU: a ping-pong between two gloo processes on
    loopback (half the round trip). CUDA with two GPUs: a copy from one to the
    other. CUDA with one GPU, which has no peer: a copy to host memory and back
    (pinned), an upper bound of a transfer over PCIe without NVLink."""
    if not sizes:
        return [], "none (one stage)"
    if device.type == "cuda":
        return _cuda_transfer(sizes, device, repeats)
    return _gloo_transfer(sizes, repeats)


def _cuda_transfer(sizes: list[int], device: torch.device, repeats: int) -> tuple[list[float], str]:
    peer = torch.cuda.device_count() >= 2
    found = []
    for size in sizes:
        src = torch.empty(max(size // 4, 1), dtype=torch.float32, device=device)
        times = []
        if peer:
            other = torch.device("cuda", (device.index or 0) + 1 if (device.index or 0) == 0 else 0)
            dst = torch.empty_like(src, device=other)
        else:
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        for rep in range(repeats + 3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if peer:
                dst.copy_(src, non_blocking=True)
            else:
                host.copy_(src, non_blocking=True)
                src.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            if rep >= 3:
                times.append(time.perf_counter() - t0)
        found.append(statistics.median(times) * 1e3)
    if peer:
        return found, f"copy from {device} to another GPU of this node"
    return found, (
        f"one GPU, no peer: a copy {device} -> pinned host memory -> {device} "
        "(an upper bound of a PCIe transfer; NVLink or NCCL between GPUs is faster)"
    )


_COLLECTIVES = """
import json, statistics, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
sizes, repeats, backend = json.loads(sys.argv[1])
rank = int(__import__("os").environ["RANK"])
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=device)
else:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
world = dist.get_world_size()
found = []
for size in sizes:
    rows = -(-max(size // 4, 1) // world)
    whole, part = torch.ones(rows * world, device=device), torch.ones(rows, device=device)
    row = {}
    for name in ("all_reduce", "reduce_scatter", "all_gather"):
        times = []
        for rep in range(repeats + 2):
            dist.barrier()
            if backend == "nccl":  # the GPU's time: CUDA events around the collective
                torch.cuda.synchronize()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            t0 = time.perf_counter()
            if name == "all_reduce":
                dist.all_reduce(whole)
            elif name == "reduce_scatter":
                dist.reduce_scatter_tensor(part, whole)
            else:
                dist.all_gather_into_tensor(whole, part)
            if backend == "nccl":
                end.record()
                torch.cuda.synchronize()
                took = start.elapsed_time(end) / 1e3
            else:
                took = time.perf_counter() - t0
            if rep >= 2:
                times.append(took)
        row[name] = statistics.median(times) * 1e3
    found.append(row)
dist.destroy_process_group()
if rank == 0:
    print(json.dumps(found))
"""


def measure_collectives(sizes: list[int], dp: int, repeats: int = 5,
                        device: torch.device | None = None) -> tuple[list[dict[str, float]], str]:
    """Median ms of an all-reduce, a reduce-scatter and an all-gather of each of
    `sizes` bytes (fp32) over `dp` processes on this machine: NCCL on CUDA
    tensors, timed by CUDA events, for a CUDA profile on a node with a GPU per
    process; else gloo on loopback (said so: a CUDA run's NCCL collectives were
    then not measured)."""
    gpus = torch.cuda.device_count() if device is not None and device.type == "cuda" else 0
    if gpus >= dp:
        found = _run_gloo(_COLLECTIVES, dp, [sizes, repeats, "nccl"], 300,
                          f"the {dp}-process NCCL collectives")
        return found, f"NCCL collectives among {dp} processes, one GPU each, timed by CUDA events"
    found = _run_gloo(_COLLECTIVES, dp, [sizes, repeats, "gloo"], 300,
                      f"the {dp}-process gloo collectives")
    if gpus:
        return found, (
            f"gloo collectives among {dp} processes on CPU tensors: this node has {gpus} "
            f"GPU{'s' if gpus != 1 else ''} for {dp} processes, so NCCL's (a CUDA run's) "
            "were NOT measured; these are an upper bound"
        )
    return found, (
        f"gloo collectives among {dp} processes on this machine's loopback (what `ppdsl run "
        f"--dp {dp}` does on CPU; NCCL between GPUs is faster)"
    )


_EXCHANGE = """
import json, os, statistics, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
sizes, repeats = json.loads(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
found = []
for size in sizes:
    buf = torch.zeros(max(size // 4, 1))
    times = []
    for rep in range(repeats + 3):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if rep >= 3:
            times.append((time.perf_counter() - t0) / 2)
    found.append(statistics.median(times) * 1e3)
dist.destroy_process_group()
if rank == 0:
    print(json.dumps(found))
"""


def _gloo_transfer(sizes: list[int], repeats: int) -> tuple[list[float], str]:
    found = _run_gloo(_EXCHANGE, 2, [sizes, repeats], 180, "the two-process gloo exchange")
    return found, (
        "send + receive between two gloo processes on loopback (half a ping-pong), "
        "the transfer `ppdsl run` makes on CPU"
    )


_LATE_RECEIVE = """
import json, statistics, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
sizes, repeats = json.loads(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
found = []
for index, size in enumerate(sizes):
    buf = torch.zeros(max(size // 4, 1))
    times = []
    for rep in range(repeats + 3):
        tag = index * (repeats + 3) + rep
        dist.barrier()
        if rank == 1:
            dist.isend(buf, 0, tag=tag).wait()
        else:
            time.sleep(0.002)  # the send is posted: its data waits for this receive
            t0 = time.perf_counter()
            dist.irecv(buf, 1, tag=tag).wait()
            if rep >= 3:
                times.append(time.perf_counter() - t0)
    if rank == 0:
        found.append(statistics.median(times) * 1e3)
dist.destroy_process_group()
if rank == 0:
    print(json.dumps(found))
"""


def measure_receive(sizes: list[int], *, repeats: int = 20) -> list[float]:
    """Median ms, per size in bytes, of a receive posted after its data was
    sent (`cost recv`): between two gloo processes on loopback, tagged as
    `ppdsl run`'s CPU transport posts them, from posting the receive to holding
    the tensor. gloo moves the data only once the receive is posted, so a rank
    pays this on every receive, however early its sender finished."""
    if not sizes:
        return []
    return list(_run_gloo(_LATE_RECEIVE, 2, [sizes, repeats], 180,
                          "the two-process gloo late receive"))


def _run_gloo(script: str, world: int, payload: object, timeout: int, what: str) -> Any:
    """Run `script` in `world` gloo processes on loopback (payload as argv[1], JSON);
    what rank 0 prints last, read as JSON."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(payload)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    outputs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{what} did not finish in {timeout} s") from None
        if p.returncode != 0:
            first = err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}"
            raise RuntimeError(f"{what} failed: {first}")
        outputs.append(out)
    return json.loads(outputs[0].strip().splitlines()[-1])


# --- the step besides passes ------------------------------------------------------

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
    group. The overhead is the step's
    time outside its passes and its waits on receives (the transfers' latency,
    `cost comm`): posting sends and receives is the rank's own work between
    passes, and counts. Each stage's `optimizer` step (with its gradient
    norms, as `OptimizerStep` computes them) is timed after every step's
    passes, as a run steps it: its state then comes back to a cache the passes
    went through (on tiny_gpt, 2 cores, it took 1.4x as long as the same steps
    timed back to back)."""
    import torch.distributed as dist

    from ppdsl.runtime.execution.pipeline import PipelineRunner, load_schedule
    from ppdsl.runtime.execution.trace import Tracer
    from ppdsl.runtime.training.optim import make_optimizer

    path = folder / f"engine_profile_{backward}.pp"
    path.write_text(_ENGINE_SCHEDULE.format(
        devices=devices, chunks=num_stages // devices, num_microbatches=num_microbatches,
        backward=backward,
        backward_passes="B(j, c); W(j, c)" if backward == "split" else "BW(j, c)"))
    schedule = load_schedule(path)
    runner = PipelineRunner(schedule, model.stage, model.loss, device=device,
                            precision=precision, note=lambda text: None)
    tracer = Tracer(dist.get_rank(), device)
    runner.tracer = tracer
    dist.barrier()
    tracer.start()
    inputs, targets = model.batch(0, microbatch_size * num_microbatches)
    passes = len(schedule.plan.orders[dist.get_rank()])
    overheads: list[float] = []
    stepped: dict[int, list[float]] = {}
    optimizers: dict[int, tuple[list[torch.nn.Parameter], torch.optim.Optimizer]] = {}
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
        for stage, module in sorted(runner.stages.items()):
            if stage not in optimizers:  # the parameters the passes gave gradients
                params = [p for p in module.parameters() if p.grad is not None]
                optimizers[stage] = (params, make_optimizer(optimizer, params, 1e-9))
            params, opt = optimizers[stage]
            t0 = time.perf_counter()
            with torch.no_grad():
                if params:
                    access.foreach_norm([p.grad for p in params], 2.0)  # type: ignore[misc]
                opt.step()
            _sync(device)
            if rep >= warmup:
                stepped.setdefault(stage, []).append((time.perf_counter() - t0) * 1e3)
        if devices > 1:  # a run's ranks meet once a step (the norm all-reduce)
            dist.barrier()
    return overheads, tracer.durations, stepped, [e for e in tracer.events
                                                  if e["args"]["step"] >= warmup]


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


def _engine_summary(
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
    return _engine_summary(overheads, durations, optimizer_ms, num_stages)


_PIPELINE = """
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
from ppdsl.runtime.measure.profile import pipeline_rank
dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a failed rank's peers
rank = dist.get_rank()
found = pipeline_rank(*json.loads(sys.argv[1]))
dist.barrier()
if rank == 0:
    print(json.dumps(found), flush=True)
sys.stderr.flush()
# every rank has its answer: skip the interpreter's teardown, where gloo's
# threads may end the process with "terminate called without an active exception"
os._exit(0)
"""


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
    overheads, rows, optimizer_rows, runs = _run_gloo(
        _PIPELINE, devices,
        [spec, num_stages, microbatch_size, optimizer, warmup, repeats, m, precision],
        900, f"the engine's passes over {devices} processes")
    durations = {(k, s): v for k, s, v in rows}
    overhead, engine, optimizer_ms, jitter = _engine_summary(
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


_NORM = """
import json, statistics, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
repeats = json.loads(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
flags = torch.zeros(2, dtype=torch.float64)
times = []
for rep in range(repeats + 3):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(flags)
    if rep >= 3:
        times.append(time.perf_counter() - t0)
dist.destroy_process_group()
print(json.dumps(statistics.median(times) * 1e3))
"""


def measure_norm_reduce(repeats: int = 20) -> float:
    """Median ms of the optimizer's gradient-norm all-reduce (two float64: the
    squared norm and the inf/NaN count, `OptimizerStep`) between two gloo
    processes on loopback, as `ppdsl run`'s pipeline ranks make it on CPU."""
    return float(_run_gloo(_NORM, 2, repeats, 120, "the two-process norm all-reduce"))


# --- the whole model ---------------------------------------------------------------


def prepare_device(requested: str) -> tuple[torch.device, str | None]:
    """The device `ppdsl profile --device` asks for (auto: CUDA when available) and
    its set-up as `ppdsl run`'s ranks have it (CPU: one thread unless
    OMP_NUM_THREADS says otherwise, freed memory kept); or an error message."""
    if requested == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu"), "--device cuda, but CUDA is not available here; use --device cpu"
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        return device, None
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    keep_freed_memory()
    return torch.device("cpu"), None


def profile_model(
    spec: str,
    num_stages: int,
    microbatch_size: int,
    device: torch.device,
    *,
    warmup: int = 5,
    repeats: int = 20,
    transfer: bool = True,
    progress: Callable[[str, float], None] | None = None,
    norms: str = "in-b",
    dp: int = 1,
    dp_mode: str = "replicate",
    precision: str = "fp32",
    optimizer: str | None = "adam",
    devices: int | None = None,
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
    may use (`pipeline_devices`), on CUDA 1."""
    if norms not in NORMS:
        raise ValueError(f"norms must be 'in-b' or 'deferred', not {norms!r}")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, not {precision!r}")
    thread_clock = device.type == "cpu" and torch.get_num_threads() == 1
    clock = time.thread_time if thread_clock else time.perf_counter
    model = build_model(spec, num_stages)
    inputs, targets = model.batch(0, microbatch_size)
    inputs, targets = inputs.to(device), targets.to(device)
    timings: list[StageTiming] = []
    boundary: list[int] = []
    uncovered: list[tuple[str, ...]] = []
    param_bytes: list[int] = []
    x = inputs
    for s in range(num_stages):
        stage = model.stage(s).to(device)
        last = s == num_stages - 1
        stage_input = x
        try:
            with torch.no_grad(), _precision_context(device, precision):
                out = stage(stage_input)
                if last:
                    model.loss(out, targets)
        except Exception as exc:  # the user's model: report, don't crash
            what = f"stage {s}" + (f" on stage {s - 1}'s output of shape {list(x.shape)}" if s else "")
            raise ModelError(f"--model {spec!r}: {what}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(out, torch.Tensor):
            raise ModelError(f"--model {spec!r}: stage {s} returned {type(out).__name__}, "
                             "expected one tensor")
        if last:
            grad_output = None
            boundary.append(0)

            def finish(y: torch.Tensor) -> torch.Tensor:
                return model.loss(y, targets)
        else:
            g = torch.Generator(device="cpu").manual_seed(s)
            grad_output = torch.randn(out.shape, generator=g).to(out.dtype).to(device)
            boundary.append(out.numel() * out.element_size())

            def finish(y: torch.Tensor) -> torch.Tensor:
                return y

        def report(fraction: float, s: int = s) -> None:
            if progress is not None:
                progress(f"stage {s}", (s + fraction) / num_stages)

        def make_input(t: torch.Tensor = stage_input) -> torch.Tensor:
            return t

        timings.append(measure_stage(
            stage, make_input, finish, grad_output, device,
            warmup=warmup, repeats=repeats, progress=report, clock=clock, norms=norms,
            precision=precision,
        ))
        uncovered.append(tuple(uncovered_parameters(stage, stage_input)))
        param_bytes.append(sum(p.numel() * p.element_size() for p in stage.parameters()))
        x = out.detach()
    sizes = [b for b in boundary if b]
    if transfer:
        if progress is not None:
            progress("transfer", 1.0)
        measured, method = measure_transfer(sizes, device)
        late = measure_receive(sizes) if device.type == "cpu" else []
    else:
        measured, method, late = [], "not measured", []
    by_size = dict(zip(sizes, measured, strict=False))
    collectives: list[dict[str, float] | None] = [None] * num_stages
    collective_method = "not measured"
    if dp > 1:
        if progress is not None:
            progress("collectives", 1.0)
        found, collective_method = measure_collectives(param_bytes, dp, device=device)
        collectives = list(found)
    step = None
    if optimizer is not None:
        if progress is not None:
            progress("engine", 1.0)
        if devices is None:
            devices = 1 if device.type == "cuda" else pipeline_devices(num_stages, _usable_cores())
        if device.type == "cuda" and devices > 1:
            raise ValueError(f"devices={devices}: the pipeline of processes runs on CPU; "
                             "on CUDA the engine's passes are timed on this process (1)")
        try:
            latency = None
            if devices > 1:
                overhead, engine, optimizer_ms, jitter, latency = measure_pipeline(
                    spec, num_stages, microbatch_size, devices, optimizer=optimizer,
                    precision=precision, warmup=max(warmup, 1), repeats=repeats)
            else:
                overhead, engine, optimizer_ms, jitter = measure_engine(
                    build_model(spec, num_stages), num_stages, microbatch_size, device,
                    optimizer=optimizer, precision=precision, warmup=max(warmup, 1),
                    repeats=repeats,
                )
        except Exception as exc:  # noqa: BLE001 - the stage runs worked: say so, keep them
            print(f"ppdsl profile: warning: running the stages through the engine failed "
                  f"({type(exc).__name__}: {exc}); no step costs, and the pass costs are the "
                  "stage runs' (--optimizer none skips this)", file=sys.stderr)
        else:
            norm = measure_norm_reduce() if transfer and num_stages > 1 else None
            step = StepCosts(overhead, engine, optimizer_ms, optimizer, norm, jitter,
                             latency if transfer else None)
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    return Profile(
        model=spec,
        num_stages=num_stages,
        microbatch_size=microbatch_size,
        device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        threads=threads,
        warmup=warmup,
        repeats=repeats,
        transfer_method=method,
        clock="cuda-events" if device.type == "cuda" else "thread" if thread_clock else "wall",
        norms=norms,
        precision=precision,
        tf32=tf32_settings() if device.type == "cuda" else "n/a",
        stages=tuple(
            StageProfile(s, timings[s], boundary[s], by_size.get(boundary[s]) if boundary[s] else None,
                         uncovered[s], param_bytes[s],
                         _reduce_ms(collectives[s], dp_mode), (collectives[s] or {}).get("all_gather"))
            for s in range(num_stages)
        ),
        dp=dp,
        dp_mode=dp_mode,
        collective_method=collective_method,
        step=step,
        recv_ms=statistics.fmean(late) if late else None,
        devices=(devices or 1) if step is not None else 1,
    )


def _engine_where(devices: int) -> str:
    """Where the engine's passes were timed, in words."""
    if devices == 1:
        return "every stage on one process"
    return f"a pipeline of {devices} gloo processes, the stages placed looped"


def _usable_cores() -> int:
    """The cores this process may run on (`taskset` narrows them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _reduce_ms(row: dict[str, float] | None, dp_mode: str) -> float | None:
    if row is None:
        return None
    return row["all_reduce" if dp_mode == "replicate" else "reduce_scatter"]


# --- the costs file ----------------------------------------------------------------


def _norms_pass(norms: str) -> str:
    """The pass that computes layer norms' weight gradients under `norms`."""
    return "B" if norms == "in-b" else "W"


def _step_statements(step: StepCosts | None) -> list[str]:
    """`cost overhead`, `cost optimizer[s]`, `cost norm` (those measured)."""
    if step is None:
        return []
    lines = [f"    cost overhead = {cost_decimal(step.overhead_ms)}",
             "    cost optimizer[s] = " + per_stage_text([cost_decimal(x) for x in step.optimizer_ms])]
    if step.norm_ms is not None:
        lines.append(f"    cost norm = {cost_decimal(step.norm_ms)}")
    if step.jitter > 0:
        lines.append(f"    cost jitter = {cost_decimal(step.jitter)}")
    return lines


def to_costs_pp(profile: Profile, command: str | None = None) -> str:
    """The profile as a `.pp` file of `cost` and `memory` statements (per stage)
    that `--costs-from` reads: costs in milliseconds, memory in units of the mean
    stage's M_B (the header says how many bytes that is). The pass costs are the
    engine's (`StepCosts.engine_pass_ms`: profile = run) where it measured them,
    else the stage runs'."""
    unit = profile.memory_unit_bytes()
    rows = []
    for s in profile.stages:
        t = s.timing
        rows.append(
            f"#   stage {s.stage}: T_F {t.forward_ms:.4f}  T_B {t.input_ms:.4f}  T_W {t.weight_ms:.4f}"
            f"  T_BW {t.fused_ms:.4f} ms;  M_B {t.activation_bytes}  M_W {t.weight_bytes} bytes"
        )
    stages = profile.stages
    kinds: dict[str, list[float]] = {"F": [], "B": [], "W": [], "BW": []}
    engine = profile.step.engine_pass_ms if profile.step is not None else {}
    for st in stages:
        t = st.timing
        own = {"F": t.forward_ms, "B": t.input_ms, "W": t.weight_ms, "BW": t.fused_ms}
        for kind, values in kinds.items():
            values.append(engine.get(f"{kind}{st.stage}", own[kind]))
    from_engine = all(f"{k}{st.stage}" in engine for k in kinds for st in stages)
    lines = [
        f"# Measured by ppdsl profile {__version__}"
        + (f": {command}" if command else f": {profile.model}, {profile.num_stages} stages"),
        f"# microbatch {profile.microbatch_size}, {profile.device}"
        + (f" ({profile.threads} thread{'s' if profile.threads != 1 else ''})"
           if profile.threads else "")
        + f", torch {profile.torch_version}; median of {profile.repeats} after {profile.warmup} warm-up.",
        "# Costs in milliseconds ("
        + ("this thread's CPU time" if profile.clock == "thread" else "wall time")
        + "); memory in units of the mean stage's M_B "
        f"(1 unit = {unit:.0f} bytes); layer norms' weight gradients in {_norms_pass(profile.norms)}.",
        (f"# transfer (cost comm): in the engine's pipeline ({_engine_where(profile.devices)}),"
         " the mean time from a sender's pass end to the start of the receiver's next pass, "
         "when the receiver waited for it, less the overhead per pass; alone, "
         f"{profile.transfer_method}: {profile.boundary_ms():.4f} ms"
         if profile.step is not None and profile.step.latency_ms is not None else
         f"# transfer (cost comm, mean of the stage boundaries): {profile.transfer_method}"),
        *(["# cost recv: a receive posted after its data was sent, between two gloo "
           "processes (the receiver's own part of every transfer)"]
          if profile.recv_ms is not None else []),
        *([f"# data parallel over {profile.dp} ranks: cost reduce = "
           + ("all-reduce" if profile.dp_mode == "replicate" else "reduce-scatter")
           + f" of a stage's gradients, cost gather = all-gather; {profile.collective_method}"]
          if profile.dp > 1 else []),
        *rows,
        *(["# pass costs: the passes as `ppdsl run`'s engine ran them ("
           + _engine_where(profile.devices) + ", timed as the run times passes: "
           + ("CUDA events" if profile.clock == "cuda-events" else "wall time")
           + "); the stage lines above are the profile's own runs"] if from_engine else []),
        *([f"# step besides passes: overhead = the engine's work per pass (wall time), "
           f"optimizer = {profile.step.optimizer}'s step per stage, norm = the gradient-norm "
           "all-reduce between two gloo processes, jitter = the spread of the engine's pass "
           "times (IQR / 1.349 of log(duration / median))"] if profile.step is not None else []),
        "# Use with: ppdsl check|show|stats|compare|search ... --costs-from THIS_FILE",
        "schedule profile {",
        f"    let {PROFILED_STAGES} = {profile.num_stages}",
        *(f"    cost {kind}[s] = " + per_stage_text([cost_decimal(x) for x in values])
          for kind, values in kinds.items()),
        f"    cost comm = {cost_decimal(profile.comm_ms())}",
        *([f"    cost recv = {cost_decimal(profile.recv_ms)}"] if profile.recv_ms is not None else []),
        *([
            "    cost reduce[s] = " + per_stage_text([cost_decimal(s.reduce_ms or 0.0) for s in stages]),
            "    cost gather[s] = " + per_stage_text([cost_decimal(s.gather_ms or 0.0) for s in stages]),
        ] if profile.dp > 1 else []),
        *_step_statements(profile.step),
        "    memory M_B[s] = "
        + per_stage_text([cost_decimal(s.timing.activation_bytes / unit) for s in stages]),
        "    memory M_W[s] = "
        + per_stage_text([cost_decimal(s.timing.weight_bytes / unit) for s in stages]),
        "}",
    ]
    return "\n".join(lines) + "\n"


def write_json(profile: Profile, path: str | Path) -> None:
    """The profile's JSON (as `--json` prints it) into `path`."""
    Path(path).write_text(json.dumps(profile.to_json(), indent=2) + "\n", encoding="utf-8")
