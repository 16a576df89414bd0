"""DTensor, the one place the runtime asks about it: FSDP2 (`--dp-mode shard`)
holds each sharded parameter and its gradient as a DTensor, and every measurement
(the memory meter, the norm, a digest) wants this rank's shard of it."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["dtensor_class", "is_sharded", "local_tensor", "sharded_like"]


def dtensor_class() -> Any:
    """torch's DTensor class (public in torch.distributed.tensor from torch 2.5)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.5
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    return DTensor


def is_sharded(t: Any) -> bool:
    """Whether `t` is a DTensor (FSDP keeps ignored and 0-dim parameters whole)."""
    return callable(getattr(t, "to_local", None))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined, no-any-return]


def sharded_like(local: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's rows) as a DTensor laid out as `sharded` is."""
    return dtensor_class().from_local(  # type: ignore[no-any-return]
        local, sharded.device_mesh, sharded.placements,  # type: ignore[attr-defined]
        run_check=False, shape=sharded.shape, stride=sharded.stride())
