"""Token files for `--data FILE --seq-len L` (no torch here: `ppdsl run` checks a
file before starting torchrun).

A token file is a flat array of token ids: `.npy` (any unsigned or signed
integer dtype), or raw `.bin` of little-endian uint16, as nanoGPT's prepare
scripts write (uint32 with `--data-dtype uint32`).

The batching is deterministic: step k (from 0) of a global batch of B samples
uses sequences k·B … (k+1)·B − 1, sequence i being the L + 1 consecutive tokens
from position i·(L + 1) of the file (positions taken modulo the file's length,
so the file is read as a ring: it wraps at its end); a sample's inputs are the
first L of its sequence, its targets the last L. With data parallelism replica r
takes its contiguous share of the B samples (docs/runtime.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["DataError", "TokenFile", "open_tokens", "batch_tokens"]

_BIN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class DataError(Exception):
    """A token file that cannot be trained on (reported before training)."""


@dataclass(frozen=True)
class TokenFile:
    """A token file opened for reading (memory-mapped)."""

    path: Path
    """The file."""
    tokens: np.ndarray
    """Its token ids, a 1-D array (memory-mapped)."""

    @property
    def num_tokens(self) -> int:
        """How many token ids the file holds."""
        return int(self.tokens.shape[0])


def open_tokens(
    path: str | Path, seq_len: int, vocab_size: int | None = None, dtype: str = "uint16"
) -> TokenFile:
    """Open and check `path`: a flat integer array holding at least `seq_len` + 1
    ids, each in [0, `vocab_size`) when that is given; `dtype` is the element type
    of a raw `.bin` file (uint16 or uint32; a `.npy` file says its own). Raises
    `DataError` saying what is wrong."""
    path = Path(path)
    if seq_len < 1:
        raise DataError(f"--seq-len {seq_len}: need at least 1 token per sample")
    if not path.is_file():
        raise DataError(f"--data {str(path)!r}: no such file")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise DataError(f"--data {str(path)!r}: not a readable .npy array: {exc}") from exc
        if tokens.dtype.kind not in "iu":
            raise DataError(
                f"--data {str(path)!r}: holds {tokens.dtype} values; token ids must be "
                "integers (save them with an integer dtype, e.g. np.uint16 or np.int64)"
            )
        if tokens.ndim != 1:
            raise DataError(
                f"--data {str(path)!r}: an array of shape {tuple(tokens.shape)}; token files "
                "are flat (one dimension): save tokens.reshape(-1)"
            )
    else:
        if dtype not in _BIN_DTYPES:
            raise DataError(f"--data-dtype {dtype!r}: use uint16 or uint32")
        item = _BIN_DTYPES[dtype]
        size = path.stat().st_size
        if size % item.itemsize:
            raise DataError(
                f"--data {str(path)!r}: {size} bytes is not a whole number of {dtype} ids "
                f"({item.itemsize} bytes each); is it a token file of another dtype?"
            )
        if size == 0:
            raise DataError(f"--data {str(path)!r}: the file is empty")
        tokens = np.memmap(path, dtype=item, mode="r")  # type: ignore[call-overload]
    if tokens.shape[0] < seq_len + 1:
        raise DataError(
            f"--data {str(path)!r}: {tokens.shape[0]} tokens, too short for one sample of "
            f"--seq-len {seq_len} (a sample reads {seq_len + 1} consecutive tokens)"
        )
    if vocab_size is not None:
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            where = int(np.argmax(tokens == bad))
            raise DataError(
                f"--data {str(path)!r}: token id {bad} (at position {where}) is outside the "
                f"model's vocabulary of {vocab_size} ids"
                + ("" if path.suffix == ".npy" or dtype == "uint32" else
                   "; if the file holds uint32 ids, give --data-dtype uint32")
            )
    return TokenFile(path, tokens)


def batch_tokens(data: TokenFile, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    """The `batch_size` x (`seq_len` + 1) token ids of step `step` (int64), as the
    module's docstring defines them: inputs are `[:, :-1]`, targets `[:, 1:]`."""
    width = seq_len + 1
    first = step * batch_size * width
    index = (first + np.arange(batch_size * width, dtype=np.int64)) % data.num_tokens
    return np.asarray(data.tokens[index], dtype=np.int64).reshape(batch_size, width)
