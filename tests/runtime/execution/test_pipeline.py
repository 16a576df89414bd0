"""The library's pieces in one process: values between stages, the LR schedule,
the training options' limits, the loss scale, and the optimizer step's rollback
(a one-rank gloo group), plus load_schedule's errors."""

from __future__ import annotations

import copy
import math
import types
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from ppdsl.runtime.execution.pipeline import ScheduleError, load_schedule
from ppdsl.runtime.execution.precision import LossScaler
from ppdsl.runtime.execution.structure import StructureError, flatten, split_microbatches, unflatten
from ppdsl.runtime.training.optim import OptimizerStep, lr_lambda
from ppdsl.runtime.training.options import check_training_options
from tests.paths import ROOT


def test_structures_round_trip_and_split() -> None:
    """A dict of a tuple and tensors flattens to its tensors and back; a batch cuts
    into microbatches of the same structure; a non-tensor or an indivisible
    batch is refused with a message naming it."""
    value = {"hidden": torch.ones(4, 3), "pair": (torch.zeros(4, dtype=torch.long), torch.ones(4) > 0)}
    leaves, spec = flatten(value)
    assert len(leaves) == 3 and [leaf.differentiable for leaf in spec.leaves()] == [True, False, False]
    back = unflatten(spec, leaves)
    assert back.keys() == value.keys() and isinstance(back["pair"], tuple)
    parts = split_microbatches(value, 2, "the inputs")
    assert len(parts) == 2 and parts[1]["hidden"].shape == (2, 3)
    with pytest.raises(StructureError, match=r"value\['n'\] is a int"):
        flatten({"n": 3})
    with pytest.raises(ValueError, match="tensor 1 of the inputs has 3 samples"):
        split_microbatches((torch.ones(4), torch.ones(3)), 2, "the inputs")


def test_warmup_cosine() -> None:
    """Linear warm-up to the base rate, then a cosine to 0 at the last step."""
    f = lr_lambda("warmup-cosine", total_steps=10, warmup_steps=2)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == 1.0 and math.isclose(f(6), 0.5) and f(10) == 0.0
    assert lr_lambda("constant", 10)(7) == 1.0


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"clip_grad_norm": -1.0}, "--clip-grad-norm must be positive"),
        ({"resume": True}, "--resume needs --checkpoint-dir"),
        ({"stop_after": 2}, "--stop-after needs --checkpoint-dir"),
        ({"optimizer": "adamw", "momentum": 0.9}, "--momentum is SGD's"),
        ({"warmup_steps": -1}, "--warmup-steps must not be negative"),
    ],
)
def test_training_option_limits(given: dict, message: str) -> None:
    """Each out-of-range option is named, with what to do."""
    assert message in (check_training_options(Namespace(**given)) or "")


def test_loss_scale_follows_grad_scaler() -> None:
    """Halved on inf/NaN, doubled after growth_interval clean steps, restored from
    its state."""
    scaler = LossScaler(torch.device("cpu"), growth_interval=2)
    scaler.update(True)
    assert float(scaler.scale) == 32768.0
    scaler.update(False)
    scaler.update(False)
    assert float(scaler.scale) == 65536.0 and scaler.growth_tracker == 0
    other = LossScaler(torch.device("cpu"))
    other.load_state_dict(scaler.state_dict())
    assert float(other.scale) == 65536.0


def _setup(validation: str, max_norm: float | None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    runner = types.SimpleNamespace(group=None, device=torch.device("cpu"), scaler=None,
                                   hooks=types.SimpleNamespace(before_first_pass=[]),
                                   norm_parameters=lambda: list(model.parameters()))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, optimizer, OptimizerStep(runner, optimizer, max_norm=max_norm,
                                           validation=validation)


def _grads(model: torch.nn.Module, scale: float, nan: bool = False) -> None:
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, scale * (i + 1))
        if nan:
            p.grad.view(-1)[0] = float("nan")


def test_post_validation_rolls_back_adam(one_rank) -> None:
    """post: a NaN leaves the parameters and Adam's moments and step count bit for
    bit as they were; a step needing clipping is stepped at once, rolled back and
    redone, ending where sync's clipped step ends, with the learning rate of its
    own step although the rate changed in between."""
    for nan in (False, True):
        model, optimizer, stepper = _setup("post", max_norm=0.5)
        _grads(model, 1.0)
        stepper.step()
        stepper.resolve()  # a first, clipped step: Adam's state exists
        before = copy.deepcopy((list(model.parameters()), optimizer.state_dict()))
        _grads(model, 2.0, nan=nan)
        stepper.step()
        optimizer.param_groups[0]["lr"] = 123.0  # a scheduler stepping before resolve
        for p in model.parameters():
            p.grad = None
        outcome = stepper.resolve()
        # a NaN on this rank: it never stepped (the rollback of a rank whose own
        # gradients were finite is tests/system/test_pipeline_training.py's); clipping: rolled back
        assert outcome is not None and outcome.rolled_back == (not nan)
        assert outcome.skipped == nan
        optimizer.param_groups[0]["lr"] = 0.1
        if nan:
            for p, q in zip(model.parameters(), before[0], strict=True):
                assert torch.equal(p, q)
            state, saved = optimizer.state_dict()["state"], before[1]["state"]
            assert all(torch.equal(state[k][n], saved[k][n]) for k in saved for n in saved[k])
            continue
        ref, ref_opt, ref_step = _setup("sync", max_norm=0.5)
        for scale in (1.0, 2.0):
            _grads(ref, scale)
            assert ref_step.step().clipped
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)


def test_post_validation_refuses_gradients_zeroed_in_place(one_rank) -> None:
    """Gradients zeroed in place before a clipped step is validated cannot be
    redone: a clear error, not a silently wrong step."""
    model, optimizer, stepper = _setup("post", max_norm=0.5)
    _grads(model, 1.0)
    stepper.step()
    optimizer.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match="set_to_none=True"):
        stepper.resolve()


def test_load_schedule_errors_are_located(tmp_path: Path) -> None:
    """A schedule that does not compile: ScheduleError with file:line:col."""
    bad = tmp_path / "bad.pp"
    bad.write_text("schedule s {\n    param d = 2\n    param m = 4\n    place nowhere\n}\n")
    with pytest.raises(ScheduleError, match=r"bad\.pp:4:"):
        load_schedule(bad)
    good = load_schedule(ROOT / "examples" / "zb_h1.pp", {"d": 2, "m": 4})
    assert (good.num_ranks, good.num_stages, good.num_microbatches) == (2, 2, 4)
    assert good.stages_of(1) == (1,) and good.torch_actions()[0][0] == "0F0"
