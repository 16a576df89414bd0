"""What moves between stages: a tensor, or tuples, lists and dicts of tensors
(e.g. hidden states plus an attention mask), as flat lists of tensors and a spec.

A stage is called with what the previous stage returned: `stage(x)` for a tensor,
`stage(*x)` for a tuple or list, `stage(**x)` for a dict (stage 0 with the
microbatch of the inputs the user gave, in the same way). The runtime sends each
tensor leaf on its own; floating-point leaves carry a gradient back (zeros when
the next stage does not use them), others (integer ids, boolean masks) none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Spec", "Leaf", "flatten", "unflatten", "call_stage", "split_microbatches",
           "StructureError"]


class StructureError(TypeError):
    """A value between stages that is not a tensor or a tuple/list/dict of them."""


@dataclass(frozen=True)
class Leaf:
    """One tensor's shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def differentiable(self) -> bool:
        """Whether a gradient flows back for it (floating-point or complex)."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclass(frozen=True)
class Spec:
    """The structure of a value: `kind` is "tensor", "tuple", "list" or "dict";
    `leaf` for a tensor, `keys` (dicts) and `items` (containers) otherwise."""

    kind: str
    leaf: Leaf | None = None
    keys: tuple[str, ...] = ()
    items: tuple[Spec, ...] = ()

    def leaves(self) -> list[Leaf]:
        """The tensor leaves, in the order `flatten` lists them."""
        if self.leaf is not None:
            return [self.leaf]
        return [leaf for item in self.items for leaf in item.leaves()]

    def __str__(self) -> str:
        if self.leaf is not None:
            return str(self.leaf)
        if self.kind == "dict":
            return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(self.keys, self.items, strict=True)) + "}"
        inner = ", ".join(str(i) for i in self.items)
        return f"({inner}{',' if len(self.items) == 1 else ''})" if self.kind == "tuple" else f"[{inner}]"


def flatten(value: Any, where: str = "value") -> tuple[list[torch.Tensor], Spec]:
    """The tensor leaves of `value` and its spec; anything but tensors, tuples,
    lists and dicts with string keys raises StructureError naming `where`."""
    leaves: list[torch.Tensor] = []

    def walk(v: Any, path: str) -> Spec:
        if isinstance(v, torch.Tensor):
            leaves.append(v)
            return Spec("tensor", Leaf(tuple(v.shape), v.dtype))
        if isinstance(v, (tuple, list)):
            kind = "tuple" if isinstance(v, tuple) else "list"
            return Spec(kind, items=tuple(walk(x, f"{path}[{i}]") for i, x in enumerate(v)))
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise StructureError(f"{path} is a dict with non-string keys; use string keys")
            keys = tuple(v)
            return Spec("dict", keys=keys, items=tuple(walk(v[k], f"{path}[{k!r}]") for k in keys))
        raise StructureError(
            f"{path} is a {type(v).__name__}; between stages only tensors and tuples, lists "
            "or dicts of tensors can move"
        )

    spec = walk(value, where)
    return leaves, spec


def unflatten(spec: Spec, leaves: Sequence[torch.Tensor]) -> Any:
    """The value of `spec` built from `leaves` (as `flatten` listed them)."""
    it = iter(leaves)

    def build(s: Spec) -> Any:
        if s.leaf is not None:
            return next(it)
        items = [build(i) for i in s.items]
        if s.kind == "dict":
            return dict(zip(s.keys, items, strict=True))
        return tuple(items) if s.kind == "tuple" else items

    return build(spec)


def call_stage(module: Any, value: Any) -> Any:
    """`module(x)`, `module(*x)` or `module(**x)` for a tensor, sequence or dict."""
    if isinstance(value, dict):
        return module(**value)
    if isinstance(value, (tuple, list)):
        return module(*value)
    return module(value)


def split_microbatches(value: Any, num_microbatches: int, what: str) -> list[Any]:
    """`value` (a tensor or a structure of them) cut along dim 0 into
    `num_microbatches` equal parts, each of the same structure."""
    leaves, spec = flatten(value, what)
    if not leaves:
        raise StructureError(f"{what} holds no tensor")
    parts = []
    for i, t in enumerate(leaves):
        if t.dim() == 0 or t.shape[0] % num_microbatches:
            size = "a scalar" if t.dim() == 0 else f"{t.shape[0]} samples"
            which = what if len(leaves) == 1 else f"tensor {i} of {what}"
            raise ValueError(
                f"{which} has {size}, which does not split into {num_microbatches} equal "
                f"microbatches; give a batch whose size is a multiple of {num_microbatches}"
            )
        parts.append(torch.tensor_split(t, num_microbatches))
    return [unflatten(spec, [p[j] for p in parts]) for j in range(num_microbatches)]
