"""The optimizer step (`ppdsl.runtime.training.optim`): the LR schedule, and
post-validation's rollback of a step (a one-rank gloo group)."""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch

from ppdsl.runtime.training.optim import OptimizerStep, lr_lambda, make_optimizer


def test_warmup_cosine() -> None:
    """Linear warm-up to the base rate, then a cosine to 0 at the last step."""
    f = lr_lambda("warmup-cosine", total_steps=10, warmup_steps=2)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == 1.0 and math.isclose(f(6), 0.5) and f(10) == 0.0
    assert lr_lambda("constant", 10)(7) == 1.0


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_steps_fused_as_the_loop_does(name: str) -> None:
    """Adam and AdamW on CPU parameters run fused (one kernel per parameter, no
    temporary of its size: ppdsl/runtime/training/optim.py) and step where torch's
    default loop steps, to float rounding."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    loop_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = make_optimizer(name, params, 1e-2, weight_decay=0.1)
    loop = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name](
        loop_params, lr=1e-2, weight_decay=0.1)
    assert optimizer.param_groups[0]["fused"] and not loop.param_groups[0]["fused"]
    for _ in range(3):
        for p, q in zip(params, loop_params, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        optimizer.step()
        loop.step()
    for p, q in zip(params, loop_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


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
