"""Run a program in several processes at once, ranks of one process group on
this machine's loopback, and read rank 0's answer: the jobs of
`ppdsl.runtime.measure.gloo_worker` (`run_job`), or any program (`launch`).

Each process gets RANK, WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT, and one
OpenMP thread, as `ppdsl run`'s CPU ranks have it; a rank that fails or
overruns the timeout ends them all with a `RuntimeError` naming the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["run_job", "launch"]

_WORKER = "ppdsl.runtime.measure.gloo_worker"


def run_job(job: str, world: int, payload: object, timeout: int, what: str) -> Any:
    """Run the `gloo_worker` job `job` in `world` processes (`payload` as its
    JSON argument); what rank 0 prints last, read as JSON. `what` names the job
    in the `RuntimeError` raised when a rank fails or overruns `timeout` seconds."""
    return launch(["-m", _WORKER, job], world, payload, timeout, what)


def launch(program: Sequence[str], world: int, payload: object, timeout: int, what: str) -> Any:
    """Run ``python PROGRAM PAYLOAD`` (`payload` as JSON) in `world` processes,
    ranks of one process group on loopback (RANK, WORLD_SIZE, MASTER_ADDR and a
    free MASTER_PORT set; one OpenMP thread each); what rank 0 prints last,
    read as JSON."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, *program, json.dumps(payload)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    outputs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.communicate()  # reaped, its pipes closed
            raise RuntimeError(f"{what} did not finish in {timeout} s") from None
        if p.returncode != 0:
            first = err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}"
            raise RuntimeError(f"{what} failed: {first}")
        outputs.append(out)
    return json.loads(outputs[0].strip().splitlines()[-1])
