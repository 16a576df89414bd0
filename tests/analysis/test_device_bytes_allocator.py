"""The byte model's rows (`ppdsl.analysis.device_bytes`) against what the
allocator imitation (tests/oracles/allocator.py) sees torch allocate for the
same thing: each test reads one row of `device_bytes` on a compiled schedule,
so it fails when that component is dropped from the model (the allocator's
reserve, which the imitation does not round, is a stated fraction:
tests/analysis/test_device_bytes.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ppdsl.analysis.device_bytes import (
    DeviceOptions,
    ModelBytes,
    RankBytes,
    StageBytes,
    device_bytes,
)
from ppdsl.compiler import compile_source
from ppdsl.ir.schedule import PassKind
from ppdsl.runtime.execution.split import WStash, backward_input
from ppdsl.runtime.measure.fake import fake_layer_bytes
from tests.oracles.allocator import HostAllocator
from tests.paths import EXAMPLES

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
HIDDEN, ROWS = 48, 16


def _stage() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.Tanh(), nn.Linear(4 * HIDDEN, HIDDEN))


def _count(stage: nn.Module) -> int:
    return sum(p.numel() for p in stage.parameters())


def _rank0(name: str, stage: StageBytes, unit_bytes: float = 0.0,
           options: DeviceOptions | None = None) -> RankBytes:
    """Rank 0's bytes under `name` at d=2, m=2, every model stage `stage`."""
    options = options or DeviceOptions()
    c = compile_source((EXAMPLES / f"{name}.pp").read_text(), f"{name}.pp", {"d": "2", "m": "2"})
    n = c.schedule.placement.num_model_stages
    return device_bytes(c.schedule, c.lowered, ModelBytes((stage,) * n, unit_bytes), options)[0]


def test_parameters_and_gradients_as_allocated() -> None:
    """A stage's parameters as made, then the gradients its backward makes: the
    parameters and gradients rows (fp32)."""
    with HostAllocator() as h:
        stage = _stage()
        made = h.now()
        row = _rank0("1f1b", StageBytes(_count(stage))).bytes
        assert made == row["parameters"]
        stage(torch.randn(ROWS, HIDDEN)).square().sum().backward()
        assert h.now() - made == row["gradients"]


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_optimizer_state_as_allocated(name: str) -> None:
    """The first optimizer step leaves allocated the optimizer row's bytes
    (Adam's two fp32 moments; plain SGD none)."""
    stage = _stage()
    stage(torch.randn(ROWS, HIDDEN)).sum().backward()
    optimizer = OPTIMIZERS[name](stage.parameters(), lr=0.01)
    with HostAllocator() as h:
        optimizer.step()
        row = _rank0("1f1b", StageBytes(_count(stage)), options=DeviceOptions(optimizer=name))
        assert h.now() == row.bytes["optimizer"]


def test_autocast_copies_as_allocated() -> None:
    """bf16 autocast over fp32 parameters keeps a bf16 copy of each weight in its
    cast cache while the step runs: the autocast row."""
    stage = _stage()
    x = torch.randn(ROWS, HIDDEN)
    with HostAllocator() as h, torch.autocast("cpu", dtype=torch.bfloat16):
        out = stage(x)
        del out  # the activations go with the graph; the cast cache stays
        row = _rank0("1f1b", StageBytes(_count(stage)), options=DeviceOptions(precision="bf16"))
        assert h.now() == row.bytes["autocast_copies"] > 0


def test_activations_and_send_buffers_as_allocated() -> None:
    """1F1B's rank 0 at d=2 runs two forwards before its first backward: what
    their graphs keep (the input buffers included) is the activations row at one
    unit per stage's saved bytes, and each output, held until sent, is the send
    buffers row."""
    stage = _stage()
    size = fake_layer_bytes(stage, torch.randn(ROWS, HIDDEN, requires_grad=True))
    row = _rank0("1f1b", StageBytes(_count(stage), boundary=size.output_bytes),
                 unit_bytes=size.activation_bytes).bytes
    with HostAllocator() as h:
        outs = []
        for _ in range(2):
            x = torch.randn(ROWS, HIDDEN, requires_grad=True)
            outs.append(stage(x))
        del x
        sent = sum(o.untyped_storage().nbytes() for o in outs)
        assert h.now() - sent == row["activations"] > 0
        assert outs[0].untyped_storage().nbytes() == row["send_buffers"] > 0


def test_stash_gradients_as_allocated() -> None:
    """ZB-H1's rank 0 at d=2 holds one W stash at a time: the output gradients
    a B leaves in its stash, freed by the W, are the stash gradients row."""
    stage = _stage()
    size = fake_layer_bytes(stage, torch.randn(ROWS, HIDDEN, requires_grad=True))
    row = _rank0("zb_h1", StageBytes(_count(stage), stash_gradients=size.stash_bytes)).bytes
    with HostAllocator() as h:
        x = torch.randn(ROWS, HIDDEN, requires_grad=True)
        out = stage(x)
        dy = torch.randn_like(out)
        stash = WStash()
        backward_input(out, dy, x, stash)
        del out, dy
        held = h.now()
        stash.work.clear()  # the deferred work and the output gradients; the inputs stay
        stash.gradients.clear()
        assert held - h.now() == row["stash_gradients"] > 0


def test_working_memory_as_allocated() -> None:
    """A forward's transient peak above the larger of the levels before and
    after it (the wide hidden layer's output, freed within the pass) is the
    working row."""
    stage = _stage()
    size = fake_layer_bytes(stage, torch.randn(ROWS, HIDDEN, requires_grad=True))
    row = _rank0("1f1b", StageBytes(_count(stage), working={PassKind.F: size.working["F"]})).bytes
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    with HostAllocator() as h:
        before = h.now()
        h.reset()
        out = stage(x)
        transient = h.high() - max(before, h.now())
        assert transient == row["working"] > 0
        del out


def test_input_batch_as_allocated() -> None:
    """The step's token ids (int64, every microbatch) on the first stage's rank
    and the targets on the last: the input batch row of `plan --gpu`'s model."""
    from ppdsl.commands.plan_real import TOKEN_BYTES

    microbatches, rows, seq = 2, 3, 40
    with HostAllocator() as h:
        ids = torch.randint(0, 100, (microbatches * rows, seq))
        made = h.now()
        del ids
    c = compile_source((EXAMPLES / "1f1b.pp").read_text(), "1f1b.pp", {"d": "1", "m": "2"})
    batch = microbatches * rows * seq * TOKEN_BYTES
    (rank,) = device_bytes(c.schedule, c.lowered,
                           ModelBytes((StageBytes(10),), 0.0, batch, batch))
    assert rank.bytes["input_batch"] == 2 * made  # ids and targets on the one rank
