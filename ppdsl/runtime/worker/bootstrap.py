"""A rank's process from torchrun's environment to its exit, around a body that
does the work (`ppdsl.runtime.training.train` passes its loop): the device, the
process group on this attempt's store, the watchdog, what an error that escapes
the body means, and the way out. Nothing here knows what a schedule is.

    code = run_worker(lambda worker: train(worker), device="auto", share_gpu=False,
                      timeout=60.0)
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ppdsl.runtime.errors import PeerError, first_line, peer_failure
from ppdsl.runtime.worker.attempt import attempt_store
from ppdsl.runtime.worker.cpu import keep_freed_memory
from ppdsl.runtime.worker.devices import DeviceChoice, choose_device
from ppdsl.runtime.worker.watchdog import Watchdog, fail, group_timeout

__all__ = ["EXIT_INVALID", "EXIT_USAGE", "Worker", "world_from_env", "run_worker"]

EXIT_INVALID = 1
"""A rank's exit code for bad input (the model, the data, the start-up checks)."""
EXIT_USAGE = 2
"""A rank's exit code for a request the node cannot meet (`--device cuda`)."""


@dataclass(frozen=True)
class Worker:
    """What the body of a rank's process is given: who it is, where it runs, and
    the watchdog that stops every rank when one fails."""

    rank: int
    """The global rank (torchrun's RANK)."""
    world: int
    """The number of processes (torchrun's WORLD_SIZE)."""
    device: torch.device
    """This rank's device: its GPU, or the CPU."""
    watchdog: Watchdog
    """The heartbeat thread, already started; `fail(watchdog, ...)` stops every rank."""


def world_from_env() -> tuple[int, int] | None:
    """(rank, world size) from torchrun's environment; None in a process torchrun
    did not start."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def run_worker(body: Callable[[Worker], int], *, device: str, share_gpu: bool,
               timeout: float) -> int:
    """Run `body` in this rank's process group and return its exit code: EXIT_USAGE
    when the node cannot give the `device` asked for, EXIT_INVALID when the
    group does not form within `timeout` seconds. An exception out of `body`
    stops every rank (exit 1), naming the peer when a collective failed because
    one died. Call it under torchrun (`world_from_env` is not None)."""
    found = world_from_env()
    assert found is not None, "run_worker runs under torchrun"
    rank, world = found
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    choice = choose_device(device, local_ranks, share_gpu=share_gpu)
    if choice.error is not None:
        if local_rank == 0:
            print(f"ppdsl: error: {choice.error}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if choice.note is not None and rank == 0:
        print(choice.note, file=sys.stderr, flush=True)
    here = _take_device(choice, local_rank)
    problem = _form_group(rank, world, here, share_gpu, timeout)
    if problem is not None:
        print(f"ppdsl: rank {rank}: {problem}", file=sys.stderr)
        return EXIT_INVALID
    watchdog = Watchdog(rank, world, timeout)
    watchdog.start()
    code = _guarded(body, Worker(rank, world, here, watchdog))
    # The heartbeat thread is joined here, before the process group and its store
    # go away: a thread still inside a store call at exit aborts the process
    # ("terminate called without an active exception").
    watchdog.done()
    if code == 0:
        dist.barrier()
    if here.type == "cuda" and share_gpu:
        # Past the barrier every result is written. The interpreter's teardown of
        # ranks sharing a GPU over gloo with FSDP2 state can crash in torch's
        # destructors (SIGSEGV), which would turn a finished run into a failed one,
        # so these ranks leave without tearing down.
        torch.cuda.synchronize(here)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    dist.destroy_process_group()
    return code


def _take_device(choice: DeviceChoice, local_rank: int) -> torch.device:
    """This rank's device, made current: with `--share-gpu` rank r takes GPU
    r mod count, else one GPU per local rank; on CPU one thread (unless
    OMP_NUM_THREADS says otherwise) and glibc keeping freed memory."""
    if choice.kind == "cuda":
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    keep_freed_memory()
    return torch.device("cpu")


def _form_group(rank: int, world: int, device: torch.device, share_gpu: bool,
                timeout: float) -> str | None:
    """Join the process group on this attempt's store (NCCL with a GPU per rank,
    gloo otherwise); what went wrong, or None."""
    limit = timedelta(seconds=group_timeout(timeout))
    try:
        store = attempt_store(rank, world, timeout)
        if device.type == "cuda" and not share_gpu:
            dist.init_process_group("nccl", timeout=limit, device_id=device, store=store,
                                    rank=rank, world_size=world)
        else:
            dist.init_process_group("gloo", timeout=limit, store=store, rank=rank,
                                    world_size=world)
    except Exception as exc:  # a rank that never arrives, an unreachable MASTER_ADDR
        return (f"could not form the group of {world} ranks within {timeout:g} s (is every "
                "rank started, and MASTER_ADDR:MASTER_PORT reachable?): "
                f"{first_line(exc)[:300]}")
    return None


def _guarded(body: Callable[[Worker], int], worker: Worker) -> int:
    """`body(worker)`; an exception out of it stops every rank with one message
    (this rank exits 1 inside `fail`)."""
    rank, watchdog = worker.rank, worker.watchdog
    try:
        return body(worker)
    except PeerError as exc:
        fail(watchdog, rank, str(exc))
    except Exception as exc:  # a bug or a model failing mid-training: stop everyone
        if peer_failure(exc):  # a collective with a peer that died or hung
            time.sleep(min(2 * watchdog.interval, 2.0))  # let the watchdog name the peer
            fail(watchdog, rank, f"a collective with the other ranks failed: {first_line(exc, 200)}")
        traceback.print_exc()
        fail(watchdog, rank, f"{type(exc).__name__}: {exc}")
