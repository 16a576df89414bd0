"""ppdsl/runtime/execution/stopwatch.py: the GPU-or-CPU timer (CUDA events on
CUDA, a host clock elsewhere)."""

from __future__ import annotations

import time

import pytest
import torch

from ppdsl.runtime.execution.stopwatch import Stopwatch


def test_cpu_marks_are_readings_of_the_host_clock() -> None:
    """On CPU a mark is a reading of the host clock it was given, an interval the
    difference of two, and the clock is named for what it counts."""
    readings = iter([10.0, 10.25])
    watch = Stopwatch(torch.device("cpu"), lambda: next(readings))
    start, end = watch.mark(), watch.mark()
    watch.sync()  # nothing queued on a CPU
    assert watch.seconds(start, end) == 0.25 and not watch.cuda and watch.clock == "wall"
    assert Stopwatch(torch.device("cpu"), time.thread_time).clock == "thread"
    assert Stopwatch(torch.device("cpu")).clock == "wall"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_marks_time_the_gpu_work_between_them() -> None:
    """On CUDA the marks are events on the stream: work queued between them is
    timed once synchronised, the host clock unused."""
    watch = Stopwatch(torch.device("cuda", 0), lambda: pytest.fail("host clock read"))
    a = torch.randn(2048, 2048, device="cuda")
    watch.sync()
    start = watch.mark()
    for _ in range(10):
        a = a @ a / 2048
    end = watch.mark()
    watch.sync()
    assert watch.clock == "cuda-events" and 0 < watch.seconds(start, end) < 10
