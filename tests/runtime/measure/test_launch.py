"""ppdsl/runtime/measure/launch.py: a program run in several processes, ranks of
one process group on loopback, and rank 0's answer read back."""

from __future__ import annotations

import pytest

from ppdsl.runtime.measure.launch import launch, run_job

_RANKS = """
import json, os, sys
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
print("a line before the answer")
print(json.dumps([rank, world, json.loads(sys.argv[1]), os.environ["OMP_NUM_THREADS"]]))
"""


def test_rank_0_answers_last_line_as_json() -> None:
    """Each process is told its rank and the world, gets the payload as JSON and
    one OpenMP thread; what rank 0 prints last is the answer."""
    assert launch(["-c", _RANKS], 3, {"sizes": [4]}, 120, "ranks") == [0, 3, {"sizes": [4]}, "1"]


def test_a_failing_rank_is_named_with_its_last_error_line() -> None:
    """A rank that fails raises `RuntimeError` naming the job and the rank's last
    line of stderr; one past its timeout is killed (and reaped) and said so; an
    unknown job of gloo_worker fails naming the jobs there are."""
    with pytest.raises(RuntimeError, match="the test program failed: SystemExit: no luck"):
        launch(["-c", "raise SystemExit('SystemExit: no luck')"], 1, [], 60, "the test program")
    with pytest.raises(RuntimeError, match="the sleeper did not finish in 1 s"):
        launch(["-c", "import time; time.sleep(30)"], 1, [], 1, "the sleeper")
    with pytest.raises(RuntimeError, match="ping failed: gloo_worker: no job 'ping': one of exchange"):
        run_job("ping", 1, [], 60, "ping")
