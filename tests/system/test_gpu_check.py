"""`make gpu-check` (bench/gpu_check.py) without CUDA: a part that needs a GPU is
a row that names the skip, and the table shows every row with the device it ran
on (README, On a GPU). The whole command's CPU run takes minutes and is not part
of the suite; its parts' machinery (the shared-GPU transfers, the profile) is
tested in tests/system/test_pipeline_training.py and tests/runtime/measure/test_profile.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.gpu_check import Row, nccl_one_rank, table


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour")
def test_parts_that_need_cuda_name_their_skip(tmp_path: Path) -> None:
    """Without CUDA the d=1 NCCL part starts nothing and says why; the table
    lists it beside the others, under the device line."""
    (row,) = nccl_one_rank(False, tmp_path)
    assert row.status == "skipped: no CUDA" and row.part == "d"
    text = table([Row("a", "gpu-marked tests", "11 skipped", "all pass", "skipped: no CUDA"), row],
                 "no CUDA (torch x)", 1.0)
    lines = text.splitlines()
    assert lines[0].startswith("gpu-check on no CUDA (torch x)")
    assert len(lines) == 3 and lines[2].startswith("d") and lines[2].endswith("skipped: no CUDA")


def test_snapshot_summary_replays_to_the_peak() -> None:
    """An allocator snapshot is reduced to its largest allocated total, with the
    blocks live then grouped by their innermost ppdsl frame: a block freed
    before the peak is not in it, one made after the peak neither."""
    from bench.gpu_check import snapshot_summary

    def frame(file: str, line: int) -> list[dict]:
        return [{"filename": "/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": f"/x/ppdsl/runtime/{file}", "line": line, "name": "f"}]

    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frame("engine.py", 10)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frame("split.py", 20)},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "alloc", "addr": 3, "size": 300, "frames": frame("engine.py", 10)},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 50, "frames": []},
    ]
    found = snapshot_summary({"device_traces": [trace],
                              "segments": [{"total_size": 2048, "allocated_size": 500}]})
    assert found["peak_allocated"] == 400
    assert found["at_peak"] == [{"where": "engine.py:10 f", "bytes": 400, "blocks": 2}]
    assert (found["reserved"], found["allocated_at_dump"], found["segments"]) == (2048, 500, 1)
