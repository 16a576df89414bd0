"""What a step records around a pass (`ppdsl.runtime.execution.instruments`):
trace slices, pass times per kind, on CPU."""

from __future__ import annotations

import time

import torch

from ppdsl.ir.rank import Exchange
from ppdsl.ir.schedule import Pass, PassKind
from ppdsl.runtime.execution.instruments import PassInstruments
from ppdsl.runtime.execution.trace import Tracer


def test_pass_time_and_slices_on_cpu() -> None:
    """A pass is timed into the step's compute and its kind's running total, and
    traced as a slice named by kind and microbatch, filed under (kind, stage);
    a wait is its own "wait" slice, outside the pass's time; an exchange
    without transfers records no slice."""
    tracer = Tracer(0, torch.device("cpu"))
    tracer.start()
    tracer.timed = True
    totals = {k: 0.0 for k in PassKind}
    totals[PassKind.F] = 1.0  # from earlier steps: accumulated onto
    instruments = PassInstruments(tracer, torch.device("cpu"), None, totals)
    with instruments.exchange(Exchange((), ())):
        pass
    with instruments.waiting("recv act(mb 0, stage 1)"):  # type: ignore[arg-type]
        time.sleep(0.5)
    with instruments.pass_(Pass(PassKind.F, 3, 1)):
        time.sleep(0.01)
    instruments.finish(torch.device("cpu"))
    assert 0.01 <= instruments.compute < 0.5  # the wait's half second is not the pass's
    assert totals[PassKind.F] == 1.0 + instruments.compute and totals[PassKind.B] == 0.0
    assert [(e["name"], e["cat"]) for e in tracer.events] == [("wait", "exchange"), ("F3", "F")]
    assert tracer.events[1]["args"] == {"stage": 1, "microbatch": 3, "step": 0}
    assert list(tracer.durations) == [("exchange", -1), ("F", 1)]


def test_no_tracer_times_the_pass_only() -> None:
    """Without a tracer the pass is still timed, and nothing else is recorded."""
    totals = {k: 0.0 for k in PassKind}
    instruments = PassInstruments(None, torch.device("cpu"), None, totals)
    with instruments.pass_(Pass(PassKind.W, 0, 0)):
        time.sleep(0.005)
    instruments.finish(torch.device("cpu"))
    assert totals[PassKind.W] == instruments.compute >= 0.005
