"""Never an endless hang: every rank beats a heartbeat into the rendezvous store
(torchrun's, at MASTER_ADDR:MASTER_PORT) and watches the others'.

A rank whose heartbeat stops for `timeout` seconds (killed, or frozen) or that
reports a failure makes every other rank print a message naming it and exit
non-zero. With each beat a rank also publishes where it is (`progress`): when no
rank has moved for `timeout` seconds while every one still beats (a wedged
kernel, a peer that stops answering, which NCCL would only abort after its own
timeout), every rank stops and the first to see it prints where each one stood. The
process group's own timeout is longer (`group_timeout`), so this report comes
first.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ppdsl.runtime.errors import first_line
from ppdsl.runtime.worker import progress
from ppdsl.runtime.worker.attempt import attempt_prefix

__all__ = ["Watchdog", "fail", "group_timeout"]


def group_timeout(timeout: float) -> float:
    """The process group's timeout for a watchdog of `timeout` seconds: long
    enough that the watchdog names a hung peer before a transfer times out."""
    return 2 * timeout + 10

# Keys per torchrun attempt: the agent's store outlives a restart of the workers,
# and a failure reported by the attempt before must not stop this one.
_PREFIX = f"{attempt_prefix()}watchdog/"


def say(message: str) -> None:
    """`message` and its newline on stderr in one write: print's two writes
    (text, then newline) on a line-buffered stream let another rank's line in
    between them when several ranks share the terminal."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _default_exit(message: str) -> None:
    say(message)
    os._exit(1)


class Watchdog:
    """Heartbeat thread; call `start()`, `done()` at a clean end, `fail(msg)` on error."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float,
        *,
        interval: float = 0.5,
        on_failure: Callable[[str], None] = _default_exit,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.interval = interval
        self.on_failure = on_failure
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "29500"))
        self.store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=max(timeout, 5.0)),
            wait_for_workers=False,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ppdsl-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def done(self) -> None:
        """This rank finished cleanly: its silence from now on is not a failure.
        Stops the heartbeat thread and joins it, so that it is not inside a store
        call when the process group and the interpreter go away (a thread left
        there makes the process abort at exit: "terminate called without an
        active exception")."""
        self._stop.set()
        self.join()
        try:
            self.store.set(f"{_PREFIX}done/{self.rank}", "1")
        except Exception:  # the store lives on rank 0, which may have exited: best effort
            pass

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the heartbeat thread to end (at most `timeout` seconds, default
        the store's timeout plus one interval); True when it has."""
        if self._thread.ident is None or self._thread is threading.current_thread():
            return True
        limit = timeout if timeout is not None else max(self.timeout, 5.0) + self.interval
        self._thread.join(limit)
        return not self._thread.is_alive()

    def fail(self, message: str) -> None:
        """Tell the other ranks why this one stops."""
        self._stop.set()
        try:
            self.store.set(f"{_PREFIX}fail/{self.rank}", message)
        except Exception:  # the store may be gone; this rank still exits with its message
            pass

    def _loop(self) -> None:
        others = [r for r in range(self.world_size) if r != self.rank]
        seen = {r: -1 for r in others}
        changed = {r: time.monotonic() for r in others}
        moved = {r: (-1, time.monotonic()) for r in range(self.world_size)}
        published = -1
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"{_PREFIX}hb/{self.rank}", 1)
                count, where = progress.position()
                if count != published:
                    self.store.set(f"{_PREFIX}at/{self.rank}", f"{count}|{where}")
                    published = count
                now = time.monotonic()
                if self._stalled(moved, now):
                    return
                for r in others:
                    if self.store.check([f"{_PREFIX}done/{r}"]):
                        changed[r] = now
                        continue
                    if self.store.check([f"{_PREFIX}fail/{r}"]):
                        reason = self.store.get(f"{_PREFIX}fail/{r}").decode(errors="replace")
                        self._report(f"rank {r} failed: {reason}")
                        return
                    count = self.store.add(f"{_PREFIX}hb/{r}", 0)
                    if count != seen[r]:
                        seen[r], changed[r] = count, now
                    elif now - changed[r] > self.timeout:
                        self._report(
                            f"rank {r} stopped responding (no heartbeat for {self.timeout:g} s: "
                            "killed or hung)"
                        )
                        return
            except Exception as exc:
                if self._stop.is_set():
                    return
                self._report(
                    "lost the rendezvous store (hosted by torchrun or rank 0): the launcher or "
                    f"rank 0 died ({type(exc).__name__}: {first_line(exc)})"
                )
                return

    def _stalled(self, moved: dict[int, tuple[int, float]], now: float) -> bool:
        """True (after reporting) when no rank still running has moved for
        `timeout` seconds; `moved` holds each rank's last count and when it changed."""
        positions = {}
        for r in range(self.world_size):
            if self.store.check([f"{_PREFIX}done/{r}"]):
                moved[r] = (-1, now)
                continue
            if not self.store.check([f"{_PREFIX}at/{r}"]):
                return False  # not started yet
            text = self.store.get(f"{_PREFIX}at/{r}").decode(errors="replace")
            count, _, where = text.partition("|")
            if int(count) == 0:
                return False  # still starting: start-up has its own timeouts
            positions[r] = where
            if int(count) != moved[r][0]:
                moved[r] = (int(count), now)
        if not positions or any(now - moved[r][1] <= self.timeout for r in positions):
            return False
        what = (f"no rank made progress for {self.timeout:g} s, though every one is alive "
                "(a hang: a wedged kernel or a peer that stopped answering)")
        if self.store.add(f"{_PREFIX}hang-reported", 1) == 1:  # the first to see it tells
            what += "; where each rank stands:\n" + "\n".join(
                f"  rank {r}: {positions[r]}" for r in sorted(positions))
        self._report(what)
        return True

    def _report(self, what: str) -> None:
        if self._stop.is_set():
            return
        self.on_failure(f"ppdsl: rank {self.rank}: stopping: {what}")


def fail(watchdog: Watchdog | None, rank: int, message: str) -> None:
    """Print `message`, tell the others, and exit this rank at once (exit code 1)."""
    say(f"ppdsl: rank {rank}: {message}")
    if watchdog is not None:
        watchdog.fail(message)
        time.sleep(min(2 * watchdog.interval, 2.0))  # let the others read it
    os._exit(1)
