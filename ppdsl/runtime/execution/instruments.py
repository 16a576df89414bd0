"""What a step records around its ops besides running them, in one place so
that the engine's pass loop reads as the schedule does (hooks, wait, compute,
hooks): each pass's and exchange's trace slice (`ppdsl.runtime.execution.trace`),
each pass's time, and in a measured step on CUDA each pass's memory window
(`ppdsl.runtime.execution.memory.DevicePeak.pass_window`).

On CPU a pass is timed with `time.perf_counter` around it. On CUDA a pass only
queues kernels, so its CPU time is their launch: each pass is bracketed by CUDA
events, read once at the step's end (one synchronisation).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from ppdsl.ir.rank import Exchange, Transfer
from ppdsl.ir.schedule import Pass, PassKind
from ppdsl.runtime.execution.memory import DevicePeak
from ppdsl.runtime.execution.trace import Tracer

__all__ = ["PassInstruments"]


class PassInstruments:
    """One step's instruments (made per step): trace slices, pass times, memory
    windows. `compute_time` (per pass kind, seconds) accumulates across steps."""

    def __init__(self, tracer: Tracer | None, device: torch.device,
                 device_peak: DevicePeak | None, compute_time: dict[PassKind, float]) -> None:
        self.tracer = tracer
        self.cuda = device.type == "cuda"
        self.device_peak = device_peak
        self.compute_time = compute_time
        self.compute = 0.0
        """Seconds in passes (on CUDA, once `finish` has read the events)."""
        self._events: list[tuple[PassKind, Any, Any]] = []
        self._pass = Pass(PassKind.F, 0, 0)
        self._window: Any = None
        self._begin: Any = None
        self._t0 = 0.0

    @contextlib.contextmanager
    def exchange(self, op: Exchange) -> Iterator[None]:
        """Around posting an exchange: its trace slice."""
        if self.tracer is None or not (op.sends or op.recvs):
            yield
            return
        self.tracer.begin()
        yield
        self.tracer.end("exchange", "exchange",
                        {"sends": [str(t) for t in op.sends], "recvs": [str(t) for t in op.recvs]},
                        None)

    @contextlib.contextmanager
    def waiting(self, transfer: Transfer) -> Iterator[None]:
        """Around waiting for a pass's receive (not the pass's time): its trace slice."""
        if self.tracer is None:
            yield
            return
        self.tracer.begin()
        yield
        self.tracer.end("wait", "exchange", {"recvs": [str(transfer)]}, None)

    def pass_(self, done: Pass) -> PassInstruments:
        """Around a pass (``with instruments.pass_(p):``): its trace slice, its time
        and its memory window. The instruments are their own context manager
        (passes do not nest): a generator-made one costs the host several Python
        calls a pass (issue 39)."""
        self._pass = done
        return self

    def __enter__(self) -> None:
        if self.tracer is not None:
            self.tracer.begin()
        if self.cuda:  # the GPU's time, read at the step's end
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        if self.device_peak is not None:
            self._window = self.device_peak.pass_window(self._pass.kind, self._pass.stage)
            self._window.__enter__()
        if not self.cuda:
            self._t0 = time.perf_counter()

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        done = self._pass
        if self.cuda:
            if self._window is not None:
                self._window.__exit__(kind, value, traceback)
            if kind is not None:
                return
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((done.kind, self._begin, end))
        else:
            dt = time.perf_counter() - self._t0
            if self._window is not None:
                self._window.__exit__(kind, value, traceback)
            if kind is not None:
                return
            self.compute += dt
            self.compute_time[done.kind] += dt
        if self.tracer is not None:
            self.tracer.end(f"{done.kind.value}{done.microbatch}", done.kind.value,
                            {"stage": done.stage, "microbatch": done.microbatch},
                            (done.kind.value, done.stage))

    def finish(self, device: torch.device) -> None:
        """At the step's end: the trace's slices written, the CUDA events read."""
        if self.tracer is not None:
            self.tracer.flush()
        if self.cuda:
            torch.cuda.synchronize(device)
            for kind, begin, end in self._events:
                seconds = begin.elapsed_time(end) / 1e3
                self.compute += seconds
                self.compute_time[kind] += seconds
            self._events.clear()
