"""The training options' limits (`ppdsl.runtime.training.options`)."""

from __future__ import annotations

from argparse import Namespace

import pytest

from ppdsl.runtime.training.options import check_training_options


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
