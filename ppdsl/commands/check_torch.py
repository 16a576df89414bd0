"""`ppdsl check --torch CLASS --pp N --v V`: the program torch itself runs for
one of its schedule classes, checked without running it.

torch.distributed.pipelining lowers a class's compute order (its
`pipeline_order`) with its own passes, as `_PipelineScheduleRuntime.
_prepare_schedule_with_comms` does: `_add_unshard_reshard`, `_add_reduce_grad`,
then `_add_send_recv` (the comm insertion). The result is read as the
compute+comm CSV `ppdsl import` reads (`ppdsl.interchange.torch_comm_items`)
and run under `--comm-model` (NCCL's rules by default); a deadlock is its
cycle of waits, each at the rank's row and the action's column of that CSV.

This is the one place outside `ppdsl.runtime` that reaches into torch, and
only when `--torch` is given (imported on use, like numba in `ppdsl.jit`): it
reads torch's private lowering (`_add_send_recv` and the classes' order
methods), so a torch release that renames them fails here, loudly, as a usage
error naming the missing piece.
"""

from __future__ import annotations

import csv
import importlib
import io
from typing import Any

from ppdsl.commands.common import UsageError

__all__ = ["schedule_classes", "torch_program_csv", "default_microbatches"]

_MODULE = "torch.distributed.pipelining.schedules"


def _schedules() -> Any:
    try:
        return importlib.import_module(_MODULE)
    except ImportError as exc:  # torch is optional for the compiler
        raise UsageError(f"--torch needs torch installed ({exc})") from None


def schedule_classes() -> dict[str, Any]:
    """torch's schedule classes by name: the multi-stage runtime ones and the
    single-stage ones (GPipe, 1F1B), public names only."""
    mod = _schedules()
    bases = tuple(getattr(mod, b) for b in ("_PipelineScheduleRuntime", "PipelineScheduleSingle"))
    return {
        name: cls for name, cls in vars(mod).items()
        if isinstance(cls, type) and issubclass(cls, bases) and not name.startswith("_")
        and name.startswith("Schedule")
    }


def _is_v_shape(mod: Any, cls: type) -> bool:
    return cls.__name__ in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def default_microbatches(num_stages: int, pp: int) -> int:
    """Microbatches when `--m` is not given: as many as stages, at least 2·pp
    (every class's constraint holds: 1F1B and DualPipeV need m >= stages)."""
    return max(num_stages, 2 * pp)


def torch_program_csv(class_name: str, pp: int, v: int, m: int) -> str:
    """The compute+comm CSV of the program torch lowers for `class_name` at
    `pp` ranks, `v` stages per rank and `m` microbatches. Raises UsageError for
    an unknown class or a (pp, v, m) the class does not allow."""
    mod = _schedules()
    classes = schedule_classes()
    cls = classes.get(class_name)
    if cls is None:
        raise UsageError(f"--torch {class_name}: not one of torch's schedule classes "
                         f"({', '.join(sorted(classes))})")
    single = issubclass(cls, mod.PipelineScheduleSingle)
    if single and v != 1:
        raise UsageError(f"--torch {class_name} runs one stage per rank: --v 1, not {v}")
    if _is_v_shape(mod, cls) and v != 2:
        raise UsageError(f"--torch {class_name} needs two stages per rank: --v 2, not {v}")
    num_stages = pp * v
    o = cls.__new__(cls)  # the order methods read these fields only: no stages or group
    try:
        if single:
            o._num_stages, o._n_microbatches = pp, m
            if class_name == "Schedule1F1B" and m < pp:
                raise UsageError(f"--torch {class_name} needs --m >= --pp ({pp}), not {m}")
            order = o._get_pipeline_order()
            stage_rank = list(range(pp))
        else:
            o.pp_group_size, o.n_local_stages, o._n_microbatches = pp, v, m
            o._stages = [None] * v  # LoopedBFS counts its local stages from this list
            o._num_stages = o.num_stages = num_stages
            o.number_of_rounds = max(1, m // pp)
            o.microbatches_per_round = m // o.number_of_rounds
            if m % o.number_of_rounds:
                raise UsageError(f"--torch {class_name}: --m {m} is not a multiple of the "
                                 f"{o.number_of_rounds} rounds of {pp} microbatches")
            if class_name == "ScheduleDualPipeV" and m < num_stages:
                raise UsageError(f"--torch {class_name} needs --m >= {num_stages} (the stages)")
            style = "v" if _is_v_shape(mod, cls) else "loop"
            stage_rank = mod.generate_stage_to_rank_mapping(pp, num_stages, style=style)
            o.stage_index_to_group_rank = stage_rank
            order = {r: o._calculate_single_rank_operations(r) for r in range(pp)}
        lowered = {r: mod._add_unshard_reshard(order[r]) for r in order}
        lowered = {r: mod._add_reduce_grad(lowered[r], m) for r in lowered}
        lowered = mod._add_send_recv(lowered, stage_to_rank=lambda s: stage_rank[s],
                                     num_stages=num_stages)
    except AssertionError as exc:
        raise UsageError(f"torch's own comm insertion refuses {class_name}'s order at pp={pp}, "
                         f"v={v}, m={m}: {exc}") from None
    except (AttributeError, TypeError) as exc:
        raise UsageError(f"torch's {class_name} internals are not as ppdsl reads them "
                         f"(torch {importlib.import_module('torch').__version__}): {exc}") from None
    out = io.StringIO()
    writer = csv.writer(out)
    for r in range(pp):
        writer.writerow([str(a) for a in lowered[r] if a is not None])
    return out.getvalue()
