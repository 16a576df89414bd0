"""What each rank did when: its passes and exchanges, timed, as a Chrome/Perfetto
trace (`--trace OUT.json`), and the per-pass times that let the simulator be
checked against the run (`ppdsl.analysis.run_gap`, torch-free, compares them).

On CPU a pass is timed with `time.perf_counter` around it. On CUDA, where a pass
only queues kernels, each pass is bracketed by CUDA events and read back once per
step (one synchronisation), so the times are the GPU's. Times count from an
epoch every rank takes right after a barrier, so the ranks' rows line up (to
within the barrier's skew; one machine's clock is shared, across nodes NTP's).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["Tracer", "chrome_trace", "write_chrome_trace", "OUTSIDE"]

OUTSIDE = ("exchange", "optimizer", "data")
"""The traced slices outside passes whose durations `Tracer.durations` keeps:
the engine's exchanges (posting sends, waiting on receives), the optimizer step
(with the gradient-norm all-reduce and the wait for the other ranks in it), and
building the batch (outside the timed step)."""


class Tracer:
    """Records one rank's passes and exchanges."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.events: list[dict[str, Any]] = []
        """Chrome trace events ("X" slices), times in microseconds from the epoch."""
        self.durations: dict[tuple[str, int], list[float]] = {}
        """(pass kind letter, stage) -> durations in ms of the steps marked `timed`;
        the slices outside passes under (their category, -1): `OUTSIDE` ("exchange",
        "optimizer", "data")."""
        self._epoch = 0.0
        self._epoch_event: Any = None
        self._pending: list[tuple[dict[str, Any], Any, Any]] = []
        self._open: Any = None
        self.step = 0
        self.timed = False
        self.shared_clock = False
        """Whether `start` took rank 0's epoch (one clock with it)."""

    def start(self) -> None:
        """Take the epoch: call right after a barrier, on every rank of the
        default process group at once (when there is one). On CPU a rank on the
        same host as rank 0 then takes rank 0's epoch: `perf_counter` is the host's monotonic clock, so their
        times compare exactly; a barrier alone leaves each rank's epoch where
        it left the barrier, which on busy cores differs between ranks by
        milliseconds, as much as a short pass lasts."""
        if self.cuda:
            torch.cuda.synchronize()
            self._epoch_event = torch.cuda.Event(enable_timing=True)
            self._epoch_event.record()
        self._epoch = time.perf_counter()
        if not self.cuda:
            import socket

            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                every: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(every, (socket.gethostname(), self._epoch))
                if every[0][0] == socket.gethostname():
                    self._epoch = every[0][1]
                    self.shared_clock = True

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self) -> None:
        """Mark the start of the next slice."""
        self._open = self._now()

    def end(self, name: str, category: str, args: dict[str, Any], kind_stage: tuple[str, int] | None) -> None:
        """Close the slice opened by `begin`; `kind_stage` files its duration as a
        pass of that kind and stage."""
        event = {"name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": 0,
                 "args": {**args, "step": self.step}}
        if kind_stage is not None:
            event["_kind_stage"] = kind_stage
        self._pending.append((event, self._open, self._now()))
        self._open = None

    def flush(self) -> None:
        """Turn the step's pending slices into events (on CUDA: one synchronisation)."""
        if self.cuda and self._pending:
            torch.cuda.synchronize()
        for event, start, end in self._pending:
            if self.cuda:
                ts = self._epoch_event.elapsed_time(start) * 1e3
                dur = start.elapsed_time(end) * 1e3
            else:
                ts = (start - self._epoch) * 1e6
                dur = (end - start) * 1e6
            event["ts"], event["dur"] = ts, dur
            kind_stage = event.pop("_kind_stage", None)
            if kind_stage is None and event["cat"] in OUTSIDE:
                kind_stage = (event["cat"], -1)
            if kind_stage is not None and self.timed:
                self.durations.setdefault(kind_stage, []).append(dur / 1e3)
            self.events.append(event)
        self._pending.clear()


def chrome_trace(per_rank: list[list[dict[str, Any]]], names: list[str], meta: dict[str, Any]) -> dict[str, Any]:
    """One trace of every rank: a process per rank (named by `names`), slices as
    recorded, and `meta` under otherData."""
    events: list[dict[str, Any]] = []
    for rank, (evs, name) in enumerate(zip(per_rank, names, strict=True)):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        events.extend(evs)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def write_chrome_trace(path: str | Path, trace: dict[str, Any]) -> None:
    """Write the trace as JSON (open it in ui.perfetto.dev or chrome://tracing)."""
    out = Path(path)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace), encoding="utf-8")
