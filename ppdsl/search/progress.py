"""A one-line progress bar on stderr, drawn only where a person watches it."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """`bar(stage, fraction)` redraws `[#####.....] stage  45%` in place.
    Draws nothing unless `enabled`; redraws at most 20 times a second."""

    def __init__(self, enabled: bool, stream: TextIO | None = None, width: int = 30):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self._last = 0.0
        self._drawn = False

    def __call__(self, stage: str, fraction: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if fraction < 1.0 and now - self._last < 0.05:
            return
        self._last = now
        filled = int(round(self.width * max(0.0, min(1.0, fraction))))
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {stage:<16} {fraction * 100:3.0f}%")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """End the bar's line (so the summary starts on a fresh one)."""
        if self._drawn:
            self.stream.write("\r" + " " * (self.width + 26) + "\r")
            self.stream.flush()
            self._drawn = False
