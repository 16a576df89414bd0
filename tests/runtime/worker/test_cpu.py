"""glibc told to keep freed memory (ppdsl/runtime/worker/cpu.py): it takes the
setting on Linux and says so; elsewhere, or without a C library to ask, it
declines without failing."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import types

import pytest

from ppdsl.runtime.worker import cpu


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_glibc_takes_the_setting() -> None:
    """On Linux with glibc both mallopt calls succeed (each returns 1)."""
    assert cpu.keep_freed_memory() is True


def test_declines_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off Linux, or when no C library is found, it returns False and asks
    nothing."""
    monkeypatch.setattr(sys, "platform", "darwin")
    assert cpu.keep_freed_memory() is False
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert cpu.keep_freed_memory() is False


def test_refused_setting_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A C library whose mallopt refuses (returns 0) makes it return False."""

    def mallopt(parameter: int, value: int) -> int:
        return 0

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libc.so.6")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: types.SimpleNamespace(mallopt=mallopt))
    assert cpu.keep_freed_memory() is False
