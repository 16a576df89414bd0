"""CPU stand-ins for NCCL behaviours gloo does not have, patched into
torch.distributed for one case of a worker:

- `rendezvous_sends`: a send completes only once the peer has posted the matching
  receive, and the sending call blocks until then (NCCL's behaviour for a tensor
  larger than its buffering). The k-th receive a rank posts from (peer, tag)
  registers in the job's store; the k-th send to (peer, tag) waits for it, and
  fails after `timeout` seconds (a deadlock). Batches (`batch_isend_irecv`) post
  their receives before blocking on their sends, as a grouped NCCL call does.
- `delayed_sends`: a send reports itself incomplete until it is waited for, and
  every wait is recorded with the number of compute passes the rank had run, so
  a case can tell whether any exchange waited on a send before the passes ended.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ppdsl.runtime.execution.engine import Engine

_cases = itertools.count()


@contextlib.contextmanager
def _patched(isend: Any, irecv: Any) -> Iterator[None]:
    old = (dist.isend, dist.irecv, c10d.isend, c10d.irecv)
    dist.isend = c10d.isend = isend
    dist.irecv = c10d.irecv = irecv
    try:
        yield
    finally:
        dist.isend, dist.irecv, c10d.isend, c10d.irecv = old


def _global(group: Any, peer: int | None, group_peer: int | None) -> int:
    if peer is not None:
        return peer
    assert group_peer is not None
    return group_peer if group is None else dist.get_global_rank(group, group_peer)


@contextlib.contextmanager
def rendezvous_sends(timeout: float = 10.0) -> Iterator[None]:
    """Sends that block until the peer posted the matching receive (module doc)."""
    store = c10d._get_default_store()
    me = dist.get_rank()
    prefix = f"rendezvous{next(_cases)}"
    sent: Counter[tuple[int, int]] = Counter()
    received: Counter[tuple[int, int]] = Counter()
    real_isend, real_irecv = dist.isend, dist.irecv

    def irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
              group_src: int | None = None) -> Any:
        src = _global(group, src, group_src)
        k = received[(src, tag)]
        received[(src, tag)] += 1
        work = real_irecv(tensor, src, group=group, tag=tag)
        store.set(f"{prefix}/{src}->{me}/{tag}/{k}", "posted")
        return work

    def isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
              group_dst: int | None = None) -> Any:
        dst = _global(group, dst, group_dst)
        k = sent[(dst, tag)]
        sent[(dst, tag)] += 1
        store.wait([f"{prefix}/{me}->{dst}/{tag}/{k}"], timedelta(seconds=timeout))
        return real_isend(tensor, dst, group=group, tag=tag)

    with _patched(isend, irecv):
        yield


class _DelayedWork:
    """A send's work that is never complete before it is waited for."""

    def __init__(self, work: Any, log: list[int], passes: list[int]) -> None:
        self._work, self._log, self._passes = work, log, passes

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout: Any = None) -> bool:
        self._log.append(self._passes[0])
        return bool(self._work.wait() if timeout is None else self._work.wait(timeout))


@contextlib.contextmanager
def delayed_sends(log: list[int], passes: list[int]) -> Iterator[None]:
    """Sends whose completion is delayed until waited for; each wait appends the
    number of passes run so far (`passes[0]`, counted here) to `log`."""
    real_isend = dist.isend
    real_compute = Engine._compute

    def isend(*args: Any, **kw: Any) -> Any:
        return _DelayedWork(real_isend(*args, **kw), log, passes)

    def compute(self: Engine, op: Any) -> None:
        real_compute(self, op)
        passes[0] += 1

    Engine._compute = compute  # type: ignore[method-assign]
    try:
        with _patched(isend, dist.irecv):
            yield
    finally:
        Engine._compute = real_compute  # type: ignore[method-assign]
