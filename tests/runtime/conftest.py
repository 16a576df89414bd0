"""Fixtures shared by the runtime's in-process tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory):
    """A one-rank gloo group in this process, for one test module."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
