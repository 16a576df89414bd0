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


_BLOCKS = """
import torch
from ppdsl.runtime.worker import cpu
assert cpu.keep_freed_memory()
torch.set_num_threads(1)
embedding = torch.nn.Embedding(16384, 1024)  # 64 MiB: above the kept size
ids = torch.zeros(1, 8, dtype=torch.long)
embedding(ids).sum().backward()
before = cpu.resident_bytes()
for _ in range(6):  # each backward makes a 64 MiB gradient and adds it to .grad
    embedding(ids).sum().backward()
print(cpu.resident_bytes() - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_blocks_of_a_parameters_size_go_back() -> None:
    """Under `keep_freed_memory` a block larger than `KEPT_BLOCK_BYTES` goes
    back when freed: six more backwards through a 64 MiB embedding, each making
    a gradient of its size and adding it to `.grad`, leave resident memory
    within one such block of where it was (kept in glibc's heap, small tensors
    split each freed block and every backward took 64 MiB more)."""
    import subprocess

    from tests.paths import ROOT

    grown = int(subprocess.run([sys.executable, "-c", _BLOCKS], capture_output=True, text=True,
                               check=True, cwd=ROOT, timeout=120).stdout)
    assert cpu.KEPT_BLOCK_BYTES < 64 << 20
    assert grown < 64 << 20, grown
