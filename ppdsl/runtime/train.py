"""The path generated rank programs import (`from ppdsl.runtime.train import main`),
kept so that programs already on disk keep running; the loop itself is
`ppdsl.runtime.training.train`."""

from __future__ import annotations

from ppdsl.runtime.training.train import main

__all__ = ["main"]
