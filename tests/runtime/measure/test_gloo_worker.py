"""ppdsl/runtime/measure/gloo_worker.py: the programs `ppdsl profile` runs in
several gloo processes, one module run as `python -m
ppdsl.runtime.measure.gloo_worker JOB PAYLOAD` (tests/runtime/measure/test_transfers.py
and test_profile.py run each job through the launcher)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ppdsl.runtime.measure.gloo_worker import JOBS
from tests.dist.harness import free_port
from tests.paths import ROOT


@pytest.mark.slow
def test_the_module_runs_a_job_from_the_command_line() -> None:
    """`python -m ppdsl.runtime.measure.gloo_worker norm 1` in a one-rank group
    prints its answer as one JSON line (a payload that is no list is the job's
    one argument); the jobs are the five `ppdsl profile` runs."""
    assert set(JOBS) == {"exchange", "late-receive", "collectives", "norm", "pipeline"}
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ppdsl.runtime.measure.gloo_worker", "norm", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) > 0


@pytest.mark.slow
def test_collectives_job_answers_a_row_per_size() -> None:
    """The collectives job in one gloo rank: one row per size, each with the
    three collectives' median ms (the CPU timer of `Stopwatch`)."""
    from ppdsl.runtime.measure.launch import run_job

    rows = run_job("collectives", 1, [[64, 4096], 1, "gloo"], 120, "collectives")
    assert len(rows) == 2
    assert all(set(r) == {"all_reduce", "reduce_scatter", "all_gather"} and min(r.values()) >= 0
               for r in rows)
