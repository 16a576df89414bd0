"""torch's own pipeline schedules, property-tested with ppdsl.testing.

Each schedule class of torch.distributed.pipelining.schedules computes its
per-rank action lists (`pipeline_order`) when it is built; no model runs and no
process group forms: the stages below are stand-ins carrying only the numbers
the classes read. ppdsl checks every order for pp in 2..8 and m in pp..4*pp:
each pass exactly once, dependencies, deadlock-freedom under blocking
send/recv, activation memory.

    python examples/test_torch_schedules.py          # the table of docs/testing.md
    pytest examples/test_torch_schedules.py          # a sample of it, under hypothesis

The table records what ppdsl finds; a class found invalid somewhere is a
finding about torch, not a failure of this file.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ppdsl.testing import OrdersCheck, check_orders

CLASSES = (
    "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
)
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
PP_RANGE = range(2, 9)


class _StandInStage:
    """What a schedule class reads of its stages while computing its order."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.has_backward = True
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}


def pipeline_order(name: str, pp: int, m: int) -> dict:
    """torch's `pipeline_order` of class `name` for pp ranks and m microbatches
    (two stages per rank for the multi-stage classes)."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, name)
    if issubclass(cls, schedules.PipelineScheduleSingle):
        return cls(_StandInStage(0, pp, pp, 0), m).pipeline_order
    style = "v" if name in V_SHAPED else "loop"
    mapping = schedules.generate_stage_to_rank_mapping(pp, 2 * pp, style=style)
    stages = [_StandInStage(s, 2 * pp, pp, 0) for s in range(2 * pp) if mapping[s] == 0]
    return cls(stages, m).pipeline_order


@dataclass(frozen=True)
class Finding:
    """What ppdsl found for one (class, pp, m)."""

    refused: str | None
    """torch's own error when it refuses the sizes."""
    check: OrdersCheck | None

    @property
    def verdict(self) -> str:
        """valid, refused, or the first error's message, shortened."""
        if self.refused is not None:
            return "refused"
        assert self.check is not None
        if self.check.valid:
            return "valid"
        return self.check.errors[0].message.split(";")[0].split(":")[0]


def find(name: str, pp: int, m: int) -> Finding:
    """Check torch's order of `name` at (pp, m)."""
    try:
        order = pipeline_order(name, pp, m)
    except (ValueError, RuntimeError, AssertionError) as exc:
        return Finding(str(exc).splitlines()[0][:80], None)
    return Finding(None, check_orders(order, num_microbatches=m,
                                      name=f"{name}(pp={pp}, m={m})"))


def table() -> str:
    """The markdown table of docs/testing.md: every class over pp in 2..8, m in pp..4*pp."""
    lines = [
        "| torch class | (pp, m) checked | valid | torch refuses | invalid | first invalid, and why |",
        "|---|---|---|---|---|---|",
    ]
    for name in CLASSES:
        counts = {"valid": 0, "refused": 0, "invalid": 0}
        first = ""
        for pp in PP_RANGE:
            for m in range(pp, 4 * pp + 1):
                finding = find(name, pp, m)
                verdict = finding.verdict
                key = verdict if verdict in counts else "invalid"
                counts[key] += 1
                if key == "invalid" and not first:
                    first = f"pp={pp}, m={m}: {verdict}"
        total = sum(counts.values())
        lines.append(f"| `{name}` | {total} | {counts['valid']} | {counts['refused']} | "
                     f"{counts['invalid']} | {first or '-'} |")
    return "\n".join(lines) + "\n"


# --- under pytest: a hypothesis sample of the same sweep -----------------------------

try:
    import pytest
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ppdsl.testing import param_values
except ImportError:  # the table needs neither
    pass
else:
    pytest.importorskip("torch.distributed.pipelining.schedules")

    @pytest.mark.parametrize("name", ["ScheduleGPipe", "ScheduleInterleaved1F1B",
                                      "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
                                      "ScheduleZBVZeroBubble"])
    @settings(max_examples=6, deadline=None, database=None)
    @given(params=param_values("pp=2..8", "m=pp..4*pp"))
    def test_torch_schedule_is_valid(name, params):
        """torch's order of each class found valid in docs/testing.md's table is
        valid at drawn (pp, m): every pass once, dependencies, no deadlock."""
        finding = find(name, params["pp"], params["m"])
        if finding.refused is None:
            assert finding.check is not None and finding.check.valid, finding.check.report()

    def test_one_f_one_b_last_rank_skips_its_first_forward():
        """torch 2.13's Schedule1F1B order has no forward of microbatch 0 on its last
        rank: ppdsl reports the missing pass (docs/testing.md's table)."""
        finding = find("Schedule1F1B", 4, 8)
        assert finding.check is not None and not finding.check.valid
        assert "F0" in finding.check.report() or "forward" in finding.check.report()

    @settings(max_examples=4, deadline=None, database=None)
    @given(st.integers(2, 6))
    def test_gpipe_peak_memory_is_m(pp):
        """GPipe holds every microbatch's activations on each rank: peak m = 2 pp."""
        finding = find("ScheduleGPipe", pp, 2 * pp)
        assert finding.check is not None and max(finding.check.peak_memory) == 2 * pp


if __name__ == "__main__":
    sys.stdout.write(table())
