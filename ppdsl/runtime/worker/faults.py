"""Faults on purpose, to prove that a killed job restarts and loses nothing.

`PPDSL_FAULT="POINT:STEP:RANK"` makes global rank RANK kill itself (SIGKILL, as
the kernel's OOM killer or a preemption would) the first time it reaches POINT
during step STEP (counted from 1), on torchrun's first attempt only
(`TORCHELASTIC_RESTART_COUNT` 0), so the restarted job runs through. A
comma-separated list gives one fault per attempt: the k-th on attempt k (from
0), none after the list, so one job can be killed at several points in turn
(under `--max-restarts` at least the list's length). The points:

- `forward`: at the start of a forward pass;
- `exchange`: in the middle of a transfer exchange (its sends and receives
  posted, not yet waited for);
- `optimizer`: in the optimizer step;
- `save`: while a checkpoint is being written (its save started, not finished);
- `saved`: right after a checkpoint was made visible (the coordinating rank).

Unset, each point costs one comparison.
"""

from __future__ import annotations

import os
import signal

from ppdsl.runtime.worker.attempt import restart_count

__all__ = ["POINTS", "set_step", "reached"]

POINTS = ("forward", "exchange", "optimizer", "save", "saved")


def _parse(text: str | None) -> tuple[str, int, int] | None:
    faults = text.split(",") if text else []
    attempt = restart_count()
    if attempt >= len(faults):
        return None
    point, step, rank = faults[attempt].strip().split(":")
    if point not in POINTS:
        raise ValueError(f"PPDSL_FAULT: unknown point {point!r}; one of {', '.join(POINTS)}")
    if int(rank) != int(os.environ.get("RANK", "0")):
        return None
    return point, int(step), int(rank)


_FAULT = _parse(os.environ.get("PPDSL_FAULT"))
_step = 0


def set_step(step: int) -> None:
    """The step now running, counted from 1 (the training loop says it)."""
    global _step
    _step = step


def reached(point: str, step: int | None = None) -> None:
    """Die here if PPDSL_FAULT names this point, this step and this rank."""
    if _FAULT is not None and _FAULT[0] == point and _FAULT[1] == (_step if step is None else step):
        os.kill(os.getpid(), signal.SIGKILL)
