"""torchrun's attempts (ppdsl/runtime/worker/attempt.py, docs/runtime.md
"Checkpoints and restarts"): which attempt this is, the line that says so, and a
store whose keys carry the attempt, so a restarted group never reads the keys
of the attempt before."""

from __future__ import annotations

import pytest

from ppdsl.runtime.worker import attempt
from tests.dist import harness


def test_attempt_read_from_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """The restart count and limit come from torchrun's variables (0 when unset
    or empty) and name the store's key prefix."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "")
    assert (attempt.restart_count(), attempt.max_restarts()) == (0, 0)
    assert attempt.attempt_prefix() == "ppdsl/attempt0/"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "5")
    assert (attempt.restart_count(), attempt.max_restarts()) == (2, 5)
    assert attempt.attempt_prefix() == "ppdsl/attempt2/"


def test_attempt_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """No note without restarts allowed; the first attempt says how many may
    follow, a restart says which one it is."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert attempt.attempt_note() == ""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert attempt.attempt_note() == " (torchrun may restart the workers 3 times)"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert attempt.attempt_note() == " (restart 1 of at most 3)"


def test_each_attempt_keys_its_own_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 hosts the store when torchrun's agent does not; a key written in
    attempt 0 is seen by another rank of attempt 0, and not through attempt 1's
    store on the same server."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(harness.free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    host = attempt.attempt_store(0, 1, timeout=10)
    host.set("rendezvous", "attempt 0")
    peer = attempt.attempt_store(1, 2, timeout=10)  # a client of the same server
    assert peer.get("rendezvous") == b"attempt 0"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = attempt.attempt_store(1, 2, timeout=10)
    assert not restarted.check(["rendezvous"])
