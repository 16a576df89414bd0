"""The host's work per pass, counted: the CPU stand-in for what a GPU waits on.

On a GPU a pass only queues kernels; whatever Python the engine and the split
run around them is time the GPU may sit idle (issue 39: the split backward's
(T_I + T_W) / T_B of 1.24-1.34 at hidden 2048 was that). On a CPU the same work
hides inside the kernels' time, so it is counted instead of timed: per pass,
the Python functions called (`sys.setprofile`'s "call" and "c_call" events:
Python functions and the C functions Python calls) and the operators torch's
dispatcher ran (a `TorchDispatchMode`: every aten op, whoever called it). The
counts are the same every step once the stage's shapes repeat (the first step
finds the split's plan), so a test can hold them under a ceiling and a
regression in host work fails on CPU.

`count_host_ops` runs an engine's steps with a `Tracer` that counts between a
pass's begin and end (the engine brackets every pass with them), and
`host_seconds` times the same steps uncounted: a tiny stage's pass time is its
host time. `small_engine` is the fixed stage both are read on (the test's
ceilings, `python -m bench hostops`): two stages of two blocks each
(Linear 16->64, GELU, Linear 64->16, LayerNorm), microbatches of 8 rows, every
stage on this rank.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ppdsl.runtime.execution.engine import Engine
from ppdsl.runtime.execution.group import LaneEnds
from ppdsl.runtime.execution.structure import flatten
from ppdsl.runtime.execution.trace import Tracer

__all__ = ["HostOps", "count_host_ops", "host_seconds", "small_engine", "Batch"]

Batch = Callable[[int], tuple[Sequence[Any], Sequence[Any]]]
"""A step's (inputs, targets) by step number."""

_ROWS, _WIDTH, _HIDDEN = 8, 16, 64


@dataclass(frozen=True)
class HostOps:
    """One pass kind's host work, per pass (the mean over the passes counted)."""

    kind: str
    """The pass kind's letter (F, B, W, BW, R)."""
    passes: int
    """How many passes of this kind were counted."""
    python_calls: float
    """Python functions and C functions called from Python, per pass."""
    torch_ops: float
    """Operators through torch's dispatcher, per pass."""


class _DispatchCounter(TorchDispatchMode):
    """Counts every operator the dispatcher runs while it is the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


class _CountingTracer(Tracer):
    """A tracer that, between a pass's `begin` and `end`, counts the Python calls
    and dispatcher ops the pass makes (exchanges and waits are not passes: their
    `end` carries no kind, and their counts are dropped)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(0, device)
        self.python = True
        """What is counted: Python calls, or (False) dispatcher ops; apart, so
        that neither counts the other's own calls."""
        self.totals: dict[str, list[int]] = {}
        """Pass kind -> [passes, count]."""
        self._calls = 0
        self._mode: _DispatchCounter | None = None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            self._calls += 1

    def begin(self) -> None:
        self._calls = 0
        if self.python:
            sys.setprofile(self._profile)
        else:
            self._mode = _DispatchCounter()
            self._mode.__enter__()

    def end(self, name: str, category: str, args: dict[str, Any],
            kind_stage: tuple[str, int] | None) -> None:
        if self.python:
            sys.setprofile(None)
            count = self._calls
        else:
            assert self._mode is not None
            self._mode.__exit__(None, None, None)
            count, self._mode = self._mode.count, None
        if kind_stage is not None:
            found = self.totals.setdefault(kind_stage[0], [0, 0])
            found[0] += 1
            found[1] += count

    def flush(self) -> None:
        return None


