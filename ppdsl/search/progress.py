"""A one-line progress bar on stderr, drawn only where a person watches it."""

from __future__ import annotations

import sys
import time
from fractions import Fraction
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """`bar(stage, fraction)` redraws `[#####.....] stage  45%` in place;
    `bar.solver(incumbent, bound, fraction)` shows the exact engine's best value
    and lower bound as they move. Draws nothing unless `enabled`; redraws at
    most 20 times a second."""

    def __init__(self, enabled: bool, stream: TextIO | None = None, width: int = 30):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self._last = 0.0
        self._drawn = 0

    def __call__(self, stage: str, fraction: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if fraction < 1.0 and now - self._last < 0.05:
            return
        self._last = now
        filled = int(round(self.width * max(0.0, min(1.0, fraction))))
        bar = "#" * filled + "." * (self.width - filled)
        text = f"\r[{bar}] {stage:<16} {fraction * 100:3.0f}%"
        pad = max(0, self._drawn - len(text))
        self.stream.write(text + " " * pad)
        self.stream.flush()
        self._drawn = len(text)

    def solver(self, incumbent: Fraction | None, bound: Fraction | None, fraction: float) -> None:
        """The exact engine's progress: best value found and proven lower bound."""
        best = "-" if incumbent is None else f"{float(incumbent):.5g}"
        low = "-" if bound is None else f"{float(bound):.5g}"
        self(f"exact: best {best}, bound {low}", fraction)

    def close(self) -> None:
        """End the bar's line (so the summary starts on a fresh one)."""
        if self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self.stream.flush()
            self._drawn = 0
