"""The runtime's errors that more than one of its rooms raises or catches: the
bottom of ppdsl.runtime, importing nothing of it (docs/architecture.md)."""

from __future__ import annotations

__all__ = ["ModelError", "LossError"]


class ModelError(Exception):
    """The user's model does not follow the protocol (reported before training)."""


class LossError(ModelError):
    """The user's loss failed, or returned no scalar tensor, on the rank that
    calls it (during a step: that rank stops every other)."""
