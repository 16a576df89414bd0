"""Parameters one pipeline holds more than once: tied parameters (a head tied to
the token embedding, `tied=[{stage: name}, ...]`) and, under a bidirectional
placement (`place dualpipe`), the two copies of each model stage, one per lane.

Either way the holders must stay equal. On one rank they are made one Parameter
(`tie_parameters`); across ranks the lowest owning rank's values are copied to
the others at start, as DDP broadcasts, and each step's gradients are summed
over the owners after the passes (`Ties.attach` puts that on
`Hooks.after_passes`, as data parallelism and post-validation attach), in rank
order so that every owner ends with the same bits. A global gradient norm
counts each such parameter once, on its lowest owning rank
(`Ties.not_counted`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ppdsl.backend.plan import Plan
from ppdsl.runtime.errors import ModelError
from ppdsl.runtime.execution.engine import Hooks
from ppdsl.runtime.execution.group import copy_tag, global_rank, tie_tag
from ppdsl.runtime.execution.transport import Transport

__all__ = ["Ties", "check_ties", "copy_groups", "tie_parameters"]


def tie_parameters(stages: Mapping[int, nn.Module], tied: Sequence[Mapping[int, str]]) -> None:
    """Make the tied parameters that sit in `stages` one Parameter: in each group
    ({stage: parameter name}), the lowest stage's replaces the others' (a single
    process or one rank holding several owners)."""
    for group in tied:
        here = sorted(s for s in group if s in stages)
        if len(here) < 2:
            continue
        first = stages[here[0]].get_parameter(group[here[0]])
        for s in here[1:]:
            owner, _, leaf = group[s].rpartition(".")
            module = stages[s].get_submodule(owner) if owner else stages[s]
            setattr(module, leaf, first)


def check_ties(tied: Sequence[Mapping[int, str]], num_stages: int,
               modules: Mapping[int, nn.Module]) -> None:
    """ModelError unless each tie names at least two stages of the schedule, and
    the parameters it names on this rank (`modules`) exist with one shape."""
    for group in tied:
        if len(group) < 2:
            raise ModelError(f"tied parameters {group}: a tie names at least two stages")
        shapes = set()
        for s, name in group.items():
            if not 0 <= s < num_stages:
                raise ModelError(f"tied parameters {group}: no stage {s} in a "
                                 f"{num_stages}-stage schedule")
            if s in modules:
                try:
                    shapes.add(tuple(modules[s].get_parameter(name).shape))
                except AttributeError:
                    raise ModelError(f"tied parameters: stage {s} has no parameter {name!r}") from None
        if len(shapes) > 1:
            raise ModelError(f"tied parameters {group}: shapes differ ({sorted(shapes)})")


def copy_groups(plan: Plan, modules: Mapping[int, nn.Module]) -> list[dict[int, str]]:
    """Under a bidirectional placement, the copies of one model stage that sit on
    this one rank (`modules`): per parameter, {stage: name}, to be made one
    Parameter by `tie_parameters`."""
    groups = []
    for k in range(plan.num_model_stages if plan.lanes > 1 else 0):
        here = [k + lane * plan.num_model_stages for lane in range(plan.lanes)]
        here = [c for c in here if c in modules]
        if len(here) > 1:
            groups += [{c: name for c in here} for name, _ in modules[here[0]].named_parameters()]
    return groups


class Ties:
    """This rank's share of the ties and stage copies that span ranks: their
    values made equal at start, their gradients summed after each step."""

    def __init__(self, plan: Plan, rank: int, tied: Sequence[Mapping[int, str]],
                 stages: Mapping[int, nn.Module], transport: Transport,
                 group: dist.ProcessGroup | None, timeout: timedelta) -> None:
        self.rank = rank
        self.plan = plan
        self.tied = [dict(g) for g in tied]
        self.stages = stages
        self.transport = transport
        self.group = group
        self.timeout = timeout
        self.peers = _peers(plan, rank, tied, stages)
        """Per tie or copy this rank owns part of, in an order every rank shares:
        (the tag of its exchange, its parameter here, the owning pipeline ranks
        in order)."""

    def attach(self, hooks: Hooks) -> None:
        """Sum the gradients after each step's passes (nothing to attach when no
        tie or copy spans ranks)."""
        if self.peers:
            hooks.after_passes.append(self.sync_grads)

    def not_counted(self) -> set[int]:
        """The ids of this rank's parameters a global norm leaves out here: tied
        ones whose lowest stage sits on another rank, and ties and copies whose
        lowest owning rank is another (each is counted once, there)."""
        skip: set[int] = set()
        for group in self.tied:
            if self.plan.stage_device[min(group)] != self.rank:
                skip.update(id(self.stages[s].get_parameter(name))
                            for s, name in group.items() if s in self.stages)
        skip.update(id(param) for _, param, ranks in self.peers if ranks[0] != self.rank)
        return skip

    def _peer(self, rank: int) -> int:
        return global_rank(self.group, rank)

    def sync_values(self) -> None:
        """The lowest owner's values go to the other owners (as DDP broadcasts)."""
        for tag, param, ranks in self.peers:
            with torch.no_grad():
                if self.rank == ranks[0]:
                    sends, _ = self.transport.post(
                        [(param.detach().contiguous(), self._peer(r), tag, r) for r in ranks[1:]], [])
                    for pending in sends:
                        pending.wait(self.timeout)
                else:
                    _, recvs = self.transport.post(
                        [], [(param.shape, param.dtype, self._peer(ranks[0]), tag, ranks[0])])
                    param.copy_(recvs[0].wait(self.timeout))

    def _swap(self, mine: torch.Tensor, ranks: Sequence[int], tag: int) -> dict[int, torch.Tensor]:
        """Send `mine` to each pipeline rank in `ranks` and receive theirs, posted as
        one batch, receives first: on NCCL an ungrouped send then receive with the
        same peer deadlocks on both sides once the tensor outgrows its buffering
        (a tied embedding's gradient). {rank: theirs}."""
        sends, recvs = self.transport.post(
            [(mine, self._peer(r), tag, r) for r in ranks],
            [(mine.shape, mine.dtype, self._peer(r), tag, r) for r in ranks],
        )
        got = {r.what: r.wait(self.timeout) for r in recvs}
        for pending in sends:
            pending.wait(self.timeout)
        return got

    def sync_grads(self) -> None:
        """Sum each tied parameter's gradient over its owning ranks, in rank order
        (every owner ends with the same bits). Runs after each step's passes.
        The sum is made in place, in the lowest owner's gradient (this rank's or
        the one received): beside the gradients it holds only the received ones
        (a tied embedding's gradient is its largest tensor)."""
        for tag, param, ranks in self.peers:
            if not param.requires_grad:
                continue
            mine = param.grad if param.grad is not None else torch.zeros_like(param)
            mine = mine.contiguous()
            bufs = self._swap(mine, [r for r in ranks if r != self.rank], tag)
            bufs[self.rank] = mine
            total = bufs.pop(ranks[0])
            for r in ranks[1:]:
                total.add_(bufs.pop(r))
            param.grad = total


def _peers(plan: Plan, rank: int, tied: Sequence[Mapping[int, str]],
           stages: Mapping[int, nn.Module]) -> list[tuple[int, nn.Parameter, list[int]]]:
    """`Ties.peers`. A copy's tag is made of its model stage and the parameter's
    position in it, the same on both ranks."""
    found = []
    for i, group in enumerate(tied):
        ranks = sorted({plan.stage_device[s] for s in group})
        mine = [s for s in sorted(group) if s in stages]
        if len(ranks) > 1 and mine:
            found.append((tie_tag(i), stages[mine[0]].get_parameter(group[mine[0]]), ranks))
    if plan.lanes > 1:
        held = {plan.model_stage(s): s for s in sorted(stages, reverse=True)}
        for k, s in sorted(held.items()):  # every rank in model-stage order
            copies = [k + lane * plan.num_model_stages for lane in range(plan.lanes)]
            ranks = sorted({plan.stage_device[c] for c in copies})
            if len(ranks) < 2:
                continue
            params = dict(stages[s].named_parameters())
            for position, name in enumerate(params):
                found.append((copy_tag(k, position), params[name], ranks))
    return found
