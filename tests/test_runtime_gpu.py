"""The distributed runtime on GPUs with NCCL (skipped without CUDA): the same
gradient and memory checks as the gloo suite, one rank per GPU."""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from tests.dist import harness
from tests.dist.cases import build_cases

pytestmark = [pytest.mark.gpu, pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs CUDA with 2 GPUs (NCCL, one rank per GPU)"
)
def test_nccl_step_equals_single_process(tmp_path: Path) -> None:
    """Every d=2 case on NCCL: gradients and parameters equal a single-GPU run within
    1e-5 relative; measured memory equals the prediction with the measured M_W."""
    cases, _ = build_cases(2, tmp_path)
    old = os.environ.get("PPDSL_TEST_BACKEND")
    os.environ["PPDSL_TEST_BACKEND"] = "nccl"
    try:
        results = harness.run_cases(cases, 2, tmp_path)
    finally:
        if old is None:
            del os.environ["PPDSL_TEST_BACKEND"]
        else:
            os.environ["PPDSL_TEST_BACKEND"] = old
    for case_id, per_rank in results.items():
        for r in per_rank:
            assert "error" not in r, (case_id, r)
            assert r["grad_rel_err"] <= 1e-5 and r["param_rel_err"] <= 1e-5, (case_id, r)
            assert Fraction(r["measured_peak"]) == Fraction(r["predicted_peak_real_mw"])
