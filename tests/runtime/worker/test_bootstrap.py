"""A rank's process around its body (ppdsl/runtime/worker/bootstrap.py), each
case a real process on a one-rank gloo group: the body gets its rank and
device and its exit code comes back; an error escaping the body stops the rank
with one line naming it; a group that cannot form and a device the node lacks
are exit codes with a message, not tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ppdsl.runtime.worker.bootstrap import EXIT_INVALID, EXIT_USAGE, world_from_env
from tests.dist import harness
from tests.paths import ROOT

_RANK = """
import sys
import torch.distributed as dist
from ppdsl.runtime.worker.bootstrap import run_worker

case = sys.argv[1]

def body(worker):
    print(f"rank {worker.rank} of {worker.world} on {worker.device}, group of "
          f"{dist.get_world_size()}, watchdog {worker.watchdog.timeout:g} s", flush=True)
    if case == "raises":
        raise ValueError("the body failed")
    return 7

code = run_worker(body, device=sys.argv[2], share_gpu=False, timeout=float(sys.argv[3]))
print(f"returned {code}, group left: {not dist.is_initialized()}", flush=True)
sys.exit(code)
"""


def _rank(case: str, device: str = "cpu", timeout: float = 20.0, rank: int = 0,
          world: int = 1) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(rank), WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(harness.free_port()),
               OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", _RANK, case, device, str(timeout)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_world_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK and WORLD_SIZE make the world; a process without either was not
    started by torchrun."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert world_from_env() == (3, 4)
    monkeypatch.delenv("WORLD_SIZE")
    assert world_from_env() is None


@pytest.mark.slow
def test_body_runs_in_the_group_and_errors_stop_the_rank() -> None:
    """The body runs on its rank in a formed group with the watchdog started;
    its exit code is returned and the group left after. A body that raises
    stops the rank with exit 1 and the error named on one line. A group that
    cannot form (rank 1 of 2, nobody hosting the store) is exit 1 with why."""
    cases = {"returns": _rank("returns"), "raises": _rank("raises"),
             "alone": _rank("returns", timeout=1.0, rank=1, world=2)}
    if not torch.cuda.is_available():
        cases["no-gpu"] = _rank("returns", device="cuda")
    results = {}
    try:
        for name, proc in cases.items():
            out, err = proc.communicate(timeout=120)
            results[name] = (proc.returncode, out, err)
    finally:
        for proc in cases.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    code, out, err = results["returns"]
    assert code == 7, err
    assert out == "rank 0 of 1 on cpu, group of 1, watchdog 20 s\nreturned 7, group left: True\n"
    code, out, err = results["raises"]
    assert code == 1 and "returned" not in out, out + err
    assert "ppdsl: rank 0: ValueError: the body failed\n" in err
    code, out, err = results["alone"]
    assert code == EXIT_INVALID and out == "returned 1, group left: True\n", out + err
    assert "ppdsl: rank 1: could not form the group of 2 ranks within 1 s" in err
    assert "Traceback" not in err
    if "no-gpu" in results:
        code, out, err = results["no-gpu"]
        assert code == EXIT_USAGE and out == "returned 2, group left: True\n", out + err
        assert err.startswith("ppdsl: error: --device cuda needs one GPU per rank"), err
