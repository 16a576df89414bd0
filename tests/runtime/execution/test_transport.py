"""How tensors move between ranks (`ppdsl.runtime.execution.transport`), in one process: the
backend is read from the tensors' device, never from the group's reported name;
a CUDA device without NCCL is refused unless the GPU is shared or there is one rank. The multi-rank
runs of each mode (ordered and staged forced on CPU tensors) are in
tests/system/test_pipeline_training.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ppdsl.runtime.execution.transport import Transport, backend_for, backends_of


@pytest.fixture(scope="module")
def no_backend(tmp_path_factory: pytest.TempPathFactory):
    """A one-rank group made without naming a backend (it reports 'undefined')."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group(store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_group_without_backend_is_read_by_device(no_backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group made by init_process_group() without a backend reports 'undefined';
    the transfer mode still follows the backend serving the tensors' device: gloo
    for CPU tensors (tagged), and NCCL's ordered batches for CUDA tensors where the
    configuration says cuda:nccl (docs/runtime.md, transfers)."""
    assert dist.get_backend() == "undefined"
    assert backend_for(None, torch.device("cpu")) == "gloo"
    assert Transport(None, torch.device("cpu")).mode == "tagged"
    # what a GPU node reports for the same call (this machine has no CUDA)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert backends_of(None) == {"cpu": "gloo", "cuda": "nccl"}
    assert Transport(None, torch.device("cuda", 0)).ordered


def test_cuda_without_nccl_is_refused_unless_shared(no_backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA tensors in a gloo-only group cannot move point to point: refused with
    what to do, unless the ranks share the GPU (staged through host memory) or there
    is one rank (nothing to send: a one-rank gloo group on a GPU, as the gpu tests make)."""
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:gloo")
    assert Transport(None, torch.device("cuda", 0)).mode == "tagged"
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="share the GPU"):
        Transport(None, torch.device("cuda", 0))
    assert Transport(None, torch.device("cuda", 0), staged=True).staged
