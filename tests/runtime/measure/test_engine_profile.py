"""ppdsl/runtime/measure/engine_profile.py: the stages' passes through the
runtime's engine, timed as `ppdsl run` times them, and the step's costs besides
passes (docs/runtime.md, "Profiling a model")."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ppdsl.analysis.trace_timeline import pipeline_latency, transfer_latencies
from ppdsl.runtime.measure.costs_pp import to_costs_pp
from ppdsl.runtime.measure.engine_profile import (
    engine_summary,
    measure_engine,
    overhead_per_pass,
    pipeline_devices,
)
from ppdsl.runtime.measure.records import StepCosts
from ppdsl.runtime.models.model import build_model
from tests.runtime.measure.examples import small_profile


def _slice(kind: str, stage: int, mb: int, ts: float, dur: float) -> dict:
    return {"name": f"{kind}{mb}", "cat": kind, "ph": "X", "ts": ts, "dur": dur,
            "args": {"stage": stage, "microbatch": mb, "step": 3}}


def test_transfer_latency_is_taken_where_the_receiver_waited(tmp_path: Path) -> None:
    """`cost comm` from the engine's pipeline (docs/runtime.md, "Profiling a
    model"): a transfer's time from the end of the pass that made it to the
    start of the pass that takes it, where the receiver was ready first; the
    mean of both directions between two ranks, so a skew between their clocks
    cancels; less the overhead per pass the simulator charges the sender."""
    def events(skew: float) -> list[list[dict]]:
        rank0 = [_slice("F", 0, 0, 0, 1000), _slice("F", 0, 1, 1000, 1000),
                 _slice("B", 0, 0, 3700, 1000)]
        rank1 = [_slice("F", 1, 0, 1300, 1000), _slice("B", 1, 0, 2300, 1000),
                 # ready at 3300, after F1 of stage 0 ended: not on the critical path
                 _slice("F", 1, 1, 3300, 1000)]
        return [rank0, [dict(e, ts=e["ts"] + skew) for e in rank1]]

    found = transfer_latencies(events(0.0), 0.05)
    assert {k: [round(x, 6) for x in v] for k, v in found.items()} == {(0, 1): [0.3], (1, 0): [0.4]}
    assert pipeline_latency(found, 0.05) == pytest.approx(0.3)
    skewed = transfer_latencies(events(200.0), 0.05)  # rank 1's clock 0.2 ms ahead
    assert {k: [round(x, 6) for x in v] for k, v in skewed.items()} == {(0, 1): [0.5], (1, 0): [0.2]}
    assert pipeline_latency(skewed, 0.05) == pytest.approx(0.3)
    # a rank whose previous pass ends within the overhead of the sender's end is busy
    assert transfer_latencies(events(0.0), 2.5).get((1, 0)) is None
    assert pipeline_latency({}, 0.05) is None
    assert pipeline_latency({(0, 1): [0.01]}, 0.05) == 0.0  # never below 0
    path = tmp_path / "costs.pp"
    step = StepCosts(0.0625, {"F0": 1.0}, (3.5, 4.25), "adam", 0.375, 0.25, 0.75)
    path.write_text(to_costs_pp(replace(small_profile(), step=step)))
    assert "    cost comm = 0.75\n" in path.read_text()
    assert "the mean time from a sender's pass end" in path.read_text()


def test_default_pipeline_is_one_process_per_core() -> None:
    """The default `--devices` (docs/runtime.md): the most processes that divide
    the stages without outnumbering the cores."""
    assert pipeline_devices(2, 2) == 2 and pipeline_devices(4, 2) == 2
    assert pipeline_devices(3, 2) == 1 and pipeline_devices(6, 4) == 3
    assert pipeline_devices(1, 8) == 1 and pipeline_devices(8, 1) == 1


def test_overhead_counts_posting_transfers_not_waiting_on_them() -> None:
    """`cost overhead` (docs/runtime.md, "Profiling a model"): a step's time less
    its passes and its waits on receives, over its passes; posting the
    exchanges stays in (it is the rank's work between passes)."""
    events = [{"name": "exchange", "dur": 400.0}, {"name": "F0", "dur": 2000.0},
              {"name": "wait", "dur": 3000.0}, {"name": "exchange", "dur": 400.0}]
    # 10 ms step, 2 ms of passes, 3 ms waited: 5 ms of work over 2 passes
    assert overhead_per_pass(0.010, 0.002, events, 2) == pytest.approx(0.0025)


def test_engine_step_costs_are_means_over_the_steps() -> None:
    """The profile's `cost overhead` and `cost optimizer[s]` are means over the timed
    steps (docs/runtime.md, "Profiling a model"): a step adds every pass's overhead
    and its optimizer step up, the one slow step included, as pass costs."""
    overhead, _, optimizer, _ = engine_summary(
        [0.001, 0.001, 0.004], {("F", 0): [1.0, 1.0]}, {0: [2.0, 2.0, 5.0]}, 1)
    assert overhead == pytest.approx(2.0)  # ms; the median would read 1.0
    assert optimizer == pytest.approx((3.0,))  # the median would read 2.0


_LINEAR = """
import torch
from torch import nn
from ppdsl.runtime import PipelineModel

def stages(n):
    return PipelineModel(n, lambda index: nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                         lambda out, y: ((out - y) ** 2).mean(),
                         lambda step, b: (torch.randn(b, 8), torch.randn(b, 8)))
"""


def test_engine_on_one_process_times_every_pass_of_every_stage(tmp_path: Path) -> None:
    """`measure_engine` runs a model's two stages through `PipelineRunner` on
    this process, fused and split: a mean time for F, B, W and BW of each stage,
    each stage's optimizer step, and the passes' jitter; it starts its own
    one-process group and leaves none behind."""
    import torch.distributed as dist

    (tmp_path / "linear.py").write_text(_LINEAR)
    overhead, engine, optimizer_ms, jitter = measure_engine(
        build_model(f"{tmp_path / 'linear.py'}:stages", 2), 2, 2, torch.device("cpu"),
        optimizer="sgd", warmup=1, repeats=2)
    assert sorted(engine) == sorted(f"{k}{s}" for k in ("F", "B", "W", "BW") for s in range(2))
    assert all(ms > 0 for ms in engine.values()) and len(optimizer_ms) == 2
    assert all(ms > 0 for ms in optimizer_ms) and jitter >= 0 and math.isfinite(overhead)
    assert not dist.is_initialized()
