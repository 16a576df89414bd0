"""What moving data between ranks costs, measured alone: a stage's output sent
to another rank (`cost comm`), a receive posted after its data was sent (`cost
recv`), the data-parallel collectives of a stage's parameters (`cost reduce`,
`cost gather`) and the optimizer's gradient-norm all-reduce (`cost norm`).

Between processes each is a job of `ppdsl.runtime.measure.gloo_worker`, run on
this machine's loopback as `ppdsl run`'s ranks run on CPU; a CUDA transfer is a
copy between two GPUs of this node, or through pinned host memory."""

from __future__ import annotations

import statistics
import time

import torch

from ppdsl.runtime.measure.launch import run_job

__all__ = ["measure_transfer", "measure_receive", "measure_collectives", "measure_norm_reduce"]


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
    """Per size, the median wall time of a copy to another GPU (or through
    pinned host memory and back), the device drained before and after it."""
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


def _gloo_transfer(sizes: list[int], repeats: int) -> tuple[list[float], str]:
    """Per size, half a ping-pong between two gloo processes (the `exchange` job)."""
    found = run_job("exchange", 2, [sizes, repeats], 180, "the two-process gloo exchange")
    return found, (
        "send + receive between two gloo processes on loopback (half a ping-pong), "
        "the transfer `ppdsl run` makes on CPU"
    )


def measure_collectives(sizes: list[int], dp: int, repeats: int = 5,
                        device: torch.device | None = None) -> tuple[list[dict[str, float]], str]:
    """Median ms of an all-reduce, a reduce-scatter and an all-gather of each of
    `sizes` bytes (fp32) over `dp` processes on this machine: NCCL on CUDA
    tensors, timed by CUDA events, for a CUDA profile on a node with a GPU per
    process; else gloo on loopback (said so: a CUDA run's NCCL collectives were
    then not measured)."""
    gpus = torch.cuda.device_count() if device is not None and device.type == "cuda" else 0
    if gpus >= dp:
        found = run_job("collectives", dp, [sizes, repeats, "nccl"], 300,
                        f"the {dp}-process NCCL collectives")
        return found, f"NCCL collectives among {dp} processes, one GPU each, timed by CUDA events"
    found = run_job("collectives", dp, [sizes, repeats, "gloo"], 300,
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


def measure_receive(sizes: list[int], *, repeats: int = 20) -> list[float]:
    """Median ms, per size in bytes, of a receive posted after its data was
    sent (`cost recv`): between two gloo processes on loopback, tagged as
    `ppdsl run`'s CPU transport posts them, from posting the receive to holding
    the tensor. gloo moves the data only once the receive is posted, so a rank
    pays this on every receive, however early its sender finished."""
    if not sizes:
        return []
    return list(run_job("late-receive", 2, [sizes, repeats], 180,
                        "the two-process gloo late receive"))


def measure_norm_reduce(repeats: int = 20) -> float:
    """Median ms of the optimizer's gradient-norm all-reduce (two float64: the
    squared norm and the inf/NaN count, `OptimizerStep`) between two gloo
    processes on loopback, as `ppdsl run`'s pipeline ranks make it on CPU."""
    return float(run_job("norm", 2, repeats, 120, "the two-process norm all-reduce"))
