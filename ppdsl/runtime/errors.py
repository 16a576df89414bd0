"""The runtime's errors, and what it reads from other libraries' errors: the
bottom of ppdsl.runtime, importing nothing of it (docs/architecture.md)."""

from __future__ import annotations

__all__ = ["ModelError", "LossError", "ShapeError", "PeerError", "first_line", "peer_failure"]


class ModelError(Exception):
    """The user's model does not follow the protocol (reported before training)."""


class LossError(ModelError):
    """The user's loss failed, or returned no scalar tensor, on the rank that
    calls it (during a step: that rank stops every other)."""


class ShapeError(LossError):
    """A stage made a value of another shape than the step's lengths say its
    receiver expects (variable-length microbatches): raised on the sending rank,
    before anything is sent, so no receiver waits for a tensor of the wrong size;
    like a failing loss, that rank stops every other."""


class PeerError(RuntimeError):
    """A transfer with another rank failed or timed out."""


def first_line(error: BaseException | str, limit: int | None = None) -> str:
    """An error's first line (at most `limit` characters), or its type's name when
    it says nothing: what a one-line report quotes of a library's error."""
    text = str(error).strip()
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    line = text.splitlines()[0]
    return line if limit is None else line[:limit]


# What gloo, NCCL and c10d say when the rank at the other end is gone or silent.
# torch raises RuntimeError (or DistBackendError, a subclass) with these words; it
# has no exception type per cause, so the text is all there is to read.
_PEER_LOST = ("reset by peer", "closed", "EOF")
_PEER_SILENT = ("timed out", "timeout")
_COLLECTIVE = ("gloo", "NCCL", "c10d", "Connection")


def peer_failure(error: BaseException) -> str | None:
    """Why a distributed call failed, when a peer is the cause: "lost" (its
    connection is gone: it died), "silent" (it did not answer in time), "failed"
    (another failure inside the backend); None for an error that is not about the
    other ranks (a bug, a model failing)."""
    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    lowered = text.lower()
    if any(word.lower() in lowered for word in _PEER_LOST):
        return "lost"
    if any(word in lowered for word in _PEER_SILENT):
        return "silent"
    if any(word in text for word in _COLLECTIVE):
        return "failed"
    return None
