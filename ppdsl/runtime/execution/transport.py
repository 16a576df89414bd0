"""How tensors move between two ranks: decided from the tensors' device, once.

- `backend_for(group, device)`: the backend that serves `device`'s tensors in
  `group`, read from the group's backend configuration ("cpu:gloo,cuda:nccl"),
  never from its reported name (a group made by ``init_process_group()`` without
  a backend reports "undefined" although NCCL serves its CUDA tensors).
- `Transport`: posting a batch of sends and receives for one rank. Three modes:
  *tagged* (gloo on CPU tensors: each tensor matched by its tag, so receives may
  be posted early), *ordered* (NCCL: matched in posting order, so each exchange
  is one ``batch_isend_irecv`` as lowered and checked for deadlock), *staged*
  (ranks sharing a GPU: device tensors go through pinned host memory over gloo,
  tagged). Every mode returns pending receives and sends: a receive is waited
  for where its tensor is first used, a send is completed lazily with its tensor
  kept alive until then, so no exchange stalls compute on its sends.
- The staged path: a send copies device → pinned host on a side stream, an event
  orders the copy after the producing work, and the gloo send is posted once
  that copy has landed; a receive lands in pinned host memory and is copied host →
  device on a side stream that the compute stream then waits for (an event).
  With CPU tensors the same path runs (the copies are CPU copies), which is how
  the suite runs it without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MODES",
    "PendingRecv",
    "PendingSend",
    "Transport",
    "backend_for",
    "backends_of",
]

MODES = ("tagged", "ordered", "staged")
"""The transfer modes (module docstring)."""


def backends_of(group: dist.ProcessGroup | None) -> dict[str, str]:
    """{device type: backend name} of `group` (default: the world), from its
    backend configuration, e.g. {"cpu": "gloo", "cuda": "nccl"}."""
    config = dist.get_backend_config(group)
    found: dict[str, str] = {}
    for part in config.split(","):
        if ":" in part:
            device, backend = part.split(":", 1)
            found[device.strip()] = backend.strip()
        elif part.strip():  # an old single-name form: it serves every device
            found.setdefault("cpu", part.strip())
            found.setdefault("cuda", part.strip())
    return found


def backend_for(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """The backend serving `device`'s tensors in `group`, or None if none does."""
    return backends_of(group).get(device.type)


def _mode_for(group: dist.ProcessGroup | None, device: torch.device, staged: bool) -> str:
    if staged:
        if backend_for(group, torch.device("cpu")) is None:
            raise ValueError("sharing a GPU stages transfers through host memory over gloo, "
                             "but the process group has no CPU backend (make it with "
                             "backend 'cpu:gloo,cuda:nccl' or 'gloo')")
        return "staged"
    backend = backend_for(group, device)
    if backend == "nccl":
        return "ordered"
    if device.type != "cpu" and dist.get_world_size(group) > 1:  # one rank sends nothing
        raise ValueError(
            f"tensors on {device} need NCCL to move between ranks, but the process group "
            f"serves them with {backend or 'no backend'} ({dist.get_backend_config(group)}); "
            "make the group with NCCL, or share the GPU (share_gpu=True / --share-gpu), "
            "which stages transfers through host memory over gloo")
    return "tagged"


class PendingSend:
    """A send posted and not yet known complete: its tensor (and any host copy)
    is kept alive until `wait` returns or `done` says it finished."""

    def __init__(self, works: Sequence[Any], keep: Sequence[torch.Tensor], what: Any) -> None:
        self._works = list(works)
        self._keep = list(keep)
        self.what = what
        """What the caller named this send (a `Transfer`), for its error message."""

    def done(self) -> bool:
        """Whether the send has completed (never blocks)."""
        if all(w.is_completed() for w in self._works):
            self._keep.clear()
            return True
        return False

    def wait(self, timeout: timedelta) -> None:
        """Block until the send has completed."""
        for w in self._works:
            w.wait(timeout)
        self._keep.clear()


