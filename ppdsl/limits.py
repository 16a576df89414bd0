"""The compiler's resource limits: what it refuses before starting work it could
not finish in reasonable time and memory.

Each limit is checked at the entry of the work it bounds (the source read, a
number literal or a named value, the passes a schedule expands to, a loop's
head) and refused with a located error that quotes the size and the flag that
raises it. Commands run under `using(limits)`; the defaults hold otherwise.
Long compiles report their phase on stderr (`progress`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from fractions import Fraction

from ppdsl.diagnostics import CompileError, Diagnostic, Span

__all__ = [
    "Limits",
    "LimitError",
    "DEFAULT",
    "FLAGS",
    "active",
    "using",
    "check_source",
    "check_integer",
    "check_literal",
    "check_passes",
    "count_iterations",
    "iterations_left",
    "iteration_count",
    "progress",
]


@dataclass(frozen=True)
class Limits:
    """Sizes past which the compiler refuses the input (each raised by its flag)."""

    source_bytes: int = 256 * 1024
    """The most bytes a `.pp` (or costs, or CSV) file may have (`--max-source-bytes`):
    the parser reads about 20 KB a second on a slow machine."""
    depth: int = 200
    """How deep expressions and blocks may nest, counted in grammar levels
    (`--max-depth`); a chain `a + b + c` nests one level per operator."""
    integer_bits: int = 64
    """The most bits of a number literal, a named value (param, let, cost, memory)
    or a block's start time (`--max-integer-bits`); numerator and denominator each."""
    passes: int = 1_000_000
    """The most passes (stages x microbatches x pass kinds) a schedule may expand
    to (`--max-passes`)."""
    loop_iterations: int = 4_000_000
    """The most `for`/`repeat` iterations one elaboration may run, all loops
    together (`--max-loop-iterations`)."""


DEFAULT = Limits()

_UNITS = {
    "source_bytes": "bytes",
    "depth": "levels",
    "integer_bits": "bits",
    "passes": "passes",
    "loop_iterations": "iterations",
}

FLAGS = {
    "source_bytes": "--max-source-bytes",
    "depth": "--max-depth",
    "integer_bits": "--max-integer-bits",
    "passes": "--max-passes",
    "loop_iterations": "--max-loop-iterations",
}
"""The command-line flag of each limit."""

assert set(FLAGS) == {f.name for f in fields(Limits)}


class LimitError(CompileError):
    """A limit was reached: a CompileError holding one located finding, raised
    through any pass unchanged."""

    def __init__(self, diagnostic: Diagnostic):
        super().__init__([diagnostic])
        self.diagnostic = diagnostic


class _State(threading.local):
    def __init__(self) -> None:
        self.limits = DEFAULT
        self.iterations = 0


_state = _State()


def active() -> Limits:
    """The limits in force."""
    return _state.limits


@contextmanager
def using(limits: Limits) -> Iterator[Limits]:
    """Run the body under `limits` (restored after it)."""
    saved = _state.limits, _state.iterations
    _state.limits, _state.iterations = limits, 0
    try:
        yield limits
    finally:
        _state.limits, _state.iterations = saved


def _refuse(what: str, limit_name: str, span: Span | None) -> LimitError:
    limit = getattr(_state.limits, limit_name)
    flag = FLAGS[limit_name]
    message = f"{what}; ppdsl's limit is {limit:,} {_UNITS[limit_name]} (raise it with {flag} N)"
    return LimitError(Diagnostic("error", message, span))


def check_source(size: int, file: str) -> None:
    """A source of `size` bytes fits the limit (checked before parsing)."""
    if size > _state.limits.source_bytes:
        span = Span(file, 1, 1, 1, 1)
        raise _refuse(f"'{file}' has {size:,} bytes", "source_bytes", span)


def _bits(value: object) -> int:
    if type(value) is int:
        return value.bit_length()
    if type(value) is Fraction:
        return max(value.numerator.bit_length(), value.denominator.bit_length())
    return 0


def _digits(value: int | Fraction | str) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...{text[-6:]}"


def check_integer(value: object, span: Span | None, what: str) -> None:
    """`value` (an int or Fraction; anything else passes) fits the integer-bits limit."""
    bits = _bits(value)
    if bits > _state.limits.integer_bits:
        assert isinstance(value, int | Fraction)
        described = f"{what} {_digits(value)} needs {bits} bits"
        raise _refuse(described, "integer_bits", span)


def check_literal(text: str, span: Span | None) -> None:
    """A number literal is not surely past the integer-bits limit (each digit is
    more than 3 bits), checked before converting it."""
    if len(text) > _state.limits.integer_bits + 1:
        what = f"the number {_digits(text)} has {len(text)} digits, too many bits"
        raise _refuse(what, "integer_bits", span)


def check_passes(count: int, span: Span | None, what: str) -> None:
    """A schedule expanding to `count` passes fits the limit (checked before expanding)."""
    if count > _state.limits.passes:
        raise _refuse(f"{what} makes {count:,} passes", "passes", span)


def iteration_count(values: range) -> int:
    """How many values a range holds, however large its bounds."""
    step = values.step
    if step > 0:
        return max(0, (values.stop - values.start + step - 1) // step)
    return max(0, (values.start - values.stop - step - 1) // -step)


def iterations_left() -> int:
    """How many more loop iterations this elaboration may run."""
    return _state.limits.loop_iterations - _state.iterations


def count_iterations(count: int, span: Span | None) -> None:
    """A loop about to run `count` iterations keeps the elaboration within the limit."""
    total = _state.iterations + count
    if total > _state.limits.loop_iterations:
        done = _state.iterations
        what = f"this loop runs {count:,} iterations after {done:,} already run"
        raise _refuse(what, "loop_iterations", span)
    _state.iterations = total


# --- progress of long compiles ------------------------------------------------------

_PROGRESS_AFTER = 3.0
"""Seconds of compiling before the first progress line."""
_PROGRESS_EVERY = 5.0


class _Progress:
    """Prints `ppdsl: FILE: PHASE... N s` on stderr while a compile runs long."""

    def __init__(self, file: str, enabled: bool):
        self.file = file
        self.phase = "parse"
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        wait = _PROGRESS_AFTER
        while not self._stop.wait(wait):
            elapsed = time.monotonic() - self.start
            print(f"ppdsl: {self.file}: {self.phase}... {elapsed:.0f} s", file=sys.stderr, flush=True)
            wait = _PROGRESS_EVERY

    def __call__(self, phase: str) -> None:
        """Enter the compiler phase named `phase`."""
        self.phase = phase

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _progress_wanted() -> bool:
    forced = os.environ.get("PPDSL_PROGRESS")
    if forced is not None:
        return forced not in ("", "0")
    return sys.stderr.isatty()


@contextmanager
def progress(file: str) -> Iterator[_Progress]:
    """A phase reporter for one compile: after a few seconds, and every few seconds
    after that, the current phase goes to stderr (on a terminal, or with
    PPDSL_PROGRESS=1; PPDSL_PROGRESS=0 silences it)."""
    reporter = _Progress(file, _progress_wanted())
    try:
        yield reporter
    finally:
        reporter.close()
