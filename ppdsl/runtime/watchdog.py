"""Never an endless hang: every rank beats a heartbeat into the rendezvous store
(torchrun's, at MASTER_ADDR:MASTER_PORT) and watches the others'.

A rank whose heartbeat stops for `timeout` seconds (killed, or frozen) or that
reports a failure makes every other rank print a message naming it and exit
non-zero. Transfers themselves also time out (the process group's timeout), so a
rank stuck waiting on a live but wedged peer names that peer too.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ppdsl.runtime.attempt import attempt_prefix

__all__ = ["Watchdog", "fail"]

# Keys per torchrun attempt: the agent's store outlives a restart of the workers,
# and a failure reported by the attempt before must not stop this one.
_PREFIX = f"{attempt_prefix()}watchdog/"


def _default_exit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
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
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"{_PREFIX}hb/{self.rank}", 1)
                now = time.monotonic()
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
                    f"rank 0 died ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                )
                return

    def _report(self, what: str) -> None:
        if self._stop.is_set():
            return
        self.on_failure(f"ppdsl: rank {self.rank}: stopping: {what}")


def fail(watchdog: Watchdog | None, rank: int, message: str) -> None:
    """Print `message`, tell the others, and exit this rank at once (exit code 1)."""
    print(f"ppdsl: rank {rank}: {message}", file=sys.stderr, flush=True)
    if watchdog is not None:
        watchdog.fail(message)
        time.sleep(min(2 * watchdog.interval, 2.0))  # let the others read it
    os._exit(1)
