"""Faces that import their names on first use: `import ppdsl.runtime.training`
(what `ppdsl run` reads its options from) must not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `name` is imported from the submodule
    `table[name]` (relative to `package`) when first asked for; a name that is the
    submodule's own (`"split": "execution.split"`) is that module."""

    def getattr_(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        imported = importlib.import_module(f"{package}.{module}")
        return imported if module.rsplit(".", 1)[-1] == name else getattr(imported, name)

    return getattr_
