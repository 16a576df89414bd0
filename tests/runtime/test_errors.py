"""ppdsl/runtime/errors.py: the first line a report quotes of a library's error,
and which failures of a distributed call a peer caused."""

from __future__ import annotations

from ppdsl.runtime.errors import LossError, ModelError, PeerError, first_line, peer_failure


def test_first_line_quotes_the_first_line_or_the_type() -> None:
    """An error's first line, cut to the limit; an empty error gives its type's name."""
    assert first_line(ValueError("  bad shape\n  at layer 3")) == "bad shape"
    assert first_line(ValueError("abcdef"), 3) == "abc"
    assert first_line(OSError()) == "OSError"
    assert first_line("plain text\nmore") == "plain text"


def test_peer_failure_reads_the_backends_words() -> None:
    """A lost connection, a silent peer and another backend failure are told apart;
    an error not about the other ranks is None (a bug, a model failing)."""
    assert peer_failure(RuntimeError("[gloo] Connection reset by peer")) == "lost"
    assert peer_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1")) == "lost"
    assert peer_failure(RuntimeError("unexpected EOF")) == "lost"
    assert peer_failure(RuntimeError("[../gloo/transport] Timed out waiting 30000ms")) == "silent"
    assert peer_failure(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp")) == "failed"
    assert peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert peer_failure(ValueError("connection closed")) is None


def test_error_classes_nest() -> None:
    """A loss failure is a model error; a peer's failure is a RuntimeError, as torch's are."""
    assert issubclass(LossError, ModelError) and issubclass(PeerError, RuntimeError)