def count_host_ops(engine: Engine, batch: Batch,
                   *, warmup: int = 1, steps: int = 2) -> dict[str, HostOps]:
    """Per pass kind, the host work of one pass of `engine` (which this call
    traces, and leaves untraced): `warmup` steps whose counts are dropped (the
    split's plans found, the caches warm, what the counting mode imports on its
    first use imported), then `steps` counted;
    `batch(step)` gives a step's (inputs, targets). Gradients accumulate as the
    steps leave them."""
    tracer = _CountingTracer(engine.device)
    previous, engine.tracer = engine.tracer, tracer
    found: list[dict[str, list[int]]] = []
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection's finalizers and callbacks are not the pass's calls
    try:
        for python in (True, False):
            tracer.python = python
            for step in range(warmup + steps):
                if step in (0, warmup):  # what the warm-up counted (first imports) dropped
                    tracer.totals = {}
                engine.step(*batch(step))
            found.append(tracer.totals)
    finally:
        sys.setprofile(None)
        engine.tracer = previous
        if collecting:
            gc.enable()
    calls, ops = found
    return {kind: HostOps(kind, n, total / n, ops[kind][1] / ops[kind][0])
            for kind, (n, total) in sorted(calls.items())}


def host_seconds(engine: Engine, batch: Batch, *, warmup: int = 3, steps: int = 20,
                 ) -> dict[str, float]:
    """Per pass kind, the median over `steps` steps (after `warmup`) of the mean
    CPU seconds of this thread one pass took (`time.thread_time`: other work on
    the machine does not count): on a stage whose kernels are tiny, the host's
    time per pass."""
    tracer = _TimingTracer(engine.device)
    previous, engine.tracer = engine.tracer, tracer
    per_step: dict[str, list[float]] = {}
    try:
        for step in range(warmup + steps):
            tracer.totals = {}
            engine.step(*batch(step))
            if step >= warmup:
                for kind, (n, seconds) in tracer.totals.items():
                    per_step.setdefault(kind, []).append(seconds / n)
    finally:
        engine.tracer = previous
    return {kind: sorted(values)[len(values) // 2] for kind, values in sorted(per_step.items())}


class _TimingTracer(Tracer):
    """A tracer that adds up, per pass kind, this thread's CPU time between a
    pass's `begin` and `end`."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(0, device)
        self.totals: dict[str, list[float]] = {}
        """Pass kind -> [passes, seconds]."""
        self._start = 0.0

    def begin(self) -> None:
        self._start = time.thread_time()

    def end(self, name: str, category: str, args: dict[str, Any],
            kind_stage: tuple[str, int] | None) -> None:
        seconds = time.thread_time() - self._start
        if kind_stage is not None:
            found = self.totals.setdefault(kind_stage[0], [0, 0.0])
            found[0] += 1
            found[1] += seconds

    def flush(self) -> None:
        return None


def small_engine(schedule: str | Path, num_microbatches: int = 4, **options: Any,
                 ) -> tuple[Engine, Batch]:
    """The fixed small stage's engine for the `.pp` file `schedule` at d=1 (every
    stage on rank 0 of the current process group, which must have one rank), and
    its batch. `options` go to `Engine` (e.g. ``release="at-w"``)."""
    from ppdsl.runtime.execution.pipeline import load_schedule

    compiled = load_schedule(schedule, {"d": 1, "m": num_microbatches})
    plan = compiled.plan
    torch.manual_seed(0)
    stages: dict[int, nn.Module] = {s: nn.Sequential(*(nn.Sequential(nn.Linear(_WIDTH, _HIDDEN), nn.GELU(),
                                               nn.Linear(_HIDDEN, _WIDTH), nn.LayerNorm(_WIDTH))
                                 for _ in range(2)))
              for s in range(len(plan.stage_device))}
    engine = Engine(0, compiled.ops[0], plan.stage_device, num_microbatches, plan.memory, stages,
                    _loss, torch.device("cpu"), lane_ends=LaneEnds.of(plan), **options)
    x = torch.zeros(_ROWS, _WIDTH)
    specs = {}
    with torch.no_grad():
        for s in sorted(stages):  # what the runner's probe learns
            x = stages[s](x)
            specs[s] = flatten(x)[1]
    engine.set_specs(specs)
    g = torch.Generator().manual_seed(1)
    inputs = list(torch.randn(num_microbatches * _ROWS, _WIDTH, generator=g).split(_ROWS))
    targets = list(torch.randn(num_microbatches * _ROWS, _WIDTH, generator=g).split(_ROWS))
    return engine, lambda step: (inputs, targets)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()
