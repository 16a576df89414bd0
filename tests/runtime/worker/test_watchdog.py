"""The watchdog (ppdsl/runtime/worker/watchdog.py, docs/runtime.md "When a rank
dies or hangs"), one rank's thread against a real store, the other ranks played
by writing their keys: a failure reported, a silent rank and a hang are each
named within the timeout, and a clean exit joins the thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ppdsl.runtime.worker import progress
from ppdsl.runtime.worker.attempt import attempt_prefix
from ppdsl.runtime.worker.watchdog import Watchdog, group_timeout
from tests.dist import harness
from tests.paths import ROOT


def _watch(monkeypatch: pytest.MonkeyPatch, world: int, timeout: float
           ) -> tuple[Watchdog, dist.TCPStore, list[str], threading.Event]:
    """Rank 0's watchdog on a fresh store (`interval` 50 ms), its reports kept."""
    port = harness.free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                          wait_for_workers=False)
    reports: list[str] = []
    reported = threading.Event()

    def report(message: str) -> None:
        reports.append(message)
        reported.set()

    watchdog = Watchdog(0, world, timeout, interval=0.05, on_failure=report)
    return watchdog, store, reports, reported


def _key(what: str, rank: int) -> str:
    return f"{attempt_prefix()}watchdog/{what}/{rank}"


def test_group_timeout_outlasts_the_watchdog() -> None:
    """The process group waits longer than the watchdog, so the watchdog's
    message comes first."""
    for timeout in (0.5, 60.0, 600.0):
        assert group_timeout(timeout) > timeout


def test_a_failed_peer_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that reports a failure makes this one stop, naming it and its
    reason."""
    watchdog, store, reports, reported = _watch(monkeypatch, 2, timeout=30.0)
    store.add(_key("hb", 1), 1)
    watchdog.start()
    store.set(_key("fail", 1), "LossError: the loss is nan")
    assert reported.wait(10)
    watchdog.done()
    assert reports == ["ppdsl: rank 0: stopping: rank 1 failed: LossError: the loss is nan"]


def test_a_silent_peer_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose heartbeat never moves is reported after `timeout` seconds,
    not before."""
    watchdog, _, reports, reported = _watch(monkeypatch, 2, timeout=0.6)
    started = time.monotonic()
    watchdog.start()
    assert reported.wait(10)
    assert time.monotonic() - started >= 0.6
    watchdog.done()
    assert reports == ["ppdsl: rank 0: stopping: rank 1 stopped responding (no heartbeat "
                       "for 0.6 s: killed or hung)"]


def test_a_hang_reports_where_each_rank_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank beating but none moving for `timeout` seconds is a hang: the
    first to see it prints where each rank stands."""
    watchdog, store, reports, reported = _watch(monkeypatch, 2, timeout=0.5)
    progress.at("the optimizer step")
    store.set(f"{attempt_prefix()}watchdog/at/1", "7|waiting to receive act(mb 1)")
    stop = threading.Event()

    def beat() -> None:  # rank 1 alive, its position never changing
        while not stop.wait(0.05):
            store.add(_key("hb", 1), 1)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    watchdog.start()
    try:
        assert reported.wait(10)
    finally:
        stop.set()
        beating.join()
    watchdog.done()
    assert reports[0].startswith("ppdsl: rank 0: stopping: no rank made progress for 0.5 s")
    assert reports[0].endswith("  rank 0: the optimizer step\n  rank 1: waiting to receive act(mb 1)")


def test_a_finished_peer_is_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that said it is done may fall silent: no report while this rank
    goes on moving, and this rank's own done() is written for the others."""
    watchdog, store, reports, _ = _watch(monkeypatch, 2, timeout=0.3)
    store.set(_key("done", 1), "1")
    watchdog.start()
    for step in range(20):
        progress.at(f"step {step}")
        time.sleep(0.05)
    watchdog.done()
    assert reports == []
    assert store.check([_key("done", 0)])


_EXIT_RACE = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from ppdsl.runtime.worker.watchdog import Watchdog
port = int(sys.argv[1])
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                       wait_for_workers=False)
# 400 ranks to watch and no pause: the heartbeat thread is inside a store call
# nearly all the time, so it is there when the process exits unless done() joins it
watchdog = Watchdog(0, 400, 60.0, interval=0.0)
watchdog.start()
time.sleep(0.3)
watchdog.done()
print("alive", watchdog._thread.is_alive(), flush=True)
"""


@pytest.mark.slow
def test_clean_exit_joins_the_heartbeat_thread() -> None:
    """Exit right after the watchdog's done(), with its thread kept inside store
    calls: a thread left there aborts the process at exit ("terminate called
    without an active exception", exit 134); done() joins it, so every run
    exits 0."""
    # three runs at once, each on its own port: they spend their time importing torch
    procs = [subprocess.Popen([sys.executable, "-c", _EXIT_RACE, str(harness.free_port())],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
             for _ in range(3)]
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            assert "terminate called" not in err
            assert "alive False" in out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
