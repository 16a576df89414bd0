"""Kernels compiled by numba when their inputs are large, run by the interpreter
when they are small.

Importing numba and its first dispatch cost about half a second (its typing
context loads scipy's BLAS), more than a small schedule's whole check takes.
So `kernel(fn)` wraps a numba-compatible function: while the arrays it has been
given sum to few elements (`SMALL`, over all its calls: a search that times
thousands of small candidates soon compiles) it runs `fn` as plain Python
(same code, same results: numba is not asked for fastmath, so float sums happen
in the same order); past that it imports numba and compiles `fn` with
`cache=True` (compiled once per machine, then loaded from numba's cache). A
kernel that calls another gets the other's compiled form at its own
compilation.

`PPDSL_JIT=numba` or `python` forces one way (`mode()` does for a block of
code); the default is `auto`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Kernel", "kernel", "mode", "SMALL"]

SMALL = 30_000
"""Array elements, summed over a kernel's calls, up to which it runs as plain
Python (a few ms there; numba's start-up is a few hundred)."""

_MODES = ("auto", "numba", "python")
_mode = os.environ.get("PPDSL_JIT", "auto")
if _mode not in _MODES:
    _mode = "auto"


class Kernel:
    """A numba-compatible function, compiled on first large call."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn
        self._compiled: Any = None
        self._seen = 0  # array elements given to the plain-Python runs so far

    def compiled(self) -> Any:
        """The numba dispatcher (compiled, or loaded from the cache, once)."""
        if self._compiled is None:
            import numba

            names = self.fn.__globals__
            for name in self.fn.__code__.co_names:
                other = names.get(name)
                if isinstance(other, Kernel):
                    # numba calls a kernel's dispatcher, not this wrapper
                    names[name] = other.compiled()
            self._compiled = numba.njit(cache=True)(self.fn)
        return self._compiled

    def eager(self) -> Callable[..., Any]:
        """The compiled function now (for a caller about to call it many times
        on small inputs, which `auto` would run as Python for a while and then
        compile mid-way), or `fn` itself under `PPDSL_JIT=python`."""
        return self.fn if _mode == "python" else self.compiled()

    def __call__(self, *args: Any) -> Any:
        if _mode == "python":
            return self.fn(*args)  # (a kernel it calls may be compiled already)
        if self._compiled is None and _mode == "auto":
            self._seen += sum(getattr(a, "size", 0) for a in args)
            if self._seen < SMALL:
                return self.fn(*args)
        return self.compiled()(*args)


def kernel(fn: Callable[..., Any]) -> Kernel:
    """Decorator: `fn` as a `Kernel`."""
    return Kernel(fn)


@contextmanager
def mode(how: str) -> Iterator[None]:
    """Run kernels `how` ("numba", "python" or "auto") inside the block."""
    global _mode
    if how not in _MODES:
        raise ValueError(f"jit mode must be one of {', '.join(_MODES)}, got {how!r}")
    saved, _mode = _mode, how
    try:
        yield
    finally:
        _mode = saved
