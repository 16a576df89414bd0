"""CPU memory allocation the way the runtime wants it.

glibc returns a freed block of more than 128 KiB to the operating system at once
(mmap/munmap) and trims the heap's free top, so the next tensor of that size
starts on fresh pages and pays a page fault per 4 KiB. A pipeline keeps many
microbatches' tensors alive and frees them out of order, so on CPU this costs a
large and erratic share of every pass (measured: a 4096x1024 layer norm's input
gradient took 7.4 ms instead of 3.0). `keep_freed_memory` makes glibc keep freed
blocks up to `KEPT_BLOCK_BYTES` for reuse, as CUDA's caching allocator does on
GPUs; the process's resident memory then stays at its peak.

Larger blocks still come from mmap and go back at once. Those are a parameter's
size (a 151936x896 embedding's gradient, before it is added to `.grad`, or an
optimizer's temporary), and kept in the heap they do not come back: small
tensors allocated meanwhile split the freed block, so the next one of that size
extends the heap again (measured: four microbatches' backward through that
embedding left 2.0 GiB more resident with a 1 GiB limit, none with 32 MiB;
`tests/runtime/worker/test_cpu.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["KEPT_BLOCK_BYTES", "keep_freed_memory", "resident_bytes", "peak_resident_bytes"]

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
KEPT_BLOCK_BYTES = 32 << 20
"""The largest freed block glibc keeps for reuse: glibc's own ceiling for its
adaptive mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), set from the start."""


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed blocks up to `KEPT_BLOCK_BYTES` for reuse and never
    trim the heap; returns whether it could (False elsewhere than glibc on Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES) == 1
    # M_TRIM_THRESHOLD is an int: the largest it takes is "never trim" in practice.
    ok = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok
    return ok


def _status_kib(field: str) -> int | None:
    """A `kB` field of /proc/self/status (Linux), or None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes() -> int | None:
    """This process's resident memory now (VmRSS), or None where it cannot be read."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_resident_bytes() -> int | None:
    """The most resident memory this process has held so far (VmHWM, the
    kernel's high-water mark), or None where it cannot be read."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024
