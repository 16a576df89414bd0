"""Where this rank is: the op the pipeline engine runs now, or a phase of the
training loop, with a count that moves at each. The watchdog publishes it, so
that a hang (every rank stuck, none dead: a wedged kernel, a peer that stops
answering on NCCL) is reported as where each rank stands. Marking costs a
global assignment and an increment."""

from __future__ import annotations

from typing import Any

__all__ = ["at", "current", "describe", "position"]

_now: Any = "starting"
_count = 0


def at(where: Any) -> None:
    """This rank now runs `where`: an engine op (`ppdsl.ir.rank.Compute` or
    `Exchange`), a wait ("receive" or "send", `Transfer`), described when read,
    or a phrase."""
    global _now, _count
    _now = where
    _count += 1


def current() -> Any:
    """The last mark, as given to `at` (to return to it after a wait)."""
    return _now


def position() -> tuple[int, str]:
    """(how many marks so far, what this rank is doing)."""
    return _count, describe(_now)


def describe(where: Any) -> str:
    """A phrase for a mark: 'computing F(mb 3, stage 1)', 'waiting to receive
    grad(...)', 'in an exchange: recv act(...)', or the phrase itself."""
    from ppdsl.ir.rank import Compute, Exchange

    if isinstance(where, Compute):
        p = where.pass_
        return f"computing {p.kind.value}(mb {p.microbatch}, stage {p.stage})"
    if isinstance(where, tuple):  # (verb, transfer) from the engine's wait
        return f"waiting to {where[0]} {where[1]}"
    if isinstance(where, Exchange):
        parts = [f"recv {t}" for t in where.recvs] + [f"send {t}" for t in where.sends]
        return "in an exchange: " + ", ".join(parts)
    return str(where)
