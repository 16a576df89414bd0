"""Recomputation (activation checkpointing) on one rank in this process (a
one-rank gloo group): a stage marked `recompute` keeps only its input after F,
R re-runs its forward with F's RNG state, and the step's loss and gradients are
those of the same order without recomputation, dropout included; the meter's
measured peak is the memory model's with the measured M_I. The multi-rank runs
(every example at d = 2 and 4, examples/1f1b_recompute.pp among them) are
tests/system/test_pipeline_dist.py's."""

from __future__ import annotations

import contextlib
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from ppdsl.runtime.execution.pipeline import PipelineRunner, load_schedule
from ppdsl.runtime.execution.step_state import RngState
from ppdsl.runtime.models.model import build_model
from ppdsl.runtime.training.summary import with_real_mw

ROOT = Path(__file__).resolve().parents[2]
DROPOUT = str(ROOT / "examples" / "models" / "tiny_gpt.py") + ":stages_dropout"

SOURCE = """schedule two_stages_one_rank {{
    param d = 1
    param m = 2
    place [0, 0]
    backward split
    {recompute}
    order {{
        for j in 0..m {{ F(j, 0); F(j, 1) }}
        for j in 0..m {{ {r1} B(j, 1); W(j, 1); {r0} B(j, 0); W(j, 0) }}
    }}
    expect peak_memory <= 2 * m * M_B
}}
"""


def _step(tmp_path: Path, name: str, recompute: str, r0: str, r1: str, device: str = "cpu"):
    path = tmp_path / f"{name}.pp"
    path.write_text(SOURCE.format(recompute=recompute, r0=r0, r1=r1))
    compiled = load_schedule(path)
    model = build_model(DROPOUT, 2)
    runner = PipelineRunner(compiled, model.stage, model.loss, device=device, note=lambda _: None)
    inputs, targets = model.batch(0, 4)
    torch.manual_seed(1234)  # dropout's masks come from here (CPU and CUDA generators)
    loss = runner.step(inputs, targets, measure_memory=True)
    grads = {n: p.grad.clone() for n, p in runner.named_parameters() if p.grad is not None}
    return compiled, runner, loss, grads


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-7) for k in a)


def test_recomputed_step_equals_the_plain_one(one_rank, tmp_path: Path) -> None:
    """Both stages recomputed, or only the first: loss and every gradient equal
    the run that keeps its activations (dropout draws the same masks in R); F
    keeps a few per cent of M_B; the measured peak equals the prediction with
    the measured M_I, and is below the plain run's."""
    _, plain, loss, grads = _step(tmp_path, "plain", "", "", "")
    for name, marks, r0, r1 in (
        ("all", "recompute", "R(j, 0);", "R(j, 1);"),
        ("first", "recompute[s] = s == 0", "R(j, 0);", ""),
    ):
        compiled, runner, again, regrads = _step(tmp_path, name, marks, r0, r1)
        assert torch.equal(again, loss), name
        assert _same(regrads, grads), name
        kept = runner.engine.measured_mi_ratio()
        assert sorted(kept) == sorted(compiled.plan.memory.recompute)
        assert all(0 < r < Fraction(1, 10) for r in kept.values()), kept
        meter = runner.engine.meter
        real = with_real_mw(compiled.plan.memory, runner.engine.measured_mw_ratio(), kept)
        assert meter.peak_units == compiled.plan.predicted_peak(0, real), name
        assert meter.peak_bytes < plain.engine.meter.peak_bytes, name


def test_recompute_needs_the_rng_of_its_forward(one_rank, tmp_path: Path, monkeypatch) -> None:
    """Without restoring F's RNG state, R draws other dropout masks and the
    gradients differ: the equality above depends on it."""
    _, _, _, grads = _step(tmp_path, "plain", "", "", "")
    monkeypatch.setattr(
        RngState, "restored", lambda self: contextlib.nullcontext()
    )
    _, _, _, regrads = _step(tmp_path, "all", "recompute", "R(j, 0);", "R(j, 1);")
    assert not _same(regrads, grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (one GPU)")
def test_recompute_on_cuda_restores_the_device_rng(one_rank, tmp_path: Path) -> None:
    """On one GPU (dropout draws from the CUDA generator, which R must restore
    as well): the recomputed step's gradients equal the plain one's."""
    _, _, loss, grads = _step(tmp_path, "plain", "", "", "", device="cuda")
    _, _, again, regrads = _step(tmp_path, "all", "recompute", "R(j, 0);", "R(j, 1);", "cuda")
    assert torch.allclose(again, loss)
    assert _same(regrads, grads)
