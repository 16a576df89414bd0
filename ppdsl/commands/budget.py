"""`ppdsl search --memory 80GiB`: a budget with a byte unit means the whole
device. The model state each device holds (its share of `--params`:
parameters, gradients, optimizer state and autocast copies, as
`analysis.device_bytes` counts them) and the allocator's reserve are taken off
it, and what is left is the activation budget in M_B (one 1F1B stage's
activations, `--unit-bytes` bytes) that the search bounds. A budget without a
unit keeps meaning M_B."""

from __future__ import annotations

import argparse
import math
import re

from ppdsl.analysis.device_bytes import DTYPE_BYTES, format_bytes
from ppdsl.commands.common import UsageError, add_bytes_arguments, device_options, parse_bytes

__all__ = ["add_budget_arguments", "activation_budget", "is_bytes"]

_BYTES = re.compile(r"\s*[0-9]*\.?[0-9]+(?:e[0-9]+)?\s*(b|kb|mb|gb|kib|mib|gib)\s*", re.IGNORECASE)


def is_bytes(text: str) -> bool:
    """Whether a `--memory` budget carries a byte unit (`80GiB`, `512MB`)."""
    return _BYTES.fullmatch(text) is not None


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """What a byte budget needs: `--params`, `--unit-bytes` and the state's dtypes."""
    parser.add_argument("--params", type=float, default=None, metavar="N",
                        help="with --memory in bytes: the model's parameters (split evenly "
                        "over the devices)")
    parser.add_argument("--unit-bytes", type=float, default=None, metavar="B",
                        help="with --memory in bytes: the bytes of one M_B (one 1F1B stage's "
                        "activations for one microbatch)")
    add_bytes_arguments(parser)


def activation_budget(args: argparse.Namespace) -> tuple[str, str] | None:
    """For a byte `--memory`: the activation budget in M_B (as `--memory`'s
    text) and a line saying how it was made; None for a budget in M_B."""
    if args.memory is None or not is_bytes(args.memory):
        return None
    if (args.params is None or args.unit_bytes is None or not 0 < args.params < math.inf
            or not 0 < args.unit_bytes < math.inf):
        raise UsageError(f"--memory {args.memory} is the whole device: give positive, finite --params N and "
                         "--unit-bytes B (the bytes of one M_B) too, or a budget in M_B (8, 2p)")
    budget = parse_bytes(args.memory)
    options = device_options(args)
    per_device = args.params / args.devices
    autocast = DTYPE_BYTES[options.precision] if (options.precision != "fp32"
                                                  and options.param_dtype == "fp32") else 0
    state = per_device * (2 * DTYPE_BYTES[options.param_dtype] + options.optimizer_bytes()
                          + autocast)
    left = budget / (1 + options.reserve) - state
    if left <= 0:
        raise UsageError(f"--memory {args.memory}: the model state alone is {format_bytes(state)} "
                         f"a device ({options.param_dtype} parameters, {options.optimizer}); use "
                         "more devices or a larger budget")
    units = left / args.unit_bytes
    note = (f"--memory {args.memory} is the whole device: {format_bytes(state)} of model state "
            f"and a {options.reserve:.0%} allocator reserve leave {units:.4g} M_B of activations "
            "(buffers and working memory are not in this budget)")
    return f"{units:.6f}", note
