"""ppdsl/runtime/measure/transfers.py: transfers and collectives measured alone,
between real gloo processes (docs/runtime.md, "Profiling a model")."""

from __future__ import annotations

import pytest
import torch

from ppdsl.runtime.measure.transfers import (
    measure_collectives,
    measure_norm_reduce,
    measure_receive,
    measure_transfer,
)


@pytest.mark.slow
def test_transfer_is_measured_between_two_gloo_processes() -> None:
    """On CPU the transfer time comes from two real gloo processes (one per size)."""
    times, method = measure_transfer([4096, 1 << 20], torch.device("cpu"), repeats=3)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert "gloo" in method
    assert measure_transfer([], torch.device("cpu")) == ([], "none (one stage)")


@pytest.mark.slow
def test_late_receive_and_norm_reduce_are_measured() -> None:
    """`cost recv` (a receive posted after its data was sent) and `cost norm` (the
    two-float all-reduce) are timed between two real gloo processes."""
    (late,) = measure_receive([4096], repeats=3)
    assert 0 < late < 1000
    assert measure_receive([]) == []
    assert 0 < measure_norm_reduce(repeats=2) < 1000


@pytest.mark.slow
def test_collectives_are_measured_per_size() -> None:
    """`--dp`: each size's all-reduce, reduce-scatter and all-gather are timed
    among real gloo processes."""
    rows, method = measure_collectives([4096, 1 << 16], 2, repeats=1)
    assert len(rows) == 2 and "gloo" in method
    assert all(r[k] > 0 for r in rows for k in ("all_reduce", "reduce_scatter", "all_gather"))


@pytest.mark.slow
def test_collectives_of_a_cuda_run_without_a_gpu_each_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA profile's `--dp 2` on a one-GPU node cannot run NCCL (a GPU per
    process): the gloo numbers it falls back to say NCCL's were not measured."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rows, method = measure_collectives([4096], 2, repeats=1, device=torch.device("cuda", 0))
    assert len(rows) == 1 and "NOT measured" in method and "gloo" in method
