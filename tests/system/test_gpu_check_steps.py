"""Rows (f) and (g) of `make gpu-check` (bench/gpu_check.py, bench/_step_compare.py)
on CPU: the d=1 schedules' ppdsl step beside the plain step and beside
torch.distributed.pipelining's, at a small size in fp32, naming what it skips
(README, On a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.gpu_check import step_limits


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour")
def test_rows_f_and_g_run_small_on_cpu_and_name_their_skips(tmp_path: Path) -> None:
    """Without CUDA, row (f) times interleaved 1F1B, ZB-V and DualPipe-V at d=1
    against the plain step with equal gradients (fp32), names V-Half (its file
    needs d >= 2) and the GPU sizes as skipped; row (g) times the three schedules
    torch also has against torch's classes."""
    rows = step_limits(False, tmp_path)
    f = {r.what.split(" d=1")[0]: r for r in rows if r.part == "f" and "ppdsl / plain" in r.what}
    assert set(f) == {"interleaved_1f1b", "zb_v", "dualpipe_v"}
    assert all(r.status.startswith("info") and float(r.measured.split()[0]) > 0 for r in f.values())
    grads = [r for r in rows if r.part == "f" and "gradients" in r.what]
    assert len(grads) == 3 and all(r.status == "ok" for r in grads), grads
    g = {r.what.split(" d=1")[0]: r for r in rows if r.part == "g"}
    assert set(g) == {"interleaved_1f1b", "interleaved_zb", "zb_v"}, rows
    assert "ScheduleZBVZeroBubble" in g["zb_v"].what
    skipped = [r for r in rows if r.status.startswith("skipped")]
    assert any("v_half" in r.what and "d >= 2" in r.status for r in skipped), skipped
    assert any("hidden 2048 and 4096" in r.what and "no CUDA" in r.status for r in skipped)
