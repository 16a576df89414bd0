"""Documents into microbatches: the one rule (issue 38) that `ppdsl run --data
FILE.npz`, the compiler's `--lengths-from` and `--reorder` all follow. No torch
here: the command line and the compiler read lengths without it.

A document file is a `.npz` with `tokens` (1-D integers) and `offsets` (the N
document starts, strictly ascending, the first 0, no end marker): document i is
`tokens[offsets[i]:offsets[i + 1]]` (the last one runs to the end).

The numbered microbatches (`numbered`):

- by default (`max_seq_len` L or none), microbatch i is document i, cut to its
  first L tokens;
- with `pack` T, documents are packed greedily in document order: a microbatch
  takes the next documents while their total stays at most T tokens; a
  document longer than T is cut to its first T tokens.

Step k's microbatch j is numbered microbatch (k * m + j) mod (their count)
(`step_microbatches`). A document (or its cut) of n tokens has n - 1 targets,
its own next tokens; a step's loss is the mean over all its targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "Piece",
    "Microbatch",
    "DocumentError",
    "Documents",
    "open_documents",
    "document_lengths",
    "numbered",
    "step_microbatches",
    "step_lengths",
    "tokens_of",
    "targets_of",
    "long_tailed_lengths",
    "document_file",
    "SHORTEST",
    "LONGEST",
]

SHORTEST = 128
"""The shortest document `long_tailed_lengths` draws."""
LONGEST = 4096
"""The longest: draws above it are cut to it."""

Piece = tuple[int, int]
"""(document index, tokens taken from its start)."""
Microbatch = tuple[Piece, ...]
"""The documents a microbatch holds, in order (one unless packed)."""


class DocumentError(Exception):
    """A document file that cannot be trained on, or a batching rule that cannot
    apply (reported before training)."""


@dataclass(frozen=True)
class Documents:
    """A document file, opened and checked."""

    path: Path
    """The file."""
    tokens: np.ndarray
    """Every token id, documents one after the other (1-D)."""
    offsets: np.ndarray
    """Each document's first position in `tokens` (int64, strictly ascending, from 0)."""

    @property
    def lengths(self) -> np.ndarray:
        """Each document's token count."""
        return document_lengths(self.offsets, int(self.tokens.shape[0]))

    def piece(self, piece: Piece) -> np.ndarray:
        """The token ids of `piece` (int64)."""
        doc, size = piece
        start = int(self.offsets[doc])
        return np.asarray(self.tokens[start:start + size], dtype=np.int64)


def document_lengths(offsets: np.ndarray, num_tokens: int) -> np.ndarray:
    """The documents' token counts from their starts and the total (int64)."""
    ends = np.append(np.asarray(offsets[1:], dtype=np.int64), num_tokens)
    return ends - np.asarray(offsets, dtype=np.int64)


