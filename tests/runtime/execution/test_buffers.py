"""Module buffers (`ppdsl.runtime.execution.buffers`): a forward the pipeline runs
beside the training's (the probe, a recompute) leaves them as it found them."""

from __future__ import annotations

import torch
from torch import nn

from ppdsl.runtime.execution.buffers import kept_buffers


def test_kept_buffers_restore_batchnorm_statistics() -> None:
    """A training-mode BatchNorm forward inside `kept_buffers` updates nothing
    that outlives the block: running mean, variance and the batch counter are
    back, bit for bit, in the same tensors; outside the block the forward
    updates them."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    norm = model[1]
    before = {name: buf.clone() for name, buf in norm.named_buffers()}
    tensors = {name: buf for name, buf in norm.named_buffers()}
    with kept_buffers(model):
        model(torch.randn(8, 3))
        assert not torch.equal(norm.running_mean, before["running_mean"])
    for name, buf in norm.named_buffers():
        assert torch.equal(buf, before[name]) and buf is tensors[name], name
    model(torch.randn(8, 3))
    assert int(norm.num_batches_tracked) == 1


def test_kept_buffers_put_back_a_replaced_buffer() -> None:
    """A block that replaces a buffer (assigns a new tensor) gets the old tensor
    back, still registered as a buffer, even when the block raises."""
    module = nn.Module()
    module.register_buffer("count", torch.zeros(()))
    original = module.count
    try:
        with kept_buffers(module):
            module.count = torch.ones(())
            raise RuntimeError("the user's forward failed")
    except RuntimeError:
        pass
    assert module.count is original and float(module.count) == 0.0
    assert dict(module.named_buffers()) == {"count": original}


def test_kept_buffers_restore_without_a_version_bump() -> None:
    """The restore writes through `.data`: a graph that saved the buffer (R's,
    which B then runs on) stays valid: backward through it raises no in-place
    modification error (a plain `copy_` would), and reads the restored values."""
    module = nn.Module()
    module.register_buffer("scale", torch.full((2,), 2.0))
    x = torch.ones(2, requires_grad=True)
    with kept_buffers(module):
        module.scale.add_(1.0)
        y = (x * module.scale).sum()  # saves the buffer at its current version
    y.backward()
    assert torch.equal(x.grad, torch.full((2,), 2.0)) and torch.equal(module.scale, torch.full((2,), 2.0))
