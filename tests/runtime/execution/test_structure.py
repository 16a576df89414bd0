"""Values between stages (`ppdsl.runtime.execution.structure`): tensors, tuples,
lists and dicts flattened to their tensors and back, a batch cut into
microbatches, a stage called on a structure."""

from __future__ import annotations

import pytest
import torch

from ppdsl.runtime.execution.structure import (
    StructureError,
    call_stage,
    flatten,
    split_microbatches,
    unflatten,
)


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


def test_call_stage_spreads_a_structure_over_the_arguments() -> None:
    """A tensor is one argument, a tuple or list positional ones, a dict keyword ones."""
    def stage(*args: torch.Tensor, **kwargs: torch.Tensor) -> tuple[int, list[str]]:
        return len(args), sorted(kwargs)

    assert call_stage(stage, torch.ones(2)) == (1, [])
    assert call_stage(stage, (torch.ones(2), torch.ones(2))) == (2, [])
    assert call_stage(stage, [torch.ones(2)] * 3) == (3, [])
    assert call_stage(stage, {"x": torch.ones(2), "mask": torch.ones(2)}) == (0, ["mask", "x"])


def test_split_refuses_a_scalar_and_an_empty_structure() -> None:
    """A 0-dim tensor has no samples to cut, and a structure without a tensor
    nothing to cut: both named, with what to give instead."""
    with pytest.raises(ValueError, match="the targets has a scalar.*multiple of 2"):
        split_microbatches(torch.tensor(3.0), 2, "the targets")
    with pytest.raises(StructureError, match="the inputs holds no tensor"):
        split_microbatches((), 2, "the inputs")


def test_spec_records_shape_dtype_and_gradient_flow() -> None:
    """A spec's leaves carry each tensor's shape and dtype, and whether a gradient
    comes back for it (floating point only); equal structures give equal specs."""
    value = (torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64))
    _, spec = flatten(value)
    first, second = spec.leaves()
    assert tuple(first.shape) == (2, 3) and first.dtype == torch.bfloat16 and first.differentiable
    assert second.dtype == torch.int64 and not second.differentiable
    assert flatten((torch.zeros(2, 3, dtype=torch.bfloat16), torch.ones(2, dtype=torch.int64)))[1] == spec
    assert flatten((torch.zeros(4, 3, dtype=torch.bfloat16), torch.ones(4, dtype=torch.int64)))[1] != spec
