"""A compiled schedule as the runtime needs it (`CompiledPipeline`: the plan
every rank shares and the rank programs), and `load_schedule`, which compiles
a `.pp` file into one (`ppdsl.runtime.execution.pipeline` re-exports both)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ppdsl.backend.plan import Plan, plan_from_schedule
from ppdsl.ir.rank import Op
from ppdsl.ir.schedule import torch_actions

__all__ = ["CompiledPipeline", "ScheduleError", "load_schedule"]


class ScheduleError(ValueError):
    """The `.pp` file does not compile; the message holds every located finding."""


@dataclass(frozen=True)
class CompiledPipeline:
    """A compiled schedule as the runtime needs it: the plan every rank shares and
    the rank programs (all of them, or only this rank's in a generated program)."""

    plan: Plan
    ops: Mapping[int, Sequence[Op]]
    """Per rank: its ops (compute passes and exchanges), in order."""
    fingerprint: str
    """The compiled schedule's fingerprint; ranks must agree on it."""

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks (the schedule's devices)."""
        return self.plan.num_devices

    @property
    def num_stages(self) -> int:
        """Model stages."""
        return self.plan.num_stages

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step (each step's batch is cut into that many)."""
        return self.plan.num_microbatches

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, in model order."""
        return tuple(s for s, r in enumerate(self.plan.stage_device) if r == rank)

    def torch_actions(self) -> list[list[str]]:
        """Per rank, torch.distributed.pipelining's action strings (`0F1`, `0I1`,
        `0W1`, `0B1`)."""
        return [torch_actions(order.passes) for order in self.plan.orders]


def load_schedule(
    path: str | Path,
    params: Mapping[str, int | str] | None = None,
    *,
    costs_from: str | Path | None = None,
) -> CompiledPipeline:
    """Compile the `.pp` file at `path` with `params` overriding its parameters (as
    `-D name=value` does, e.g. {"d": 4, "m": 8}); `costs_from`: a costs file
    (`ppdsl profile -o`). Raises ScheduleError with every located finding."""
    from ppdsl.compiler import compile_file
    from ppdsl.costs_file import load_costs_file
    from ppdsl.diagnostics import CompileError, render_all

    try:
        costs = load_costs_file(costs_from) if costs_from is not None else None
        compiled = compile_file(path, {k: str(v) for k, v in (params or {}).items()}, costs=costs)
    except CompileError as exc:
        raise ScheduleError(render_all(exc.diagnostics, sys.stderr)) from None
    plan = plan_from_schedule(compiled.schedule, compiled.programs, compiled.timeline,
                              compiled.costs_from)
    return CompiledPipeline(
        plan, {r: p.ops for r, p in enumerate(compiled.programs)}, plan.fingerprint
    )
