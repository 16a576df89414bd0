"""One stage's passes timed and measured on one microbatch, and a chain of
stages measured one after another (`ppdsl profile`'s stages, the per-layer
profile's layers).

For a stage: the forward (T_F), the fused backward (T_B, what a BW pass runs:
plain autograd), the split backward's two halves (T_I, what a B pass runs; T_W,
what a W pass runs), the bytes one microbatch keeps after its F (M_B) and after
its B (M_W), both by the runtime's own meter. Each time is the median of
`repeats` runs after `warmup` untimed ones; the plain run (F then fused
backward) and the split run (F, B, W) alternate, so that drift on a busy machine
hits both alike.

The split's forward is the plain module's forward (`ppdsl.runtime.execution.split`),
so the forward of each run is timed separately and both are reported: their
ratio is the split's cost in F, as (T_I + T_W) / T_B is its cost in the backward.

On CUDA each pass is timed by CUDA events recorded around it on the current
stream (the GPU's own time; the queue is drained before each pass), not by a CPU
clock, which would time kernel launches only (`Stopwatch`). `precision` "bf16"
or "fp16" runs the forward (and loss) under autocast, as `ppdsl run --precision`
does.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from ppdsl.ir.schedule import PassKind
from ppdsl.runtime.execution.memory import MemoryMeter
from ppdsl.runtime.execution.precision import autocast_dtype
from ppdsl.runtime.execution.split import WStash, backward_input
from ppdsl.runtime.execution.stopwatch import Stopwatch
from ppdsl.runtime.measure.records import StageTiming
from ppdsl.runtime.models.model import ModelError
from ppdsl.runtime.worker.cpu import keep_freed_memory

__all__ = ["measure_stage", "measure_chain", "ChainLink", "prepare_device", "stage_stopwatch",
           "precision_context", "tf32_settings"]

Finish = Callable[[torch.Tensor], torch.Tensor]


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


def precision_context(device: torch.device, precision: str) -> Any:
    """The autocast region a forward runs in under `precision` (none for fp32)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def tf32_settings() -> str:
    """torch's TF32 switches, as the profile records them."""
    return (f"matmul {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}, "
            f"cudnn {'on' if torch.backends.cudnn.allow_tf32 else 'off'}, "
            f"float32 matmul precision {torch.get_float32_matmul_precision()}")


def stage_stopwatch(device: torch.device) -> Stopwatch:
    """The clock stage runs are timed by: CUDA events on CUDA; on CPU with one
    torch thread this thread's CPU time (another process's work on a shared CPU
    does not count), else wall time."""
    one_thread = device.type == "cpu" and torch.get_num_threads() == 1
    return Stopwatch(device, time.thread_time if one_thread else time.perf_counter)


