"""Module buffers (BatchNorm's running statistics and batch counter, any state a
forward updates in place): changed only where a non-pipelined run changes them.

A non-pipelined run updates a stage's buffers once per microbatch, in its
forward, in microbatch order. The pipeline runs a stage's forward at two more
points, which must leave the buffers as they found them:

- the first step's shape probe (`PipelineRunner._probe`), one forward per stage;
- a recompute pass R (`Engine._recompute`), the forward again before B (its F,
  run without autograd, made the update already).

`kept_buffers` snapshots every buffer of a module and restores it afterwards.
With data parallelism each replica updates its buffers on its own share of the
batch; `broadcast_buffers` makes every replica hold replica 0's after each step
(DDP's `broadcast_buffers` policy: the first replica's buffers win; DDP
broadcasts before each forward, this at the end of each step, so the replicas
also end, checkpoint and evaluate equal).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch import nn

from ppdsl.runtime.execution.autograd_access import own_buffers
from ppdsl.runtime.execution.group import global_rank

__all__ = ["kept_buffers", "broadcast_buffers"]


@contextlib.contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """Run the block, then put every buffer of `module` back as it was (values, and
    the tensor itself where the block replaced a buffer)."""
    saved = [(owner, name, buf, buf.detach().clone())
             for owner in module.modules()
             for name, buf in own_buffers(owner)]
    try:
        yield
    finally:
        # through .data: the restore bumps no version counter, so a graph that saved
        # a buffer (R's, which B runs on; a mask multiplied in) stays valid
        for owner, name, buf, value in saved:
            buf.data.copy_(value)
            setattr(owner, name, buf)  # a registered buffer: Module.__setattr__ keeps it one


def broadcast_buffers(modules: list[nn.Module], group: dist.ProcessGroup) -> None:
    """Every buffer of `modules` set to the group's first rank's (collective over
    `group`; the same modules in the same order on every rank)."""
    src = global_rank(group, 0)
    works = [dist.broadcast(buf.data, src=src, group=group, async_op=True)
             for module in modules for buf in module.buffers()]
    for work in works:
        work.wait()
