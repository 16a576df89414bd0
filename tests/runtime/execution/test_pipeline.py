"""The library's face (`ppdsl.runtime.execution.pipeline`): load_schedule's
results and errors, and the runner's argument checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppdsl.runtime.execution.pipeline import PipelineRunner, ScheduleError, load_schedule
from tests.paths import ROOT


def test_load_schedule_errors_are_located(tmp_path: Path) -> None:
    """A schedule that does not compile: ScheduleError with file:line:col."""
    bad = tmp_path / "bad.pp"
    bad.write_text("schedule s {\n    param d = 2\n    param m = 4\n    place nowhere\n}\n")
    with pytest.raises(ScheduleError, match=r"bad\.pp:4:"):
        load_schedule(bad)
    good = load_schedule(ROOT / "examples" / "zb_h1.pp", {"d": 2, "m": 4})
    assert (good.num_ranks, good.num_stages, good.num_microbatches) == (2, 2, 4)
    assert good.stages_of(1) == (1,) and good.torch_actions()[0][0] == "0F0"


def test_runner_refuses_bad_arguments_before_anything_collective(one_rank) -> None:
    """A DP mode that does not exist, a group beside a mesh, a mesh that is not
    ("dp", "pp"): a ValueError naming the argument and what it must be, raised
    by the argument checks before the stages are built."""
    schedule = load_schedule(ROOT / "examples" / "1f1b.pp", {"d": 1, "m": 2})
    with pytest.raises(ValueError, match="dp_mode must be one of replicate, shard, not 'fsdp'"):
        PipelineRunner(schedule, {}, lambda out, target: out, dp_mode="fsdp")
    mesh = type("Mesh", (), {"mesh_dim_names": ("pp", "dp")})()
    with pytest.raises(ValueError, match="give either group or mesh"):
        PipelineRunner(schedule, {}, lambda out, target: out, group=object(), mesh=mesh)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mesh must be 2-D with dims \('dp', 'pp'\)"):
        PipelineRunner(schedule, {}, lambda out, target: out, mesh=mesh)
