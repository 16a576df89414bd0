"""The byte model's model-state rows (`ppdsl.analysis.device_bytes`) against
what the allocator imitation (tests/oracles/allocator.py) sees torch allocate:
parameters, their gradients and each optimizer's state, per parameter."""

from __future__ import annotations

import pytest
import torch

from ppdsl.analysis.device_bytes import DTYPE_BYTES, DeviceOptions
from tests.oracles.allocator import HostAllocator

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 32))


def test_parameters_and_gradients_as_allocated() -> None:
    """Parameters made, then gradients made by a backward: each is as many
    bytes as the model's parameters row and gradients row say (fp32)."""
    with HostAllocator() as h:
        model = _model()
        params = sum(p.numel() for p in model.parameters())
        assert h.now() == params * DTYPE_BYTES[DeviceOptions().param_dtype]
        loss = model(torch.randn(8, 64)).square().sum()
        loss.backward()
        del loss  # the activations and the input die with the graph
        assert h.now() == 2 * params * DTYPE_BYTES[DeviceOptions().param_dtype]


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizer_state_as_allocated(name: str) -> None:
    """The first optimizer step leaves allocated the optimizer row's bytes per
    parameter (Adam's two fp32 moments; plain SGD none)."""
    model = _model()
    params = sum(p.numel() for p in model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    optimizer = OPTIMIZERS[name](model.parameters(), lr=0.01)
    with HostAllocator() as h:
        optimizer.step()
        assert h.now() == params * DeviceOptions(optimizer=name).optimizer_bytes()
