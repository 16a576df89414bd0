"""The programs `ppdsl profile` runs in several processes at once, as
``python -m ppdsl.runtime.measure.gloo_worker JOB PAYLOAD`` in every rank of a
process group on this machine's loopback (`ppdsl.runtime.measure.launch.run_job`
starts them). Each job is one function below:

- `exchange`: a ping-pong between two ranks, half its round trip per size
  (the transfer `ppdsl run` makes on CPU);
- `late-receive`: a receive posted after its data was sent (`cost recv`);
- `collectives`: all-reduce, reduce-scatter and all-gather per size, NCCL with
  a GPU per rank or gloo (`cost reduce`, `cost gather`);
- `norm`: the optimizer's two-float gradient-norm all-reduce (`cost norm`);
- `pipeline`: the model's stages through the engine on a pipeline of ranks
  (`ppdsl.runtime.measure.engine_profile.pipeline_rank`).

Each prints its answer on rank 0 as one JSON line; the launcher reads the last.
The jobs import torch (and the runtime) inside, so that a job's process loads
only what it runs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["JOBS", "main"]


# --- the jobs: each runs in every rank of the group ----------------------------------


def _exchange(sizes: list[int], repeats: int) -> None:
    """Median one-way ms per size: a send and a receive each way between ranks
    0 and 1, half the round trip, after 3 untimed rounds."""
    import torch
    import torch.distributed as dist

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


def _late_receive(sizes: list[int], repeats: int) -> None:
    """Median ms per size on rank 0 of a tagged receive posted 2 ms after rank 1
    posted its send, from posting to holding the tensor."""
    import torch
    import torch.distributed as dist

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
                sent = dist.isend(buf, 0, tag=tag)
                assert sent is not None  # None only for a rank outside the group
                sent.wait()
            else:
                time.sleep(0.002)  # the send is posted: its data waits for this receive
                t0 = time.perf_counter()
                received = dist.irecv(buf, 1, tag=tag)
                assert received is not None
                received.wait()
                if rep >= 3:
                    times.append(time.perf_counter() - t0)
        if rank == 0:
            found.append(statistics.median(times) * 1e3)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(found))


def _collectives(sizes: list[int], repeats: int, backend: str) -> None:
    """Per size, the median ms of an all-reduce, a reduce-scatter and an
    all-gather of that many fp32 bytes over every rank (a dict per size), each
    after a barrier; on NCCL the GPU's time (`Stopwatch`: CUDA events)."""
    import torch
    import torch.distributed as dist

    from ppdsl.runtime.execution.stopwatch import Stopwatch

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world = dist.get_world_size()
    watch = Stopwatch(device)
    operations: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
        "all_reduce": lambda whole, part: dist.all_reduce(whole),
        "reduce_scatter": lambda whole, part: dist.reduce_scatter_tensor(part, whole),
        "all_gather": lambda whole, part: dist.all_gather_into_tensor(whole, part),
    }
    found = []
    for size in sizes:
        rows = -(-max(size // 4, 1) // world)
        whole, part = torch.ones(rows * world, device=device), torch.ones(rows, device=device)
        row = {}
        for name, operation in operations.items():
            times = []
            for rep in range(repeats + 2):
                dist.barrier()
                watch.sync()
                start = watch.mark()
                operation(whole, part)
                end = watch.mark()
                watch.sync()
                if rep >= 2:
                    times.append(watch.seconds(start, end))
            row[name] = statistics.median(times) * 1e3
        found.append(row)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(found))


def _norm(repeats: int) -> None:
    """Median ms of an all-reduce of two float64 (the squared norm and the
    inf/NaN count), after 3 untimed ones; every rank prints it."""
    import torch
    import torch.distributed as dist

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


def _pipeline(*arguments: Any) -> None:
    """`engine_profile.pipeline_rank(*arguments)` in this rank; rank 0 prints
    what every rank measured. The process then ends at once: every rank has its
    answer, and gloo's threads may end an interpreter's teardown with
    "terminate called without an active exception"."""
    import torch.distributed as dist

    from ppdsl.runtime.measure.engine_profile import pipeline_rank

    # a rank that fails leaves its peers waiting: they give up after 120 s
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    found = pipeline_rank(*arguments)
    dist.barrier()
    if rank == 0:
        print(json.dumps(found), flush=True)
    sys.stderr.flush()
    os._exit(0)


JOBS: dict[str, Callable[..., None]] = {
    "exchange": _exchange,
    "late-receive": _late_receive,
    "collectives": _collectives,
    "norm": _norm,
    "pipeline": _pipeline,
}
"""Each job by name, called with its payload's items as arguments (a payload
that is no list is one argument)."""


def main(argv: Sequence[str]) -> None:
    """``JOB PAYLOAD``: run the job on the JSON payload."""
    job, payload = argv
    if job not in JOBS:
        raise SystemExit(f"gloo_worker: no job {job!r}: one of {', '.join(JOBS)}")
    arguments = json.loads(payload)
    if isinstance(arguments, list):
        JOBS[job](*arguments)
    else:
        JOBS[job](arguments)


if __name__ == "__main__":
    main(sys.argv[1:])
