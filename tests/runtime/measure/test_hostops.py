"""ppdsl/runtime/measure/hostops.py: the host's work per pass counted on CPU, the
stand-in for what a GPU waits on (docs/runtime.md, "Host work per pass"). The
ceilings hold the engine's and the split's Python per pass on a fixed small
stage; they are pinned to the installed torch (nn.Module's own calls count)."""

from __future__ import annotations

import pytest
import torch

from ppdsl.runtime.measure.hostops import count_host_ops, host_seconds, small_engine
from tests.paths import ROOT

# Per pass kind: (Python calls, dispatcher ops) a pass may make on `small_engine`'s
# stage, each about 10% over what it makes (bench/results/hostops.md).
CEILINGS = {
    "v_zb": {"F": (136, 17), "B": (237, 17), "W": (43, 15)},
    "interleaved_1f1b": {"F": (136, 17), "BW": (62, 56)},
}


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(CEILINGS))
def test_host_work_per_pass_stays_under_its_ceiling(one_rank, example: str) -> None:
    """Every pass kind's Python calls and dispatcher ops per pass, steady state,
    stay under the stated ceiling: a regression in the engine's or the split's
    host work fails here, on CPU."""
    engine, batch = small_engine(ROOT / "examples" / f"{example}.pp")
    found = count_host_ops(engine, batch)
    assert set(found) == set(CEILINGS[example])
    for kind, (calls, ops) in CEILINGS[example].items():
        assert found[kind].passes == 2 * 8  # 2 counted steps, 4 microbatches x 2 stages
        assert 0 < found[kind].python_calls <= calls, (kind, found[kind])
        assert 0 < found[kind].torch_ops <= ops, (kind, found[kind])


@pytest.mark.slow
def test_counts_repeat_from_step_to_step(one_rank) -> None:
    """After the warm-up the counts are the same every step (the split's plan is
    found once), so a ceiling is a fact, not a sample."""
    engine, batch = small_engine(ROOT / "examples" / "v_zb.pp")
    first = count_host_ops(engine, batch, steps=1)
    assert count_host_ops(engine, batch, steps=3) == {
        k: type(v)(v.kind, 3 * v.passes, v.python_calls, v.torch_ops) for k, v in first.items()}


def test_counting_leaves_the_step_as_it_was(one_rank) -> None:
    """The counted steps compute what uncounted ones do (the counter only
    watches), and the engine is left untraced."""
    counted, batch = small_engine(ROOT / "examples" / "v_zb.pp")
    plain, _ = small_engine(ROOT / "examples" / "v_zb.pp")
    count_host_ops(counted, batch, warmup=0, steps=1)
    assert counted.tracer is None
    plain.step(*batch(0))
    plain.step(*batch(0))  # the counter ran two steps: one per kind of count
    for a, b in zip(counted.params, plain.params, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_host_seconds_per_pass_kind(one_rank) -> None:
    """`host_seconds` reports a positive time for every pass kind the order runs,
    and none for a kind it does not."""
    engine, batch = small_engine(ROOT / "examples" / "interleaved_1f1b.pp")
    found = host_seconds(engine, batch, warmup=1, steps=3)
    assert set(found) == {"F", "BW"} and all(t > 0 for t in found.values())