def open_documents(path: str | Path, vocab_size: int | None = None, *,
                   flag: str = "--data") -> Documents:
    """Open and check the document file at `path` (module docstring); every
    token in [0, `vocab_size`) when that is given. Raises `DocumentError` saying
    what is wrong and what to do, naming the option `flag` that gave the file."""
    path = Path(path)
    where = f"{flag} {str(path)!r}"
    if not path.is_file():
        raise DocumentError(f"{where}: no such file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [k for k in ("tokens", "offsets") if k not in archive.files]
            if missing:
                raise DocumentError(
                    f"{where}: a document file holds the arrays 'tokens' and 'offsets'; this one "
                    f"lacks {' and '.join(repr(k) for k in missing)} (it has {archive.files}); "
                    "write it with np.savez(path, tokens=..., offsets=...)")
            tokens, offsets = archive["tokens"], archive["offsets"]
    except (ValueError, OSError) as exc:
        raise DocumentError(f"{where}: not a readable .npz archive: {exc}") from exc
    for name, array in (("tokens", tokens), ("offsets", offsets)):
        if array.dtype.kind not in "iu" or array.ndim != 1:
            raise DocumentError(f"{where}: {name!r} is {array.dtype} of shape "
                                f"{tuple(array.shape)}; it must be 1-D integers")
    if tokens.shape[0] == 0 or offsets.shape[0] == 0:
        raise DocumentError(f"{where}: holds no document (empty 'tokens' or 'offsets')")
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0:
        raise DocumentError(f"{where}: the first offset is {int(offsets[0])}; document 0 "
                            "starts at 0")
    steps = np.diff(np.append(offsets, tokens.shape[0]))
    if (steps <= 0).any():
        bad = int(np.argmax(steps <= 0))
        raise DocumentError(
            f"{where}: offsets must ascend strictly and stay below the token count "
            f"{tokens.shape[0]}; document {bad} (offset {int(offsets[bad])}) is empty or runs "
            "backwards (no end marker: the last document runs to the end)")
    if vocab_size is not None:
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            bad_id = low if low < 0 else high
            raise DocumentError(
                f"{where}: token id {bad_id} (at position {int(np.argmax(tokens == bad_id))}) is "
                f"outside the model's vocabulary of {vocab_size} ids")
    return Documents(path, tokens, offsets)


def numbered(lengths: Sequence[int] | np.ndarray, *, max_seq_len: int | None = None,
             pack: int | None = None) -> list[Microbatch]:
    """The numbered microbatches of documents of `lengths` (module docstring):
    one per document cut to `max_seq_len`, or with `pack` T the greedy packing.
    The two rules exclude each other; `DocumentError` when both are given or one
    is below 1."""
    if max_seq_len is not None and pack is not None:
        raise DocumentError("--max-seq-len and --pack exclude each other: --pack T cuts "
                            "documents to T tokens itself")
    for flag, value in (("--max-seq-len", max_seq_len), ("--pack", pack)):
        if value is not None and value < 1:
            raise DocumentError(f"{flag} {value}: need at least 1 token")
    sizes = [int(n) for n in lengths]
    if not sizes:
        raise DocumentError("the document file holds no documents")
    if pack is None:
        limit = max_seq_len
        return [((i, n if limit is None else min(n, limit)),) for i, n in enumerate(sizes)]
    found: list[Microbatch] = []
    current: list[Piece] = []
    total = 0
    for i, n in enumerate(sizes):
        size = min(n, pack)
        if current and total + size > pack:
            found.append(tuple(current))
            current, total = [], 0
        current.append((i, size))
        total += size
    if current:
        found.append(tuple(current))
    return found


def step_microbatches(microbatches: Sequence[Microbatch], step: int,
                      num_microbatches: int) -> list[Microbatch]:
    """Step `step`'s microbatches: numbers step * m .. step * m + m - 1, modulo
    their count."""
    count = len(microbatches)
    first = step * num_microbatches
    return [microbatches[(first + j) % count] for j in range(num_microbatches)]


def tokens_of(microbatch: Microbatch) -> int:
    """The tokens a microbatch holds."""
    return sum(size for _, size in microbatch)


def targets_of(microbatch: Microbatch) -> int:
    """The targets a microbatch's loss counts: n - 1 per document piece of n."""
    return sum(size - 1 for _, size in microbatch)


def step_lengths(lengths: Sequence[int] | np.ndarray, step: int, num_microbatches: int, *,
                 max_seq_len: int | None = None, pack: int | None = None) -> list[int]:
    """The token counts of step `step`'s microbatches, in microbatch order."""
    found = numbered(lengths, max_seq_len=max_seq_len, pack=pack)
    return [tokens_of(mb) for mb in step_microbatches(found, step, num_microbatches)]



def long_tailed_lengths(count: int, seed: int = 0) -> list[int]:
    """Issue 38's document lengths: floor(128 / U) cut to 4,096, U uniform in
    (0, 1] from numpy's PCG64 seeded with `seed`: P(length >= x) = 128 / x
    between 128 and 4,096 (a Pareto tail of index 1: median 256, one in eight
    above 1,024, one in 32 at 4,096)."""
    rng = np.random.default_rng(seed)
    u = 1.0 - rng.random(count)  # (0, 1]
    return [int(x) for x in np.minimum(LONGEST, np.floor(SHORTEST / u)).astype(np.int64)]


def document_file(path: str | Path, lengths: Sequence[int], vocab_size: int,
                  seed: int = 0) -> None:
    """Write a document file of documents with these `lengths`, each token
    drawn uniformly from 0..vocab_size-1 (numpy's PCG64 seeded with `seed`)."""
    if vocab_size < 1 or not lengths or min(lengths) < 1:
        raise DocumentError("a document file needs a vocabulary and documents of >= 1 token")
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = rng.integers(0, vocab_size, int(sum(lengths)), dtype=np.int64)
    np.savez(path, tokens=tokens, offsets=offsets)
