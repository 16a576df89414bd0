"""The process-group facts of a pipeline, each derived here once.

- Who agrees with whom: `agree` (every rank learns the first rank's error, so
  all stop together with one message) and `differing` (every rank's
  fingerprints, when any two differ: one compiled schedule for everyone, or
  nobody starts).
- Rank mapping: `global_rank` (a rank of a sub-group, e.g. the mesh's "pp" or
  "dp" group, to the world rank point-to-point calls and broadcasts name) and
  `placement_of` (a world rank under `--dp`: replica * P + pipeline rank, the
  ("dp", "pp") mesh's layout, `ppdsl.runtime.execution.data_parallel.dp_pp_mesh`).
- Message tags: one allocator (`transfer_tag`, `tie_tag`, `copy_tag`), each kind
  of message in its own range of `TAG_RANGES`; the ranges are disjoint and each
  allocator refuses an index outside its range, so no two messages of different
  kinds (or of one kind) can share a tag (gloo matches a receive by peer and tag).
- Lane ends: `LaneEnds.of(plan)`, a lane's first stage (given the inputs) and
  last (computes the loss), read from the plan (`Plan.is_lane_first`,
  `Plan.is_lane_last`), which the engine and the runner both use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ppdsl.backend.plan import Plan
from ppdsl.ir.rank import Transfer, TransferKind

__all__ = [
    "COPY_WIDTH",
    "TAG_RANGES",
    "LaneEnds",
    "agree",
    "copy_tag",
    "differing",
    "gather",
    "global_rank",
    "placement_of",
    "tie_tag",
    "transfer_tag",
]


# -- who agrees with whom -------------------------------------------------------------


def gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value` (picklable), in `group`'s rank order (collective over
    `group`; default: the world)."""
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, value, group=group)
    return found


def agree(error: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """The lowest rank's error, or None when no rank has one: every rank of `group`
    learns it, so all stop together (collective). An error another rank found is
    prefixed `(on rank R)` unless this rank found the same."""
    rank = dist.get_rank(group)
    for r, e in enumerate(gather(error, group)):
        if e is not None:
            return e if r == rank or e == error else f"(on rank {r}) {e}"
    return None


def differing(
    fingerprints: Sequence[str], group: dist.ProcessGroup | None = None, note: Any = None
) -> list[tuple[tuple[str, ...], Any]] | None:
    """Every rank's (`fingerprints`, `note`) when any two fingerprints differ, on
    one rank or between ranks; None when all are equal (collective). `note` goes
    with them for the message (e.g. the schedule's name)."""
    theirs = gather((tuple(fingerprints), note), group)
    if len({fp for fps, _ in theirs for fp in fps}) > 1:
        return theirs
    return None


# -- rank mapping ----------------------------------------------------------------------


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """The world rank of `group`'s rank `rank` (None: the world, the same rank)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def placement_of(rank: int, num_ranks: int) -> tuple[int, int]:
    """(replica, pipeline rank) of world rank `rank` with `num_ranks` pipeline ranks
    per replica: rank = replica * num_ranks + pipeline rank."""
    return rank // num_ranks, rank % num_ranks


# -- message tags ----------------------------------------------------------------------

TAG_RANGES: dict[str, range] = {
    "transfer": range(0, 1 << 28),
    "tie": range(1 << 28, 1 << 29),
    "copy": range(1 << 29, 1 << 30),
}
"""The tags of each kind of point-to-point message: a transfer between stages
(one tag per tensor of it), a tied parameter's gradient exchange, a bidirectional
placement's stage copies' exchange. Disjoint, and below 2**31 (a tag is an int)."""

COPY_WIDTH = 1 << 12
"""Copy tags per model stage: a stage copied over ranks may hold this many
parameter tensors."""


def _within(kind: str, tag: int, what: str) -> int:
    if tag not in TAG_RANGES[kind]:
        raise ValueError(f"{what} needs message tag {tag}, outside the {kind} tags "
                         f"[{TAG_RANGES[kind].start}, {TAG_RANGES[kind].stop})")
    return tag


def transfer_tag(
    t: Transfer, leaf: int, num_microbatches: int, num_stages: int, num_leaves: int
) -> int:
    """The tag of tensor `leaf` of transfer `t` (of `num_leaves` tensors at most),
    the same on sender and receiver: one per (kind, microbatch, receiving stage,
    leaf)."""
    if not 0 <= leaf < num_leaves:
        raise ValueError(f"leaf {leaf} of a transfer of {num_leaves} tensors")
    kind = 0 if t.kind is TransferKind.ACT else 1
    tag = ((kind * num_microbatches + t.microbatch) * num_stages + t.dst_stage) * num_leaves + leaf
    return _within("transfer", tag, f"transfer {t} (tensor {leaf})")


def tie_tag(index: int) -> int:
    """The tag of the gradient exchange of tie `index` (its position in the runner's
    `tied` list, the same on every rank)."""
    return _within("tie", TAG_RANGES["tie"].start + index, f"tie {index}")


def copy_tag(model_stage: int, position: int) -> int:
    """The tag of the exchange of parameter `position` (in `named_parameters`
    order) of model stage `model_stage`'s copies: the same on every rank holding
    one."""
    if not 0 <= position < COPY_WIDTH:
        raise ValueError(f"model stage {model_stage} has more than {COPY_WIDTH} parameter "
                         "tensors: too many to tag its copies' exchange")
    tag = TAG_RANGES["copy"].start + model_stage * COPY_WIDTH + position
    return _within("copy", tag, f"parameter {position} of model stage {model_stage}'s copies")


# -- lane ends -------------------------------------------------------------------------


@dataclass(frozen=True)
class LaneEnds:
    """The stages that begin and end a lane (a pipeline of S / lanes stages;
    DualPipe's placement has two, one per direction)."""

    first: frozenset[int]
    """Each lane's first stage: it reads the batch's inputs."""
    last: frozenset[int]
    """Each lane's last stage: it computes the loss."""

    @staticmethod
    def of(plan: Plan) -> LaneEnds:
        """The lane ends of `plan`'s stages (`Plan.is_lane_first`, `is_lane_last`)."""
        stages = range(plan.num_stages)
        return LaneEnds(frozenset(s for s in stages if plan.is_lane_first(s)),
                        frozenset(s for s in stages if plan.is_lane_last(s)))
