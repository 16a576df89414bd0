"""ppdsl/commands/budget.py: `ppdsl search --memory 80GiB` bounds the whole
device, a budget without a unit keeps meaning M_B (docs/architecture.md,
commands/)."""

from __future__ import annotations

import argparse

import pytest

from ppdsl.cli import main
from ppdsl.commands import search
from ppdsl.commands.budget import activation_budget, is_bytes


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    search.add_arguments(parser)
    return parser.parse_args(["--devices", "4", "--microbatches", "8", "-o", "x.pp", *flags])


def test_units_tell_bytes_from_mb() -> None:
    """80GiB, 512MB and 1000b are bytes; 8, 2p and 0.5x1f1b stay in M_B."""
    assert all(map(is_bytes, ["80GiB", "512MB", "1000b", "1.5 gib"]))
    assert not any(map(is_bytes, ["8", "2p", "1.5p", "0.5x1f1b", "4:2p"]))


def test_whole_device_leaves_the_activations_what_state_does_not_take() -> None:
    """4e8 fp32 parameters with Adam over 4 devices are 1.6e9 bytes of state a
    device; 4 GiB less a 5% reserve and that, over 1e8 bytes a M_B, is the
    activation budget."""
    units, how = activation_budget(_args("--memory", "4GiB", "--params", "4e8",
                                         "--unit-bytes", "1e8")) or ("", "")
    assert float(units) == pytest.approx((4 * 2**30 / 1.05 - 1e8 * 16) / 1e8, rel=1e-6)
    assert "whole device" in how
    bf16 = activation_budget(_args("--memory", "4GiB", "--params", "4e8", "--unit-bytes", "1e8",
                                   "--param-dtype", "bf16"))
    assert bf16 is not None and float(bf16[0]) == float(units)  # 2+2+12 = 4+4+8 bytes
    assert activation_budget(_args("--memory", "8")) is None


def test_byte_budget_needs_its_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    """A byte budget without --unit-bytes, or one the model state overflows, is
    a usage error (exit 2) saying what to give."""
    assert main(["search", "--devices", "4", "--microbatches", "8", "--memory", "4GiB",
                 "-o", "x.pp"]) == 2
    assert "--unit-bytes" in capsys.readouterr().err
    assert main(["search", "--devices", "4", "--microbatches", "8", "--memory", "1GiB",
                 "--params", "4e8", "--unit-bytes", "1e8", "-o", "x.pp"]) == 2
    assert "model state alone" in capsys.readouterr().err
