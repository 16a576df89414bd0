"""ppdsl/runtime/measure/stages.py: one stage's passes timed and measured as the
runtime runs them, and a chain of stages measured one after another
(docs/runtime.md, "Profiling a model")."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from ppdsl.runtime.measure.stages import measure_chain, measure_stage, stage_stopwatch
from ppdsl.runtime.models.model import ModelError


def test_measure_stage_measures_both_runs() -> None:
    """Every time is positive; the split's forward keeps exactly the plain forward's
    bytes; what B keeps (M_W) is between 0 and M_B."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))
    x = torch.randn(64, 16)
    t = measure_stage(net, lambda: x, lambda y: y, torch.ones(64, 8), torch.device("cpu"),
                      warmup=1, repeats=3)
    assert min(t.forward_ms, t.input_ms, t.weight_ms, t.plain_forward_ms, t.fused_ms) > 0
    assert t.activation_bytes == t.plain_activation_bytes > 0
    assert 0 < t.weight_bytes < t.activation_bytes
    assert t.gradient_bytes > 0
    assert all(p.grad is None for p in net.parameters())


def test_measure_stage_times_by_the_clock_it_is_given() -> None:
    """The passes are timed by `clock` on CPU: a clock that advances 1 ms a
    reading gives every pass exactly 1 ms (the medians of whole readings)."""
    readings = iter(range(10_000))
    net = nn.Linear(4, 4)
    t = measure_stage(net, lambda: torch.randn(2, 4), lambda y: y, torch.ones(2, 4),
                      torch.device("cpu"), warmup=1, repeats=3,
                      clock=lambda: next(readings) / 1e3)
    times = (t.forward_ms, t.input_ms, t.weight_ms, t.plain_forward_ms, t.fused_ms)
    assert times == pytest.approx((1, 1, 1, 1, 1))


def _chain(modules: list[nn.Module], inputs: torch.Tensor, **kw):  # type: ignore[no-untyped-def]
    named = [(f"stage {s}", m) for s, m in enumerate(modules)]
    return list(measure_chain(named, len(named), inputs, lambda y: y.square().mean(),
                              torch.device("cpu"), where="--model 'm.py:f'", warmup=0, repeats=1,
                              clock=time.perf_counter, **kw))


@pytest.mark.slow
def test_chain_feeds_each_stage_the_previous_output() -> None:
    """Each stage runs on the previous one's output (detached), sends on its
    output's bytes (0 from the last), and progress reaches 1 stage by stage."""
    torch.manual_seed(0)
    modules = [nn.Linear(8, 6), nn.Linear(6, 3)]
    x = torch.randn(5, 8)
    seen: list[tuple[str, float]] = []
    links = _chain(modules, x, progress=lambda name, f: seen.append((name, f)))
    assert [link.name for link in links] == ["stage 0", "stage 1"]
    assert links[0].input is x and torch.equal(links[1].input, modules[0](x).detach())
    assert [link.boundary_bytes for link in links] == [5 * 6 * 4, 0]
    assert seen[-1] == ("stage 1", 1.0) and ("stage 0", 0.5) in seen
    assert all(link.timing.fused_ms > 0 for link in links)


def test_chain_names_the_stage_that_fails() -> None:
    """A stage that fails on its input is a `ModelError` naming it, the stage
    before it and the input's shape; one that returns no tensor says so."""
    with pytest.raises(ModelError, match=r"--model 'm.py:f': stage 1 on stage 0's output of "
                                         r"shape \[5, 6\]: RuntimeError: mat1 and mat2"):
        _chain([nn.Linear(8, 6), nn.Linear(4, 3)], torch.randn(5, 8))

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    with pytest.raises(ModelError, match="stage 0 returned tuple, expected one tensor"):
        _chain([Pair(), nn.Linear(8, 3)], torch.randn(5, 8))


def test_stage_runs_are_timed_in_thread_time_on_one_thread() -> None:
    """On CPU with one torch thread the stage runs count this thread's CPU time,
    with more threads wall time (docs/runtime.md, "Profiling a model")."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert stage_stopwatch(torch.device("cpu")).clock == "thread"
        torch.set_num_threads(2)
        assert stage_stopwatch(torch.device("cpu")).clock == "wall"
    finally:
        torch.set_num_threads(threads)
