"""ppdsl/runtime/execution/dtensor.py on a one-rank gloo group: a DTensor's shard,
and a shard made back into a DTensor laid out as another."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ppdsl.runtime.execution.dtensor import is_sharded, local_tensor, sharded_like


def test_dtensor_helpers_on_a_one_rank_mesh() -> None:
    """A plain tensor is not sharded and is its own local tensor; a DTensor is
    sharded, its local tensor is its shard, and `sharded_like` rebuilds one laid
    out as another with the given rows."""
    plain = torch.arange(4.0)
    assert not is_sharded(plain) and local_tensor(plain) is plain
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = distribute_tensor(torch.arange(6.0).view(3, 2), mesh, [Shard(0)])
        assert is_sharded(sharded)
        assert torch.equal(local_tensor(sharded), torch.arange(6.0).view(3, 2))
        rebuilt = sharded_like(torch.ones(3, 2), sharded)
        assert is_sharded(rebuilt) and rebuilt.shape == sharded.shape
        assert rebuilt.placements == sharded.placements
        assert torch.equal(local_tensor(rebuilt), torch.ones(3, 2))
    finally:
        dist.destroy_process_group()
