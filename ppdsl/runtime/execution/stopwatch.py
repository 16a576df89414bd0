"""The GPU-or-CPU timer: marks on a device's own clock.

On CUDA a mark is an event recorded on the current stream, so the interval
between two marks is the GPU's time for the work queued between them (a CPU
clock there would time the kernel launches only); it is read once the device
is synchronised. Elsewhere a mark is a reading of a host clock: `perf_counter`
(wall time) by default, or `time.thread_time`, which counts only this thread's
CPU time (a pass on a CPU shared with other processes, torch on one thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Stopwatch"]


class Stopwatch:
    """Marks in a run of work on `device`: CUDA events on CUDA, readings of
    `host_clock` elsewhere."""

    def __init__(self, device: torch.device,
                 host_clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        """Whether the marks are CUDA events (`host_clock` then unused)."""
        self.host_clock = host_clock

    @property
    def clock(self) -> str:
        """What the intervals count: "cuda-events", "thread" (this thread's CPU
        time) or "wall"."""
        if self.cuda:
            return "cuda-events"
        return "thread" if self.host_clock is time.thread_time else "wall"

    def mark(self) -> Any:
        """A point in the run (on CUDA, behind the work queued so far)."""
        if not self.cuda:
            return self.host_clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        """Wait for the work queued on the device (nothing to wait for on CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks (on CUDA, once `end` is reached: `sync` first)."""
        if not self.cuda:
            return float(end - start)
        return float(start.elapsed_time(end)) / 1e3
