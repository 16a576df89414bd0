"""`HostAllocator`: the CUDA caching allocator's counters imitated for CPU
tensors, so that what `DevicePeak` reads on a GPU can be tested here."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HostAllocator(TorchDispatchMode):
    """What `torch.cuda.memory_allocated` / `max_memory_allocated` /
    `reset_peak_memory_stats` read, for CPU tensors: inside the mode, every
    storage an op makes (not one of its inputs': views and in-place results are
    not allocations) counts from its op until it dies. Storages made before the
    mode opened are the baseline (not counted). For
    `DevicePeak(..., allocated=h.now, peak=h.high, reset=h.reset)`."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def now(self) -> int:
        return self.allocated

    def high(self) -> int:
        return self.peak

    def reset(self) -> None:
        self.peak = self.allocated

    def _free(self, key: int, size: int) -> None:
        if self._live.pop(key, None) is not None:
            self.allocated -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in self._live and key not in given:
                self._live[key] = size
                self.allocated += size
                self.peak = max(self.peak, self.allocated)
                weakref.finalize(storage, self._free, key, size)
        return out