class PendingRecv:
    """A receive posted: `wait` returns its tensor on the receiving device."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], torch.Tensor], what: Any) -> None:
        self._works = list(works)
        self._finish = finish
        self._value: torch.Tensor | None = None
        self.what = what
        """What the caller named this receive (a `Transfer`)."""

    def wait(self, timeout: timedelta) -> torch.Tensor:
        """Block until the data is here (once); the tensor, ready for the
        current stream."""
        if self._value is None:
            for w in self._works:
                w.wait(timeout)
            self._value = self._finish()
        return self._value


def _returning(value: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: value


@dataclass(frozen=True)
class _Send:
    tensor: torch.Tensor
    peer: int
    tag: int


@dataclass(frozen=True)
class _Recv:
    shape: torch.Size
    dtype: torch.dtype
    peer: int
    tag: int


class Transport:
    """One rank's point-to-point transfers in `group` for tensors on `device`.
    `staged`: the ranks share a GPU (transfers through pinned host memory over
    gloo). `mode` may force a mode (tests run the ordered and staged paths on CPU
    tensors over gloo)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, *,
                 staged: bool = False, mode: str | None = None) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.group = group
        self.device = torch.device(device)
        self.mode = mode if mode is not None else _mode_for(group, self.device, staged)
        """"tagged", "ordered" or "staged" (module docstring)."""
        cuda = self.device.type == "cuda"
        self._pinned = cuda and torch.cuda.is_available()
        self._copy_out = torch.cuda.Stream(self.device) if self._pinned and self.staged else None
        self._copy_in = torch.cuda.Stream(self.device) if self._pinned and self.staged else None

    @property
    def ordered(self) -> bool:
        """Whether transfers match in posting order (NCCL): each exchange must be
        posted whole, as one batch, in the lowered order; no early receives."""
        return self.mode == "ordered"

    @property
    def staged(self) -> bool:
        """Whether device tensors go through host memory over gloo."""
        return self.mode == "staged"

    # -- posting ---------------------------------------------------------------

    def post(
        self,
        sends: Sequence[tuple[torch.Tensor, int, int, Any]],
        recvs: Sequence[tuple[torch.Size, torch.dtype, int, int, Any]],
    ) -> tuple[list[PendingSend], list[PendingRecv]]:
        """Post `sends` ((tensor, global peer, tag, name)) and `recvs` ((shape,
        dtype, global peer, tag, name)); ordered mode posts them as one batch
        (receives first, as lowered). Returns the pending sends and receives."""
        if self.mode == "ordered":
            return self._post_batch(sends, recvs)
        pending_recvs = [self._post_recv(_Recv(torch.Size(s), d, p, t), name)
                         for s, d, p, t, name in recvs]
        pending_sends = [self._post_send(_Send(x, p, t), name) for x, p, t, name in sends]
        return pending_sends, pending_recvs

    def _post_batch(self, sends: Sequence[tuple[torch.Tensor, int, int, Any]],
                    recvs: Sequence[tuple[torch.Size, torch.dtype, int, int, Any]],
                    ) -> tuple[list[PendingSend], list[PendingRecv]]:
        ops: list[dist.P2POp] = []
        bufs = []
        for shape, dtype, peer, tag, _ in recvs:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            bufs.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, peer, self.group, tag))
        for tensor, peer, tag, _ in sends:
            ops.append(dist.P2POp(dist.isend, tensor, peer, self.group, tag))
        works = list(dist.batch_isend_irecv(ops)) if ops else []
        # One work per op, or one for the whole batch (NCCL coalesced).
        per_op = len(works) == len(ops)
        pending_recvs = [
            PendingRecv([works[i]] if per_op else works, _returning(buf), name)
            for i, (buf, (*_, name)) in enumerate(zip(bufs, recvs, strict=True))
        ]
        pending_sends = [
            PendingSend([works[len(recvs) + i]] if per_op else works, [tensor], name)
            for i, (tensor, _, _, name) in enumerate(sends)
        ]
        return pending_sends, pending_recvs

    def _post_send(self, send: _Send, name: Any) -> PendingSend:
        if not self.staged:
            work = dist.isend(send.tensor, send.peer, group=self.group, tag=send.tag)
            return PendingSend([work], [send.tensor], name)
        host, ready = self._to_host(send.tensor)
        if ready is not None:
            # gloo reads the host buffer as soon as the send is posted: wait for this
            # copy (and the work producing the tensor, which it follows), not the device.
            ready.synchronize()
        work = dist.isend(host, send.peer, group=self.group, tag=send.tag)
        return PendingSend([work], [send.tensor, host], name)

    def _post_recv(self, recv: _Recv, name: Any) -> PendingRecv:
        if not self.staged:
            buf = torch.empty(recv.shape, dtype=recv.dtype, device=self.device)
            work = dist.irecv(buf, recv.peer, group=self.group, tag=recv.tag)
            return PendingRecv([work], _returning(buf), name)
        host = torch.empty(recv.shape, dtype=recv.dtype, pin_memory=self._pinned)
        work = dist.irecv(host, recv.peer, group=self.group, tag=recv.tag)
        return PendingRecv([work], lambda: self._from_host(host), name)

    # -- the staged copies ----------------------------------------------------------

    def _to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A host copy of `tensor` and the event marking it done (None on CPU)."""
        if self._copy_out is None:
            return tensor.detach().to("cpu", copy=True), None
        produced = torch.cuda.current_stream(self.device).record_event()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(self._copy_out):
            self._copy_out.wait_event(produced)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._copy_out)
            done = self._copy_out.record_event()
        return host, done

    def _from_host(self, host: torch.Tensor) -> torch.Tensor:
        """`host` on the device, ordered before the current stream's next work."""
        if self._copy_in is None:
            return host.to(self.device) if self.device.type != "cpu" else host
        with torch.cuda.stream(self._copy_in):
            value = host.to(self.device, non_blocking=True)
            done = self._copy_in.record_event()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        value.record_stream(current)
        return value