def measure_stage(
    stage: torch.nn.Module,
    make_input: Callable[[], torch.Tensor],
    finish: Finish,
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
    runs = _Runs(stage, make_input, finish, grad_output, Stopwatch(device, clock), norms,
                 precision)
    plain_f, plain_b, split_f, split_i, split_w = runs.timed(warmup, repeats, progress)
    plain_bytes, _, _ = runs.memory(split_backward=False)
    f_bytes, w_bytes, g_bytes = runs.memory(split_backward=True)
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


@dataclass(frozen=True)
class ChainLink:
    """One module of a chain as `measure_chain` measured it."""

    name: str
    """The module's name in messages and progress (`stage 1`, `layer 3`)."""
    module: torch.nn.Module
    """The module, on the device."""
    input: torch.Tensor
    """What it ran on: the previous module's output (detached), or the batch."""
    timing: StageTiming
    """Its passes' times and memory (`measure_stage`)."""
    boundary_bytes: int
    """Bytes of the output it sends on (0 for the last module)."""


def measure_chain(
    modules: Iterable[tuple[str, torch.nn.Module]],
    count: int,
    inputs: torch.Tensor,
    loss: Finish,
    device: torch.device,
    *,
    where: str,
    warmup: int,
    repeats: int,
    clock: Callable[[], float],
    norms: str = "in-b",
    precision: str = "fp32",
    progress: Callable[[str, float], None] | None = None,
) -> Iterator[ChainLink]:
    """Each of `count` (name, module) pairs measured in turn on one microbatch
    (`measure_stage`), the first on `inputs`, each later one on the output of
    the one before it, the last ending with `loss(output)`; the others receive
    a fixed random gradient of their output's shape (seeded by their index).
    Each module is moved to `device` when reached (`modules` may build them
    lazily, so only one is held at a time beside its input). A module that fails
    on its input, or returns no tensor, is a `ModelError` naming it (`where`
    first: the model as the user gave it)."""
    x = inputs
    previous = ""
    for index, (name, module) in enumerate(modules):
        module = module.to(device)
        last = index == count - 1
        out = _probe(module, x, loss if last else None, device, precision,
                     f"{where}: {name}" + (f" on {previous}'s output of shape {list(x.shape)}"
                                           if index else ""))
        if not isinstance(out, torch.Tensor):
            raise ModelError(f"{where}: {name} returned {type(out).__name__}, expected one tensor")
        if last:
            grad_output, finish, boundary = None, loss, 0
        else:
            g = torch.Generator(device="cpu").manual_seed(index)
            grad_output = torch.randn(out.shape, generator=g).to(out.dtype).to(device)
            finish, boundary = _unchanged, out.numel() * out.element_size()

        def report(fraction: float, index: int = index, name: str = name) -> None:
            if progress is not None:
                progress(name, (index + fraction) / count)

        def make_input(t: torch.Tensor = x) -> torch.Tensor:
            return t

        timing = measure_stage(module, make_input, finish, grad_output, device, warmup=warmup,
                               repeats=repeats, progress=report, clock=clock, norms=norms,
                               precision=precision)
        yield ChainLink(name, module, x, timing, boundary)
        x, previous = out.detach(), name


def _unchanged(y: torch.Tensor) -> torch.Tensor:
    """What a stage other than the last ends its pass with: its output."""
    return y


def _probe(module: torch.nn.Module, x: torch.Tensor, loss: Finish | None,
           device: torch.device, precision: str, what: str) -> Any:
    """The module's output on `x` without gradients (and, on the last, its
    loss): the next module's input, and the user's model checked before it is
    timed. An exception from the model is a `ModelError` saying `what` ran."""
    try:
        with torch.no_grad(), precision_context(device, precision):
            out = module(x)
            if loss is not None:
                loss(out)
    except Exception as exc:  # the user's model: report, don't crash
        raise ModelError(f"{what}: {type(exc).__name__}: {exc}") from exc
    return out


@dataclass
class _Runs:
    """One stage's microbatch runs, plain and split, timed or measured."""

    stage: torch.nn.Module
    make_input: Callable[[], torch.Tensor]
    finish: Finish
    grad_output: torch.Tensor | None
    watch: Stopwatch
    norms: str
    precision: str

    def fresh(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A fresh input, and the tensor whose gradient B computes (None for
        integer inputs, e.g. token ids)."""
        x = self.make_input()
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
            return x, x
        return x, None

    def timed(self, warmup: int, repeats: int, progress: Callable[[float], None] | None
              ) -> tuple[list[float], ...]:
        """Seconds of each timed run's passes: (plain F, BW, split F, B, W)."""
        found: tuple[list[float], ...] = ([], [], [], [], [])
        total = warmup + repeats
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()  # a collection inside one timed pass would land on one side only
        try:
            for rep in range(total):
                # Alternate which run goes first: caches and clock drift hit both alike.
                if rep % 2 == 0:
                    plain = self.one_run(split_backward=False)
                    split = self.one_run(split_backward=True)
                else:
                    split = self.one_run(split_backward=True)
                    plain = self.one_run(split_backward=False)
                if rep >= warmup:
                    for into, seconds in zip(found, plain + split, strict=True):
                        into.append(seconds)
                if progress is not None:
                    progress((rep + 1) / (total + 1))
        finally:
            if enabled:
                gc.enable()
        for p in self.stage.parameters():
            p.grad = None
        return found

    def one_run(self, *, split_backward: bool) -> list[float]:
        """Seconds of each pass of one microbatch: F, BW (plain) or F, B, W (split)."""
        for p in self.stage.parameters():
            p.grad = None
        x, wanted = self.fresh()
        last = PassKind.W if split_backward else PassKind.BW
        watch = self.watch
        watch.sync()
        marks = [watch.mark()]
        for kind, _ in self.passes(x, wanted, split_backward=split_backward):
            if kind is last:  # recorded behind the pass's work, which is then drained
                marks.append(watch.mark())
                watch.sync()
            else:
                watch.sync()
                marks.append(watch.mark())
        return [watch.seconds(a, b) for a, b in zip(marks, marks[1:], strict=False)]

    def memory(self, *, split_backward: bool) -> tuple[int, int, int]:
        """(bytes after F, bytes after B, stash gradient bytes), by the runtime's
        meter (under autocast the weights' low-precision copies are not
        activations: the meter counts them apart)."""
        meter = MemoryMeter(self.stage.parameters())
        key = (0, 0)
        x, wanted = self.fresh()
        for kind, stash in self.passes(x, wanted, split_backward=split_backward,
                                       saving=meter.saving(key)):
            if kind is PassKind.F:
                meter.after(PassKind.F, key, Fraction(1))
            elif kind is PassKind.B:
                assert stash is not None
                meter.set_stash(key, stash.tensors, stash.gradients)
                meter.after(PassKind.B, key, Fraction(1))
        for p in self.stage.parameters():
            p.grad = None
        if not split_backward:
            return meter.f_bytes[key], 0, 0
        return meter.f_bytes[key], meter.after_b[key], meter.peak_gradient_bytes

    def passes(
        self, x: torch.Tensor, wanted: torch.Tensor | None, *, split_backward: bool,
        saving: contextlib.AbstractContextManager[Any] | None = None,
    ) -> Iterator[tuple[PassKind, WStash | None]]:
        """One microbatch through the stage as the runtime's passes run it: F
        (under `saving`, e.g. the meter's hooks, and the precision's autocast),
        then the fused backward BW, or B (`split.backward_input` into a W stash)
        and W (the stash run). Yields (kind, the stash once B has filled it)
        after each pass, so that the caller times or measures it there; the
        graph goes with its pass."""
        with saving if saving is not None else contextlib.nullcontext(), \
                precision_context(self.watch.device, self.precision):
            out = self.finish(self.stage(x))
        yield PassKind.F, None
        if not split_backward:
            torch.autograd.backward(out, self.grad_output)
            del out
            yield PassKind.BW, None
            return
        stash = WStash()
        backward_input(out, self.grad_output, wanted, stash, norms=self.norms)
        del out
        yield PassKind.B, stash
        stash.run()
        yield PassKind.W, stash
